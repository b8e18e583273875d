"""Render the bundled model's training run (scripts/train_tiny.py on the GPU machine) into BENCHMARKS.md.

The run writes train_report.json beside the weights; this turns it into the table and keeps a copy
under benchmarks/results/.

    .venv/bin/python benchmarks/training_report.py
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from quantship.models.bundled import TINY_DIR  # noqa: E402

from _report import table, update_section, write_result  # noqa: E402


def main() -> None:
    r = json.loads((TINY_DIR / "train_report.json").read_text())
    write_result("train_tiny", r)
    gap = r["heldout_loss"] - r["train_sample_loss"]
    update_section("train_tiny", "## Bundled tiny DeepSeek-V3: training run\n\n"
        "`scripts/train_tiny.py` on one " + r["device"] + f" (torch {r['torch']}), bf16 autocast, AdamW, "
        "aux-loss-free expert balancing. Corpus from `scripts/build_corpus.py` (see "
        "`src/quantship/models/assets/tiny/SOURCES.md`). Held-out = the bundled `eval.txt`, never trained on.\n\n"
        + table(["parameters", "distinct train tokens", "tokens seen", "epochs", "minutes", "tokens/s",
                 "train loss (sample)", "held-out loss", "held-out ppl", "held-out / train ppl"],
                [[f"{r['parameters'] / 1e6:.1f}M", f"{r['train_tokens_distinct'] / 1e6:.1f}M",
                  f"{r['tokens_seen'] / 1e6:.0f}M", f"{r['epochs']:.1f}", f"{r['minutes']:.1f}",
                  f"{r['tokens_per_second']:,.0f}", f"{r['train_sample_loss']:.3f}", f"{r['heldout_loss']:.3f}",
                  f"{r['heldout_ppl']:.2f}", f"{math.exp(gap):.2f}"]]))
    print(f"held-out perplexity {r['heldout_ppl']:.2f}")


if __name__ == "__main__":
    main()
