"""Priority tiers under load: vLLM FCFS, vLLM priority and O3Scheduler on the
same open-loop arrival trace.

For each scheduler a `vllm serve` of the same model is started; its capacity
(requests/s) is measured with a saturating burst (once, on FCFS), then a
Poisson trace (tiers 10 % critical, 20 % high, 50 % normal, 20 % low) is
replayed at 0.5x, 1x and 2x that capacity. Per tier: SLO attainment
(scheduled within the tier's queue deadline, seen by the client as TTFT less
the idle server's TTFT; a dropped request misses it), TTFT p50/p99, drops;
overall goodput (requests meeting their SLO per second of arrivals: a
scheduler that serves a deadline-free `low` request late is not charged for
the wait). Also the scheduler's own time per step with 1,000 waiting
requests, O3 vs vLLM's priority scheduler, in-process.

The seed's deadlines (critical 50 ms) are shorter than one engine step of a
CPU; `--deadline-scale` multiplies them, for O3Scheduler and the SLO alike.

    python -m benchmarks.tier_scheduling MODEL [--duration 60] [--rates 0.5 1 2]
        [--deadline-scale 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks.common import percentile, write_report
from vllm_o3.scheduler.tiers import SchedulerPolicy, Tier
from vllm_o3.tools.server import O3_SERVE_ARGS, start_server, stop_server

TIER_MIX = {Tier.CRITICAL: 0.1, Tier.HIGH: 0.2, Tier.NORMAL: 0.5, Tier.LOW: 0.2}
SCHEDULERS = ("fcfs", "priority", "o3")
PROMPT = "Summarise the history of the river in two sentences: " * 4
MAX_TOKENS = 32
CAPACITY_BURST = 48  # requests in the saturating burst that measures capacity
IDLE_REQUESTS = 5  # lone requests whose median TTFT is the idle TTFT
FRONT_ENDS = {
    "http": "`vllm serve`, streamed completions from an httpx client on the same machine",
    "engine": "in-process `LLMEngine`, no HTTP (benchmarks/tier_engine_replay.py)",
}


@dataclass
class Outcome:
    tier: Tier
    status: str  # "ok", "dropped", "error"
    ttft: float | None = None
    e2e: float | None = None


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    arrival_window_s: float = 0.0  # goodput is per second of offered load


def server_args(scheduler: str, o3_policy: dict | None = None) -> list[str]:
    if scheduler == "priority":
        return ["--scheduling-policy", "priority"]
    if scheduler == "o3":
        policy = []
        if o3_policy:
            policy = ["--additional-config", json.dumps({"o3_scheduler": o3_policy})]
        return [*O3_SERVE_ARGS, *policy]
    return []


def scaled_deadlines(scale: float) -> dict:
    """The `o3_scheduler` configuration with every default deadline x`scale`."""
    defaults = SchedulerPolicy().tiers
    return {
        "tiers": {
            tier.label: {"deadline_ms": defaults[tier].deadline_ms * scale}
            for tier in Tier
            if defaults[tier].deadline_ms is not None
        }
    }


def request_body(model: str, scheduler: str, tier: Tier) -> dict:
    body = {
        "model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS,
        "ignore_eos": True, "stream": True, "temperature": 0,
    }  # fmt: skip
    if scheduler == "o3":
        body["vllm_xargs"] = {"tier": tier.label}
    elif scheduler == "priority":
        body["priority"] = int(tier)
    return body


async def one_request(client: httpx.AsyncClient, body: dict, tier: Tier) -> Outcome:
    start = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 503:
                return Outcome(tier, "dropped")
            if response.status_code != 200:
                return Outcome(tier, "error")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    kind = event["error"].get("type")
                    return Outcome(
                        tier, "dropped" if kind == "deadline_exceeded" else "error"
                    )
                if ttft is None:
                    ttft = time.perf_counter() - start
    except httpx.HTTPError:
        return Outcome(tier, "error")
    return Outcome(tier, "ok", ttft, time.perf_counter() - start)


def arrivals(rate: float, duration: float, seed: int) -> list[tuple[float, Tier]]:
    """Open loop: Poisson arrival times (s) at `rate`/s for `duration` s, and
    each request's tier."""
    rng = random.Random(seed)
    tiers, weights = zip(*TIER_MIX.items(), strict=True)
    trace, at = [], 0.0
    while at < duration:
        trace.append((at, rng.choices(tiers, weights)[0]))
        at += rng.expovariate(rate)
    return trace


async def replay(
    url: str, model: str, scheduler: str, rate: float, duration: float, seed: int
) -> Run:
    """Sends each request of `arrivals(rate, duration, seed)` when it is due."""
    tasks = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        for at, tier in arrivals(rate, duration, seed):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(
                asyncio.create_task(
                    one_request(client, request_body(model, scheduler, tier), tier)
                )
            )
        outcomes = await asyncio.gather(*tasks)
        return Run(list(outcomes), duration)


async def capacity(
    url: str,
    model: str,
    requests: int = CAPACITY_BURST,
    prompt: str = PROMPT,
    max_tokens: int = MAX_TOKENS,
) -> float:
    """Completed requests per second under a burst that saturates the server.

    The burst is `low` tier (no deadline, no breaker) so that an O3Scheduler
    server queues it all rather than dropping part of it; other servers ignore
    the field. Every request must complete, or the rate would count drops.
    Prompts differ from their first token on: none reuses another's cached
    prefix.
    """
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        outcomes = await asyncio.gather(
            *(
                one_request(
                    client,
                    {
                        **request_body(model, "o3", Tier.LOW),
                        "prompt": f"{i}. {prompt}",
                        "max_tokens": max_tokens,
                    },
                    Tier.LOW,
                )
                for i in range(requests)
            )
        )
        seconds = time.perf_counter() - start
    failed = [o.status for o in outcomes if o.status != "ok"]
    if failed:
        raise RuntimeError(f"capacity burst: {len(failed)} of {requests} failed")
    return requests / seconds


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


async def idle_ttft(url: str, model: str, requests: int = IDLE_REQUESTS) -> float:
    """Median first-token time of a lone request: the prefill and HTTP cost
    that every TTFT includes besides its wait in the queue."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        ttfts = []
        for _ in range(requests):
            outcome = await one_request(
                client, request_body(model, "o3", Tier.LOW), Tier.LOW
            )
            if outcome.status != "ok":
                raise RuntimeError(f"idle request ended {outcome.status}")
            ttfts.append(outcome.ttft)
    return statistics.median(ttfts)


def summarise(
    run: Run, policy: SchedulerPolicy, idle: float
) -> tuple[list[str], float]:
    """Per-tier table rows and goodput (requests/s meeting their SLO). The SLO
    is the tier's queue deadline; a request's queue wait is its TTFT less the
    server's idle TTFT (`idle`, s)."""
    rows, met_total = [], 0
    for tier in Tier:
        outcomes = [o for o in run.outcomes if o.tier == tier]
        if not outcomes:
            continue
        deadline = policy.tiers[tier].deadline_ms
        ttfts = [o.ttft for o in outcomes if o.ttft is not None]
        met = [
            o for o in outcomes
            if o.status == "ok"
            and (deadline is None or (o.ttft - idle) * 1e3 <= deadline)
        ]  # fmt: skip
        met_total += len(met)
        drops = sum(o.status == "dropped" for o in outcomes)
        errors = sum(o.status == "error" for o in outcomes)
        rows.append(
            f"{tier.label} | {len(outcomes)} | {len(met) / len(outcomes):.1%} | "
            f"{ms(percentile(ttfts, 0.5))} | {ms(percentile(ttfts, 0.99))} | "
            f"{drops} | {errors}"
        )
    return rows, met_total / run.arrival_window_s


def scheduler_step_time(
    model: str, waiting: int = 1000, steps: int = 200
) -> dict[str, float]:
    """Median time of schedule() + update_from_output() with `waiting` queued
    requests, in-process, for vLLM's priority scheduler and O3Scheduler."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from vllm_o3 import register
    from vllm_o3.scheduler import O3Scheduler

    register()
    results = {}
    for name, cls, policy in (
        ("vLLM priority", Scheduler, "priority"),
        ("O3Scheduler", O3Scheduler, "fcfs"),
    ):
        config = VllmConfig(
            model_config=ModelConfig(model=model, max_model_len=2048),
            scheduler_config=SchedulerConfig(
                max_num_seqs=64, max_num_batched_tokens=4096, max_model_len=2048,
                is_encoder_decoder=False, policy=policy,
            ),
            cache_config=CacheConfig(block_size=16, enable_prefix_caching=False),
        )  # fmt: skip
        config.cache_config.num_gpu_blocks = 20000
        scheduler = cls(
            vllm_config=config,
            kv_cache_config=KVCacheConfig(
                num_blocks=20000, kv_cache_tensors=[],
                kv_cache_groups=[KVCacheGroupSpec(["l"], FullAttentionSpec(
                    block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32))],
            ),
            structured_output_manager=StructuredOutputManager(config),
            block_size=16, log_stats=False,
        )  # fmt: skip
        rng = random.Random(0)
        for i in range(waiting):
            tier = rng.choices(list(TIER_MIX), list(TIER_MIX.values()))[0]
            params = SamplingParams(
                max_tokens=10_000,
                ignore_eos=True,
                extra_args={"tier": tier.label, "deadline_ms": 3.6e6},
            )
            scheduler.add_request(
                Request(f"r{i}", [1] * 64, params, None, priority=int(tier))
            )
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            output = scheduler.schedule()
            ids = list(output.num_scheduled_tokens)
            scheduler.update_from_output(output, ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                sampled_token_ids=[[5] for _ in ids]))  # fmt: skip
            times.append(time.perf_counter() - start)
        results[name] = statistics.median(times)
    return results


def measure_http(
    model: str,
    flags: list[str],
    scheduler: str,
    capacity_rps: float | None,
    rates: list[float],
    duration: float,
) -> tuple[float, float, dict[float, Run]]:
    """A `vllm serve` of `model` with `flags`: capacity (unless given), idle
    TTFT, then the trace at each rate."""
    log = Path(tempfile.mkdtemp(prefix="tier-bench-")) / f"{scheduler}.log"
    server = start_server(model, log, *flags)
    try:
        if capacity_rps is None:
            capacity_rps = asyncio.run(capacity(server.url, model))
        idle = asyncio.run(idle_ttft(server.url, model))
        runs = {
            factor: asyncio.run(
                replay(
                    server.url,
                    model,
                    scheduler,
                    factor * capacity_rps,
                    duration,
                    seed=1,
                )
            )
            for factor in rates
        }
    finally:
        stop_server(server)
    return capacity_rps, idle, runs


def main() -> None:
    from tqdm import tqdm

    from benchmarks.tier_engine_replay import measure_in_child

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument(
        "--deadline-scale", type=float, default=1.0,
        help="multiply the seed's tier deadlines (they assume a GPU's step time)",
    )  # fmt: skip
    parser.add_argument(
        "--front-end", choices=("http", "engine"), default="http",
        help="replay through `vllm serve` or on an in-process engine (no HTTP)",
    )  # fmt: skip
    args = parser.parse_args()
    o3_policy = scaled_deadlines(args.deadline_scale)
    policy = SchedulerPolicy.from_config(o3_policy)
    measure = measure_http if args.front_end == "http" else measure_in_child
    capacity_rps = None
    sections = []
    goodput: dict[tuple[str, float], float] = {}
    for scheduler in tqdm(SCHEDULERS, desc="schedulers"):
        flags = [
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "1024",
            *server_args(scheduler, o3_policy),
        ]  # fmt: skip
        capacity_rps, idle, runs = measure(
            args.model, flags, scheduler, capacity_rps, args.rates, args.duration
        )
        for factor, run in runs.items():
            rows, good = summarise(run, policy, idle)
            goodput[scheduler, factor] = good
            sections.append(
                f"### {scheduler}, {factor}x capacity ({factor * capacity_rps:.2f} req/s, "
                f"{len(run.outcomes)} requests; idle TTFT {idle * 1e3:.0f} ms)\n\n"
                "| tier | requests | SLO attainment | TTFT p50 ms | TTFT p99 ms | drops | errors |\n"
                "|---|---|---|---|---|---|---|\n"
                + "\n".join(f"| {r} |" for r in rows)
                + f"\n\nGoodput: {good:.2f} req/s meeting their SLO\n"
            )
    steps = scheduler_step_time(args.model)
    goodput_table = "\n".join(
        f"| {f}x | " + " | ".join(f"{goodput[s, f]:.2f}" for s in SCHEDULERS) + " |"
        for f in args.rates
    )
    body = (
        f"Model `{args.model}`, `--max-num-seqs {args.max_num_seqs}`, prompts of ~{len(PROMPT) // 4} "
        f"tokens, {MAX_TOKENS} output tokens; {FRONT_ENDS[args.front_end]}. Measured capacity: "
        f"{capacity_rps:.2f} req/s. Tier deadlines (the seed's x{args.deadline_scale:g}; "
        "SLO = scheduled within it, taken as TTFT less the server's idle TTFT): "
        + ", ".join(
            f"{t.label} {policy.tiers[t].deadline_ms or 'none'} ms" for t in Tier
        )
        + f". vLLM priority gets `priority` = tier index. {args.duration:.0f} s per run.\n\n"
        "## Goodput (req/s meeting their SLO)\n\n| load | "
        + " | ".join(SCHEDULERS)
        + " |\n|---|---|---|---|\n"
        + goodput_table
        + "\n\n## Per tier\n\n"
        + "\n".join(sections)
        + "\n## Scheduler time per step, 1,000 waiting requests (in-process, median of 200 steps)\n\n"
        + "\n".join(f"- {k}: {v * 1e3:.3f} ms" for k, v in steps.items())
        + f"\n- ratio O3 / vLLM priority: {steps['O3Scheduler'] / steps['vLLM priority']:.2f}x\n"
    )
    print(body)
    print(
        "written to",
        write_report(
            "bench_tier_scheduling" + ("_engine" if args.front_end == "engine" else ""),
            f"Priority tiers under load ({args.front_end} front end)",
            body,
        ),
    )


if __name__ == "__main__":
    main()
