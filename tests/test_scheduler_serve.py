"""The tier policy end to end: `vllm serve` with O3Scheduler and the O3 HTTP
middleware, two request slots, and long-running "blocker" requests that hold
them; plus the offline path through `LLM(...)`.

The server's breaker is on only for `high` (2 drops, 10 s cool-down), so the
other tests' deadline drops (of `critical` and `normal` requests) leave it be.
The `small` preset keeps a 2000-token request busy for ~20 s here.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest

from tests.utils import vllm_engine
from vllm_o3.tools.server import metric, metric_samples, start_server, stop_server

POLICY = {
    "tiers": {
        "critical": {"breaker_drops": None},
        "high": {"breaker_drops": 2},
        "normal": {"breaker_drops": None},
    },
    # Long enough that the open state is still there when the test reads it
    # on a loaded CI machine (10 s was once read as half-open already).
    "breaker_cooldown_s": 20,
}
SLOTS = 2


@pytest.fixture(scope="module")
def server(small_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("tiers") / "server.log"
    server = start_server(
        small_checkpoint, log,
        "--max-num-seqs", str(SLOTS), "--max-model-len", "2048",
        "--scheduler-cls", "vllm_o3.scheduler.O3Scheduler",
        "--middleware", "vllm_o3.middleware.O3Middleware",
        "--additional-config", json.dumps({"o3_scheduler": POLICY}),
    )  # fmt: skip
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def model(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def body(model: str, **fields) -> dict:
    request = {"model": model, "prompt": "The river", "max_tokens": 4}
    request.update(fields)
    return request


def wait_idle(server) -> None:
    """Until no request runs or waits: blockers started on a busy server
    would start one after another, and the first could end (a 2000-token
    request takes ~20 s here) while a test still counts on it."""
    deadline = time.monotonic() + 60
    while any(
        metric(metric_samples(server.url), name) > 0
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
    ):
        assert time.monotonic() < deadline, "the server did not become idle"
        time.sleep(0.1)


@contextlib.contextmanager
def blockers(server, http, model, tier: str, count: int = SLOTS):
    """`count` long streaming requests of `tier` holding request slots (each
    has produced a token when this yields); cancelled (client disconnect) on
    exit, and the slots are free again afterwards."""
    wait_idle(server)
    stop = threading.Event()
    started = [threading.Event() for _ in range(count)]

    def hold(started: threading.Event):
        request = body(
            model, max_tokens=2000, ignore_eos=True, stream=True,
            vllm_xargs={"tier": tier, "deadline_ms": 60_000},
        )  # fmt: skip
        with http.stream("POST", "/v1/completions", json=request) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold, args=(s,), daemon=True) for s in started]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(timeout=120), "blockers did not start"
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        wait_idle(server)


def assert_deadline_error(error: dict, tier: str, deadline: str) -> None:
    assert error["type"] == "deadline_exceeded"
    assert error["code"] == 503
    assert f"'{tier}'" in error["message"] and f"{deadline} ms" in error["message"]


def test_critical_request_preempts_low_ones_and_meets_its_deadline(server, http, model):
    before = metric(metric_samples(server.url), "vllm:num_preemptions_total")
    with blockers(server, http, model, "low"):
        start = time.monotonic()
        reply = http.post(
            "/v1/completions",
            json=body(model, vllm_xargs={"tier": "critical", "deadline_ms": 2000}),
        )
        elapsed = time.monotonic() - start
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] == "length"
    assert elapsed < 10
    assert metric(metric_samples(server.url), "vllm:num_preemptions_total") > before


def test_one_ms_deadline_behind_a_full_queue_gets_503(server, http, model):
    with blockers(server, http, model, "critical"):
        reply = http.post(
            "/v1/completions",
            json=body(model, vllm_xargs={"tier": "normal", "deadline_ms": 1}),
        )
    assert reply.status_code == 503
    assert_deadline_error(reply.json()["error"], "normal", "1")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_drop_is_an_error_event_before_done(server, http, model, path):
    request = body(model, stream=True)
    if path.endswith("chat/completions"):
        del request["prompt"]
        request["messages"] = [{"role": "user", "content": "Hi"}]
    headers = {"X-O3-Tier": "critical", "X-O3-Deadline-Ms": "1"}
    with blockers(server, http, model, "critical"):
        reply = http.post(path, json=request, headers=headers)
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert len(events) == 2, events
    assert_deadline_error(json.loads(events[0])["error"], "critical", "1")


def test_breaker_opens_after_drops_then_closes_after_a_met_trial(server, http, model):
    def state() -> float:
        return metric(
            metric_samples(server.url), "o3_scheduler_breaker_state", tier="high"
        )

    def diversions() -> float:
        return metric(
            metric_samples(server.url),
            "o3_scheduler_breaker_diversions_total",
            tier="high",
        )

    urgent = body(model, vllm_xargs={"tier": "high", "deadline_ms": 1})
    diverted_before = diversions()
    with blockers(server, http, model, "critical"):
        for _ in range(2):
            assert http.post("/v1/completions", json=urgent).status_code == 503
        # Open: served as normal without a deadline (after the blockers end).
        # Sent at once, well inside the cool-down however slow the machine.
        diverted = {}
        thread = threading.Thread(
            target=lambda: diverted.update(
                reply=http.post("/v1/completions", json=urgent)
            )
        )
        thread.start()
        time.sleep(0.6)  # gauges refresh twice a second
        assert state() == 1  # open
    thread.join(timeout=60)
    assert diverted["reply"].status_code == 200, diverted["reply"].text
    assert diversions() == diverted_before + 1
    time.sleep(POLICY["breaker_cooldown_s"])
    trial = body(model, vllm_xargs={"tier": "high", "deadline_ms": 5000})
    assert http.post("/v1/completions", json=trial).status_code == 200
    time.sleep(0.6)
    assert state() == 0  # closed again


@pytest.mark.parametrize(
    "xargs, headers, param",
    [
        ({"tier": "urgent"}, {}, "vllm_xargs.tier"),
        ({"tier": 3}, {}, "vllm_xargs.tier"),
        ({"tier": ""}, {}, "vllm_xargs.tier"),
        ({"tier": ["high"]}, {}, "vllm_xargs.tier"),
        ({"deadline_ms": -5}, {}, "vllm_xargs.deadline_ms"),
        ({"deadline_ms": 0}, {}, "vllm_xargs.deadline_ms"),
        ({"deadline_ms": "soon"}, {}, "vllm_xargs.deadline_ms"),
        ({"deadline_ms": 1e300}, {}, "vllm_xargs.deadline_ms"),
        ({}, {"X-O3-Tier": "gold"}, "x-o3-tier"),
        ({}, {"X-O3-Deadline-Ms": "NaN"}, "x-o3-deadline-ms"),
        ({}, {"X-O3-Deadline-Ms": "inf"}, "x-o3-deadline-ms"),
        ({}, {"X-O3-Deadline-Ms": "-1"}, "x-o3-deadline-ms"),
        ({"tier": "low"}, {"X-O3-Tier": "high"}, "x-o3-tier"),
    ],
)
def test_bad_fields_get_400_and_others_are_served(http, model, xargs, headers, param):
    reply = http.post(
        "/v1/completions", json=body(model, vllm_xargs=xargs), headers=headers
    )
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and error["message"]
    assert http.post("/v1/completions", json=body(model)).status_code == 200


def test_nan_deadline_in_raw_json_gets_400(http, model):
    raw = json.dumps(body(model)).replace(
        '"max_tokens": 4', '"max_tokens": 4, "vllm_xargs": {"deadline_ms": NaN}'
    )
    reply = http.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "vllm_xargs.deadline_ms"


def test_scheduler_metrics_are_exported(server, http, model):
    http.post("/v1/completions", json=body(model, vllm_xargs={"tier": "low"}))
    time.sleep(0.6)
    samples = metric_samples(server.url)
    for tier in ("critical", "high", "normal", "low"):
        assert (
            "o3_scheduler_deadline_drops_total",
            frozenset({("tier", tier)}),
        ) in samples
    assert metric(samples, "o3_scheduler_queue_time_seconds_count", tier="low") >= 1
    assert metric(samples, "o3_scheduler_deadline_drops_total", tier="normal") >= 1
    assert metric(samples, "vllm:num_requests_waiting") == 0  # vLLM's own still there


def test_offline_drop_is_an_abort_with_deadline_exceeded(tiny_checkpoint):
    from vllm import SamplingParams

    with vllm_engine(
        tiny_checkpoint,
        scheduler_cls="vllm_o3.scheduler.O3Scheduler",
        max_num_seqs=1,
        enforce_eager=True,
    ) as llm:
        long = SamplingParams(
            max_tokens=200, ignore_eos=True,
            extra_args={"tier": "critical", "deadline_ms": 60_000},
        )  # fmt: skip
        urgent = SamplingParams(
            max_tokens=4, extra_args={"tier": "high", "deadline_ms": 1}
        )
        outputs = llm.generate(["The river", "A lake"], [long, urgent], use_tqdm=False)
        bad = llm.generate(
            ["A lake"], SamplingParams(max_tokens=4, extra_args={"tier": "gold"}),
            use_tqdm=False,
        )  # fmt: skip
    assert outputs[0].outputs[0].finish_reason == "length"
    dropped = outputs[1].outputs[0]
    assert dropped.finish_reason == "abort"
    assert dropped.stop_reason == "deadline_exceeded"
    assert bad[0].outputs[0].finish_reason == "abort"
    assert (
        bad[0].outputs[0].stop_reason.startswith("invalid_request: tier must be one of")
    )


def test_prompt_longer_than_the_context_gets_400(http, model):
    reply = http.post("/v1/completions", json=body(model, prompt="river " * 3000))
    assert reply.status_code == 400
    assert "context length" in reply.json()["error"]["message"]
    assert http.post("/v1/completions", json=body(model)).status_code == 200


def test_triton_style_health_endpoints(http):
    assert http.get("/v2/health/live").json() == {"status": "live"}
    assert http.get("/v2/health/ready").json() == {"status": "ready"}


def test_seeded_requests_are_refused_on_cpu_and_the_server_stays_up(http, model):
    reply = http.post("/v1/completions", json=body(model, seed=7, prompt="x " * 300))
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "seed"
    assert http.post("/v1/completions", json=body(model)).status_code == 200
