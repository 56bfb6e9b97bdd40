"""Soak: mixed tiers at ~80 % of capacity for a bounded time, loopback only.

Starts `vllm serve` with O3Scheduler and the O3 middleware, measures its
capacity, then replays an open-loop Poisson trace (tiers 10/20/50/20 %) at
80 % of it. Every request is accounted for on the client (completed, dropped
with the deadline error, other error) and matched against the server's own
counters; the server's resident memory is sampled throughout; its log is
scanned for errors. Writes docs/soak.md.

    python -m benchmarks.soak MODEL [--minutes 20] [--load 0.8]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks.common import write_report
from benchmarks.tier_scheduling import capacity, replay, server_args
from vllm_o3.tools.server import errors_while_serving, metric, metric_samples

SAMPLE_S = 10


def rss_sampler(
    pid: int, samples: list[tuple[float, int]], stop: threading.Event
) -> None:
    root = psutil.Process(pid)
    start = time.monotonic()
    while not stop.wait(SAMPLE_S):
        processes = [root, *root.children(recursive=True)]
        samples.append(
            (time.monotonic() - start, sum(p.memory_info().rss for p in processes))
        )


def server_counts(url: str) -> dict[str, float]:
    """vLLM counts every finished request, the aborted ones (deadline drops
    among them) under finished_reason="abort"."""
    samples = metric_samples(url)
    return {
        "vllm_finished": metric(samples, "vllm:request_success_total"),
        "vllm_aborted": metric(
            samples, "vllm:request_success_total", finished_reason="abort"
        ),
        "o3_deadline_drops": metric(samples, "o3_scheduler_deadline_drops_total"),
    }


def main() -> None:
    from vllm_o3.tools.server import start_server, stop_server

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args()
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    server = start_server(
        args.model, log, "--max-num-seqs", str(args.max_num_seqs),
        "--max-model-len", "1024", *server_args("o3"),
    )  # fmt: skip
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        rps = asyncio.run(capacity(server.url, args.model)) * args.load
        before = server_counts(server.url)
        sampler = threading.Thread(
            target=rss_sampler, args=(server.process.pid, samples, stop)
        )
        sampler.start()
        run = asyncio.run(
            replay(server.url, args.model, "o3", rps, args.minutes * 60, seed=7)
        )
        time.sleep(2)
        after = server_counts(server.url)
    finally:
        stop.set()
        stop_server(server)
    outcomes = {
        s: sum(o.status == s for o in run.outcomes) for s in ("ok", "dropped", "error")
    }
    finished, aborted, drops = (
        after[k] - before[k]
        for k in ("vllm_finished", "vllm_aborted", "o3_deadline_drops")
    )
    rss = [r for _, r in samples]
    steady = rss[len(rss) // 4 :] or rss
    growth = (steady[-1] - steady[0]) / steady[0] if steady else 0.0
    errors = errors_while_serving(log)
    body = (
        f"Model `{args.model}`, O3Scheduler, `--max-num-seqs {args.max_num_seqs}`; "
        f"{args.minutes:g} min at {args.load:.0%} of the measured capacity "
        f"({rps:.2f} req/s), tiers 10/20/50/20 %.\n\n"
        f"| | count |\n|---|---|\n| requests sent | {len(run.outcomes)} |\n"
        f"| completed (client) | {outcomes['ok']} |\n"
        f"| dropped with deadline_exceeded (client) | {outcomes['dropped']} |\n"
        f"| other errors (client) | {outcomes['error']} |\n"
        f"| finished requests (server, vllm:request_success_total) | {finished:.0f} |\n"
        f"| of which aborted (finished_reason=abort) | {aborted:.0f} |\n"
        f"| deadline drops (server, o3_scheduler_deadline_drops_total) | {drops:.0f} |\n\n"
        f"Accounted for: client completed + dropped = {outcomes['ok'] + outcomes['dropped']}"
        f" of {len(run.outcomes)} sent; server completed (finished, not aborted) + "
        f"deadline drops = {finished - aborted + drops:.0f}.\n\n"
        f"Resident memory (server and engine processes), sampled every {SAMPLE_S} s: "
        f"first {rss[0] / 2**20:.0f} MiB, last {rss[-1] / 2**20:.0f} MiB, "
        f"max {max(rss) / 2**20:.0f} MiB; growth over the last three quarters "
        f"{growth:+.1%}.\n\nErrors in the server log: {len(errors)}"
        + ("".join(f"\n    {e}" for e in errors[:10]) if errors else "")
        + "\n"
    )
    print(body)
    print(
        f"written to {write_report('soak', 'Soak: mixed tiers at 80 % of capacity', body)}"
    )


if __name__ == "__main__":
    main()
