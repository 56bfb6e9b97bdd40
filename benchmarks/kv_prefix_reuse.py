"""KV cache reuse on a multi-turn chat workload: vLLM's prefix cache (the
seed's "hot" KV tier) on vs off, same server settings otherwise.

Conversations share one system prompt and grow turn by turn (each turn sends
the whole history back, as chat clients do); several run at once. Per setting:
prefix-cache hit rate (vLLM's own counters), TTFT p50/p95 of streamed chat
completions, and turns per second. Writes docs/bench_kv_prefix_reuse.md.

    python -m benchmarks.kv_prefix_reuse MODEL [--conversations 8] [--turns 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.common import percentile, write_report
from vllm_o3.tools.server import metric, metric_samples, start_server, stop_server

SYSTEM = (
    "You are the support assistant of a railway company. Answer briefly and "
    "politely. Timetables change twice a year, in June and December. Tickets "
    "can be refunded until departure; after departure, only by the customer "
    "office. Bicycles travel free outside rush hours (7-9 and 16-18). Pets under "
    "ten kilograms travel free in a carrier; larger dogs need a half-price "
    "ticket and a muzzle. Delays over one hour give a quarter of the fare back, "
    "over two hours half. Seat reservations are optional except on night trains. "
    "Never invent train numbers; ask for the station and the date instead. "
) * 3
QUESTIONS = [
    "Can I take my bicycle at 8 in the morning?",
    "My train was 90 minutes late. What do I get back?",
    "Do I need a seat reservation for the night train to Vienna?",
    "Can my 20 kg dog travel with me?",
    "When does the new timetable start?",
    "I missed my train. Can I still get a refund?",
    "Is there a discount for families?",
    "How early should I be at the station?",
]


async def conversation(
    client: httpx.AsyncClient, model: str, turns: int, seed: int, ttfts: list[float]
) -> int:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": SYSTEM}]
    for _ in range(turns):
        messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
        body = {"model": model, "messages": messages, "max_tokens": 32,
                "temperature": 0, "stream": True}  # fmt: skip
        start, first, text = time.perf_counter(), None, []
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    first = first or time.perf_counter()
                    text.append(delta["content"])
        ttfts.append((first or time.perf_counter()) - start)
        messages.append({"role": "assistant", "content": "".join(text)})
    return turns


async def workload(url: str, conversations: int, turns: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = metric_samples(url)
        ttfts: list[float] = []
        start = time.perf_counter()
        done = await asyncio.gather(
            *(
                conversation(client, model, turns, i, ttfts)
                for i in range(conversations)
            )
        )
        elapsed = time.perf_counter() - start
    after = metric_samples(url)

    def delta(name: str) -> float:
        return metric(after, name) - metric(before, name)

    queries = delta("vllm:prefix_cache_queries_total")
    return {
        "hit_rate": delta("vllm:prefix_cache_hits_total") / queries if queries else 0.0,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p95": percentile(ttfts, 0.95),
        "turns_per_s": sum(done) / elapsed,
        "prompt_tokens": delta("vllm:prompt_tokens_total"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args()
    settings = {"prefix caching on": "--enable-prefix-caching",
                "prefix caching off": "--no-enable-prefix-caching"}  # fmt: skip
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, flag in settings.items():
            server = start_server(
                args.model, Path(scratch) / "server.log", flag,
                "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "4096",
            )  # fmt: skip
            try:
                asyncio.run(workload(server.url, 2, 2))  # warm-up
                results[name] = asyncio.run(
                    workload(server.url, args.conversations, args.turns)
                )
            finally:
                stop_server(server)
    on, off = results["prefix caching on"], results["prefix caching off"]
    rows = [
        f"| {name} | {r['hit_rate']:.1%} | {r['ttft_p50'] * 1e3:.0f} / "
        f"{r['ttft_p95'] * 1e3:.0f} | {r['turns_per_s']:.2f} | {r['prompt_tokens']:.0f} |"
        for name, r in results.items()
    ]
    body = "\n".join([
        f"Model `{args.model}`; {args.conversations} conversations at once, "
        f"{args.turns} turns each, a shared system prompt of ~{len(SYSTEM.split())} "
        "words, 32 new tokens per turn, the whole history resent every turn; "
        f"`--max-num-seqs {args.max_num_seqs}`.",
        "",
        "| setting | prefix-cache hit rate | TTFT p50 / p95 ms | turns/s | prompt tokens |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"With the prefix cache: TTFT p50 {off['ttft_p50'] / on['ttft_p50']:.2f}x "
        f"faster, p95 {off['ttft_p95'] / on['ttft_p95']:.2f}x, throughput "
        f"{on['turns_per_s'] / off['turns_per_s']:.2f}x.",
    ])  # fmt: skip
    print(body)
    print(
        f"written to {write_report('bench_kv_prefix_reuse', 'KV cache reuse: multi-turn chat, prefix cache on vs off', body)}"
    )


if __name__ == "__main__":
    main()
