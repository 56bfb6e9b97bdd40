"""Priority tiers: their names, the policy numbers, and the request fields.

One place defines what a tier is and what a valid request field looks like;
the scheduler (engine process) and the HTTP middleware (API process) both use
it, so a value refused by one is refused by the other.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any


class Tier(enum.IntEnum):
    """Strict order: a lower value is always served first."""

    CRITICAL = 0
    HIGH = 1
    NORMAL = 2
    LOW = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: Any) -> Tier:
        if not isinstance(value, str) or value.lower() not in TIER_NAMES:
            raise ValueError(
                f"tier must be one of {', '.join(TIER_NAMES)}, got {value!r}"
            )
        return cls[value.upper()]


TIER_NAMES = tuple(t.name.lower() for t in Tier)

# Request fields: `vllm_xargs` keys (SamplingParams.extra_args) and headers.
TIER_FIELD, DEADLINE_FIELD = "tier", "deadline_ms"
TIER_HEADER, DEADLINE_HEADER = "x-o3-tier", "x-o3-deadline-ms"
# A queue wait beyond a day is a mistake, not a deadline.
MAX_DEADLINE_MS = 86_400_000


@dataclass(frozen=True)
class TierPolicy:
    """One tier's numbers; None means no limit."""

    deadline_ms: float | None
    max_running: int | None
    breaker_drops: int | None  # consecutive deadline drops that open the breaker


@dataclass(frozen=True)
class SchedulerPolicy:
    """The whole configuration (`--additional-config '{"o3_scheduler": {...}}'`).

    Defaults are the seed's: deadlines 50 / 200 / 1000 ms / none, concurrency
    caps 8 / 16 / 32 / none, breakers after 3 / 5 / 10 drops / none, 30 s
    cool-down.
    """

    tiers: dict[Tier, TierPolicy] = field(
        default_factory=lambda: {
            Tier.CRITICAL: TierPolicy(50.0, 8, 3),
            Tier.HIGH: TierPolicy(200.0, 16, 5),
            Tier.NORMAL: TierPolicy(1000.0, 32, 10),
            Tier.LOW: TierPolicy(None, None, None),
        }
    )
    breaker_cooldown_s: float = 30.0

    @classmethod
    def from_config(cls, config: Any) -> SchedulerPolicy:
        """Build from the `o3_scheduler` dict, refusing bad values by name:

        {"tiers": {"high": {"deadline_ms": 300, "max_running": 4,
                            "breaker_drops": 2}},
         "breaker_cooldown_s": 10}

        Omitted fields keep their defaults; null removes a limit.
        """
        policy = cls()
        if config is None:
            return policy
        if not isinstance(config, dict):
            raise ValueError(f"o3_scheduler must be a JSON object, got {config!r}")
        unknown = set(config) - {"tiers", "breaker_cooldown_s"}
        if unknown:
            raise ValueError(f"o3_scheduler: unknown field(s) {sorted(unknown)}")
        tiers = dict(policy.tiers)
        tier_configs = config.get("tiers", {})
        if not isinstance(tier_configs, dict):
            raise ValueError("o3_scheduler.tiers must be a JSON object")
        for name, fields in tier_configs.items():
            tier = Tier.parse(name)
            where = f"o3_scheduler.tiers.{tier.label}"
            if not isinstance(fields, dict):
                raise ValueError(f"{where} must be a JSON object")
            unknown = set(fields) - {"deadline_ms", "max_running", "breaker_drops"}
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
            updates = {}
            if "deadline_ms" in fields:
                value = fields["deadline_ms"]
                updates["deadline_ms"] = (
                    None
                    if value is None
                    else parse_deadline_ms(value, f"{where}.deadline_ms")
                )
            for key in ("max_running", "breaker_drops"):
                if key in fields:
                    updates[key] = _positive_int_or_none(fields[key], f"{where}.{key}")
            tiers[tier] = replace(tiers[tier], **updates)
        cooldown = config.get("breaker_cooldown_s", policy.breaker_cooldown_s)
        if (
            isinstance(cooldown, bool)
            or not isinstance(cooldown, int | float)
            or not math.isfinite(cooldown)
            or cooldown <= 0
        ):
            raise ValueError(
                "o3_scheduler.breaker_cooldown_s must be a positive number, "
                f"got {cooldown!r}"
            )
        return cls(tiers=tiers, breaker_cooldown_s=float(cooldown))


def _positive_int_or_none(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be a positive integer or null, got {value!r}")
    return value


def parse_deadline_ms(value: Any, where: str = DEADLINE_FIELD) -> float:
    """A queue deadline in milliseconds: a finite number in (0, one day].

    Strings are accepted only where they come from text (headers): numbers
    that arrive as strings in JSON are refused by `parse_request_fields`.
    """
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(
                f"{where} must be a number of milliseconds, got {value!r}"
            ) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where} must be a number of milliseconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{where} must be a positive, finite number of milliseconds, got {value!r}"
        )
    if value > MAX_DEADLINE_MS:
        raise ValueError(
            f"{where} must be at most {MAX_DEADLINE_MS} ms (one day), got {value!r}"
        )
    return float(value)


@dataclass(frozen=True)
class RequestFields:
    """What a request asked for: its tier and, optionally, its own deadline."""

    tier: Tier = Tier.NORMAL
    deadline_ms: float | None = None


def parse_request_fields(extra_args: dict[str, Any] | None) -> RequestFields:
    """Validate `vllm_xargs` / `SamplingParams.extra_args` O3 fields."""
    extra_args = extra_args or {}
    tier = Tier.NORMAL
    if TIER_FIELD in extra_args:
        tier = Tier.parse(extra_args[TIER_FIELD])
    deadline = None
    if DEADLINE_FIELD in extra_args:
        value = extra_args[DEADLINE_FIELD]
        if isinstance(value, str):
            raise ValueError(
                f"{DEADLINE_FIELD} must be a number of milliseconds, got {value!r}"
            )
        deadline = parse_deadline_ms(value)
    return RequestFields(tier, deadline)
