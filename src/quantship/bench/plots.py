"""Three pictures of a run: latency percentiles against load, TTFT distribution per step, throughput against load.

Bare matplotlib Figures rendered through Agg: no pyplot, so no global backend is touched and no
registry of open figures grows. The x axis is the offered rate (requests/s sent); for closed-loop
steps (synchronous, concurrent) that have none, the achieved rate stands in.
"""

from __future__ import annotations

import numpy as np

from quantship.bench.load import StepResult
from quantship.figures import figure, png

COLORS = ("#4c72b0", "#dd8452", "#c44e52", "#55a868", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


def _by_rate(summaries: list[dict]) -> list[dict]:
    return sorted(summaries, key=lambda s: s["offered_rate"])


def latency_vs_rate(summaries: list[dict]) -> bytes:
    fig = figure(10, 6.4)
    rows = _by_rate(summaries)
    x = [s["offered_rate"] for s in rows]
    titles = {"ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency",
              "e2el": "end-to-end latency"}
    for i, (metric, title) in enumerate(titles.items()):
        ax = fig.add_subplot(2, 2, i + 1)
        for stat, color in zip(("median", "p90", "p99"), COLORS):
            y = [s.get(f"{stat}_{metric}_ms") for s in rows]
            y = [np.nan if v is None else v for v in y]
            ax.plot(x, y, marker="o", color=color, label=stat)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        if i == 0:
            ax.legend(fontsize=8)
    return png(fig)


def ttft_cdf(results: list[StepResult], summaries: list[dict]) -> bytes:
    fig = figure(7, 4)
    ax = fig.add_subplot()
    for i, (result, summary) in enumerate(zip(results, summaries)):
        ttfts = np.sort([r.ttft * 1000.0 for r in result.records if r.ok and r.ttft is not None])
        if len(ttfts):
            ax.step(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts), where="post", color=COLORS[i % len(COLORS)],
                    label=f"{summary['label']} ({summary['request_throughput']:.3g} req/s)")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png(fig)


def throughput_vs_rate(summaries: list[dict]) -> bytes:
    fig = figure(7, 4)
    ax = fig.add_subplot()
    rows = _by_rate(summaries)
    x = [s["offered_rate"] for s in rows]
    ax.plot(x, [s["request_throughput"] for s in rows], marker="o", color=COLORS[0], label="completed requests/s")
    if "request_goodput" in rows[0]:
        ax.plot(x, [s["request_goodput"] for s in rows], marker="s", color=COLORS[3], label="goodput (within SLO)")
    top = max(x) if x else 1.0
    ax.plot([0, top], [0, top], linestyle=":", color="#999999", label="served = offered")
    ax.set_xlabel("offered rate (requests/s)")
    ax.set_ylabel("requests/s")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    tokens = ax.twinx()
    tokens.plot(x, [s["output_throughput"] for s in rows], marker="^", color=COLORS[1], label="output tokens/s")
    tokens.set_ylabel("output tokens/s")
    tokens.set_ylim(bottom=0)
    lines = ax.get_legend_handles_labels()
    more = tokens.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8, loc="upper left")
    return png(fig)


def all_plots(results: list[StepResult], summaries: list[dict]) -> dict[str, bytes]:
    return {"latency_vs_rate.png": latency_vs_rate(summaries), "ttft_cdf.png": ttft_cdf(results, summaries),
            "throughput_vs_rate.png": throughput_vs_rate(summaries)}
