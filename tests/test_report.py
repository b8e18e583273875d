"""report.json / report.md / report.html of `quantship verify --report`."""

import copy
import json
import re
import subprocess
from pathlib import Path

import pytest

from quantship.errors import QuantshipError
from quantship.verify.report import NOT_MEASURED, render_html, render_markdown, write_report

FIXTURE = Path(__file__).parent / "fixtures" / "report_sample.json"
PLOT_IDS = ["plot-kl-hist", "plot-position", "plot-sensitivity", "plot-coverage"]
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def sample() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def written(sample, tmp_path_factory) -> dict[str, Path]:
    """Rendering draws four plots (~2 s): once for the whole module."""
    return write_report(sample, tmp_path_factory.mktemp("report") / "nested" / "dir")


def test_writes_three_files_and_nothing_else(written):
    assert set(written) == {"json", "md", "html"}
    folder = written["json"].parent
    assert sorted(p.name for p in folder.iterdir()) == ["report.html", "report.json", "report.md"]  # no temp left
    assert all(p.stat().st_size > 0 for p in written.values())


def test_json_round_trips_in_order(written, sample):
    loaded = json.loads(written["json"].read_text(encoding="utf-8"))
    assert loaded == sample
    assert list(loaded) == list(sample)  # the dict's key order is kept


def test_markdown_has_headline_noise_floor_reference_and_gates(written):
    md = written["md"].read_text(encoding="utf-8")
    assert "0.021 [0.0195, 0.0226]" in md  # KL mean with its 95% CI
    assert "| KL mean | 0.021 [0.0195, 0.0226] | 4.20e-04" in md  # noise floor in the same row
    assert "| Top-1 agreement | 91.87% | 99.21% |" in md
    assert "Noise floor (float32)" in md
    assert "q4_K_M 0.028" in md and "between q6_K and q4_K_M" in md
    assert "212 right→wrong, 131 wrong→right" in md
    assert "| 0–16 | 1,024 | 0.0412 | 0.51 | 87.40% |" in md
    assert "| 1 | model.layers.6.mlp.experts | 6 | experts |" in md
    assert md.count("| model.layers.") <= 10 and "| 10 | " in md  # top 10 only
    assert "| 5 | 3 | 17 |" in md  # the starved expert comes first
    assert "18.73% / 14.22%" in md
    assert re.search(r"^\| FAIL \| kl_p99 \| <= \| 0\.15 \| 0\.21 \|", md, re.M)
    assert md.count("| PASS |") == 3
    assert "gates.yaml: **FAIL**" in md
    assert "<script>" not in md  # untrusted generation text is escaped there too
    assert NOT_MEASURED not in md


def test_html_self_contained_with_all_plots(written):
    page = written["html"].read_text(encoding="utf-8")
    for plot_id in PLOT_IDS:
        tag = re.search(rf'<img[^>]*id="{plot_id}"[^>]*>', page)
        assert tag, plot_id
        assert 'class="plot"' in tag[0] and re.search(r'alt="[^"]+"', tag[0])
        assert 'src="data:image/png;base64,' in tag[0]
    # No external resource: every src/href is inline data or a fragment.
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<link" not in page
    assert 'class="card"' in page and "between q6_K and q4_K_M" in page


def test_html_escapes_untrusted_text(written, sample):
    page = written["html"].read_text(encoding="utf-8")
    assert "<script>alert" not in page
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; why" in page
    assert page.count("<script>") == 1  # only the report's own inline script


def test_html_gates_table(written):
    page = written["html"].read_text(encoding="utf-8")
    assert re.search(r'<span class="FAIL">FAIL</span></td><td>kl_p99</td>', page)
    assert page.count('<span class="PASS">PASS</span>') == 3
    assert "gates.yaml: <span class=\"FAIL\">FAIL</span>" in page


def test_missing_sections_render_as_not_measured(sample, tmp_path):
    partial = copy.deepcopy(sample)
    del partial["sensitivity"], partial["coverage"]
    paths = write_report(partial, tmp_path)
    md, page = paths["md"].read_text(encoding="utf-8"), paths["html"].read_text(encoding="utf-8")
    assert "## Sensitivity (top 10)\n\nnot measured" in md
    assert "## Calibration coverage\n\nnot measured" in md
    assert "0.021 [0.0195, 0.0226]" in md
    for gone in ["plot-sensitivity", "plot-coverage"]:
        assert f'id="{gone}"' not in page and f'id="{gone}-missing"' in page
    for kept in ["plot-kl-hist", "plot-position"]:
        assert f'id="{kept}"' in page
    assert page.count(NOT_MEASURED) == 2


def test_bare_report_renders():
    """Everything optional absent: still a valid page and summary, no crash."""
    bare = {"schema_version": 1, "base": "b", "quant": "q", "quant_scheme": None}
    md, page = render_markdown(bare), render_html(bare)
    assert md.count(NOT_MEASURED) == 6
    assert all(f'id="{p}-missing"' in page for p in PLOT_IDS)
    assert "<img" not in page


def test_non_finite_values_stay_visible():
    report = {"headline": {"kl_mean": float("nan"), "kl_p99": float("inf"), "top1_agreement": None},
              "noise_floor": {"dtype": "float32"}}
    md, page = render_markdown(report), render_html(report)
    assert "| KL mean | nan |" in md and "| KL p99 | inf |" in md and "| Top-1 agreement | — |" in md
    assert "This model" not in md  # no place on the reference scale for a NaN
    assert '<div class="v">nan</div>' in page


def test_failed_write_leaves_old_file_and_no_temp(sample, tmp_path, monkeypatch):
    (tmp_path / "report.json").write_text("old", encoding="utf-8")

    def refuse(src, dst):
        raise OSError("disk full")
    monkeypatch.setattr("quantship.files.os.replace", refuse)
    with pytest.raises(QuantshipError, match="cannot write the report .disk full"):
        write_report(sample, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
    assert (tmp_path / "report.json").read_text(encoding="utf-8") == "old"


def test_no_pyplot_figures_left_open(sample):
    render_html(sample)
    import matplotlib.pyplot as plt
    assert plt.get_fignums() == []


def chromium(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """Headless chromium with everything that could reach the network or a profile turned off."""
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}"]
    return subprocess.run([str(CHROMIUM), *flags, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_browser_decodes_every_plot(written, tmp_path):
    url = written["html"].resolve().as_uri()
    dom = chromium(["--dump-dom", url], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-plots-loaded="4"' in dom.stdout, dom.stdout[:500]

    shot = tmp_path / "shot.png"
    run = chromium([f"--screenshot={shot}", "--window-size=1200,3000", url], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert shot.stat().st_size > 50_000  # a blank 1200x3000 page compresses to a few KB
