"""Starting and stopping a `vllm serve` process, by PID: for tests,
benchmarks and the load harnesses, which must leave nothing running."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A server process (`vllm serve`, a gateway, a proxy) and where it listens."""

    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


KV_CACHE_GIB = "2"

# The flags that turn `vllm serve` into an O3 server: the plugin loads itself.
O3_SERVE_ARGS = (
    "--scheduler-cls", "vllm_o3.scheduler.O3Scheduler",
    "--middleware", "vllm_o3.middleware.O3Middleware",
)  # fmt: skip


def vllm_command() -> list[str]:
    """The `vllm` command of the running Python environment."""
    return [str(Path(sys.executable).with_name("vllm"))]


def start_server(
    model: str | Path, log: Path, *args: str, timeout: float = 600, env=None
) -> Server:
    """Start `vllm serve MODEL` on a free loopback port; wait until it is healthy."""
    return wait_healthy(launch_server(model, log, *args, env=env), timeout)


def launch_server(model: str | Path, log: Path, *args: str, env=None) -> Server:
    """`vllm serve MODEL` on a free loopback port, in its own process group;
    does not wait (several servers start at once)."""
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
    return launch(command, log, port, env)


def interrupt(*_) -> None:
    raise KeyboardInterrupt


def unwind_on_sigterm() -> None:
    """Make SIGTERM unwind the program like Ctrl-C, so that the `finally`
    blocks that stop its servers run (where nothing else handles SIGTERM)."""
    if (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, interrupt)


def launch(command: list[str], log: Path, port: int, env=None) -> Server:
    """Start `command` in its own process group (so it is stopped whole, by
    PID), its output in `log`; it is to listen on `port`. Without
    `VLLM_CPU_KVCACHE_SPACE` in `env` or the environment, a CPU server gets a
    KV cache of `KV_CACHE_GIB`: vLLM's default fraction of all RAM fails once
    two servers, or a server and its load, share a machine."""
    unwind_on_sigterm()
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={"VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB, **os.environ, **(env or {})},
            start_new_session=True,
        )
    return Server(process, port, log)


def wait_healthy(server: Server, timeout: float = 600, path: str = "/health"):
    """Wait until `path` answers 200; stop the server and raise with its log's
    tail if it exits or times out."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            tail = server.log.read_text()[-4000:]
            raise RuntimeError(
                f"{server.log.stem} exited with {server.process.returncode}:\n{tail}"
            )
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{server.url}{path}", timeout=5) as reply,
        ):
            if reply.status == 200:
                return server
        time.sleep(1)
    stop_server(server)
    raise TimeoutError(
        f"{server.log.stem} not healthy after {timeout}s:\n"
        f"{server.log.read_text()[-4000:]}"
    )


def stop_server(server: Server, timeout: float = 60) -> int:
    """SIGTERM the server's process group by PID; SIGKILL what is left."""
    return stop_servers([server], timeout)[0]


def stop_servers(servers: list[Server], timeout: float = 60) -> list[int]:
    """Stop several servers at once: SIGTERM every process group, then wait;
    SIGKILL the groups still there after `timeout`. Their exit codes."""
    for server in servers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    codes = []
    for server in servers:
        try:
            codes.append(server.process.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.process.pid, signal.SIGKILL)
            codes.append(server.process.wait())
    return codes


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


def metric_samples(url: str) -> dict[tuple[str, frozenset], float]:
    """`/metrics` of a server as {(name, {label: value}): sample}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics") as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)


def requests_served(server: Server) -> float:
    """Requests a server completed (vLLM's own counter; it also counts the
    aborted ones, deadline drops among them, which are not served)."""
    samples = metric_samples(server.url)
    return sum(
        metric(samples, "vllm:request_success_total", finished_reason=reason)
        for reason in ("stop", "length")
    )


def deadline_drops(server: Server) -> float:
    """Requests O3Scheduler dropped at their queue deadline."""
    return metric(metric_samples(server.url), "o3_scheduler_deadline_drops_total")


# vLLM 0.32 logs at ERROR some client errors it answers with a 4xx (e.g. an
# unknown model name: "Error with model error=ErrorInfo(..., code=404)").
CLIENT_ERROR_LOGGED = re.compile(r"Error with model error=ErrorInfo\(.*code=4\d\d\)$")


def errors_while_serving(log: Path) -> list[str]:
    """ERROR and Traceback lines a server logged before its shutdown began
    (vLLM 0.32 may log an EngineDeadError while it tears itself down), less
    vLLM's logging of client errors it answered with a 4xx."""
    lines = log.read_text(errors="replace").splitlines()
    serving = next((i for i, line in enumerate(lines) if "[shutdown]" in line), None)
    return [
        line
        for line in lines[:serving]
        if (" ERROR " in line or "Traceback" in line)
        and not CLIENT_ERROR_LOGGED.search(line)
    ]
