"""A per-tier circuit breaker on deadline drops.

Closed: requests keep their tier. After `threshold` consecutive drops it opens:
for `cooldown_s` new requests of the tier go to the default channel (served as
`normal`, without a deadline) instead of being dropped. Then it is half-open:
the next request goes through as its own tier, a trial; if the trial is
scheduled in time the breaker closes, if it is dropped the breaker opens again.
Requests arriving while the trial is pending also go to the default channel.
"""

from __future__ import annotations

import enum


class BreakerState(enum.IntEnum):
    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2


class CircuitBreaker:
    def __init__(self, threshold: int | None, cooldown_s: float):
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.consecutive_drops = 0
        self.opened_at: float | None = None
        self.trial_pending = False

    def state(self, now: float) -> BreakerState:
        if self.opened_at is None:
            return BreakerState.CLOSED
        if now - self.opened_at < self.cooldown_s:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def admit(self, now: float) -> tuple[bool, bool]:
        """For a new request: (keeps its own tier, is the half-open trial)."""
        state = self.state(now)
        if state == BreakerState.CLOSED:
            return True, False
        if state == BreakerState.HALF_OPEN and not self.trial_pending:
            self.trial_pending = True
            return True, True
        return False, False

    def record_met(self, trial: bool) -> None:
        """A request of this tier was scheduled within its deadline."""
        self.consecutive_drops = 0
        if trial:
            self.opened_at = None
            self.trial_pending = False

    def record_drop(self, now: float, trial: bool) -> None:
        """A request of this tier was dropped at its deadline."""
        if trial:
            self.opened_at = now
            self.trial_pending = False
            return
        self.consecutive_drops += 1
        if (
            self.threshold is not None
            and self.opened_at is None
            and self.consecutive_drops >= self.threshold
        ):
            self.opened_at = now
            self.consecutive_drops = 0

    def record_trial_gone(self) -> None:
        """The trial request ended some other way (e.g. the client aborted):
        let the next request be the trial."""
        self.trial_pending = False
