"""The W4A16 kernel sweep's adopt step (benchmarks/kernel_wna16.py): which tiles a --sweep run's ranking puts
into kernels/wna16.py's table, written as the code's own source. No GPU: the ranking is made up here."""

import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from quantship.kernels import wna16
from quantship.kernels.wna16 import Blocks

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
kernel_wna16 = pytest.importorskip("kernel_wna16")

GEMV = Blocks("gemv_bf16x2", 1, 256, 128, -1, 4, 1)
FLOAT_GEMV = Blocks("gemv", 1, 256, 64, -1, 2, 1)
SWAP = Blocks("swap_x", 16, 128, 256, 8, 4, 3)
WHOLE = Blocks("dequantize", 0, 64, 64, 1, 4, 1)
WIDE = Blocks("dequantize", 0, 128, 128, 1, 4, 1)


def ranking(**by_m):
    return {"ranking": {str(m): [(asdict(b), t) for b, t in items] for m, items in by_m.items()}, "rows": [],
            "sweep_shapes": []}


def test_dequantize_tiles_are_adopted_by_m_and_written_as_source(monkeypatch):
    """A sweep where 256 rows dequantize fastest in one tile shape and 2,048 in another: 65-256 rows get their
    own dequantize class; the source adopt writes is the code's own, and dequantizing starts past the tiles."""
    r = ranking(**{"1": [(GEMV, 1.0), (FLOAT_GEMV, 2.0)], "16": [(SWAP, 1.0)],
                   "256": [(WHOLE, 1.0), (WIDE, 1.1)], "2048": [(WIDE, 1.0), (WHOLE, 1.2)]})
    table, tinygemm_rows = kernel_wna16.adopted_table(r, current=[(1, GEMV), (16, SWAP), (None, WHOLE)])
    assert table == [(1, GEMV), (1, FLOAT_GEMV), (16, SWAP), (256, WHOLE), (None, WIDE)] and tinygemm_rows == 0
    assert kernel_wna16._source(WIDE) == 'Blocks("dequantize", 0, 128, 128, 1, 4, 1)'
    assert eval(kernel_wna16._source(WIDE), {"Blocks": Blocks}) == WIDE
    monkeypatch.setattr(wna16, "BLOCKS_BY_M", table)
    assert wna16.dequantizes_from() == 17
    assert wna16.choose_blocks(300) == WIDE and wna16.choose_blocks(200) == WHOLE


def test_adopt_writes_every_field_a_tile_sets():
    """The source adopt writes gives back the same tiles for every field that differs from its default (a
    field it left out would be dropped from the table the sweep chose: x_paired was, once)."""
    tiles = [Blocks("swap_bf16x2", 128, 128, 64, 4, 8, 3, finish=False, rows_first=True, x_paired=True),
             Blocks("swap_bf16x2", 16, 128, 128, 8, 4, 3, max_registers=128), *(b for _, b in wna16.BLOCKS_BY_M)]
    for b in tiles:
        assert eval(kernel_wna16._source(b), {"Blocks": Blocks}) == b, kernel_wna16._source(b)


def test_the_same_dequantize_tiles_at_every_swept_m_are_one_class():
    r = ranking(**{"1": [(GEMV, 1.0), (FLOAT_GEMV, 2.0)], "64": [(SWAP, 1.0)],
                   "256": [(WIDE, 1.0)], "2048": [(WIDE, 1.0)]})
    table, _ = kernel_wna16.adopted_table(r, current=[(1, GEMV), (64, SWAP), (None, WHOLE)])
    assert table[-2:] == [(64, SWAP), (None, WIDE)]


def test_a_sweep_of_some_rows_keeps_the_tables_classes_it_did_not_sweep():
    """A sweep run with --ms 1 16 128 2048 replaces those classes' tiles and keeps the table's 32- and
    64-row classes (it timed nothing there); a class past the last swept M goes to dequantize + cuBLAS."""
    r = ranking(**{"1": [(GEMV, 1.0), (FLOAT_GEMV, 2.0)], "16": [(SWAP, 1.0)],
                   "128": [(WHOLE, 1.0)], "2048": [(WIDE, 1.0), (WHOLE, 1.1)]})
    at_32, at_64, at_4096 = (Blocks("swap_x", 32, 64, 128, 4, 4, 3), Blocks("swap_dot", 64, 128, 128, 4, 4, 4),
                             Blocks("swap_x", 64, 128, 128, 4, 4, 3))
    current = [(1, GEMV), (16, Blocks("swap_x", 16, 64, 128, 8, 4, 3)), (32, at_32), (64, at_64),
               (4096, at_4096), (None, WHOLE)]
    table, _ = kernel_wna16.adopted_table(r, current=current)
    assert table == [(1, GEMV), (1, FLOAT_GEMV), (16, SWAP), (32, at_32), (64, at_64), (128, WHOLE),
                     (None, WIDE)]


def test_a_sweep_stopping_short_of_dequantizing_keeps_the_classes_above_it():
    """A sweep of the swap tiles at 16 and 32 rows only (--kinds stream --ms 16 32): its winners take those
    classes, and the 64-row class and the dequantize fallback past it stay the table's (it timed nothing
    there); adopting a later sweep of 64 rows then replaces that class alone."""
    at_32, at_64 = Blocks("swap_x", 32, 64, 128, 4, 4, 3), Blocks("swap_dot", 64, 128, 128, 4, 4, 4)
    stream_16, stream_32 = replace(SWAP, stream=3), replace(at_32, stream=2)
    current = [(1, GEMV), (16, SWAP), (32, at_32), (64, at_64), (None, WIDE)]
    r = ranking(**{"16": [(stream_16, 1.0), (SWAP, 1.1)], "32": [(stream_32, 1.0), (at_32, 1.1)]})
    table, _ = kernel_wna16.adopted_table(r, current=current)
    assert table == [(1, GEMV), (16, stream_16), (32, stream_32), (64, at_64), (None, WIDE)]
    later = replace(at_64, stream=2)
    table, _ = kernel_wna16.adopted_table(ranking(**{"64": [(later, 1.0), (at_64, 1.1)]}), current=table)
    assert table == [(1, GEMV), (16, stream_16), (32, stream_32), (64, later), (None, WIDE)]


def test_a_row_blocks_first_swap_tile_winning_a_short_prompt_is_adopted_before_dequantizing(monkeypatch):
    """128 rows fastest as 64-row swap tiles whose grid walks the row blocks first: the 65-128 class takes
    them, written with rows_first, dequantizing starts past it, and the capacity planner's first dense
    row count moves with it."""
    first = Blocks("swap_dot", 64, 128, 128, 1, 4, 4, rows_first=True)
    r = ranking(**{"1": [(GEMV, 1.0), (FLOAT_GEMV, 2.0)], "16": [(SWAP, 1.0)],
                   "128": [(first, 1.0), (WHOLE, 1.2)], "2048": [(WHOLE, 1.0)]})
    table, _ = kernel_wna16.adopted_table(r, current=[(1, GEMV), (1, FLOAT_GEMV), (16, SWAP), (None, WHOLE)])
    assert table == [(1, GEMV), (1, FLOAT_GEMV), (16, SWAP), (128, first), (None, WHOLE)]
    assert kernel_wna16._source(first) == 'Blocks("swap_dot", 64, 128, 128, 1, 4, 4, rows_first=True)'
    assert eval(kernel_wna16._source(first), {"Blocks": Blocks}) == first
    monkeypatch.setattr(wna16, "BLOCKS_BY_M", table)
    assert wna16.dequantizes_from() == 129 and wna16.choose_blocks(100) == first


def test_a_sweep_past_one_row_keeps_both_one_row_gemvs():
    """A sweep of 128 rows and up leaves the one-row class alone: the bf16x2 GEMV and the float32 GEMV for
    what its PTX cannot take (both limit 1) stay, in order."""
    r = ranking(**{"128": [(WHOLE, 1.0)], "2048": [(WHOLE, 1.0)]})
    table, _ = kernel_wna16.adopted_table(r, current=[(1, GEMV), (1, FLOAT_GEMV), (16, SWAP), (None, WIDE)])
    assert table == [(1, GEMV), (1, FLOAT_GEMV), (16, SWAP), (None, WHOLE)]


def test_a_sweep_ranks_tiles_that_ran_on_every_shape_and_keeps_each_shapes_fastest(monkeypatch, tmp_path):
    """run --sweep with the GPU's timings made up: the ranking sums each candidate over the layer's four
    calls and leaves out one that did not run on every shape; by_shape keeps each shape's own fastest,
    which the adopt step does not read (a table per shape's worth, for a reader of the result)."""
    import json

    import torch

    fast_everywhere, fast_on_qo = SWAP, Blocks("swap_x", 16, 64, 128, 4, 4, 3)

    def time_shape(label, n, k, bandwidth, sweep, kinds, ms):
        times = {fast_everywhere: 2.0}
        if label == "q/o_proj 4096x4096":
            times[fast_on_qo] = 1.0  # ran on this shape only (say, the others did not compile)
        return [{"shape": label, "m": 16}], {"errors": {}, "sweep": {16: times}}

    monkeypatch.setattr(kernel_wna16, "time_shape", time_shape)
    monkeypatch.setattr(kernel_wna16, "copy_bandwidth", lambda: 1.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "made up")
    kernel_wna16.run(tmp_path, sweep=True, kinds=("swap_x",), ms=(16,), name="sweep")
    r = json.loads((tmp_path / "sweep.json").read_text())
    assert [(Blocks(**b), t) for b, t in r["ranking"]["16"]] == [(fast_everywhere, 8.0)]
    assert Blocks(**r["by_shape"]["q/o_proj 4096x4096"]["16"][0][0]) == fast_on_qo
    assert Blocks(**r["by_shape"]["down 4096x11008"]["16"][0][0]) == fast_everywhere


def test_a_register_capped_tile_is_adopted_and_written_with_its_cap():
    """A 16-row tile winning with ptxas' register cap keeps the cap in the table's source, and the candidates at
    16 rows include capped tiles (the uncapped one compiles to 130 registers for sm_90)."""
    capped = Blocks("swap_bf16x2", 16, 128, 128, 8, 4, 3, max_registers=128)
    assert capped in kernel_wna16.candidates(16)
    r = ranking(**{"1": [(GEMV, 1.0), (FLOAT_GEMV, 2.0)], "16": [(capped, 1.0), (SWAP, 1.1)]})
    table, _ = kernel_wna16.adopted_table(r, current=[(1, GEMV), (1, FLOAT_GEMV), (16, SWAP), (None, WHOLE)])
    assert table[2] == (16, capped)
    source = kernel_wna16._source(capped)
    assert source == 'Blocks("swap_bf16x2", 16, 128, 128, 8, 4, 3, max_registers=128)'
    assert eval(source, {"Blocks": Blocks}) == capped


def test_a_gpus_sweep_is_adopted_as_its_own_tiles_where_they_beat_the_tables_by_the_margin(monkeypatch, capsys):
    """adopt --device: at one row a GEMV of the same kind 5% faster than the table's becomes the device's own
    tile; at 16 rows one 1% faster does not (noise); at 64 rows another kernel ran fastest: printed as a new
    table's case, and the device keeps the table's tile; classes the sweep did not time are left alone."""
    table = [(1, GEMV), (1, FLOAT_GEMV), (16, SWAP), (64, Blocks("swap_x", 64, 128, 128, 0, 4, 3)), (None, WHOLE)]
    monkeypatch.setattr(wna16, "BLOCKS_BY_M", table)
    wide = Blocks("gemv_bf16x2", 1, 512, 64, -1, 4, 1)
    swap_deep = Blocks("swap_x", 16, 128, 128, 8, 4, 3)
    r = ranking(**{"1": [(wide, 0.95), (GEMV, 1.0)], "16": [(swap_deep, 0.99), (SWAP, 1.0)],
                   "64": [(WHOLE, 0.5), (table[3][1], 1.0)]})
    r["device"] = "made up"
    assert kernel_wna16.device_tiles(r) == {(1, "gemv_bf16x2"): wide}
    assert "M=64: dequantize" in capsys.readouterr().out
    monkeypatch.setattr(wna16, "DEVICE_TILES", {"made up": kernel_wna16.device_tiles(r)})
    assert wna16.choose_blocks(1, device="made up") == wide and wna16.choose_blocks(1) == GEMV
    source = kernel_wna16.device_tiles_source(wna16.DEVICE_TILES)
    assert eval(source, {"Blocks": Blocks}) == wna16.DEVICE_TILES
    # a later sweep of 16 rows only keeps the device's one-row tiles; one where the table's one-row tiles win
    # again drops them
    later = ranking(**{"16": [(swap_deep, 0.9), (SWAP, 1.0)]})
    later["device"] = "made up"
    assert kernel_wna16.device_tiles(later) == {(1, "gemv_bf16x2"): wide, (16, "swap_x"): swap_deep}
    again = ranking(**{"1": [(GEMV, 1.0), (wide, 1.01)]})
    again["device"] = "made up"
    assert kernel_wna16.device_tiles(again) == {}


def test_the_current_runs_section_says_whether_its_table_is_the_codes(monkeypatch, tmp_path):
    """The kernel section opens with the newest run of the table (kernel_wna16_current.json): it says it is the
    code's table only while the run recorded that table, and sums a layer's four calls per M from the run's rows."""
    device = "NVIDIA H100 80GB HBM3"
    rows = [{"shape": shape, "m": m, "bf16_s": 4e-5, "w4a16_s": 2e-5, "w4a16_gbs": 1500.0, "bf16_gbs": 2500.0,
             "w8a16_gbs": 2000.0} for shape in kernel_wna16.SWEEP_SHAPES for m in (1, 16)]
    monkeypatch.setattr(kernel_wna16, "RESULTS", tmp_path)
    for table, claim in ((kernel_wna16._table_text(wna16.table_for(device)), "as the code has it now"),
                         ("M <= 16: an older table", "as it stood then")):
        run = {"device": device, "copy_bandwidth": 3e12, "group_size": 128, "table": table, "rows": rows}
        (tmp_path / kernel_wna16.CURRENT_RUN).write_text(json.dumps(run))
        text = "\n".join(kernel_wna16._current_text())
        assert claim in text and f"Its table: {table}." in text
        assert "| 16 | 160.0 | 80.0 | 2.00x |" in text  # four calls of 40 and 20 µs
        assert "| q/o_proj 4096x4096 | 1 | 40.0 | 20.0 | 1500 | 50% |" in text


def test_a_classs_pdl_setting_stays_with_whatever_stream_tile_wins_it(monkeypatch):
    """Blocks.pdl is the class's, measured in the engine: a stream-K tile that wins the 16-row class in a sweep
    (adopt, adopt --device) takes the class's PDL on, one winning the 64-row class keeps it off, and a tile
    that does not stream is left as it is."""
    stream16 = Blocks("swap_bf16x2", 16, 128, 128, 8, 4, 3, tma=True, stream=3, pdl=True)
    stream64 = Blocks("swap_bf16x2", 64, 128, 128, 0, 8, 3, tma=True, stream=2)
    current = [(1, GEMV), (1, FLOAT_GEMV), (16, stream16), (64, stream64), (None, WHOLE)]
    winner16 = Blocks("swap_bf16x2", 16, 64, 128, 8, 4, 3, tma=True, stream=4)
    winner64 = replace(stream64, stream=1, pdl=True)  # a run that had timed it under PDL: the class says off
    r = ranking(**{"1": [(GEMV, 1.0)], "16": [(winner16, 0.5), (stream16, 1.0)],
                   "64": [(winner64, 0.5), (stream64, 1.0)], "256": [(WHOLE, 1.0)]})
    table, _ = kernel_wna16.adopted_table(r, current=current)
    assert (16, replace(winner16, pdl=True)) in table and (64, replace(winner64, pdl=False)) in table
    unstreamed = Blocks("swap_bf16x2", 16, 128, 128, 8, 4, 3, tma=True)
    table, _ = kernel_wna16.adopted_table(ranking(**{"16": [(unstreamed, 0.5), (stream16, 1.0)]}), current=current)
    assert (16, unstreamed) in table and not unstreamed.pdl
    monkeypatch.setattr(wna16, "BLOCKS_BY_M", current)
    r["device"] = "made up"
    assert kernel_wna16.device_tiles(r)[(16, "swap_bf16x2")] == replace(winner16, pdl=True)


def test_the_sweep_times_a_classs_stream_tiles_with_its_pdl_setting():
    """Every stream-K candidate of a class carries the table's PDL setting for that class, the other tiles none;
    the table has the classes both ways (16 rows on, 64 off, as measured), so both are checked."""
    assert {wna16.choose_blocks(m).pdl for m in (16, 64)} == {True, False}
    for m in (16, 64):
        on = wna16.choose_blocks(m).pdl
        tiles = kernel_wna16.candidates(m)
        assert any(b.stream for b in tiles) and all(b.pdl == on for b in tiles if b.stream)
        assert not any(b.pdl for b in tiles if not b.stream)


def test_the_gemv_on_tensor_cores_may_be_a_gpus_own_tiles_for_the_bf16_classes(monkeypatch):
    """adopt --device: gemv_mma (kernels.wna16_mma), ahead of the one-row class's bf16x2 GEMV by the margin, becomes
    the device's tile for that class (under the class's kind, which table_for looks up); at 16 rows, behind the
    swap tile, it does not; calls it declines go to the shared table's entry (wna16.matmul)."""
    swap16 = Blocks("swap_bf16x2", 16, 128, 128, 8, 4, 3, tma=True, stream=3, pdl=True)
    table = [(1, GEMV), (1, FLOAT_GEMV), (16, swap16), (None, WHOLE)]
    monkeypatch.setattr(wna16, "BLOCKS_BY_M", table)
    mma = Blocks("gemv_mma", 16, 512, 256, -1, 4, 1)
    r = ranking(**{"1": [(mma, 0.90), (GEMV, 1.0)], "16": [(swap16, 1.0), (mma, 1.3)]})
    r["device"] = "made up"
    assert kernel_wna16.device_tiles(r) == {(1, "gemv_bf16x2"): mma}
    monkeypatch.setattr(wna16, "DEVICE_TILES", {"made up": kernel_wna16.device_tiles(r)})
    assert wna16.choose_blocks(1, device="made up") == mma and wna16.choose_blocks(16, device="made up") == swap16
    assert eval(kernel_wna16.device_tiles_source(wna16.DEVICE_TILES), {"Blocks": Blocks}) == wna16.DEVICE_TILES
    # what takes the calls it declines: never itself, even where a table's own entry for the class is gemv_mma
    monkeypatch.setattr(wna16, "BLOCKS_BY_M", [(1, mma)] + table)
    assert wna16.choose_blocks(1) == mma and wna16.choose_blocks(1, mma=False) == GEMV
    assert wna16.choose_blocks(1, bf16x2=False, mma=False) == FLOAT_GEMV


def test_a_gpu_with_tiles_of_its_own_is_judged_against_them(monkeypatch):
    """A sweep on a GPU that already has its own tiles for a class times those, not BLOCKS_BY_M's (table_for):
    adopt --device weighs the candidates against what was timed. gemv_mma 5% ahead of the device's own GEMV
    replaces it, 1% ahead keeps it, and the shared table's tiles coming out fastest drop the device's entry."""
    swap16 = Blocks("swap_bf16x2", 16, 128, 128, 8, 4, 3, tma=True, stream=3, pdl=True)
    monkeypatch.setattr(wna16, "BLOCKS_BY_M", [(1, GEMV), (1, FLOAT_GEMV), (16, swap16), (None, WHOLE)])
    wide = Blocks("gemv_bf16x2", 1, 512, 128, -1, 4, 1)
    monkeypatch.setattr(wna16, "DEVICE_TILES", {"made up": {(1, "gemv_bf16x2"): wide}})
    mma = Blocks("gemv_mma", 16, 512, 256, -1, 4, 1)
    for gain, expected in ((0.95, mma), (0.99, wide)):
        r = ranking(**{"1": [(mma, gain), (wide, 1.0)]})
        r["device"] = "made up"
        assert kernel_wna16.device_tiles(r) == {(1, "gemv_bf16x2"): expected}
    r = ranking(**{"1": [(GEMV, 0.99), (wide, 1.0), (mma, 1.1)]})
    r["device"] = "made up"
    assert kernel_wna16.device_tiles(r) == {}
