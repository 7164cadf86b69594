"""``python -m app.bench.kernels``: every Triton kernel of the heads compiles for Hopper
(sm_90) on this CPU, through Triton's own ptxas, with nothing spilled to local memory, and
the rows kernels read their logits in 16-byte loads. Needs Triton (an optional GPU extra):
skipped, with the reason, where it is not installed."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.bench.kernels import (
    Usage,
    instruction_counts,
    loop_barriers,
    main,
    pipeline_counts,
    spill_stores,
)

REPO = Path(__file__).resolve().parents[3]


def test_warps_per_sm_follow_the_registers():
    assert Usage("k", "", 64, 0, 0, 8, 0, 0, 0, None).warps_per_sm == 32  # 4 blocks of 8 warps
    assert Usage("k", "", 121, 0, 0, 8, 0, 0, 0, None).warps_per_sm == 16
    # one block is over 64k registers
    assert Usage("k", "", 255, 0, 0, 16, 0, 0, 0, None).warps_per_sm == 0


def test_spills_are_ptxas_spill_stores_not_the_stack_frame():
    """A stack frame may hold local arrays that are no spill (the gate noise's ``cos``
    range reduction): the spill is what ``ptxas -v`` counts as spill stores."""
    report = ("ptxas info    : Compiling entry function 'frequent_blocks' for 'sm_90a'\n"
              "ptxas info    : Function properties for frequent_blocks\n"
              "    32 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n")  # fmt: skip
    assert spill_stores(report) == 0
    assert spill_stores(report.replace("0 bytes spill stores", "16 bytes spill stores")) == 16
    with pytest.raises(RuntimeError, match="no spill count"):
        spill_stores("ptxas info    : Used 76 registers")


def test_pipeline_counts_read_async_copies_and_wgmma_off_the_sass():
    sass = _sass("LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]",
                 "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24",
                 "HMMA.16816.F32.BF16 R4, R8, R12, R4",
                 "LDG.E.128 R4, desc[UR4][R6.64]")  # fmt: skip
    assert pipeline_counts(sass) == (1, 1)


def test_instruction_counts_read_loads_and_barriers_off_the_sass():
    sass = """
        /*0090*/                   LDG.E.64 R2, desc[UR4][R2.64] ;
        /*00a0*/              @!P0 LDG.E.128 R4, desc[UR4][R6.64] ;
        /*00b0*/                   LDG.E.U16 R8, desc[UR4][R10.64] ;
        /*00c0*/                   LDG.E R9, desc[UR4][R12.64] ;
        /*00d0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00e0*/                   STG.E.128 desc[UR4][R6.64], R4 ;
    """
    assert instruction_counts(sass) == (1, 2, 1)


def _sass(*lines: str) -> str:
    return "\n".join(f"        /*{16 * i:04x}*/                   {line} ;"
                     for i, line in enumerate(lines))  # fmt: skip


def test_loop_barriers_are_counted_in_the_loops_over_columns():
    """A row's loop (two barriers) holding a column loop (two loads, none): 0; a column loop
    with a barrier: 1; a loop of one load (a table walk) is no column loop; no loop: None."""
    row_loop = _sass("LDG.E.64 R2, desc[UR4][R2.64]", "LDG.E.128 R4, desc[UR4][R6.64]",
                     "@!P0 LDG.E.128 R8, desc[UR4][R6.64]", "FADD R1, R1, R4",
                     "@P1 BRA 0x10", "BAR.SYNC.DEFER_BLOCKING 0x0",
                     "BAR.SYNC.DEFER_BLOCKING 0x0", "@P2 BRA 0x0")  # fmt: skip
    assert loop_barriers(row_loop) == 0
    synced = _sass("LDG.E.128 R4, desc[UR4][R6.64]", "BAR.SYNC.DEFER_BLOCKING 0x0",
                   "LDG.E.128 R8, desc[UR4][R6.64]", "@P1 BRA 0x0")  # fmt: skip
    assert loop_barriers(synced) == 1
    walk = _sass("LDG.E.CONSTANT R2, desc[UR4][R2.64]", "BAR.SYNC.DEFER_BLOCKING 0x0",
                 "@P1 BRA 0x0")  # fmt: skip
    assert loop_barriers(walk) is None
    assert loop_barriers(_sass("LDG.E.128 R4, desc[UR4][R6.64]", "EXIT")) is None


def test_the_committed_report_renders_in_the_results_document(tmp_path):
    import shutil

    from app.results import render

    folder = tmp_path / "results"  # the report alone: every file is rendered in test_results
    folder.mkdir()
    shutil.copy(REPO / "docs" / "results" / "kernels_sm90.json", folder)
    text = render(folder, tmp_path)
    assert "The heads' Triton kernels compiled for sm_90" in text
    assert "| rows.statistics | REPS=4, LANES=2048, FUSE=True, HAS_OUTSIDE=False | 128 |" in text


@pytest.mark.slow
def test_every_kernel_compiles_for_hopper_without_spills():
    pytest.importorskip("triton", reason="Triton is an optional GPU extra (requirements-gpu.txt)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    run = subprocess.run([sys.executable, "-m", "app.bench.kernels"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    for kernel in ("rows.statistics", "rows.gradient", "mixtape.statistics K=4",
                   "mixtape.gradient K=8"):  # fmt: skip
        assert kernel in run.stdout
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith("rows.")]
    assert len(rows) == 4  # statistics: two-pass, fused, fused as a block; gradient
    for *_, wide, _, _, in_loop, _, _ in rows:  # REPS = 4 16-byte loads a block at least
        assert int(wide) >= 4 and in_loop in ("0", "-"), run.stdout  # no barrier in a loop
    # the fused products: operands copied ahead into shared memory, multiplied by wgmma
    products = [line.split() for line in run.stdout.splitlines()
                if line.startswith(("gemm.logits", "gemm.gradient"))]  # fmt: skip
    assert len(products) == 3
    for *_, copies, wgmma in products:
        assert int(copies) > 0 and int(wgmma) > 0, run.stdout


@pytest.mark.slow
def test_every_fused_products_setting_the_sweep_times_compiles_without_spills():
    """What ``python -m app.bench.sweep`` times must be what compiles well: each of its
    fused-products settings (and Mixtape's frequent block's), as the heads launch them,
    spills nothing and multiplies by wgmma."""
    pytest.importorskip("triton", reason="Triton is an optional GPU extra (requirements-gpu.txt)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    script = (
        "import heads.kernels.triton_gemm as g\n"
        "import heads.kernels.triton_mixtape_gemm as f\n"
        "from app.bench import kernels, sweep\n"
        "kernels._specs = kernels._gemm_specs\n"
        "settings = [(s, f.FrequentLaunch()) for s in sweep.FUSED_SETTINGS]\n"
        "settings += [(g.GemmLaunch(), s) for s in sweep.FREQUENT_SETTINGS[1:]]\n"
        "print('specs', len(kernels._gemm_specs()) * len(settings))\n"
        "for g.GEMM_LAUNCH, f.FREQUENT_LAUNCH in settings:\n"
        "    for u in kernels.compile_all():\n"
        "        print(u.kernel.replace(' ', '_'), u.spilled_bytes, u.tensor_core)\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=900)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    (count,), *lines = [line.split()[1:] if line.startswith("specs") else line.split()
                        for line in run.stdout.splitlines()]  # fmt: skip
    assert len(lines) == int(count) > 0
    for kernel, spilled, wgmma in lines:
        assert spilled == "0", (kernel, run.stdout)
        assert kernel == "gemm.merge_blocks" or int(wgmma) > 0, (kernel, run.stdout)


def test_without_triton_it_stops_with_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    with pytest.raises(SystemExit) as stop:
        main([])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install triton" in err
