"""verify: metric arithmetic, the report, gates that pass and fail, and mixed-precision plans."""

import itertools
import json
import math
import random

import pytest
import torch

from quantship.cli import main
from quantship.models.loader import Checkpoint
from quantship.quant.pipeline import QuantizeOptions, quantize
from quantship.quant.plan import choose_plan
from quantship.verify import metrics as M
from quantship.verify.gates import evaluate_gates, parse_gates

FAST = dict(samples=8, seq_len=256)
VERIFY_FAST = ["--max-tokens", "2048", "--ctx", "512"]


# --- metrics -------------------------------------------------------------------------------


def test_kl_by_hand():
    p = torch.tensor([[0.5, 0.5]]).log()
    q = torch.tensor([[0.9, 0.1]]).log()
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert M.token_kl(p, q).item() == pytest.approx(expected, rel=1e-6)
    assert M.token_kl(p, p).item() == pytest.approx(0.0, abs=1e-7)


def test_topk_overlap_entropy_and_repetition():
    base = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    quant = torch.tensor([[5.0, 1.0, 3.0, 4.0, 2.0]])
    assert M.topk_overlap(base, quant, 2).item() == pytest.approx(0.5)  # {0,1} vs {0,3}
    assert M.entropy(torch.zeros(1, 4)).item() == pytest.approx(math.log(4))
    assert M.repetition_rate([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4], n=4) == pytest.approx(1 - 4 / 9)
    assert M.repetition_rate(list(range(20))) == 0.0


def test_bootstrap_interval_covers_the_mean():
    values = torch.rand(5000, generator=torch.Generator().manual_seed(0)).pow(3)  # skewed, like KL
    lo, hi = M.bootstrap_mean_ci(values, samples=300)
    assert lo < values.mean().item() < hi and hi - lo < 0.02


# --- plan --------------------------------------------------------------------------------


def test_choose_plan_matches_brute_force():
    rng = random.Random(0)
    bits = {"W4A16": 4.125, "W8A16": 8.0}
    for _ in range(30):
        units = [f"u{i}" for i in range(5)]
        params = {u: rng.randint(1, 10) * 100 for u in units}
        damage = {}
        for u in units:
            d4 = rng.uniform(0.001, 0.05)
            damage[u] = {"W4A16": d4, "W8A16": d4 * rng.uniform(0.01, 0.2)}
        budget = rng.uniform(4.2, 12)
        plan = choose_plan(damage, params, bits, budget)
        total = sum(params.values())
        all_bits = {**bits, "none": 16.0}

        def cost(choice):
            return sum(params[u] * all_bits[s] for u, s in choice.items()) / total

        def harm(choice):
            return sum(damage[u].get(s, 0.0) for u, s in choice.items())

        assert cost(plan) <= budget + 1e-9
        best = min(harm(dict(zip(units, c))) for c in itertools.product(["W4A16", "W8A16", "none"], repeat=5)
                   if cost(dict(zip(units, c))) <= budget + 1e-9)
        # Greedy on convex hulls is optimal up to one unit's step; on these sizes it lands close.
        assert harm(plan) <= best + max(max(d.values()) for d in damage.values())


# --- verify end to end ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    out = {}
    for scheme in ("W8A16", "W4A16", "W2A16"):
        out[scheme] = root / scheme
        quantize("tiny", out[scheme], QuantizeOptions(scheme=scheme, **FAST))
    return out


def test_w8a16_passes_default_gates(checkpoints, tmp_path, capsys):
    report_dir = tmp_path / "r8"
    # The default gates read the headline and the positions only: sensitivity and generations, which the
    # report test and the demo's verify cover, are skipped here.
    assert main(["verify", "tiny", str(checkpoints["W8A16"]), "--report", str(report_dir), "--gate", "default",
                 "--no-sensitivity", "--no-generations", *VERIFY_FAST]) == 0
    report = json.loads((report_dir / "report.json").read_text())
    assert report["gates"]["passed"] and report["gates"]["file"].endswith("W8A16.yaml")
    for name in ("report.md", "report.html"):
        assert (report_dir / name).stat().st_size > 1000
    assert "PASS" in capsys.readouterr().err


def test_two_bit_fails_gates_with_a_clear_list(checkpoints, tmp_path, capsys):
    code = main(["verify", "tiny", str(checkpoints["W2A16"]), "--report", str(tmp_path / "r2"), "--gate", "default",
                 "--no-sensitivity", "--no-generations", *VERIFY_FAST])
    assert code == 1
    err = capsys.readouterr().err
    assert "FAIL kl_mean" in err and "FAIL top1_agreement" in err and "FAILED" in err


def test_report_contents(checkpoints, tmp_path):
    assert main(["verify", "tiny", str(checkpoints["W4A16"]), "--report", str(tmp_path / "r4"), *VERIFY_FAST]) == 0
    r = json.loads((tmp_path / "r4" / "report.json").read_text())
    h, floor = r["headline"], r["noise_floor"]
    assert r["tokens"] == 4 * 511 and r["ctx"] == 512
    assert h["kl_mean_ci95"][0] <= h["kl_mean"] <= h["kl_mean_ci95"][1]
    assert h["kl_median"] <= h["kl_p90"] <= h["kl_p99"] <= h["kl_p999"] <= h["kl_max"]
    assert 0.5 < h["top1_agreement"] < 1 and h["top10_overlap"] > 0.5
    assert h["ppl_ratio"] == pytest.approx(math.exp(h["ln_ppl_ratio"]))
    assert h["flips_right_to_wrong"] > 0 and h["flips_wrong_to_right"] > 0
    assert floor["kl_mean"] < h["kl_mean"] / 5  # bf16 rounding is far below 4-bit damage
    assert r["by_position"]["bin_edges"][-1] == 512 and sum(r["by_position"]["tokens"]) == r["tokens"]
    units = {s["module"] for s in r["sensitivity"]}
    assert "model.layers.0.dense_mlp" in units and "model.layers.7.experts" in units and len(units) == 1 + 1 + 7 * 3
    kls = [s["kl_mean"] for s in r["sensitivity"]]
    assert kls == sorted(kls, reverse=True) and kls[0] > 0
    cov = r["coverage"]
    # RTN checkpoints run no calibration pass, so their recipes hold no routing counts to report.
    assert cov["tokens_per_expert"] == {} and 0 < cov["vocab_share_calib"] < 1
    assert len(cov["activation_rms"]) == 8
    assert len(r["generations"]) >= 3 and all("tokens_to_divergence" in g for g in r["generations"])


def test_gate_file_errors(tmp_path, checkpoints, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("gates:\n  - kl_mean is small\n")
    assert main(["verify", "tiny", str(checkpoints["W8A16"]), "--report", str(tmp_path / "r"), "--gate", str(bad),
                 "--no-sensitivity", "--no-generations", *VERIFY_FAST]) == 2
    assert "expected 'METRIC" in capsys.readouterr().err
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("gates:\n  - klmean <= 0.1\n")
    with pytest.raises(Exception, match="unknown metric"):
        evaluate_gates({"headline": {"kl_mean": 0.1}}, parse_gates(unknown), unknown)


def test_position_gate_names_the_bin():
    report = {"headline": {}, "by_position": {"bin_edges": [1, 16, 32, 64], "kl_p99": [0.1, 0.2, 0.5]}}
    path = None
    result = evaluate_gates(report, [("by_position.kl_p99", "<=", 0.3)], path)
    assert not result["passed"] and result["results"][0]["where"] == "positions 32-64"


def test_plan_then_quantize_mixed(tmp_path, capsys):
    plan_path = tmp_path / "plan.json"
    assert main(["plan", "--budget-bits", "6", "-o", str(plan_path)]) == 0
    plan = json.loads(plan_path.read_text())
    assert 4.125 <= plan["predicted_avg_bits"] <= 6
    assert {u["scheme"] for u in plan["units"]} >= {"W4A16", "W8A16"}
    out = tmp_path / "mixed"
    assert main(["quantize", "-o", str(out), "--plan", str(plan_path), "--quiet", "--samples", "8",
                 "--seq-len", "256"]) == 0
    qc = Checkpoint(out).config.raw["quantization_config"]
    assert len(qc["config_groups"]) == 2
    groups = {g["weights"]["num_bits"]: g["targets"] for g in qc["config_groups"].values()}
    for module, scheme in plan["modules"].items():
        bits = {"W4A16": 4, "W8A16": 8}.get(scheme)
        assert (bits is None and all(module not in t for t in groups.values())) or module in groups[bits]
    model = Checkpoint(out).load_model()
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(1, 50)[None])).all()


def test_bad_inputs(checkpoints, tmp_path, capsys, reference_dirs):
    llama_dir, _ = reference_dirs["llama"]
    assert main(["verify", "tiny", str(llama_dir), "--report", str(tmp_path / "a")]) == 2
    assert "architectures differ" in capsys.readouterr().err
    short = tmp_path / "short.txt"
    short.write_text("def f():\n    return 1\n")
    assert main(["verify", "tiny", str(checkpoints["W8A16"]), "--report", str(tmp_path / "b"), "--text", str(short),
                 "--ctx", "512"]) == 2
    assert "fewer than one window of 512" in capsys.readouterr().err
    unknown = tmp_path / "g.yaml"
    unknown.write_text("gates:\n  - perplexity <= 10\n")
    assert main(["verify", "tiny", str(checkpoints["W8A16"]), "--report", str(tmp_path / "c"), "--gate", str(unknown),
                 "--no-sensitivity", "--no-generations", *VERIFY_FAST]) == 2
    assert "unknown metric 'perplexity'" in capsys.readouterr().err
