"""Fidelity report of `quantship verify`: report.json, a Markdown summary and one self-contained HTML page.

Any part of the report dict may be missing (that measurement was skipped); renderers show what exists and
say "not measured" for the rest instead of failing.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from quantship.figures import figure, png
from quantship.files import write_atomic

NOT_MEASURED = "not measured"

# llama.cpp's published scale (Llama-3-8B): gives a bare KL number a meaning for the reader.
REFERENCE_KL = [("q8_0", 0.0014), ("q6_K", 0.0055), ("q4_K_M", 0.028), ("q4_0", 0.072)]
REFERENCE_TOP1_Q4_K_M = 0.919

# (key, label, kind): kind "pct" is a fraction shown as a percentage, "int" a count, "num" anything else.
HEADLINE = [
    ("kl_mean", "KL mean", "num"), ("kl_median", "KL median", "num"), ("kl_p90", "KL p90", "num"),
    ("kl_p99", "KL p99", "num"), ("kl_p999", "KL p99.9", "num"), ("kl_max", "KL max", "num"),
    ("top1_agreement", "Top-1 agreement", "pct"), ("top5_overlap", "Top-5 overlap", "pct"),
    ("top10_overlap", "Top-10 overlap", "pct"),
    ("dp_true_mean", "Δp(true) mean", "num"), ("dp_true_rms", "Δp(true) RMS", "num"),
    ("dp_true_p01", "Δp(true) p1", "num"), ("dp_true_p50", "Δp(true) p50", "num"),
    ("dp_true_p99", "Δp(true) p99", "num"),
    ("entropy_base_mean", "Entropy base", "num"), ("entropy_quant_mean", "Entropy quant", "num"),
    ("entropy_shift_mean", "Entropy shift", "num"),
    ("ppl_base", "PPL base", "num"), ("ppl_quant", "PPL quant", "num"), ("ppl_ratio", "PPL ratio", "num"),
    ("ln_ppl_ratio", "ln PPL ratio", "num"), ("nll_correlation", "NLL correlation", "num"),
    ("flips_right_to_wrong", "Flips right→wrong", "int"), ("flips_wrong_to_right", "Flips wrong→right", "int"),
]
KINDS = {key: kind for key, _, kind in HEADLINE}
LABELS = {key: label for key, label, _ in HEADLINE}
CARDS = ["kl_mean", "kl_p99", "top1_agreement", "top5_overlap", "ppl_ratio", "flips_right_to_wrong"]
GROUP_COLORS = {"attention": "#4c72b0", "dense_mlp": "#55a868", "experts": "#c44e52", "shared_experts": "#8172b2"}


# ---------------------------------------------------------------- formatting

def fmt(value, kind: str = "num") -> str:
    """One number as a short string; missing -> "—" so tables keep their shape."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # nan / inf: a failed measurement must stay visible, not crash the report
    if kind == "int" or isinstance(value, int):
        return f"{int(value):,}"
    value = float(value)
    if kind == "pct":
        return f"{100 * value:.2f}%"
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.2e}"
    return f"{value:.4g}"


def headline_value(section: dict | None, key: str) -> str:
    if not section or key not in section:
        return "—"
    text = fmt(section[key], KINDS.get(key, "num"))
    if key == "kl_mean" and section.get("kl_mean_ci95"):
        lo, hi = section["kl_mean_ci95"]
        text += f" [{fmt(lo)}, {fmt(hi)}]"
    return text


def reference_place(kl: float) -> str:
    """Where a KL mean falls on llama.cpp's scale, e.g. "between q6_K and q4_K_M"."""
    if kl < REFERENCE_KL[0][1]:
        return f"below {REFERENCE_KL[0][0]}"
    for (lo_name, lo), (hi_name, hi) in zip(REFERENCE_KL, REFERENCE_KL[1:]):
        if lo <= kl < hi:
            return f"between {lo_name} and {hi_name}"
    return f"above {REFERENCE_KL[-1][0]}"


def reference_line(report: dict) -> str:
    scale = " · ".join(f"{name} {kl}" for name, kl in REFERENCE_KL)
    text = (f"llama.cpp reference (Llama-3-8B, KL mean): {scale}; q4_K_M top-1 agreement "
            f"{fmt(REFERENCE_TOP1_Q4_K_M, 'pct')}.")
    kl = (report.get("headline") or {}).get("kl_mean")
    if kl is not None and math.isfinite(kl):
        text += f" This model: {fmt(kl)}, {reference_place(kl)}."
    return text


def bin_labels(edges: list[int]) -> list[str]:
    return [f"{a}–{b}" for a, b in zip(edges, edges[1:])]


def fewest_token_experts(coverage: dict, n: int = 5) -> list[tuple[int, int, int]]:
    """(layer, expert, tokens) of the n least-routed experts: those are the ones calibrated on too little data."""
    rows = [(int(layer), e, c) for layer, counts in coverage.get("tokens_per_expert", {}).items()
            for e, c in enumerate(counts)]
    return sorted(rows, key=lambda r: (r[2], r[0], r[1]))[:n]


def gate_rows(gates: dict) -> list[list[str]]:
    return [["PASS" if g["passed"] else "FAIL", g["metric"], g["op"], fmt(g["threshold"]), fmt(g["value"]),
             g.get("where") or "—"] for g in gates.get("results") or []]


def generation_summary(g: dict) -> str:
    div = g.get("tokens_to_divergence")
    return (f"diverges after {div} tokens" if div is not None else "no divergence") + (
        f"; repetition {fmt(g.get('repetition_base'))} → {fmt(g.get('repetition_quant'))}"
        f"; EOS {fmt(g.get('eos_base'))} → {fmt(g.get('eos_quant'))}")


# ---------------------------------------------------------------- Markdown

def meta_rows(report: dict) -> list[list[str]]:
    return [["base", report.get("base", "—")], ["quant", report.get("quant", "—")],
            ["scheme", report.get("quant_scheme") or "—"], ["text", report.get("text", "—")],
            ["ctx / tokens", f"{report.get('ctx', '—')} / {fmt(report.get('tokens'))}"],
            ["quantship", report.get("quantship_version", "—")]]


def coverage_rows(cov: dict) -> list[list[str]]:
    rows = [["calibration tokens", fmt(cov.get("calib_tokens"))],
            ["vocab share calib / eval", f"{fmt(cov.get('vocab_share_calib'), 'pct')} / "
                                         f"{fmt(cov.get('vocab_share_eval'), 'pct')}"],
            ["eval tokens unseen in calib", fmt(cov.get("eval_tokens_unseen_in_calib"), "pct")],
            ["calib/eval text overlap", fmt(cov.get("text_overlap"), "pct")]]
    if cov.get("tokens_per_expert"):  # RTN runs no calibration pass, so it has no routing counts
        never = sum(c == 0 for counts in cov["tokens_per_expert"].values() for c in counts)
        rows.append(["experts never routed", fmt(never)])
    # Calibration activations far from eval ones mean scales were fit on the wrong distribution.
    ratios = [(r["eval"] / r["calib"], r["layer"]) for r in cov.get("activation_rms", []) if r.get("calib")]
    if ratios:
        ratio, layer = max(ratios, key=lambda t: abs(math.log(t[0])) if t[0] > 0 else math.inf)
        rows.append(["largest eval/calib activation RMS ratio", f"{ratio:.3g}× (layer {layer})"])
    return rows


def md_table(header: list[str], rows: list[list], escape: bool = False) -> str:
    """`escape` for untrusted text (prompts, generations): Markdown viewers render inline HTML."""
    def cell(text) -> str:
        text = html.escape(str(text), quote=False) if escape else str(text)
        return text.replace("|", "\\|").replace("\n", "<br>")
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows])


def md_headline(report: dict) -> list[str] | None:
    head, floor = report.get("headline"), report.get("noise_floor")
    if not head:
        return None
    floor_col = f"Noise floor ({floor.get('dtype', '?')})" if floor else "Noise floor"
    rows = [[label, headline_value(head, key), headline_value(floor, key)] for key, label, _ in HEADLINE]
    out = [md_table(["Metric", "Quant vs base", floor_col], rows), "", reference_line(report)]
    if "flips_right_to_wrong" in head:
        r2w, w2r = head["flips_right_to_wrong"], head.get("flips_wrong_to_right", 0)
        out += ["", f"Top-1 flips: {r2w:,} right→wrong, {w2r:,} wrong→right (net {r2w - w2r:+,} lost)."]
    return out


def md_position(report: dict) -> list[str] | None:
    pos = report.get("by_position")
    if not pos:
        return None
    keys = ["kl_mean", "kl_p99", "top1_agreement", "entropy_base", "entropy_quant"]
    rows = [[label, fmt(pos["tokens"][i])] + [fmt(pos[k][i], "pct" if k == "top1_agreement" else "num") for k in keys]
            for i, label in enumerate(bin_labels(pos["bin_edges"]))]
    return [md_table(["Positions", "Tokens", "KL mean", "KL p99", "Top-1", "Entropy base", "Entropy quant"], rows)]


def md_sensitivity(report: dict) -> list[str] | None:
    sens = report.get("sensitivity")
    rows = [[i + 1, s["module"], s["layer"], s["group"], fmt(s["kl_mean"])] for i, s in enumerate((sens or [])[:10])]
    return [md_table(["#", "Module", "Layer", "Group", "KL mean"], rows)] if sens else None


def md_coverage(report: dict) -> list[str] | None:
    cov = report.get("coverage")
    if not cov:
        return None
    fewest = [[layer, expert, fmt(n)] for layer, expert, n in fewest_token_experts(cov)]
    return [md_table(["", ""], coverage_rows(cov)), "", "Experts that saw the fewest calibration tokens:", "",
            md_table(["Layer", "Expert", "Tokens"], fewest)]


def md_generations(report: dict) -> list[str] | None:
    out = []
    for g in report.get("generations") or []:
        out += [md_table(["Prompt", "Base", "Quant"], [[g["prompt"], g["base"], g["quant"]]], escape=True), "",
                generation_summary(g), ""]
    return out[:-1] or None


def md_gates(report: dict) -> list[str] | None:
    gates = report.get("gates")
    if not gates:
        return None
    return [f"{gates.get('file', '')}: **{'PASS' if gates.get('passed') else 'FAIL'}**", "",
            md_table(["Result", "Metric", "Op", "Threshold", "Value", "Where"], gate_rows(gates))]


def render_markdown(report: dict) -> str:
    out = ["# quantship verify report", "", md_table(["", ""], meta_rows(report))]
    for title, section in [("Headline", md_headline), ("By position", md_position),
                           ("Sensitivity (top 10)", md_sensitivity), ("Calibration coverage", md_coverage),
                           ("Generations", md_generations), ("Gates", md_gates)]:
        out += ["", f"## {title}", ""] + (section(report) or [NOT_MEASURED])
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- plots

def plot_kl_hist(report: dict) -> bytes | None:
    hist = report.get("kl_histogram")
    if not hist or not hist.get("counts"):
        return None
    edges = list(hist["edges"])
    edges[0] = edges[0] if edges[0] > 0 else edges[1] / 10  # a log axis cannot show 0
    fig = figure(7, 3.4)
    ax = fig.add_subplot()
    ax.stairs(hist["counts"], edges, fill=True, color="#4c72b0", alpha=0.8)
    ax.set_xscale("log")
    ax.set(xlabel="per-token KL(base ‖ quant)", ylabel="tokens", title="KL distribution")
    head, floor = report.get("headline") or {}, report.get("noise_floor") or {}
    lines = [(head.get("kl_mean"), "mean", "#c44e52", "-"), (head.get("kl_p99"), "p99", "#dd8452", "--"),
             (floor.get("kl_mean"), "noise floor mean", "#555555", ":")]
    for x, label, color, style in lines:
        if x is not None and math.isfinite(x) and x > 0:
            ax.axvline(x, color=color, linestyle=style, label=f"{label} {fmt(x)}")
    ax.legend(fontsize=8)
    return png(fig)


def plot_position(report: dict) -> bytes | None:
    pos = report.get("by_position")
    if not pos or not pos.get("tokens"):
        return None
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    labels, x = bin_labels(pos["bin_edges"]), range(len(pos["tokens"]))
    fig = figure(7, 4.4)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(x, pos["kl_mean"], "o-", label="KL mean")
    top.plot(x, pos["kl_p99"], "s--", label="KL p99")
    top.set(yscale="log", ylabel="KL", title="By position in context")
    # A KL range is often under a decade: plain 1-2-5 ticks instead of crowded 10^x minor labels.
    top.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    top.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    top.yaxis.set_minor_formatter(NullFormatter())
    top.legend(fontsize=8)
    bottom.plot(x, [100 * v for v in pos["top1_agreement"]], "o-", color="#55a868")
    bottom.set(ylabel="top-1 agreement %", xlabel="token position")
    bottom.set_xticks(list(x), labels)
    return png(fig)


def plot_sensitivity(report: dict) -> bytes | None:
    sens = report.get("sensitivity")
    if not sens:
        return None
    from matplotlib.patches import Patch
    top = sens[:20][::-1]  # most sensitive at the top of a horizontal bar chart
    fig = figure(7, 1 + 0.28 * len(top))
    ax = fig.add_subplot()
    ax.barh([s["module"] for s in top], [s["kl_mean"] for s in top],
            color=[GROUP_COLORS.get(s["group"], "#999999") for s in top])
    present = [g for g in GROUP_COLORS if any(s["group"] == g for s in top)]  # legend only for groups shown
    ax.legend(handles=[Patch(color=GROUP_COLORS[g], label=g) for g in present], fontsize=8, loc="lower right")
    ax.set(xlabel="KL mean with only this module quantized", title="Sensitivity (top 20)")
    ax.tick_params(axis="y", labelsize=7)
    return png(fig)


def plot_coverage(report: dict) -> bytes | None:
    tpe = (report.get("coverage") or {}).get("tokens_per_expert")
    if not tpe:
        return None
    import matplotlib
    import numpy as np
    from matplotlib.colors import LogNorm
    layers = sorted(tpe, key=int)
    width = max(len(tpe[k]) for k in layers)
    grid = np.full((len(layers), width), np.nan)
    for i, k in enumerate(layers):
        grid[i, : len(tpe[k])] = tpe[k]
    # Zero-token experts were never calibrated: masked so they stand out in red, not as the darkest shade.
    data = np.ma.masked_less_equal(np.nan_to_num(grid, nan=0.0), 0)
    fig = figure(min(12, max(7, 2.5 + 0.18 * width)), min(10, max(3.5, 1.5 + 0.3 * len(layers))))
    ax = fig.add_subplot()
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d62728")
    norm = LogNorm(vmin=max(1, data.min()), vmax=max(2, data.max())) if data.count() else None
    im = ax.imshow(data, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
    ax.set(xlabel="expert", ylabel="layer", title="Calibration tokens per expert (red: none)")
    ax.set_yticks(range(len(layers)), layers)
    if grid.size <= 256:  # counts are readable only on small grids
        for (i, j), v in np.ndenumerate(np.nan_to_num(grid)):
            dark = v <= 0 or (norm is not None and norm(v) < 0.6)  # white text on the dark half of viridis
            ax.text(j, i, f"{int(v)}", ha="center", va="center", fontsize=6, color="white" if dark else "black")
    fig.colorbar(im, ax=ax, label="tokens")
    return png(fig)


PLOTS = [("plot-kl-hist", "Histogram of per-token KL divergence on a log axis", plot_kl_hist),
         ("plot-position", "KL mean, KL p99 and top-1 agreement by position in context", plot_position),
         ("plot-sensitivity", "Per-module sensitivity: KL mean when only that module is quantized", plot_sensitivity),
         ("plot-coverage", "Heat map of calibration tokens routed to each expert, per layer", plot_coverage)]


# ---------------------------------------------------------------- HTML

CSS = """body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:1100px;color:#222;padding:0 1rem}
.cards{display:flex;flex-wrap:wrap;gap:.8rem}.card{border:1px solid #ddd;border-radius:8px;padding:.7rem 1rem;
min-width:150px;flex:1}.card .v{font-size:1.6rem;font-weight:600}.card .s{font-size:.8rem;color:#666}
table{border-collapse:collapse;margin:.5rem 0;font-size:.9rem}td,th{border:1px solid #ddd;padding:.3rem .6rem;
vertical-align:top;text-align:left}pre{margin:0;white-space:pre-wrap;max-width:420px}
.PASS{color:#1a7f37;font-weight:600}.FAIL{color:#cf222e;font-weight:600}.missing{color:#888;font-style:italic}
img.plot{max-width:100%;display:block;margin:.5rem 0}"""

# Inline on purpose (no external resource): lets a headless browser test prove every plot decoded.
SCRIPT = """window.addEventListener("load",function(){var n=0;document.querySelectorAll("img.plot").forEach(
function(i){if(i.complete&&i.naturalWidth>0)n++;});document.body.dataset.plotsLoaded=String(n);});"""

e = html.escape


def html_table(header: list[str], rows: list[list[str]], raw: bool = False) -> str:
    """Rows are escaped here unless `raw` (cells already built from escaped parts)."""
    cells = "".join(f"<tr>{''.join(f'<td>{c if raw else e(str(c))}</td>' for c in row)}</tr>" for row in rows)
    return f"<table><tr>{''.join(f'<th>{e(h)}</th>' for h in header)}</tr>{cells}</table>"


def cards(report: dict) -> str:
    head, floor = report.get("headline") or {}, report.get("noise_floor") or {}
    out = []
    for key in CARDS:
        if key not in head:
            continue
        value = head[key]
        finite = isinstance(value, (int, float)) and math.isfinite(value)
        ref = (f"ref: {reference_place(value)}" if key == "kl_mean" and finite
               else f"ref q4_K_M: {fmt(REFERENCE_TOP1_Q4_K_M, 'pct')}" if key == "top1_agreement" else "")
        out.append(f'<div class="card"><div class="s">{e(LABELS[key])}</div><div class="v">{e(fmt(value, KINDS[key]))}'
                   f'</div><div class="s">noise floor {e(fmt(floor.get(key), KINDS[key]))}</div>'
                   f'<div class="s">{e(ref)}</div></div>')
    return f'<div class="cards">{"".join(out)}</div>' if out else f'<p class="missing">{NOT_MEASURED}</p>'


def plot_html(plot_id: str, alt: str, data: bytes | None) -> str:
    if data is None:
        return f'<p class="missing" id="{plot_id}-missing">{e(alt)}: {NOT_MEASURED}</p>'
    b64 = base64.b64encode(data).decode("ascii")
    return f'<img class="plot" id="{plot_id}" alt="{e(alt)}" src="data:image/png;base64,{b64}">'


def render_html(report: dict) -> str:
    head, floor = report.get("headline"), report.get("noise_floor")
    title = f"quantship verify: {report.get('quant', '?')}"
    parts = [f"<h1>{e(title)}</h1>", html_table(["", ""], meta_rows(report)), "<h2>Headline</h2>", cards(report),
             f"<p>{e(reference_line(report))}</p>"]
    if head:
        floor_col = f"noise floor ({floor.get('dtype', '?')})" if floor else "noise floor"
        rows = [[label, headline_value(head, k), headline_value(floor, k)] for k, label, _ in HEADLINE]
        parts.append(f"<details><summary>All headline metrics</summary>"
                     f"{html_table(['metric', 'quant vs base', floor_col], rows)}</details>")
    parts.append("<h2>Plots</h2>")
    parts += [plot_html(pid, alt, fn(report)) for pid, alt, fn in PLOTS]
    if report.get("coverage"):
        parts += ["<h2>Calibration coverage</h2>", html_table(["", ""], coverage_rows(report["coverage"]))]
    parts.append("<h2>Generations</h2>")
    gens = [[f"<pre>{e(g['prompt'])}</pre>", f"<pre>{e(g['base'])}</pre>", f"<pre>{e(g['quant'])}</pre>",
             e(generation_summary(g))] for g in report.get("generations") or []]
    parts.append(html_table(["prompt", "base", "quant", "summary"], gens, raw=True) if gens
                 else f'<p class="missing">{NOT_MEASURED}</p>')
    parts.append("<h2>Gates</h2>")
    gates = report.get("gates")
    if gates:
        verdict = "PASS" if gates.get("passed") else "FAIL"
        rows = [[f'<span class="{r[0]}">{r[0]}</span>'] + [e(c) for c in r[1:]] for r in gate_rows(gates)]
        parts += [f'<p>{e(gates.get("file", ""))}: <span class="{verdict}">{verdict}</span></p>',
                  html_table(["result", "metric", "op", "threshold", "value", "where"], rows, raw=True)]
    else:
        parts.append(f'<p class="missing">{NOT_MEASURED}</p>')
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>'
            f"<style>{CSS}</style><script>{SCRIPT}</script></head><body>\n" + "\n".join(parts) + "\n</body></html>\n")


# ---------------------------------------------------------------- files

def write_report(report: dict, directory: Path) -> dict[str, Path]:
    """report.json first (the data outlives any rendering bug), then report.md and report.html."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {name: directory / f"report.{name}" for name in ("json", "md", "html")}
    write_atomic(paths["json"], json.dumps(report, indent=2, ensure_ascii=False) + "\n", "report")
    write_atomic(paths["md"], render_markdown(report), "report")
    write_atomic(paths["html"], render_html(report), "report")
    return paths
