"""The scheduler's Prometheus metrics (engine process; they reach `/metrics`
through the multiprocess directory the plugin sets up for `vllm serve`):

- o3_scheduler_deadline_drops_total{tier}
- o3_scheduler_breaker_diversions_total{tier}: requests served in the default
  channel because their tier's breaker was open
- o3_scheduler_breaker_state{tier}: 0 closed, 1 open, 2 half-open
- o3_scheduler_waiting_requests{tier}, o3_scheduler_running_requests{tier}
- o3_scheduler_queue_time_seconds{tier}: arrival to first scheduling
- o3_scheduler_kv_internal_fragmentation: empty share of allocated KV slots
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from vllm_o3.scheduler.tiers import Tier

QUEUE_TIME_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0
)  # fmt: skip


class SchedulerMetrics:
    """Created once per engine process (prometheus_client refuses duplicates)."""

    _instance: SchedulerMetrics | None = None

    def __init__(self) -> None:
        self.drops = Counter(
            "o3_scheduler_deadline_drops",
            "Requests dropped at their queue deadline",
            ["tier"],
        )
        self.diversions = Counter(
            "o3_scheduler_breaker_diversions",
            "Requests served as normal, without deadline, while their tier's "
            "breaker was open",
            ["tier"],
        )
        self.breaker_state = Gauge(
            "o3_scheduler_breaker_state",
            "Circuit breaker: 0 closed, 1 open, 2 half-open",
            ["tier"],
            multiprocess_mode="livemax",
        )
        self.waiting = Gauge(
            "o3_scheduler_waiting_requests", "Waiting requests per tier",
            ["tier"], multiprocess_mode="livesum",
        )  # fmt: skip
        self.running = Gauge(
            "o3_scheduler_running_requests", "Running requests per tier",
            ["tier"], multiprocess_mode="livesum",
        )  # fmt: skip
        self.kv_fragmentation = Gauge(
            "o3_scheduler_kv_internal_fragmentation",
            "Share of the running requests' allocated KV slots holding no token",
            multiprocess_mode="livemax",
        )
        self.queue_time = Histogram(
            "o3_scheduler_queue_time_seconds",
            "Time from arrival to first scheduling, per tier",
            ["tier"], buckets=QUEUE_TIME_BUCKETS,
        )  # fmt: skip
        for tier in Tier:  # every series exists from the start, at zero
            self.drops.labels(tier.label)
            self.diversions.labels(tier.label)
            self.breaker_state.labels(tier.label).set(0)

    @classmethod
    def get(cls) -> SchedulerMetrics:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance
