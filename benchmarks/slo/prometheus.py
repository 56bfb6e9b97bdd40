"""A real Prometheus server for the harness: Debian's `prometheus` binary
(from PATH, or fetched with `apt-get download` and unpacked into the cache),
started with a generated config, queried over its HTTP API, stopped by PID."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from vllm_o3.tools.debian import DEFAULT_CACHE, debian_program
from vllm_o3.tools.server import free_port

SCRAPE_INTERVAL_S = 1


@dataclass
class Prometheus:
    process: subprocess.Popen
    url: str
    folder: Path

    def query(self, expression: str, at: float | None = None) -> float | None:
        """An instant query's single value (None when it has no data)."""
        parameters = {"query": expression}
        if at is not None:
            parameters["time"] = f"{at:.3f}"
        result = self._get("/api/v1/query", parameters)
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if value != value else value  # NaN: no data

    def query_range(self, expression: str, start: float, end: float, step: float = 2.0):
        """[(time, value)] of the first series of a range query."""
        result = self._get(
            "/api/v1/query_range",
            {"query": expression, "start": start, "end": end, "step": step},
        )
        return [(float(t), float(v)) for t, v in result[0]["values"]] if result else []

    def _get(self, path: str, parameters: dict):
        url = f"{self.url}{path}?{urllib.parse.urlencode(parameters)}"
        with urllib.request.urlopen(url, timeout=30) as reply:
            body = json.loads(reply.read())
        if body.get("status") != "success":
            raise RuntimeError(f"PromQL failed: {parameters}: {body}")
        return body["data"]["result"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_prometheus(
    targets: dict[str, str], cache: Path = DEFAULT_CACHE
) -> Prometheus:
    """Scrape `targets` ({job: "host:port"}) every second."""
    binary = debian_program("prometheus", "usr/bin/prometheus", "prometheus", cache)
    folder = Path(tempfile.mkdtemp(prefix="o3-prometheus-"))
    jobs = "\n".join(
        f"  - job_name: {job}\n    static_configs:\n      - targets: ['{address}']"
        for job, address in targets.items()
    )
    config = folder / "prometheus.yml"
    config.write_text(
        f"global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
        f"  evaluation_interval: {SCRAPE_INTERVAL_S}s\nscrape_configs:\n{jobs}\n"
    )
    port = free_port()
    process = subprocess.Popen(
        [str(binary), f"--config.file={config}", f"--storage.tsdb.path={folder / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=open(folder / "prometheus.log", "wb"),  # noqa: SIM115
    )  # fmt: skip
    prometheus = Prometheus(process, f"http://127.0.0.1:{port}", folder)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{prometheus.url}/-/ready", timeout=2):
                return prometheus
        except OSError:
            time.sleep(0.5)
    prometheus.stop()
    raise TimeoutError("prometheus did not become ready")
