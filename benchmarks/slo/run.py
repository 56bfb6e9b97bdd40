"""SLO verification in one command: `vllm serve` (per scheduler), a real
Prometheus, Locust headless over a sweep of request rates, SLO verdicts from
PromQL, and a report with plots; everything started is stopped by PID.

    python -m benchmarks.slo.run MODEL [--schedulers o3 fcfs priority]
        [--rates 0.5 1 2] [--duration 60] [--deadline-scale 1] [--out docs/slo]
    python -m benchmarks.slo.run --url http://host:port ...   # your own server

Rates are multiples of the capacity measured first (a saturating burst of
requests of the load's mean size, on the first scheduler). SLOs:
availability >= 99.9 % per tier (deadline drops and requests still unanswered
when a run ends count as failures) and first token within the tier's deadline
at p95. The seed's deadlines (critical 50 ms) are shorter than one engine step
of a CPU; `--deadline-scale` multiplies them.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from benchmarks.common import percentile
from benchmarks.slo.prometheus import start_prometheus
from benchmarks.tier_scheduling import capacity, scaled_deadlines, server_args
from vllm_o3.scheduler.tiers import SchedulerPolicy, Tier
from vllm_o3.tools.server import free_port, start_server, stop_server

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
AVAILABILITY_SLO = 0.999
TIERS = [t.label for t in Tier]


def run_locust(
    url: str, rate: float, duration: float, exporter_port: int, record: Path, args
) -> None:
    env = {
        **os.environ,
        "O3_MODE": args.mode, "O3_RATE": f"{rate}", "O3_EXPORTER_PORT": str(exporter_port),
        "O3_RECORD": str(record), "O3_TIER_STYLE": args.style,
        "O3_MAX_REQUESTS": str(args.max_requests), "O3_PROMPT_TOKENS": args.prompt_tokens,
        "O3_OUTPUT_TOKENS": args.output_tokens, "O3_ARRIVAL_S": str(duration),
    }  # fmt: skip
    # Open loop: arrivals for `duration`, then `drain` s for their answers and
    # no longer (what is still unanswered is recorded as unfinished). Closed
    # loop: users stop at `duration`, each finishing its request within `drain`.
    users, run_time, stop_timeout = "1", duration + args.drain, 0
    if args.mode == "closed":
        users, run_time, stop_timeout = str(args.users), duration, args.drain
    subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", users,
         "-r", users, "--run-time", f"{int(run_time)}s", "--host", url, "--only-summary",
         "--stop-timeout", str(int(stop_timeout)), "--loglevel", "WARNING",
         "--exit-code-on-error", "0"],  # drops are outcomes, not a failed run
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def mean_request(args) -> tuple[str, int]:
    """A prompt and output length at the middle of the load's ranges, so that
    capacity is measured on requests the size of the load's."""
    words = sum(map(int, args.prompt_tokens.split("-"))) // 2
    tokens = sum(map(int, args.output_tokens.split("-"))) // 2
    return " ".join(["river"] * words), tokens


def client_summary(record: Path, policy: SchedulerPolicy) -> dict:
    rows = list(csv.DictReader(record.open()))
    per_tier = {}
    good = 0
    for tier in TIERS:
        mine = [r for r in rows if r["tier"] == tier]
        ok = [r for r in mine if r["status"] == "ok"]
        ttft = [float(r["ttft"]) for r in ok if r["ttft"]]
        deadline = policy.tiers[Tier.parse(tier)].deadline_ms
        met = [t for t in ttft if deadline is None or t * 1e3 <= deadline]
        good += len(met)
        per_tier[tier] = {
            "requests": len(mine),
            "dropped": sum(r["status"] == "dropped" for r in mine),
            "errors": sum(r["status"] == "error" for r in mine),
            "unfinished": sum(r["status"] == "unfinished" for r in mine),
            "ttft_p50": percentile(ttft, 0.5), "ttft_p95": percentile(ttft, 0.95),
            "ttft_p99": percentile(ttft, 0.99),
            "tpot_mean": statistics.mean([float(r["tpot"]) for r in ok if r["tpot"]] or [0]),
            "e2e_p95": percentile([float(r["e2e"]) for r in ok], 0.95),
            "e2e_mean": statistics.mean([float(r["e2e"]) for r in ok] or [0]),
        }  # fmt: skip
    span = (
        (max(float(r["start"]) for r in rows) - min(float(r["start"]) for r in rows))
        if rows
        else 0
    )
    completed = sum(r["status"] == "ok" for r in rows)
    return {
        "tiers": per_tier,
        "throughput": completed / max(span, 1e-9),
        "goodput": good / max(span, 1e-9),
    }


def prometheus_verdicts(
    prom, start: float, end: float, policy: SchedulerPolicy
) -> dict:
    """SLO verdicts from PromQL. Scrapes can time out while the CPU is
    saturated, so no query leans on samples taken during the load: the load
    generator's counters start at zero in each run (their last value is the
    run's total), and server counters are read before and after the run."""
    window = f"{max(1, int(end - start))}s"

    def served_since_start(expression: str) -> float | None:
        after = prom.query(expression, end)
        return None if after is None else after - (prom.query(expression, start) or 0)

    def run_total(selector: str) -> str:
        return f"sum(max_over_time({selector}[{window}]))"

    verdicts = {}
    for tier in TIERS:
        total = run_total(f'loadgen_requests_total{{tier="{tier}"}}')
        ok = run_total(f'loadgen_requests_total{{tier="{tier}",status="ok"}}')

        def quantile(q: float, metric: str, tier: str = tier) -> str:
            buckets = f'max_over_time({metric}_bucket{{tier="{tier}"}}[{window}])'
            return f"histogram_quantile({q}, sum by (le) ({buckets}))"

        availability = prom.query(f"({ok}) / ({total})", end)
        p95 = prom.query(quantile(0.95, "loadgen_ttft_seconds"), end)
        deadline = policy.tiers[Tier.parse(tier)].deadline_ms
        verdicts[tier] = {
            "availability": availability,
            "ttft_p95": p95,
            "ttft_p99": prom.query(quantile(0.99, "loadgen_ttft_seconds"), end),
            "e2e_p95": prom.query(quantile(0.95, "loadgen_e2e_seconds"), end),
            "e2e_p99": prom.query(quantile(0.99, "loadgen_e2e_seconds"), end),
            "server_drops": served_since_start(
                f'sum(o3_scheduler_deadline_drops_total{{tier="{tier}"}})'
            ),
            "slo_met": availability is not None and availability >= AVAILABILITY_SLO
            and (deadline is None or (p95 is not None and p95 * 1e3 <= deadline)),
        }  # fmt: skip
    heavy = served_since_start('sum(o3_router_tokens_total{path="heavy"})')
    tokens = served_since_start("sum(o3_router_tokens_total)")
    verdicts["_server"] = {
        "heavy_fraction": heavy / tokens if heavy is not None and tokens else None,
        "kv_usage_max": prom.query(f"max_over_time(vllm:kv_cache_usage_perc[{window}])", end),
        "kv_usage_mean": prom.query(f"avg_over_time(vllm:kv_cache_usage_perc[{window}])", end),
        "kv_fragmentation_mean": prom.query(
            f"avg_over_time(o3_scheduler_kv_internal_fragmentation[{window}])", end),
    }  # fmt: skip
    return verdicts


def peak_rss_during(pid: int, action) -> int:
    """Peak resident memory of `pid` and its children while `action()` runs."""
    root, peak, done = psutil.Process(pid), [0], threading.Event()

    def sample():
        while not done.wait(0.2):
            processes = [root, *root.children(recursive=True)]
            peak[0] = max(peak[0], sum(p.memory_info().rss for p in processes))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        action()
    finally:
        done.set()
        sampler.join()
    return peak[0]


def memory_table(
    url: str, pid: int, model: str, batches=(1, 4, 8), lengths=(128, 512)
) -> list[dict]:
    """Resident memory (server and engine) while B requests of S prompt tokens run."""
    import httpx

    def run_batch(batch: int, length: int) -> None:
        body = {"model": model, "prompt": "river " * length, "max_tokens": 32,
                "ignore_eos": True, "vllm_xargs": {"tier": "low"}}  # fmt: skip
        threads = [
            threading.Thread(target=httpx.post, args=(f"{url}/v1/completions",),
                             kwargs={"json": body, "timeout": 600})
            for _ in range(batch)
        ]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    return [
        {"batch": b, "prompt_tokens": n,
         "rss_mib": peak_rss_during(pid, lambda b=b, n=n: run_batch(b, n)) / 2**20}
        for n in lengths for b in batches
    ]  # fmt: skip


def plot(
    results: dict, out: Path, heavy_series: list, policy: SchedulerPolicy
) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, axes = plt.subplots(1, len(TIERS), figsize=(4 * len(TIERS), 3.6), sharey=True)
    for ax, tier in zip(axes, TIERS, strict=True):
        for scheduler, runs in results.items():
            xs = [r["offered_rps"] for r in runs]
            ys = [
                (r["client"]["tiers"][tier]["ttft_p95"] or float("nan")) * 1e3
                for r in runs
            ]
            ax.plot(xs, ys, marker="o", label=scheduler)
        deadline = policy.tiers[Tier.parse(tier)].deadline_ms
        if deadline:
            ax.axhline(deadline, color="grey", linestyle="--", label="deadline")
        ax.set_title(f"{tier}: TTFT p95")
        ax.set_xlabel("offered load (requests/s)")
        ax.set_yscale("log")
    axes[0].set_ylabel("time to first token, p95 (ms)")
    axes[0].legend()  # the first tier has a deadline line to name
    fig.tight_layout()
    fig.savefig(out / "latency_vs_qps.png", dpi=110)
    files.append("latency_vs_qps.png")
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for scheduler, runs in results.items():
        ax.plot([r["offered_rps"] for r in runs], [r["client"]["goodput"] for r in runs],
                marker="o", label=scheduler)  # fmt: skip
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("goodput (requests/s meeting SLO)")
    ax.set_title("Goodput vs load")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "goodput_vs_qps.png", dpi=110)
    files.append("goodput_vs_qps.png")
    if heavy_series:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        t0 = heavy_series[0][0]
        ax.plot([t - t0 for t, _ in heavy_series], [v * 100 for _, v in heavy_series])
        ax.set_xlabel("time (s)")
        ax.set_ylabel("tokens on the full FFN (%)")
        ax.set_ylim(0, 100)
        ax.set_title("Router heavy fraction (o3 run)")
        fig.tight_layout()
        fig.savefig(out / "heavy_fraction.png", dpi=110)
        files.append("heavy_fraction.png")
    plt.close("all")
    return files


def fmt(value, scale=1.0, digits=0) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def report(
    results: dict, extra: dict, plots: list[str], args, policy: SchedulerPolicy
) -> str:
    lines = [
        f"Model `{args.model or args.url}`; {args.mode} loop, {args.duration:g} s of load per rate "
        f"and up to {args.drain:g} s more for its answers (`unfinished`: still unanswered then); "
        f"prompts {args.prompt_tokens} words, outputs {args.output_tokens} tokens; "
        f"tier mix 10/20/50/20 %. Measured capacity {extra['capacity']:.2f} req/s "
        f"(with `--max-num-seqs 1`: {extra.get('capacity_unbatched', float('nan')):.2f}). "
        f"SLO: availability >= {AVAILABILITY_SLO:.1%} and TTFT p95 within the tier deadline "
        f"(the seed's x{args.deadline_scale:g}, O3Scheduler's too) "
        + ", ".join(f"{t.label} {policy.tiers[t].deadline_ms or '-'} ms" for t in Tier)
        + ".",
        "",
    ]
    for scheduler, runs in results.items():
        for run in runs:
            lines += [
                f"### {scheduler}, {run['rate']}x capacity ({run['offered_rps']:.2f} req/s)", "",
                "| tier | requests | availability (PromQL) | TTFT p50 / p95 / p99 ms | TPOT ms | "
                "E2E p95 ms | drops | unfinished | SLO met |",
                "|---|---|---|---|---|---|---|---|---|",
            ]  # fmt: skip
            for tier in TIERS:
                c, p = run["client"]["tiers"][tier], run["prometheus"][tier]
                lines.append(
                    f"| {tier} | {c['requests']} | {fmt(p['availability'], 100, 2)} % | "
                    f"{fmt(c['ttft_p50'], 1e3)} / {fmt(c['ttft_p95'], 1e3)} / {fmt(c['ttft_p99'], 1e3)} | "
                    f"{fmt(c['tpot_mean'], 1e3, 1)} | {fmt(c['e2e_p95'], 1e3)} | {c['dropped']} | {c['unfinished']} | "
                    f"{'yes' if p['slo_met'] else 'no'} |"
                )
            s = run["prometheus"]["_server"]
            lines += [
                "",
                f"Throughput {run['client']['throughput']:.2f} req/s, goodput "
                f"{run['client']['goodput']:.2f} req/s. Router heavy fraction "
                f"{fmt(s['heavy_fraction'], 100, 1)} %; KV cache usage mean / max "
                f"{fmt(s['kv_usage_mean'], 100, 1)} / {fmt(s['kv_usage_max'], 100, 1)} %; "
                f"internal fragmentation of allocated KV blocks {fmt(s['kv_fragmentation_mean'], 100, 1)} %.",
                "",
            ]  # fmt: skip
    first = next(iter(results.values()))
    lines += [
        "## Continuous batching: load vs latency and throughput (the seed's dynamic-batching table)",
        "", "| offered req/s | achieved req/s | mean E2E ms | throughput gain vs no batching |",
        "|---|---|---|---|",
    ]  # fmt: skip
    for run in first:
        mean_e2e = statistics.mean(
            t["e2e_mean"] for t in run["client"]["tiers"].values() if t["e2e_mean"]
        )
        gain = (
            run["client"]["throughput"] / extra["capacity_unbatched"]
            if extra.get("capacity_unbatched")
            else None
        )
        lines.append(f"| {run['offered_rps']:.2f} | {run['client']['throughput']:.2f} | "
                     f"{mean_e2e * 1e3:.0f} | {fmt(gain, 1, 2)}x |")  # fmt: skip
    if extra.get("memory"):
        lines += ["", "## Resident memory by batch size and prompt length", "",
                  "| batch | prompt tokens | peak RSS MiB |", "|---|---|---|"]  # fmt: skip
        lines += [
            f"| {m['batch']} | {m['prompt_tokens']} | {m['rss_mib']:.0f} |"
            for m in extra["memory"]
        ]
    lines += ["", *[f"![{p}]({p})" for p in plots], ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "model", nargs="?", help="checkpoint to serve (omit with --url)"
    )
    parser.add_argument("--url", help="use this running server instead of starting one")
    parser.add_argument("--schedulers", nargs="+", default=["o3", "fcfs", "priority"])
    parser.add_argument("--rates", nargs="+", type=float, default=[0.5, 1.0, 2.0])
    parser.add_argument("--duration", type=float, default=60, help="arrivals, s")
    parser.add_argument(
        "--drain", type=float, default=30,
        help="s after the arrivals for answers; later ones count as unfinished",
    )  # fmt: skip
    parser.add_argument("--mode", choices=["open", "closed"], default="open")
    parser.add_argument("--users", type=int, default=8, help="closed loop")
    parser.add_argument("--max-requests", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--prompt-tokens", default="32-256")
    parser.add_argument("--output-tokens", default="16-64")
    parser.add_argument("--no-memory-table", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("docs/slo"))
    parser.add_argument(
        "--deadline-scale", type=float, default=1.0,
        help="multiply the seed's tier deadlines, for O3Scheduler and the SLOs",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not (args.model or args.url):
        parser.error("give a MODEL to serve or --url of a running server")
    o3_policy = scaled_deadlines(args.deadline_scale)
    policy = SchedulerPolicy.from_config(o3_policy)
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="o3-slo-"))
    results, extra, heavy_series = {}, {}, []
    schedulers = args.schedulers if not args.url else ["server"]
    for scheduler in schedulers:
        args.style = (
            "o3"
            if scheduler in ("o3", "server")
            else ("priority" if scheduler == "priority" else "none")
        )
        server = None
        if args.url:
            url, pid = args.url.rstrip("/"), None
        else:
            if "capacity_unbatched" not in extra:
                single = start_server(args.model, scratch / "unbatched.log", "--max-num-seqs", "1",
                                      "--max-model-len", "2048")  # fmt: skip
                try:
                    extra["capacity_unbatched"] = asyncio.run(
                        capacity(single.url, args.model, 16, *mean_request(args))
                    )
                finally:
                    stop_server(single)
            server = start_server(args.model, scratch / f"{scheduler}.log", "--max-num-seqs",
                                  str(args.max_num_seqs), "--max-model-len", "2048",
                                  *server_args(scheduler, o3_policy))  # fmt: skip
            url, pid = server.url, server.process.pid
        exporter = free_port()
        prom = start_prometheus(
            {"vllm": url.split("//")[1], "loadgen": f"127.0.0.1:{exporter}"}
        )
        try:
            if "capacity" not in extra:
                extra["capacity"] = asyncio.run(
                    capacity(url, args.model or "", 32, *mean_request(args))
                )
            runs, first_start = [], time.time()
            for rate in args.rates:
                record = scratch / f"{scheduler}-{rate}.csv"
                start = time.time()
                run_locust(
                    url, rate * extra["capacity"], args.duration, exporter, record, args
                )
                time.sleep(3 * 1.0 + 1)  # let Prometheus scrape the end
                end = time.time()
                runs.append({
                    "rate": rate, "offered_rps": rate * extra["capacity"],
                    "client": client_summary(record, policy),
                    "prometheus": prometheus_verdicts(prom, start, end, policy),
                })  # fmt: skip
                (args.out / record.name).write_bytes(record.read_bytes())
            results[scheduler] = runs
            if scheduler in ("o3", "server"):
                heavy_series = prom.query_range(
                    'sum(rate(o3_router_tokens_total{path="heavy"}[5s])) / '
                    "sum(rate(o3_router_tokens_total[5s]))",
                    first_start,
                    time.time(),
                )
                if pid is not None and not args.no_memory_table:
                    name = asyncio.run(_model_name(url))
                    extra["memory"] = memory_table(url, pid, name)
        finally:
            prom.stop()
            if server is not None:
                stop_server(server)
    plots = plot(results, args.out, heavy_series, policy)
    (args.out / "results.json").write_text(json.dumps({"results": results, "extra": extra,
                                                       "heavy_series": heavy_series}, indent=1))  # fmt: skip
    text = report(results, extra, plots, args, policy)
    command = " ".join(["python -m benchmarks.slo.run", *(argv or sys.argv[1:])])
    (args.out / "report.md").write_text(
        f"# SLO report\n\nCommand: `{command}`\n\n{text}"
    )
    print(text)
    return args.out / "report.md"


async def _model_name(url: str) -> str:
    import httpx

    async with httpx.AsyncClient() as client:
        return (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]


if __name__ == "__main__":
    main()
