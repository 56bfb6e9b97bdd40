"""The scale-out set under load (`vllm-o3 cluster`): canary split by weight
and header, and failover when a prod replica is killed mid-load. Every client
request is counted by outcome. Writes docs/bench_scale_out.md.

    python -m benchmarks.scale_out MODEL [--requests 400] [--failover-requests 200]
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks.common import write_report
from vllm_o3.tools.cluster import start_cluster
from vllm_o3.tools.server import deadline_drops, requests_served


def send(url: str, env: str | None, prompt: str) -> str:
    headers = {"X-O3-Env": env} if env else {}
    body = {"model": "o3", "prompt": prompt, "max_tokens": 4}
    try:
        reply = httpx.post(f"{url}/v1/completions", json=body, headers=headers,
                           timeout=120)  # fmt: skip
    except httpx.HTTPError as e:
        return type(e).__name__
    return str(reply.status_code)


def canary_split(cluster, requests: int) -> list[str]:
    def counts(count) -> dict[str, float]:
        return {e: sum(map(count, rs)) for e, rs in cluster.replicas.items()}

    before, drops_before = counts(requests_served), counts(deadline_drops)
    with ThreadPoolExecutor(4) as pool:
        outcomes = Counter(pool.map(lambda i: send(cluster.url, None, f"Q{i}"),
                                    range(requests)))  # fmt: skip
    after, drops_after = counts(requests_served), counts(deadline_drops)
    share = {e: after[e] - before[e] for e in after}
    drops = sum(drops_after.values()) - sum(drops_before.values())
    header = {env: send(cluster.url, env, "by header") for env in ("canary", "staging", "prod", "blue")}  # fmt: skip
    return [
        f"{requests} requests without `X-O3-Env` (4 at a time): outcomes "
        f"{dict(outcomes)}; served by prod {share['prod']:.0f} "
        f"({share['prod'] / requests:.1%}), canary {share['canary']:.0f} "
        f"({share['canary'] / requests:.1%}), staging {share['staging']:.0f}. "
        "Target: 95 / 5 / 0. Replicas dropped "
        f"{drops:.0f} requests at their deadline; smg retries a 503 (on any "
        "replica of the environment), so the client saw none of them.",
        "",
        "By header: " + ", ".join(f"`{e}` → HTTP {s}" for e, s in header.items()) + ".",
    ]


def failover(cluster, requests: int) -> list[str]:
    victim, survivor = cluster.replicas["prod"][1], cluster.replicas["prod"][0]
    outcomes: list[tuple[float, str]] = []
    start = time.monotonic()

    def one(i: int) -> None:
        outcomes.append((time.monotonic() - start, send(cluster.url, "prod", f"L{i}")))

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(requests)]
        while len(outcomes) < requests // 4:
            time.sleep(0.05)
        killed_at = time.monotonic() - start
        os.killpg(victim.process.pid, signal.SIGKILL)
        for future in futures:
            future.result()
    after_kill = [s for t, s in outcomes if t > killed_at]
    before_survivor = requests_served(survivor)
    tail = [send(cluster.url, "prod", f"T{i}") for i in range(20)]
    return [
        f"{requests} requests to prod (4 at a time); replica 2 of 2 killed with "
        f"SIGKILL after {killed_at:.1f} s ({requests // 4} answered).",
        "",
        f"- all requests: {dict(Counter(s for _, s in outcomes))} "
        f"({len(outcomes)} of {requests} answered)",
        f"- answered after the kill: {dict(Counter(after_kill))}",
        f"- 20 more afterwards: {dict(Counter(tail))}, "
        f"{requests_served(survivor) - before_survivor:.0f} served by the survivor",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--failover-requests", type=int, default=200)
    args = parser.parse_args()
    cluster = start_cluster(
        args.model, {"prod": 2, "canary": 1, "staging": 1},
        ("--max-num-seqs", "4", "--max-model-len", "1024", "--enforce-eager"),
    )  # fmt: skip
    try:
        body = [
            "Two prod replicas, one canary, one staging (`vllm serve` with "
            "O3Scheduler, one CPU core each), one `smg launch --policy "
            "cache_aware` gateway per environment, nginx in front; loopback.",
            "",
            "## Canary split",
            "",
            *canary_split(cluster, args.requests),
            "",
            "## Failover",
            "",
            *failover(cluster, args.failover_requests),
        ]
    finally:
        cluster.stop()
    text = "\n".join(body)
    print(text)
    print(
        f"written to {write_report('bench_scale_out', 'Scale-out: canary and failover', text)}"
    )


if __name__ == "__main__":
    main()
