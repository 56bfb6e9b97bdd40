"""Starting and stopping a `vllm serve` process, by PID: for tests,
benchmarks and the load harnesses, which must leave nothing running."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A `vllm serve` process and where it listens."""

    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def vllm_command() -> list[str]:
    """The `vllm` command of the running Python environment."""
    return [str(Path(sys.executable).with_name("vllm"))]


def start_server(
    model: str | Path, log: Path, *args: str, timeout: float = 600, env=None
) -> Server:
    """Start `vllm serve MODEL` on a free loopback port; wait until it is healthy."""
    import urllib.request

    port = free_port()
    command = [
        *vllm_command(),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    server = Server(process, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text()[-4000:]
            raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{tail}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{server.url}/health", timeout=5) as reply,
        ):
            if reply.status == 200:
                return server
        time.sleep(1)
    stop_server(server)
    raise TimeoutError(
        f"vllm serve not healthy after {timeout}s:\n{log.read_text()[-4000:]}"
    )


def stop_server(server: Server, timeout: float = 60) -> int:
    """SIGTERM the server's process group by PID; SIGKILL what is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGTERM)
    try:
        return server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        return server.process.wait()


def processes_in_group(pgid: int) -> list[int]:
    """PIDs still alive in process group `pgid` (a server and its engine)."""
    import psutil

    alive = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if (
                os.getpgid(process.pid) == pgid
                and process.status() != psutil.STATUS_ZOMBIE
            ):
                alive.append(process.pid)
    return alive


def group_exits(pgid: int, timeout: float = 15) -> bool:
    """Whether every process of group `pgid` is gone within `timeout` seconds
    (vLLM's engine and workers exit shortly after the front end)."""
    deadline = time.monotonic() + timeout
    while processes_in_group(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True
