"""CPU serving with each way vLLM's engine and worker can wait on each other:
vLLM's automatic binding (a core kept for the engine, whose queue readers spin)
with `os.sched_yield()` (vLLM's, `VLLM_O3_CPU_SCHED_YIELD=1`) or
`time.sleep(0)` (the O3 plugin's), and the model's threads on every core with
the readers spinning on `time.sleep(0)` or waiting for the writer's
notification (the plugin's choice there); same server settings otherwise.

Per setting and repeat: one long generation alone (decode tokens/s, and the
latency of `/health` polled every 0.1 s meanwhile), then a burst of streamed
requests sent at once (time to first token p50/max: how late the later ones
reach the engine, and total tokens/s). Every probe and every burst request
opens its own connection, as orchestrators' probes and separate users do.
Medians over repeats. Writes docs/bench_cpu_polling.md.

    python -m benchmarks.cpu_polling MODEL [--repeats 3] [--tokens 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from benchmarks.common import write_report
from vllm_o3.cpu_queue_polling import (
    KEEP_SCHED_YIELD,
    NOTIFICATION_WAIT,
    every_core_binding,
)
from vllm_o3.tools.server import start_server, stop_server

EVERY_CORE = every_core_binding()
SETTINGS = {
    "auto, os.sched_yield() (vLLM)": {
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
        KEEP_SCHED_YIELD: "1",
    },
    "auto, time.sleep(0) (O3 plugin)": {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
    "every core, time.sleep(0)": {
        "VLLM_CPU_OMP_THREADS_BIND": EVERY_CORE,
        NOTIFICATION_WAIT: "0",
    },
    "every core, notification wait (O3 plugin)": {
        "VLLM_CPU_OMP_THREADS_BIND": EVERY_CORE
    },
}


def body(model: str, tokens: int, **fields) -> dict:
    return {"model": model, "prompt": "The river", "max_tokens": tokens,
            "ignore_eos": True, **fields}  # fmt: skip


async def alone_with_health_polls(
    client: httpx.AsyncClient, model: str, tokens: int
) -> dict:
    """One generation; `/health` polled meanwhile, a new connection each
    time, as orchestrators' probes do."""
    latencies: list[float] = []

    async def poll(done: asyncio.Event) -> None:
        while not done.is_set():
            start = time.perf_counter()
            async with httpx.AsyncClient(base_url=client.base_url, timeout=60) as probe:
                (await probe.get("/health")).raise_for_status()
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.1)

    done = asyncio.Event()
    poller = asyncio.create_task(poll(done))
    start = time.perf_counter()
    reply = await client.post("/v1/completions", json=body(model, tokens))
    elapsed = time.perf_counter() - start
    done.set()
    await poller
    reply.raise_for_status()
    return {
        "decode_tok_s": reply.json()["usage"]["completion_tokens"] / elapsed,
        "health_p50": statistics.median(latencies),
        "health_max": max(latencies),
    }


async def burst(url: str, model: str, tokens: int, n: int) -> dict:
    """`n` streamed requests at once, each on its own connection (clients of
    their own): first-token times and total tokens/s."""

    async def one() -> tuple[float, int]:
        start, first, count = time.perf_counter(), None, 0
        request = body(model, tokens, stream=True)
        async with (
            httpx.AsyncClient(base_url=url, timeout=600) as client,
            client.stream("POST", "/v1/completions", json=request) as reply,
        ):
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    first = first or time.perf_counter()
                    count += 1
        return first - start, count

    start = time.perf_counter()
    results = await asyncio.gather(*(one() for _ in range(n)))
    elapsed = time.perf_counter() - start
    ttfts = [ttft for ttft, _ in results]
    return {
        "ttft_p50": statistics.median(ttfts),
        "ttft_max": max(ttfts),
        "burst_tok_s": sum(count for _, count in results) / elapsed,
    }


async def measure(url: str, tokens: int, burst_size: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        return {
            **await alone_with_health_polls(client, model, tokens),
            **await burst(url, model, tokens // 4, burst_size),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args()
    medians = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, env in SETTINGS.items():
            server = start_server(
                args.model, Path(scratch) / "server.log",
                "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "2048",
                env=env,
            )  # fmt: skip
            try:
                asyncio.run(measure(server.url, 64, args.max_num_seqs))  # warm-up
                runs = [
                    asyncio.run(measure(server.url, args.tokens, args.max_num_seqs))
                    for _ in tqdm(range(args.repeats), desc=name)
                ]
            finally:
                stop_server(server)
            medians[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    rows = [
        f"| {name} | {m['decode_tok_s']:.0f} | {m['health_p50'] * 1e3:.0f} / "
        f"{m['health_max'] * 1e3:.0f} | {m['ttft_p50'] * 1e3:.0f} / "
        f"{m['ttft_max'] * 1e3:.0f} | {m['burst_tok_s']:.0f} |"
        for name, m in medians.items()
    ]
    vllm = next(iter(medians.values()))
    ratios = [
        f"- {name}: decode {m['decode_tok_s'] / vllm['decode_tok_s']:.2f}x, burst "
        f"throughput {m['burst_tok_s'] / vllm['burst_tok_s']:.2f}x, worst /health "
        f"{m['health_max'] / vllm['health_max']:.2f}x, worst burst TTFT "
        f"{m['ttft_max'] / vllm['ttft_max']:.2f}x"
        for name, m in list(medians.items())[1:]
    ]
    body_text = "\n".join([
        f"Model `{args.model}`, `--max-num-seqs {args.max_num_seqs}`; medians of "
        f"{args.repeats} repeats. Alone: one request of {args.tokens} tokens, "
        f"`/health` polled every 0.1 s meanwhile. Burst: {args.max_num_seqs} "
        f"streamed requests of {args.tokens // 4} tokens sent at once. Binding: "
        "`auto` is vLLM's (`VLLM_CPU_OMP_THREADS_BIND` unset: a core kept for the "
        f"engine), `every core` is `VLLM_CPU_OMP_THREADS_BIND={EVERY_CORE}`.",
        "",
        "| binding, queue polling | decode tok/s alone | /health p50 / max ms | "
        "burst TTFT p50 / max ms | burst tok/s |",
        "|---|---|---|---|---|",
        *rows,
        "",
        "Against the first row:",
        "",
        *ratios,
    ])  # fmt: skip
    print(body_text)
    title = "CPU serving: how vLLM's engine and worker wait on each other"
    print(f"written to {write_report('bench_cpu_polling', title, body_text)}")


if __name__ == "__main__":
    main()
