"""The SLO harness end to end at its smallest setting: a server, a real
Prometheus, Locust, the report with its plots. It checks that everything is
produced and that the PromQL queries returned numbers, not that SLOs pass."""

from __future__ import annotations

import json

from benchmarks.slo.run import main


def test_smallest_setting_produces_report_plots_and_promql_numbers(
    tiny_checkpoint, tmp_path
):
    out = tmp_path / "slo"
    report = main([
        str(tiny_checkpoint), "--schedulers", "o3", "--rates", "1", "--duration", "20",
        "--max-requests", "12", "--no-memory-table", "--prompt-tokens", "8-32",
        "--output-tokens", "4-8", "--out", str(out),
    ])  # fmt: skip
    assert report.exists() and "| normal |" in report.read_text()
    for plot in ("latency_vs_qps.png", "goodput_vs_qps.png", "heavy_fraction.png"):
        assert (out / plot).stat().st_size > 1000, plot
    results = json.loads((out / "results.json").read_text())
    run = results["results"]["o3"][0]
    assert run["prometheus"]["normal"]["availability"] is not None
    assert run["prometheus"]["_server"]["heavy_fraction"] is not None
    assert sum(t["requests"] for t in run["client"]["tiers"].values()) >= 5
