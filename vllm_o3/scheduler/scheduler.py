"""O3Scheduler: vLLM's scheduler with priority tiers, queue deadlines, per-tier
concurrency caps, preemption for higher tiers and a circuit breaker per tier.

    vllm serve MODEL --scheduler-cls vllm_o3.scheduler.O3Scheduler \\
        --additional-config '{"o3_scheduler": {...}}'   # optional, see tiers.py

Each step, before vLLM's own scheduling pass:
1. waiting requests never scheduled whose deadline has passed are dropped
   (finished as aborted, stop_reason "deadline_exceeded", KV freed);
2. if the best waiting request cannot get a slot or KV blocks, running
   requests of strictly lower tiers are preempted (lowest tier, latest
   arrival first; vLLM's recompute preemption) until it can;
3. vLLM's pass admits from the tier queue (tier, deadline, priority, arrival;
   capped tiers passed over), so prefix caching, chunked prefill and KV
   allocation stay vLLM's. Its own KV-pressure preemption picks the lowest
   tier too: the tier is folded into each request's `priority`.

The same policy runs on vLLM's async scheduler (GPU default): constructing
`O3Scheduler` with async scheduling on gives an `O3AsyncScheduler`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_o3.scheduler.breaker import CircuitBreaker
from vllm_o3.scheduler.metrics import SchedulerMetrics
from vllm_o3.scheduler.queue import Placement, TierQueue, placement
from vllm_o3.scheduler.tiers import SchedulerPolicy, Tier, parse_request_fields

logger = init_logger(__name__)

DEADLINE_EXCEEDED = "deadline_exceeded"
INVALID_REQUEST = "invalid_request"
# `priority` = tier * TIER_SPAN + the request's own priority (clamped), so
# vLLM's priority comparisons order by tier first.
TIER_SPAN = 1 << 40
NEVER_SCHEDULED = (
    RequestStatus.WAITING,
    RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
)
GAUGE_INTERVAL_S = 0.5


class O3SchedulingPolicy:
    """The O3 policy, mixed over vLLM's `Scheduler` or `AsyncScheduler`."""

    clock: Callable[[], float] = time.time  # wall clock, as request arrival times

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        additional = self.vllm_config.additional_config or {}
        self.tier_policy = SchedulerPolicy.from_config(additional.get("o3_scheduler"))
        tiers = self.tier_policy.tiers
        self.waiting = TierQueue({tier: tiers[tier].max_running for tier in Tier})
        # vLLM's own KV-pressure preemption then picks by (priority, arrival).
        self.policy = SchedulingPolicy.PRIORITY
        self.breakers = {
            tier: CircuitBreaker(
                tiers[tier].breaker_drops, self.tier_policy.breaker_cooldown_s
            )
            for tier in Tier
        }
        self.deadlines: list[tuple[float, int, Request]] = []
        self._deadline_sequence = itertools.count()
        self.ended_here: list[Request] = []  # finished by the policy, output pending
        self.metrics = SchedulerMetrics.get()
        self._gauges_at = 0.0

    # -- arrival -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:  # a streaming-input update
            return super().add_request(request)
        params = request.sampling_params
        try:
            fields = parse_request_fields(params.extra_args if params else None)
        except ValueError as error:
            return self._refuse(request, f"{INVALID_REQUEST}: {error}")
        now = self.clock()
        asked = fields.tier
        keeps_tier, trial = self.breakers[asked].admit(now)
        if keeps_tier:
            tier = asked
            deadline_ms = (
                fields.deadline_ms or self.tier_policy.tiers[asked].deadline_ms
            )
        else:  # breaker open: the default channel, without a deadline
            tier, deadline_ms = Tier.NORMAL, None
            self.metrics.diversions.labels(asked.label).inc()
        deadline = (
            None if deadline_ms is None else request.arrival_time + deadline_ms / 1e3
        )
        request.o3_placement = Placement(tier, deadline, asked, trial)
        request.priority = tier * TIER_SPAN + max(
            -TIER_SPAN // 2, min(request.priority, TIER_SPAN // 2 - 1)
        )
        super().add_request(request)
        if deadline is not None:
            heapq.heappush(
                self.deadlines, (deadline, next(self._deadline_sequence), request)
            )

    def _refuse(self, request: Request, reason: str) -> None:
        """End a request on arrival (offline callers get no HTTP 400)."""
        request.o3_placement = Placement(Tier.NORMAL, None, Tier.NORMAL)
        super().add_request(request)
        request.stop_reason = reason
        self.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
        self.ended_here.append(request)

    # -- each step -------------------------------------------------------------

    def schedule(self, *args, **kwargs) -> SchedulerOutput:
        now = self.clock()
        self._drop_expired(now)
        self.waiting.set_running(self.running)
        self._preempt_for_higher_tier(now)
        output = super().schedule(*args, **kwargs)
        self._note_first_scheduling(output, now)
        if now - self._gauges_at >= GAUGE_INTERVAL_S:
            self._update_gauges(now)
        return output

    def _drop_expired(self, now: float) -> None:
        while self.deadlines and self.deadlines[0][0] <= now:
            _, _, request = heapq.heappop(self.deadlines)
            where = placement(request)
            if where.scheduled or request.status not in NEVER_SCHEDULED:
                continue  # started, or already finished
            request.stop_reason = DEADLINE_EXCEEDED
            self.finish_requests(request.request_id, RequestStatus.FINISHED_ABORTED)
            self.ended_here.append(request)
            self.breakers[where.asked].record_drop(now, where.trial)
            self.metrics.drops.labels(where.tier.label).inc()

    def _preempt_for_higher_tier(self, now: float) -> None:
        """Make room for the best waiting request by preempting running
        requests of strictly lower tiers, if that can make room."""
        if not self.waiting:
            return
        head = self.waiting.peek_request()
        tier = placement(head).tier
        blocks_needed = -(-head.num_tokens // self.block_size)
        block_pool = self.kv_cache_manager.block_pool

        def slots_full() -> bool:
            active = len(self.running) + self.num_waiting_for_streaming_input
            return active >= self.max_num_active_reqs

        def blocks_short() -> bool:
            return block_pool.get_num_free_blocks() < blocks_needed

        if not (slots_full() or blocks_short()):
            return
        victims = sorted(
            (
                r
                for r in self.running
                if placement(r).tier > tier and self._request_blocks_can_be_freed(r)
            ),
            key=lambda r: (placement(r).tier, r.arrival_time),
            reverse=True,
        )
        freeable = sum(
            len(self.kv_cache_manager.get_block_ids(r.request_id)[0]) for r in victims
        )
        if block_pool.get_num_free_blocks() + freeable < blocks_needed:
            return  # preempting everyone below would still not fit it
        for victim in victims:
            if not (slots_full() or blocks_short()):
                break
            self.running.remove(victim)
            self._preempt_request(victim, now)
            logger.debug(
                "O3Scheduler: preempted %s (%s) for %s (%s)",
                victim.request_id, placement(victim).tier.label,
                head.request_id, tier.label,
            )  # fmt: skip

    def _note_first_scheduling(self, output: SchedulerOutput, now: float) -> None:
        for new in output.scheduled_new_reqs:
            request = self.requests.get(new.req_id)
            if request is None or placement(request).scheduled:
                continue
            where = placement(request)
            where.scheduled = True
            if where.tier == where.asked and where.deadline is not None:
                self.breakers[where.asked].record_met(where.trial)
            self.metrics.queue_time.labels(where.tier.label).observe(
                max(0.0, now - request.arrival_time)
            )

    def _update_gauges(self, now: float) -> None:
        self._gauges_at = now
        waiting = dict.fromkeys(Tier, 0)
        for request in self.waiting:
            waiting[placement(request).tier] += 1
        running = dict.fromkeys(Tier, 0)
        slots = filled = 0
        for request in self.running:
            running[placement(request).tier] += 1
            blocks = self.kv_cache_manager.get_block_ids(request.request_id)[0]
            slots += len(blocks) * self.block_size
            filled += min(request.num_computed_tokens, len(blocks) * self.block_size)
        self.metrics.kv_fragmentation.set(1 - filled / slots if slots else 0.0)
        for tier in Tier:
            self.metrics.waiting.labels(tier.label).set(waiting[tier])
            self.metrics.running.labels(tier.label).set(running[tier])
            self.metrics.breaker_state.labels(tier.label).set(
                self.breakers[tier].state(now)
            )

    # -- endings ----------------------------------------------------------------

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        finished = super().finish_requests(request_ids, finished_status)
        for request in finished:
            where = getattr(request, "o3_placement", None)
            trial_unfinished = (
                where is not None
                and where.trial
                and not where.scheduled
                and request.stop_reason != DEADLINE_EXCEEDED
            )
            if trial_unfinished:  # e.g. aborted by its client while waiting
                self.breakers[where.asked].record_trial_gone()
        return finished

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in self.ended_here:
            engine_outputs = outputs.setdefault(
                request.client_index, EngineCoreOutputs()
            )
            engine_outputs.outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ABORT,
                    stop_reason=request.stop_reason,
                    events=request.take_events(),
                    trace_headers=request.trace_headers,
                )
            )
        self.ended_here.clear()
        return outputs


class O3Scheduler(O3SchedulingPolicy, Scheduler):
    """Pass as `--scheduler-cls vllm_o3.scheduler.O3Scheduler`."""

    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is O3Scheduler and vllm_config.scheduler_config.async_scheduling:
            return super().__new__(O3AsyncScheduler)
        return super().__new__(cls)


class O3AsyncScheduler(O3Scheduler, AsyncScheduler):
    """The O3 policy on vLLM's async scheduler (what `O3Scheduler` becomes
    when async scheduling is on)."""
