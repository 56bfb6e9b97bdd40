"""The tier benchmark's trace replayed on an in-process engine, no HTTP.

Over HTTP on a small machine the load generator and vLLM's API server share
the cores with the engine, and at 2x load requests wait in front of the
engine, where no scheduler can order them. Here one process runs the engine
loop: requests enter between steps at their trace time (as the engine core
takes them from its input queue), with that time as their arrival time, so
deadlines and TTFT count from when they were due, not from when they got in.
Each scheduler runs in a fresh process, with the same flags its server gets.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections import deque

from benchmarks.tier_scheduling import (
    CAPACITY_BURST,
    IDLE_REQUESTS,
    PROMPT,
    Outcome,
    Run,
    arrivals,
    request_body,
)
from vllm_o3.scheduler.tiers import Tier
from vllm_o3.tools.server import KV_CACHE_GIB, unwind_on_sigterm

API_SERVER_FLAGS = {"--middleware"}  # each takes one value; no engine meaning


def engine(flags: list[str]):
    """An in-process `LLMEngine` from `vllm serve` flags."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.llm_engine import LLMEngine

    namespace, rest = EngineArgs.add_cli_args(
        FlexibleArgumentParser()
    ).parse_known_args(flags)
    unknown = [flag for flag in rest[::2] if flag not in API_SERVER_FLAGS]
    if unknown or len(rest) % 2:
        raise ValueError(f"not engine flags: {rest}")
    return LLMEngine.from_engine_args(EngineArgs.from_cli_args(namespace))


def sampling(scheduler: str, tier: Tier):
    """Sampling parameters and priority of the HTTP benchmark's body."""
    from vllm import SamplingParams

    body = request_body("", scheduler, tier)
    params = SamplingParams(
        max_tokens=body["max_tokens"],
        ignore_eos=True,
        temperature=0,
        extra_args=body.get("vllm_xargs"),
    )
    return params, body.get("priority", 0)


def drive(llm, requests: list[tuple[float, Tier, str]], scheduler: str) -> Run:
    """Add each (due time s, tier, prompt) when due, step the engine until
    all have finished; each request's outcome, TTFT from its due time."""
    start = time.time()
    pending = deque(requests)
    due: dict[str, tuple[float, Tier]] = {}
    first_token: dict[str, float] = {}
    outcomes = []
    while pending or llm.has_unfinished_requests():
        while pending and start + pending[0][0] <= time.time():
            at, tier, prompt = pending.popleft()
            request_id = str(len(due))
            due[request_id] = (start + at, tier)
            params, priority = sampling(scheduler, tier)
            llm.add_request(
                request_id, prompt, params, arrival_time=start + at, priority=priority
            )
        if not llm.has_unfinished_requests():
            time.sleep(max(0.0, start + pending[0][0] - time.time()))
            continue
        for output in llm.step():
            now = time.time()
            completion = output.outputs[0]
            if completion.token_ids:
                first_token.setdefault(output.request_id, now)
            if output.finished:
                arrived, tier = due[output.request_id]
                if completion.stop_reason == "deadline_exceeded":
                    outcomes.append(Outcome(tier, "dropped"))
                elif completion.finish_reason in ("length", "stop"):
                    ttft = first_token[output.request_id] - arrived
                    outcomes.append(Outcome(tier, "ok", ttft, now - arrived))
                else:
                    outcomes.append(Outcome(tier, "error"))
    return Run(outcomes)


def measure(
    model: str,
    flags: list[str],
    scheduler: str,
    capacity_rps: float | None,
    rates: list[float],
    duration: float,
) -> tuple[float, float, dict[float, Run]]:
    """As the HTTP benchmark measures a server: capacity (a burst of
    distinct `low` prompts, unless given), idle TTFT (median of lone
    requests), then the trace at each rate."""
    llm = engine(["--model", model, *flags])
    if capacity_rps is None:
        burst = [(0.0, Tier.LOW, f"{i}. {PROMPT}") for i in range(CAPACITY_BURST)]
        start = time.time()
        run = drive(llm, burst, scheduler)
        if any(o.status != "ok" for o in run.outcomes):
            raise RuntimeError("capacity burst: not every request completed")
        capacity_rps = len(burst) / (time.time() - start)
    idle = statistics.median(
        drive(llm, [(0.0, Tier.LOW, PROMPT)], scheduler).outcomes[0].ttft
        for _ in range(IDLE_REQUESTS)
    )
    runs = {}
    for factor in rates:
        trace = [
            (at, tier, PROMPT)
            for at, tier in arrivals(factor * capacity_rps, duration, seed=1)
        ]
        runs[factor] = drive(llm, trace, scheduler)
        runs[factor].arrival_window_s = duration
    return capacity_rps, idle, runs


def _send_result(connection, fn, args) -> None:
    try:
        connection.send((True, fn(*args)))
    except BaseException as error:  # noqa: BLE001 - handed to the parent
        connection.send((False, error))


def measure_in_child(*args) -> tuple[float, float, dict[float, Run]]:
    """`measure` in a fresh process: each engine has the machine to itself
    and gives all its memory back. Interrupted (Ctrl-C, SIGTERM), the child
    is stopped with it."""
    unwind_on_sigterm()
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_send_result, args=(send, measure, args))
    process.start()
    send.close()
    try:
        ok, result = receive.recv()
    except EOFError:
        process.join()
        raise RuntimeError(
            f"engine benchmark process died (exit code {process.exitcode})"
        ) from None
    except BaseException:
        process.terminate()
        raise
    finally:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
            process.join()
    if not ok:
        raise result
    return result
