"""Build a server's model and scheduler in a thread that then exits, so the engine thread's
OpenMP pool is the process's only one.

torch's CPU ops run on OpenMP (libgomp), which keeps a pool of worker threads for every thread
that has run a parallel region. Loading a model runs many, so the loading thread keeps a pool;
the scheduler's engine thread gets a second one. With more libgomp threads alive than CPUs,
libgomp cuts the time an idle worker spins before it sleeps from about 3 ms to 100 spins, and
each of the hundreds of parallel regions of a decoding step then first wakes its worker from
sleep: the 1.5B decoded about a fifth slower in the server than in `LLM` on the same machine
(2 cores). A thread's pool ends with the thread, so building off a short-lived thread leaves
one pool, the engine's. The thread that serves HTTP runs no parallel torch op.
"""
from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def built_off_thread(build: Callable[[], T]) -> T:
    """build() in a thread of its own, which exits before this returns; its result, or its error."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = build()
        except BaseException as e:  # handed to the caller, raised there
            box["error"] = e

    t = threading.Thread(target=run, name="forerun-build")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
