"""Locust scenario: streaming OpenAI completions with a tier mix, against any
`vllm serve` (loopback by default).

Configured by environment variables (the harness sets them):

| variable | meaning | default |
|---|---|---|
| O3_MODE | `open` (Poisson arrivals at O3_RATE/s) or `closed` (users back to back) | open |
| O3_RATE | arrivals per second in open mode | 1.0 |
| O3_MAX_REQUESTS | no arrivals after this many requests (0: no limit) | 0 |
| O3_ARRIVAL_S | open mode: arrivals for this many seconds, then only the answers (0: until --run-time) | 0 |
| O3_TIER_MIX | e.g. `critical:10,high:20,normal:50,low:20` | that |
| O3_TIER_STYLE | `o3` (vllm_xargs.tier), `priority` (vLLM priority), `none` | o3 |
| O3_PROMPT_TOKENS / O3_OUTPUT_TOKENS | `min-max` ranges, uniform | 32-256 / 16-64 |
| O3_EXPORTER_PORT | port of this process's Prometheus exporter | 9400 |
| O3_RECORD | CSV file: one row per request | (none) |

Per request it measures time to first token, inter-token latency and end to
end latency, counts status by tier (ok, dropped = 503 deadline_exceeded,
error, unfinished = still waiting when the run ended), and exports them as
`loadgen_*` metrics for Prometheus.
"""

from __future__ import annotations

import csv
import itertools
import json
import os
import random
import time

import gevent
from locust import User, constant, events, task
from prometheus_client import Counter, Histogram, start_http_server

TIERS = ("critical", "high", "normal", "low")
LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5,
    10.0, 15.0, 20.0, 30.0, 60.0,
)  # fmt: skip
WORDS = [
    "river",
    "valley",
    "stone",
    "market",
    "harbour",
    "evening",
    "letter",
    "music",
    "winter",
    "garden",
    "engine",
    "village",
    "mountain",
    "lantern",
    "orchard",
    "bridge",
    "ocean",
    "library",
    "candle",
    "meadow",
]


def span(name: str, default: str) -> tuple[int, int]:
    low, high = os.environ.get(name, default).split("-")
    return int(low), int(high)


def tier_mix() -> tuple[list[str], list[float]]:
    pairs = [p.split(":") for p in os.environ.get(
        "O3_TIER_MIX", "critical:10,high:20,normal:50,low:20").split(",")]  # fmt: skip
    return [t for t, _ in pairs], [float(w) for _, w in pairs]


REQUESTS = Counter(
    "loadgen_requests", "Requests by tier and outcome", ["tier", "status"]
)
TTFT = Histogram(
    "loadgen_ttft_seconds", "Time to first token", ["tier"], buckets=LATENCY_BUCKETS
)
E2E = Histogram(
    "loadgen_e2e_seconds", "End-to-end latency", ["tier"], buckets=LATENCY_BUCKETS
)
ITL = Histogram(
    "loadgen_itl_seconds", "Inter-token latency", ["tier"],
    buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0),
)  # fmt: skip
_record = {"writer": None, "count": 0}
# Requests sent and not yet answered, by id: (start wall time, tier). Those
# still here when the run ends are recorded as `unfinished`, so that a tier
# the scheduler starves is counted, not missing.
_in_flight: dict[int, tuple[float, str]] = {}
_request_ids = itertools.count()
STATUSES = ("ok", "dropped", "error", "unfinished")


# Two scrapes of the harness' Prometheus (1 s interval): long enough for it to
# read every series' final value before this process (and its exporter) ends.
SCRAPE_MARGIN_S = 2.5


@events.init.add_listener
def start_exporter(environment, **_):
    # Every tier and outcome has a series, at 0 when it saw no request.
    for tier in TIERS:
        for status in STATUSES:
            REQUESTS.labels(tier, status)
        for histogram in (TTFT, E2E, ITL):
            histogram.labels(tier)
    start_http_server(int(os.environ.get("O3_EXPORTER_PORT", "9400")), addr="127.0.0.1")
    if path := os.environ.get("O3_RECORD"):
        handle = open(path, "w", newline="")  # noqa: SIM115 (open for the run)
        writer = csv.writer(handle)
        writer.writerow(["start", "tier", "status", "ttft", "e2e", "tokens", "tpot"])
        _record["writer"], _record["handle"] = writer, handle


@events.quitting.add_listener
def close_record(environment, **_):
    for wall, tier in list(_in_flight.values()):
        REQUESTS.labels(tier, "unfinished").inc()
        if _record["writer"] is not None:
            _record["writer"].writerow([wall, tier, "unfinished", "", "", 0, ""])
    time.sleep(SCRAPE_MARGIN_S)  # the exporter dies with this process
    if _record.get("handle"):
        _record["handle"].close()


class OpenAIUser(User):
    """Sends streaming completions; in open mode one user spawns arrivals."""

    wait_time = constant(0)
    host = "http://127.0.0.1:8000"

    def on_start(self):
        import requests

        self.session = requests.Session()
        self.model = self.session.get(f"{self.host}/v1/models").json()["data"][0]["id"]
        self.tiers, self.weights = tier_mix()
        self.prompt_span = span("O3_PROMPT_TOKENS", "32-256")
        self.output_span = span("O3_OUTPUT_TOKENS", "16-64")
        self.style = os.environ.get("O3_TIER_STYLE", "o3")
        self.max_requests = int(os.environ.get("O3_MAX_REQUESTS", "0"))

    @task
    def load(self):
        if os.environ.get("O3_MODE", "open") == "closed":
            self.one_request()
            return
        rate = float(os.environ.get("O3_RATE", "1.0"))
        window = float(os.environ.get("O3_ARRIVAL_S", "0"))
        start = time.monotonic()
        while not window or time.monotonic() - start < window:
            gevent.sleep(random.expovariate(rate))
            if self.max_requests and _record["count"] >= self.max_requests:
                break
            _record["count"] += 1
            gevent.spawn(self.one_request)
        while True:  # arrivals are over; the requests drain until --run-time
            gevent.sleep(1)

    def body(self, tier: str) -> dict:
        words = random.randint(*self.prompt_span)  # ~1 token per word here
        body = {
            "model": self.model,
            "prompt": " ".join(random.choices(WORDS, k=words)),
            "max_tokens": random.randint(*self.output_span),
            "ignore_eos": True,
            "stream": True,
        }
        if self.style == "o3":
            body["vllm_xargs"] = {"tier": tier}
        elif self.style == "priority":
            body["priority"] = TIERS.index(tier)
        return body

    def one_request(self):
        tier = random.choices(self.tiers, self.weights)[0]
        start = time.perf_counter()
        wall = time.time()
        request_id = next(_request_ids)
        _in_flight[request_id] = (wall, tier)
        status, first, last, tokens = "error", None, None, 0
        try:
            with self.session.post(
                f"{self.host}/v1/completions",
                json=self.body(tier),
                stream=True,
                timeout=600,
            ) as response:
                if response.status_code == 503:
                    status = "dropped"
                elif response.status_code == 200:
                    status = "ok"
                    for line in response.iter_lines():
                        if not line.startswith(b"data: {"):
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            kind = event["error"].get("type")
                            status = (
                                "dropped" if kind == "deadline_exceeded" else "error"
                            )
                            break
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        elif last is not None:
                            ITL.labels(tier).observe(now - last)
                        last = now
                        tokens += 1
        except Exception:  # noqa: BLE001 (any failure is an error outcome)
            status = "error"
        end = time.perf_counter()
        del _in_flight[request_id]
        REQUESTS.labels(tier, status).inc()
        ttft = None if first is None else first - start
        tpot = None if first is None or tokens < 2 else (last - first) / (tokens - 1)
        if status == "ok" and ttft is not None:
            TTFT.labels(tier).observe(ttft)
            E2E.labels(tier).observe(end - start)
        events.request.fire(
            request_type=f"POST {tier}", name="/v1/completions",
            response_time=(end - start) * 1e3, response_length=tokens,
            exception=None if status == "ok" else RuntimeError(status), context={},
        )  # fmt: skip
        if _record["writer"] is not None:
            _record["writer"].writerow(
                [wall, tier, status, ttft, end - start, tokens, tpot]
            )
