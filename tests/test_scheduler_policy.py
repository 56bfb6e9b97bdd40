"""The tier policy on vLLM's real scheduler, with a fake clock and synthetic
requests: order, earliest deadline first, drops at the deadline and not
before, caps, preemption victims, breaker transitions, and the policy's
configuration. Runs on both vLLM schedulers (sync, and async as on GPUs)."""

from __future__ import annotations

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_o3 import register
from vllm_o3.scheduler import O3AsyncScheduler, O3Scheduler
from vllm_o3.scheduler.breaker import BreakerState
from vllm_o3.scheduler.http import with_tracestate_fields
from vllm_o3.scheduler.tiers import SchedulerPolicy, Tier, parse_request_fields

BLOCK = 16


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_scheduler(
    checkpoint,
    *,
    max_num_seqs: int = 8,
    num_blocks: int = 1000,
    o3: dict | None = None,
    async_scheduling: bool = False,
    clock: Clock,
):
    register()  # what vLLM's plugin loading does in an engine
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(checkpoint), dtype="float32", max_model_len=512
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=2048,
            max_model_len=512,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        additional_config={"o3_scheduler": o3} if o3 is not None else {},
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    # vLLM turns async scheduling off on the CPU platform; the scheduler's own
    # logic is platform-independent, so test the async flavour here too.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer"],
                FullAttentionSpec(
                    block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32
                ),
            )
        ],
    )
    scheduler = O3Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=False,
    )
    scheduler.clock = clock
    return scheduler


counter = iter(range(10**9))


def make_request(
    clock: Clock, tier: str | None = None, deadline_ms=None, tokens=20, priority=0, **kw
) -> Request:
    extra = {}
    if tier is not None:
        extra["tier"] = tier
    if deadline_ms is not None:
        extra["deadline_ms"] = deadline_ms
    return Request(
        request_id=f"r{next(counter)}",
        prompt_token_ids=[1] * tokens,
        sampling_params=SamplingParams(max_tokens=50, extra_args=extra or None, **kw),
        pooling_params=None,
        arrival_time=clock.now,
        priority=priority,
    )


def run_step(scheduler, token: int = 7):
    """One schedule + a model output of one token per scheduled request."""
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    runner = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids],
    )
    engine_outputs = scheduler.update_from_output(output, runner)
    finished = [
        o for eo in engine_outputs.values() for o in eo.outputs if o.finish_reason
    ]
    return output, finished


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request):
    return request.param


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def new_scheduler(tiny_checkpoint, clock, async_scheduling):
    def build(**kwargs):
        return make_scheduler(
            tiny_checkpoint, clock=clock, async_scheduling=async_scheduling, **kwargs
        )

    return build


def test_async_configuration_gives_the_async_policy(new_scheduler, async_scheduling):
    scheduler = new_scheduler()
    assert isinstance(scheduler, O3Scheduler)
    assert isinstance(scheduler, AsyncScheduler) == async_scheduling
    assert isinstance(scheduler, O3AsyncScheduler) == async_scheduling


def test_strict_tier_order_then_deadline_then_priority_then_arrival(
    new_scheduler, clock
):
    scheduler = new_scheduler(max_num_seqs=1)
    low = make_request(clock, "low")
    clock.now += 0.001
    normal_late = make_request(clock, "normal", deadline_ms=900)
    normal_early = make_request(clock, "normal", deadline_ms=500)
    normal_prio = [make_request(clock, "normal", priority=p) for p in (5, -5)]
    critical = make_request(clock, "critical")
    for r in (low, normal_late, normal_early, *normal_prio, critical):
        scheduler.add_request(r)
    order = [r.request_id for r in scheduler.waiting]
    expected = [
        critical,
        normal_early,
        normal_late,
        normal_prio[1],
        normal_prio[0],
        low,
    ]
    assert order == [r.request_id for r in expected]
    output, _ = run_step(scheduler)
    assert list(output.num_scheduled_tokens) == [critical.request_id]


def test_no_tier_means_normal_with_its_deadline(new_scheduler, clock):
    scheduler = new_scheduler()
    request = make_request(clock)
    scheduler.add_request(request)
    where = request.o3_placement
    assert where.tier == Tier.NORMAL
    assert where.deadline == pytest.approx(request.arrival_time + 1.0)


def test_dropped_at_the_deadline_and_not_before(new_scheduler, clock):
    scheduler = new_scheduler(max_num_seqs=1)
    blocker = make_request(clock, "critical")
    waiter = make_request(clock, "high", deadline_ms=100)
    scheduler.add_request(blocker)
    scheduler.add_request(waiter)
    run_step(scheduler)  # blocker takes the only slot
    clock.now += 0.099
    _, finished = run_step(scheduler)
    assert not finished and waiter.status == RequestStatus.WAITING
    clock.now += 0.002
    _, finished = run_step(scheduler)
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in finished] == [
        (waiter.request_id, FinishReason.ABORT, "deadline_exceeded")
    ]
    assert waiter.status == RequestStatus.FINISHED_ABORTED
    assert waiter.request_id not in scheduler.requests  # resources freed
    assert len(scheduler.waiting) == 0


def test_low_tier_has_no_deadline(new_scheduler, clock):
    scheduler = new_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request(clock, "critical"))
    low = make_request(clock, "low")
    scheduler.add_request(low)
    run_step(scheduler)
    clock.now += 3600
    _, finished = run_step(scheduler)
    assert not finished and low.status == RequestStatus.WAITING


def test_started_requests_are_not_dropped_even_when_preempted(new_scheduler, clock):
    scheduler = new_scheduler(max_num_seqs=1)
    low = make_request(clock, "low", deadline_ms=50)
    scheduler.add_request(low)
    run_step(scheduler)  # low starts producing tokens
    critical = make_request(clock, "critical")
    scheduler.add_request(critical)
    run_step(scheduler)  # low is preempted for critical
    assert low.status == RequestStatus.PREEMPTED
    clock.now += 10
    _, finished = run_step(scheduler)
    assert low.request_id not in [o.request_id for o in finished]
    assert low in scheduler.waiting


def test_a_critical_request_preempts_the_lowest_tier_latest_arrival(
    new_scheduler, clock
):
    scheduler = new_scheduler(max_num_seqs=3)
    normal = make_request(clock, "normal")
    clock.now += 0.001
    low_early = make_request(clock, "low")
    clock.now += 0.001
    low_late = make_request(clock, "low")
    for r in (normal, low_early, low_late):
        scheduler.add_request(r)
    run_step(scheduler)
    critical = make_request(clock, "critical")
    scheduler.add_request(critical)
    output, _ = run_step(scheduler)
    assert critical.request_id in output.num_scheduled_tokens
    assert low_late.status == RequestStatus.PREEMPTED
    assert low_early.status == RequestStatus.RUNNING
    assert normal.status == RequestStatus.RUNNING


def test_never_preempts_the_same_or_a_higher_tier(new_scheduler, clock):
    scheduler = new_scheduler(max_num_seqs=2)
    running = [make_request(clock, "high"), make_request(clock, "critical")]
    for r in running:
        scheduler.add_request(r)
    run_step(scheduler)
    waiting = make_request(clock, "high")
    scheduler.add_request(waiting)
    output, _ = run_step(scheduler)
    assert all(r.status == RequestStatus.RUNNING for r in running)
    assert waiting.request_id not in output.num_scheduled_tokens


def test_preempts_for_kv_blocks_when_slots_are_free(new_scheduler, clock):
    # 20 blocks: two 10-block low requests fill the cache.
    scheduler = new_scheduler(max_num_seqs=8, num_blocks=21)
    lows = [make_request(clock, "low", tokens=9 * BLOCK) for _ in range(2)]
    for r in lows:
        scheduler.add_request(r)
    run_step(scheduler)
    critical = make_request(clock, "critical", tokens=5 * BLOCK)
    scheduler.add_request(critical)
    output, _ = run_step(scheduler)
    assert critical.request_id in output.num_scheduled_tokens
    assert sorted(r.status for r in lows) == [
        RequestStatus.RUNNING,
        RequestStatus.PREEMPTED,
    ]


def test_per_tier_cap_counts_running_requests(new_scheduler, clock):
    scheduler = new_scheduler(
        max_num_seqs=8, o3={"tiers": {"high": {"max_running": 2}}}
    )
    highs = [make_request(clock, "high", deadline_ms=10_000) for _ in range(4)]
    low = make_request(clock, "low")
    for r in (*highs, low):
        scheduler.add_request(r)
    output, _ = run_step(scheduler)
    scheduled = set(output.num_scheduled_tokens)
    assert scheduled == {highs[0].request_id, highs[1].request_id, low.request_id}
    assert len(scheduler.waiting) == 2


def test_breaker_opens_after_consecutive_drops_and_closes_after_a_met_trial(
    new_scheduler, clock
):
    scheduler = new_scheduler(
        max_num_seqs=1,
        o3={"tiers": {"high": {"breaker_drops": 2}}, "breaker_cooldown_s": 30},
    )
    scheduler.add_request(make_request(clock, "critical", deadline_ms=10_000))
    run_step(scheduler)  # the slot is taken from now on
    breaker = scheduler.breakers[Tier.HIGH]
    for _ in range(2):
        scheduler.add_request(make_request(clock, "high", deadline_ms=10))
        clock.now += 0.02
        run_step(scheduler)
    assert breaker.state(clock.now) == BreakerState.OPEN
    # Open: a new high request is served as normal, without a deadline.
    diverted = make_request(clock, "high", deadline_ms=10)
    scheduler.add_request(diverted)
    assert diverted.o3_placement.tier == Tier.NORMAL
    assert diverted.o3_placement.deadline is None
    clock.now += 1
    _, finished = run_step(scheduler)
    assert diverted.request_id not in [o.request_id for o in finished]
    # After the cool-down: one trial as its own tier; it misses -> open again.
    clock.now += 30
    trial = make_request(clock, "high", deadline_ms=10)
    also_waiting = make_request(clock, "high", deadline_ms=10)
    scheduler.add_request(trial)
    scheduler.add_request(also_waiting)
    assert trial.o3_placement.trial and trial.o3_placement.tier == Tier.HIGH
    assert also_waiting.o3_placement.tier == Tier.NORMAL
    clock.now += 0.02
    _, finished = run_step(scheduler)
    assert trial.request_id in [o.request_id for o in finished]
    assert breaker.state(clock.now) == BreakerState.OPEN
    # Next cool-down: the trial is met (the slot is free) -> closed.
    scheduler.finish_requests(list(scheduler.requests), RequestStatus.FINISHED_ABORTED)
    clock.now += 31
    trial = make_request(clock, "high", deadline_ms=1000)
    scheduler.add_request(trial)
    output, _ = run_step(scheduler)
    assert trial.request_id in output.num_scheduled_tokens
    assert breaker.state(clock.now) == BreakerState.CLOSED
    assert make_request(clock, "high") is not None


def test_invalid_offline_fields_end_the_request_with_a_reason(new_scheduler, clock):
    scheduler = new_scheduler()
    bad = make_request(clock, "urgent")
    scheduler.add_request(bad)
    _, finished = run_step(scheduler)
    assert len(finished) == 1 and finished[0].finish_reason == FinishReason.ABORT
    assert finished[0].stop_reason.startswith("invalid_request: tier must be one of")


@pytest.mark.parametrize(
    "config, words",
    [
        ({"tiers": {"urgent": {}}}, "tier must be one of"),
        (
            {"tiers": {"high": {"deadline_ms": -5}}},
            "o3_scheduler.tiers.high.deadline_ms",
        ),
        ({"tiers": {"high": {"deadline_ms": "fast"}}}, "deadline_ms"),
        ({"tiers": {"low": {"max_running": 0}}}, "o3_scheduler.tiers.low.max_running"),
        ({"tiers": {"low": {"breaker_drops": 1.5}}}, "breaker_drops"),
        ({"tiers": {"low": {"speed": 1}}}, "unknown field"),
        ({"breaker_cooldown_s": 0}, "breaker_cooldown_s"),
        ({"cooldown": 3}, "unknown field"),
        ([], "must be a JSON object"),
    ],
)
def test_bad_configuration_is_refused_naming_the_field(config, words):
    with pytest.raises(ValueError, match=words):
        SchedulerPolicy.from_config(config)


def test_configuration_overrides_only_what_it_names():
    policy = SchedulerPolicy.from_config(
        {"tiers": {"high": {"deadline_ms": 300, "max_running": None}}}
    )
    assert policy.tiers[Tier.HIGH].deadline_ms == 300
    assert policy.tiers[Tier.HIGH].max_running is None
    assert policy.tiers[Tier.HIGH].breaker_drops == 5
    assert policy.tiers[Tier.CRITICAL].deadline_ms == 50


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"tier": "urgent"}, "tier must be one of"),
        ({"tier": ""}, "tier must be one of"),
        ({"tier": ["high"]}, "tier must be one of"),
        ({"tier": 1}, "tier must be one of"),
        ({"deadline_ms": -1}, "positive"),
        ({"deadline_ms": 0}, "positive"),
        ({"deadline_ms": float("nan")}, "finite"),
        ({"deadline_ms": float("inf")}, "finite"),
        ({"deadline_ms": "100"}, "number of milliseconds"),
        ({"deadline_ms": True}, "number of milliseconds"),
        ({"deadline_ms": [5]}, "number of milliseconds"),
        ({"deadline_ms": 1e12}, "at most"),
    ],
)
def test_bad_request_fields_are_refused(extra, words):
    with pytest.raises(ValueError, match=words):
        parse_request_fields(extra)


def test_good_request_fields():
    fields = parse_request_fields({"tier": "CRITICAL", "deadline_ms": 25})
    assert fields.tier == Tier.CRITICAL and fields.deadline_ms == 25.0
    assert parse_request_fields(None).tier == Tier.NORMAL


@pytest.mark.parametrize(
    ("headers", "want"),
    [
        ({"tracestate": "o3=tier:high;deadline-ms:50"},
         {"x-o3-tier": "high", "x-o3-deadline-ms": "50"}),
        ({"tracestate": "o3=tier:low;deadline-ms:,congo=t61rcWkgMzE"},
         {"x-o3-tier": "low"}),
        ({"tracestate": "congo=t61rcWkgMzE, o3=tier:;deadline-ms:7"},
         {"x-o3-deadline-ms": "7"}),
        ({"tracestate": "congo=t61rcWkgMzE"}, {}),
        # Headers that arrive themselves win over the tracestate copy.
        ({"tracestate": "o3=tier:high", "x-o3-tier": "low"}, {"x-o3-tier": "low"}),
    ],
)  # fmt: skip
def test_o3_headers_carried_in_tracestate(headers, want):
    got = with_tracestate_fields(headers)
    assert {k: v for k, v in got.items() if k.startswith("x-o3-")} == want
