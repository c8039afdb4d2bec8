"""A server as a subprocess on a free loopback port, for the measurement matrix: started,
awaited on its /health route, stopped with SIGINT (the graceful stop of uvicorn and of
llama-server alike), killed only when it does not stop. Its output goes to a log file, whose
tail is in the error when it fails to start."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A port the OS has just handed out on 127.0.0.1 (free unless someone takes it first)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace") if path.is_file() else ""
    return "\n".join(text.splitlines()[-lines:])


def _hear_sigint() -> None:
    """In the child before exec: SIGINT back to its default. A launcher started with `&` from a
    script ignores SIGINT, children inherit that, and a Python server that starts with SIGINT
    ignored keeps it ignored: stop() could then only kill it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Launched:
    """`with Launched(argv, port, log) as url:` runs argv (which must listen on 127.0.0.1:port)
    until the block ends. `env`: extra environment variables; `timeout`: seconds to wait for
    /health to answer 200 (a model load, a kernel build the first time)."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict | None = None, timeout: float = 900.0):
        self.argv, self.port, self.log, self.env, self.timeout = argv, port, log, env or {}, timeout
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
                                         preexec_fn=_hear_sigint)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.argv[0]} exited with {self.proc.returncode} before serving; "
                                   f"the end of {self.log}:\n{tail(self.log)}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet, or llama-server still loading (503)
            time.sleep(0.5)
        raise RuntimeError(f"{self.argv[0]} did not answer /health within {self.timeout:.0f} s; "
                           f"the end of {self.log}:\n{tail(self.log)}")

    def stop(self, grace: float = 30.0) -> int | None:
        """SIGINT, then SIGKILL after `grace` seconds; the exit status (None if it was never started)."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_in_thread(app):
    """An ASGI app served by uvicorn in a daemon thread of this process, on a free loopback port:
    (the uvicorn server, its URL); `server.should_exit = True` stops it."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


def server_argvs(forerun: list[str], max_len: int, llama_server: str | None = None, gguf: str | None = None,
                 threads: int = 2, llama_extra: list[str] = (), llama_flags: tuple[str, ...] = ()) -> list[tuple[str, list[str]]]:
    """(label, argv with "{port}") for each `forerun serve` option string, then llama-server
    plain and once per extra flag string (the same GGUF, threads and context; llama_flags go to
    every llama-server, e.g. --jinja)."""
    import shlex
    import sys

    servers = [(f"forerun {a}", [sys.executable, "-m", "forerun.cli", "serve", *shlex.split(a), "--port", "{port}",
                                 "--max-len", str(max_len)]) for a in forerun]
    if llama_server:
        for extra in ["", *llama_extra]:
            servers.append((f"llama-server {extra}".strip(), [llama_server, "-m", gguf, "-t", str(threads), "-c", str(max_len),
                                                             "-np", "1", *llama_flags, "--port", "{port}", *shlex.split(extra)]))
    return servers


class Servers:
    """`with Servers(server_argvs(...), out) as urls:` every server started (one log each in out),
    [(label, url)] while the block runs, all stopped after."""

    def __init__(self, servers: list[tuple[str, list[str]]], out: Path):
        self.servers, self.out, self.running = servers, out, []

    def __enter__(self) -> list[tuple[str, str]]:
        try:
            for label, template in self.servers:
                port = free_port()
                server = Launched([a.replace("{port}", str(port)) for a in template], port, self.out / f"server-{len(self.running)}.log")
                self.running.append((label, server, server.__enter__()))
        except BaseException:
            self.__exit__()
            raise
        return [(label, url) for label, _, url in self.running]

    def __exit__(self, *exc) -> None:
        for _, server, _ in self.running:
            server.stop()


def add_server_options(p, max_len: int, out: str) -> None:
    """The flags of a workload that plays against forerun servers and llama-server (server_argvs')."""
    p.add_argument("--max-len", type=int, default=max_len, help="each server's context")
    p.add_argument("--forerun", action="append", default=[], help="`forerun serve` options, one server each (repeatable)")
    p.add_argument("--llama-server", default=None, help="llama-server binary: plain, then once per --llama-extra")
    p.add_argument("--llama-extra", action="append", default=[], help="more llama-server flags, one server each "
                   "(e.g. '--spec-type ngram-mod')")
    p.add_argument("--gguf", default=None, help="the GGUF llama-server loads (the same file forerun's model came from)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=out)


def out_dir(path: str) -> Path:
    """The run's output folder, made if missing."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    return out
