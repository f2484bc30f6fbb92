"""The rank processes: how they start, where they meet, how they are stopped and a silent death named."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator

__all__ = ["death", "environment_variables", "free_port", "mp_context", "stop"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(procs) -> None:
    """Terminate (then kill) the workers still alive and reap every started one."""
    procs = [p for p in procs if p.pid is not None]  # a process whose start failed has nothing to reap
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def death(exitcode: int) -> str:
    """How a worker that reported nothing ended: ``process died (killed by SIGKILL)`` or ``(exit code 3)``."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"process died (killed by {name})"
    return f"process died (exit code {exitcode})"


@contextlib.contextmanager
def environment_variables(env: tuple[tuple[str, str], ...]) -> Iterator[None]:
    """``os.environ`` updated with ``env`` pairs inside the block, then restored."""
    saved = {name: os.environ.get(name) for name, _ in env}
    os.environ.update(dict(env))
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def mp_context(device: str, env: tuple[tuple[str, str], ...] = ()):
    """``forkserver`` preloaded with the heavy imports on CPU; plain ``spawn`` on CUDA (the preload would
    initialise CUDA in the server) or with ``env`` (set before any import)."""
    import multiprocessing

    if device == "cuda" or env:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["fla_ac_isolation.harness.regression._preload"])
    return ctx
