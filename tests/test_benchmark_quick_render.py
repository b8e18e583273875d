"""benchmarks/engine_throughput.py's table of quick re-runs: a `quick --pdl` run's sides with programmatic
dependent launch on (every kernel, and the default) get rows of their own beside the plain ones, and the
TTFT rows carry transformers' figure. No GPU: the run's JSON is made up here."""

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
engine_throughput = pytest.importorskip("engine_throughput")


def test_a_pdl_run_renders_both_settings(monkeypatch, tmp_path):
    anatomy = {"step_ms": 2.0, "replay_ms": 2.0}
    run = [{"batch": 1, "w4a16_tok_s": 300.0, "bf16_tok_s": 150.0, "w4a16_pdl_tok_s": 360.0,
            "bf16_pdl_tok_s": 160.0, "w4a16_pdl_no_tiles_tok_s": 400.0,
            "first_token_ms": {"w4a16": 13.0, "bf16": 7.0, "w4a16_pdl": 12.0, "bf16_pdl": 6.5, "w4a16_pdl_no_tiles": 12.5},
            "anatomy_w4a16": anatomy, "anatomy_bf16": {"step_ms": 5.0, "replay_ms": 5.0},
            "anatomy_w4a16_pdl": {"step_ms": 1.6, "replay_ms": 1.6},
            "anatomy_bf16_pdl": {"step_ms": 4.8, "replay_ms": 4.8},
            "anatomy_w4a16_pdl_no_tiles": {"step_ms": 1.2, "replay_ms": 1.5}},
           {"ttft": {name: {"ours_s": s, "transformers_s": 0.063}
                     for name, s in (("w4a16", 0.072), ("bf16", 0.070), ("w4a16_pdl", 0.070), ("bf16_pdl", 0.070),
                                     ("w4a16_pdl_no_tiles", 0.063))}}]
    (tmp_path / "engine_quick_gpu_made_up.json").write_text(json.dumps(run))
    monkeypatch.setattr(engine_throughput, "RESULTS", tmp_path)
    monkeypatch.setattr(engine_throughput, "QUICK_RUNS", {"": {"made up": "_made_up"}})
    text = "\n".join(engine_throughput.quick_rerun_note(""))
    assert "| made up | 1 | 300.0 | 150.0 | 2.00x | 2.50x | 2.50x | 13.0 / 7.0 |" in text
    assert "| made up, PDL on | 1 | 360.0 | 160.0 | 2.25x | 3.00x | 3.00x | 12.0 / 6.5 |" in text
    assert "| made up, PDL by default | 1 | 400.0 | 160.0 | 2.50x | 4.00x | 3.20x | 12.5 / 6.5 |" in text
    assert "| made up, PDL by default | TTFT 2048 | 63.0 ms | 70.0 ms | 1.11x |" in text
    assert "| made up | TTFT 2048 | 72.0 ms | 70.0 ms | 0.97x |  |  | transformers bf16 63.0 ms: W4A16 0.88x" in text
    assert "| made up, PDL on | TTFT 2048 | 70.0 ms | 70.0 ms | 1.00x |  |  | transformers bf16 63.0 ms: W4A16 " \
        "0.90x, bf16 0.90x of its speed |" in text


def test_the_kernels_a_run_took_are_read_from_the_table_it_recorded():
    from quantship.kernels import wna16

    text = engine_throughput.kernels_text({"tinygemm_max_m": 0, "kernel_table": repr(wna16.BLOCKS_BY_M)})
    kinds = [b.kind for _, b in wna16.BLOCKS_BY_M]
    assert text.startswith("ran the Triton kernel table of the run (one row: gemv_bf16x2; ")
    assert "gemv;" not in text  # the float32 GEMV's entry is for the same row: not a class of its own
    assert f"past {wna16.BLOCKS_BY_M[-2][0]} rows: dequantize + cuBLAS" in text and kinds[-1] == "dequantize"
    older = ("[(1, Blocks(kind='gemv_bf16x2', block_m=1)), (16, Blocks(kind='swap_x', block_m=16)), "
             "(32, Blocks(kind='swap_x', block_m=32)), (64, Blocks(kind='swap_dot', block_m=64)), "
             "(None, Blocks(kind='dequantize', block_m=0))]")
    assert engine_throughput.kernels_text({"tinygemm_max_m": 8, "kernel_table": older}) == (
        "ran PyTorch's tinygemm up to 8 rows, then the Triton kernel table of the run (one row: gemv_bf16x2; 2-32 "
        "rows: swap_x; 33-64 rows: swap_dot; past 64 rows: dequantize + cuBLAS; kernels.wna16, see the kernel "
        "section below)")


def test_no_tma_no_stream_and_shared_table_sides_vary_the_tables_tiles_and_put_them_back():
    """`quick --no-tma`: inside, every tile of the table and of the GPUs' own tiles loads without TMA (the
    engines built there capture graphs with those); `quick --no-stream`: the stream-K tiles split K as adopted
    instead, the others stay as they are; after, the table is the code's again, also after an error."""
    from quantship.kernels import wna16

    table, own = wna16.BLOCKS_BY_M, wna16.DEVICE_TILES
    assert any(b.tma for _, b in table) and any(b.stream for _, b in table)
    with engine_throughput.table_variant("no_tma"):
        assert not any(b.tma for _, b in wna16.BLOCKS_BY_M)
        assert not any(b.tma for tiles in wna16.DEVICE_TILES.values() for b in tiles.values())
        assert [(limit, b.kind, b.block_m) for limit, b in wna16.BLOCKS_BY_M] == \
            [(limit, b.kind, b.block_m) for limit, b in table]
    assert wna16.BLOCKS_BY_M is table and wna16.DEVICE_TILES is own
    with engine_throughput.table_variant("no_stream"):
        for (_, b), (_, before) in zip(wna16.BLOCKS_BY_M, table):
            assert b == replace(before, stream=0)
        assert wna16.choose_blocks(16) == replace(dict(table)[16], stream=0)
    gpu = next(iter(own))  # `quick --shared-table`: a GPU with tiles of its own runs the shared table's
    assert wna16.choose_blocks(1, device=gpu) != table[0][1]
    with engine_throughput.table_variant("shared_table"):
        assert wna16.choose_blocks(1, device=gpu) == table[0][1] and wna16.BLOCKS_BY_M is table
    assert wna16.choose_blocks(1, device=gpu) != table[0][1]
    assert wna16.BLOCKS_BY_M is table
    with pytest.raises(RuntimeError), engine_throughput.table_variant("no_tma"):
        raise RuntimeError("a side failed")
    assert wna16.BLOCKS_BY_M is table
    with engine_throughput.table_variant(None):
        assert wna16.BLOCKS_BY_M is table
    ahead = wna16.STREAM_PREFETCH  # `quick --prefetch 4`: the stream-K tiles prefetch 4 K tiles, then as before
    with pytest.raises(RuntimeError), engine_throughput.table_variant(None, prefetch=ahead + 3):
        assert wna16.STREAM_PREFETCH == ahead + 3 and wna16.BLOCKS_BY_M is table
        raise RuntimeError("a side failed")
    assert wna16.STREAM_PREFETCH == ahead
    fours = wna16.GEMV_QUADS  # `quick --quads`: the GEMV's sums four at once inside, then as before
    with engine_throughput.table_variant(None, quads=True):
        assert wna16.GEMV_QUADS and wna16.STREAM_PREFETCH == ahead and wna16.BLOCKS_BY_M is table
    assert wna16.GEMV_QUADS == fours
