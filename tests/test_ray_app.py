"""`python -m forerun.serve.ray_app` takes every `forerun serve` option with serve's default, and
stops what it started, however it is stopped: Ctrl-C or SIGTERM shuts Serve and the local Ray
cluster down (a fresh clone found raylet, gcs_server and ~20 workers still running after Ctrl-C).
A stand-in `ray` records the calls, so the launcher's tests need no cluster;
tests/test_serve_ray.py serves through a real one."""
import argparse
import signal
import sys
import types

import pytest

from forerun.cli import build_parser
from forerun.serve import ray_app


def _options(parser: argparse.ArgumentParser) -> dict:
    """Each option of `parser` (but --help): its flags, default, type, choices, nargs and action kind."""
    return {a.dest: (tuple(a.option_strings), a.default, a.type, a.choices, a.nargs, type(a).__name__)
            for a in parser._actions if a.option_strings and a.dest != "help"}


def test_every_serve_option_with_serve_default():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve, ray = _options(sub.choices["serve"]), _options(ray_app.build_parser())
    assert {dest: ray.get(dest) for dest in serve} == serve  # an option added to serve alone fails here
    assert set(ray) - set(serve) == {"replicas", "threads", "routing"}
    assert ray_app.build_parser().parse_args([]).dtype == "auto"


@pytest.fixture
def fake_ray(monkeypatch):
    calls = []
    ray, serve = types.ModuleType("ray"), types.ModuleType("ray.serve")
    ray.serve = serve
    ray.init = lambda address=None, **kw: calls.append(f"init {address}")
    ray.shutdown = lambda: calls.append("ray.shutdown")
    serve.start = lambda **kw: calls.append("serve.start")
    serve.shutdown = lambda: calls.append("serve.shutdown")
    serve.delete = lambda name: calls.append(f"serve.delete {name}")
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.serve", serve)
    monkeypatch.setattr(ray_app, "application", lambda *a, **kw: "the app")
    monkeypatch.setattr(ray_app, "fetch_models", lambda args: calls.append("fetch"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls, serve


def test_ctrl_c_stops_serve_and_the_local_cluster(fake_ray):
    calls, serve = fake_ray

    def run(app, blocking):
        calls.append("serve.run")
        raise KeyboardInterrupt

    serve.run = run
    before = signal.getsignal(signal.SIGTERM)
    ray_app.main(["--replicas", "2"])
    assert calls == ["fetch", "init local", "serve.start", "serve.run", "serve.shutdown", "ray.shutdown"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigterm_stops_them_too(fake_ray):
    calls, serve = fake_ray
    serve.run = lambda app, blocking: signal.raise_signal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        ray_app.main([])
    assert e.value.code == 128 + signal.SIGTERM and calls[-2:] == ["serve.shutdown", "ray.shutdown"]


def test_a_joined_cluster_keeps_running(fake_ray, monkeypatch):
    calls, serve = fake_ray
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")

    def run(app, blocking):
        raise KeyboardInterrupt

    serve.run = run
    ray_app.main([])
    assert calls == ["init ray://head:10001", "serve.start", "serve.delete default", "ray.shutdown"]
