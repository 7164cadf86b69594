"""The heads' Triton kernels compiled for a GPU without one: ``python -m app.bench.kernels``.

Each kernel of ``heads/kernels/triton_rows_kernels.py`` and
``heads/kernels/triton_mixtape_kernels.py`` is compiled, in the variants the heads launch (bf16
products, float32 statistics; Mixtape's K = 2, 4, 8 with gate noise and label smoothing on),
down to a cubin for ``--arch`` (default 90: Hopper, H100/H200) with Triton's own ``ptxas``, as
the heads launch them (:data:`ALIGNED`: what Triton specializes at such a launch), and the
cubin is read with Triton's ``cuobjdump``: registers per thread, spilled bytes (``ptxas -v``'s
spill stores: a spill is a slow kernel; the stack frame beside them, which also holds local
arrays such as the gate noise's ``cos`` range reduction, never run for its ``[0, 2 pi)``
arguments), shared memory, and from the machine code its 16-byte global loads,
its narrower multi-element ones and its barriers. What this proves on a machine without a
GPU: the kernels compile for the GPU (the interpreter the CPU tests use is more lenient: it
takes a bf16 ``tl.sigmoid``, which ``ptxas`` refuses), how many warps of them fit an SM, and
whether their loads are the wide ones a bandwidth-bound kernel needs (a mask Triton cannot
prove a multiple of 16 makes each bf16 load 2 bytes). Their speed needs a GPU
(``bash .ci/gpu``).

Needs Triton (``requirements-gpu.txt``) and ``TRITON_INTERPRET`` unset (the interpreter
replaces the kernels with Python functions that cannot be compiled).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

# the heads' launch settings: the variants and warps the wrappers use
ROWS_COMMON = {"rows": "i32", "v": "i32", "width": "i32", "stride": "i32"}
MIXTAPE_COMMON = {"s": "i32", "width": "i32", "stride_v": "i32", "stride_p": "i32",
                  "noise_std": "fp32", "row0": "i32"}  # fmt: skip
GEMM_COMMON = {name: "i32" for name in ("rows", "v", "width", "d", "stride_h", "stride_w",
                                         "stride_u", "stride_out", "stride_split", "stride_dw",
                                         "blocks", "steps", "steps_per_split")}  # fmt: skip
# what Triton specializes at a launch by the heads, which pad their products' rows to 64
# columns: pointers 16-byte aligned, these integers multiples of 16 (V itself: any; d of the
# fused products: a multiple of 16 at d = 512, as the GPU benchmark runs them)
ALIGNED = ("width", "stride", "stride_v", "stride_p", "d", "stride_h", "stride_w", "stride_u",
           "stride_out", "stride_split", "stride_dw", "stride_gw")  # fmt: skip


@dataclass
class Usage:
    """One compiled variant's resource use."""

    kernel: str
    variant: str
    registers: int
    spilled_bytes: int  # ptxas's spill stores
    shared_bytes: int
    warps: int
    wide_loads: int  # 16-byte global loads in the code (LDG.E.128)
    narrow_loads: int  # other global loads of more than one element (the rest: scalars)
    barriers: int  # BAR.SYNC in the code
    loop_barriers: int | None  # the most in one loop over a row's columns (None: no loop)
    async_copies: int = 0  # 16-byte copies from global to shared memory (LDGSTS: cp.async)
    tensor_core: int = 0  # Hopper's warpgroup tensor-core products (HGMMA: wgmma)
    stack_bytes: int = 0  # the stack frame: spills and local arrays

    @property
    def warps_per_sm(self) -> int:
        """Warps one SM runs at once by its 64k registers (other limits aside)."""
        blocks = 65536 // max(1, self.registers * 32 * self.warps)
        return blocks * self.warps


def _specs():
    """``(kernel name, function, signature, constexprs, warps, stages or None)`` of every
    variant."""
    import triton.language as tl

    from heads.kernels import triton_mixtape, triton_rows, triton_rows_kernels
    from heads.kernels import triton_mixtape_kernels as mixtape

    ptr = {name: "*fp32" for name in ("lse_ptr", "picked_ptr", "sum_ptr", "scale_ptr",
                                      "onehot_ptr", "uniform_ptr", "bias_ptr",
                                      "outside_ptr")}  # fmt: skip
    rows_args = {"z_ptr": "*bf16", "target_ptr": "*i64", **ptr}
    # (the rows plan's products take the bias as a column: its kernels read none)
    rows_flags = {"HAS_BIAS": False, "HAS_UNIFORM": True, "ACC": tl.float32,
                  "REPS": triton_rows.LAUNCH.reps, "LANES": triton_rows.LAUNCH.lanes}  # fmt: skip
    specs = []
    # the two-pass form (MoS), the fused one (softmax), fused as a block (Mixtape's rare)
    for fuse, outside in ((False, False), (True, False), (True, True)):
        specs.append((
            "rows.statistics", triton_rows_kernels.tile_statistics,
            _ordered(triton_rows_kernels.tile_statistics, {**rows_args, **ROWS_COMMON}),
            {**rows_flags, "HAS_SUM": True, "FUSE": fuse, "HAS_OUTSIDE": outside},
            triton_rows.LAUNCH.warps,
        ))  # fmt: skip
    specs.append(("rows.gradient", triton_rows_kernels.tile_gradient,
                  _ordered(triton_rows_kernels.tile_gradient, {**rows_args, **ROWS_COMMON}),
                  rows_flags, triton_rows.LAUNCH.warps))  # fmt: skip
    mixtape_args = {"values_ptr": "*bf16", "pre_ptr": "*bf16", "target_ptr": "*i64",
                    "seed_ptr": "*i64", **ptr, **MIXTAPE_COMMON}  # fmt: skip
    for k in (2, 4, 8):
        flags = {"K": k, "LEVELS": k.bit_length() - 1, "HAS_BIAS": True, "HAS_NOISE": True,
                 "ACC": tl.float32, "BLOCK": triton_mixtape._block(k)}  # fmt: skip
        for name, extra in (("statistics", {"HAS_SUM": True}), ("gradient", {"HAS_UNIFORM": True})):
            fn = getattr(mixtape, f"frequent_{name}")
            specs.append((f"mixtape.{name} K={k}", fn, _ordered(fn, mixtape_args),
                          {**flags, **extra}, triton_mixtape._WARPS))  # fmt: skip
    return [(*spec, None) for spec in specs] + _gemm_specs()


def _gemm_specs():
    """The fused products' kernels (``heads/kernels/triton_gemm_kernels.py``) as a bf16
    softmax's tile launches them (its bias added in the forward, its bias gradient taken)."""
    import triton.language as tl

    from heads.kernels import triton_gemm_kernels as gemm
    from heads.kernels.triton_gemm import GEMM_LAUNCH as launch
    from heads.kernels.triton_gemm import MERGE_ROWS, MERGE_STEP

    types = {name: "*fp32" for name in ("bias_ptr", "top_ptr", "sum_ptr", "picked_ptr",
                                        "logit_sum_ptr", "lse_ptr", "total_ptr", "scale_ptr",
                                        "onehot_ptr", "uniform_ptr", "out_ptr", "dw_ptr",
                                        "db_ptr")}  # fmt: skip
    types |= {"h_ptr": "*bf16", "w_ptr": "*bf16", "u_ptr": "*bf16", "target_ptr": "*i64"}
    variants = (
        ("gemm.logits_blocks", gemm.logits_blocks,
         {"HAS_BIAS": True, "HAS_SUM": False, "BLOCK_M": launch.block_m,
          "BLOCK_N": launch.block_n, "BLOCK_K": launch.block_k, "GROUP_M": launch.group_m}),
        ("gemm.gradient_hidden", gemm.gradient_hidden,
         {"HAS_UNIFORM": False, "BLOCK_M": launch.hidden_block_m, "BLOCK_N": launch.block_n,
          "BLOCK_K": launch.hidden_step, "BLOCK_D": launch.hidden_block_d}),
        ("gemm.gradient_weight", gemm.gradient_weight,
         {"HAS_UNIFORM": False, "HAS_BIAS": True, "ACCUMULATE": True,
          "BLOCK_N": launch.block_n, "BLOCK_C": launch.weight_block_c,
          "BLOCK_R": launch.block_r, "BLOCK_D": launch.weight_block_d}),
    )  # fmt: skip
    specs = [(name, fn, _ordered(fn, {**types, **GEMM_COMMON}), {**flags, "ACC": tl.float32},
              launch.warps, launch.stages) for name, fn, flags in variants]  # fmt: skip
    merge = gemm.merge_blocks
    flags = {"HAS_SUM": True, "ACC": tl.float32, "BLOCK_M": MERGE_ROWS, "BLOCK_B": MERGE_STEP}
    specs.append(("gemm.merge_blocks", merge, _ordered(merge, {**types, **GEMM_COMMON}), flags,
                  4, None))  # fmt: skip
    return specs + _frequent_specs(types)


def _frequent_specs(types: dict[str, str]):
    """Mixtape's frequent block as fused products (``heads/kernels/triton_mixtape_gemm.py``):
    its forward at K = 2, 4 (FUSED_COMPONENTS) with gate noise and a bias, and the gradient
    products over
    its component and gate planes (its blocks' columns, the gate planes' narrower tiles)."""
    import triton.language as tl

    from heads.kernels import triton_gemm_kernels as gemm
    from heads.kernels import triton_mixtape_gemm as frequent
    from heads.kernels import triton_mixtape_gemm_kernels as kernels

    launch = frequent.FREQUENT_LAUNCH
    args = {**types, **GEMM_COMMON, "g_ptr": "*bf16", "gw_ptr": "*bf16", "gate_ptr": "*bf16",
            "seed_ptr": "*i64", "pick_u_ptr": "*fp32", "pick_g_ptr": "*fp32", "s": "i32",
            "e": "i32", "stride_g": "i32", "stride_gw": "i32", "stride_gp": "i32",
            "noise_std": "fp32", "row0": "i32"}  # fmt: skip
    fn = kernels.frequent_blocks
    specs = [(f"frequent.blocks K={k}", fn, _ordered(fn, args),
              {"K": k, "LEVELS": k.bit_length() - 1, "HAS_BIAS": True, "HAS_NOISE": True,
               "ACC": tl.float32, "BLOCK_M": launch.block_m, "BLOCK_N": launch.block_n,
               "BLOCK_K": launch.block_k, "BLOCK_E": launch.block_e, "GROUP_M": launch.group_m},
              launch.warps, launch.stages) for k in frequent.FUSED_COMPONENTS]  # fmt: skip
    for plane, planes in zip(("values", "gates"), frequent._plane_launches(), strict=True):
        specs.append((f"frequent.{plane} dz W", gemm.gradient_hidden,
                      _ordered(gemm.gradient_hidden, {**types, **GEMM_COMMON}),
                      {"HAS_UNIFORM": False, "ACC": tl.float32, "BLOCK_M": planes.hidden_block_m,
                       "BLOCK_N": planes.block_n, "BLOCK_K": planes.hidden_step,
                       "BLOCK_D": planes.hidden_block_d}, planes.warps, planes.stages))  # fmt: skip
        specs.append((f"frequent.{plane} dz^T h", gemm.gradient_weight,
                      _ordered(gemm.gradient_weight, {**types, **GEMM_COMMON}),
                      {"HAS_UNIFORM": False, "HAS_BIAS": plane == "values", "ACCUMULATE": True,
                       "ACC": tl.float32, "BLOCK_N": planes.block_n,
                       "BLOCK_C": planes.weight_block_c, "BLOCK_R": planes.block_r,
                       "BLOCK_D": planes.weight_block_d}, planes.warps, planes.stages))  # fmt: skip
    return specs


def _ordered(fn, types: dict[str, str]) -> dict[str, str]:
    """The signature in the kernel's own argument order (constexprs filled in later)."""
    return {name: types.get(name, "constexpr") for name in fn.arg_names}


def _dump(cubin: bytes, cuobjdump: Path, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(cuobjdump), flag, f.name], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def _resources(cubin: bytes, cuobjdump: Path) -> tuple[int, int, int]:
    """``(registers, stack and local bytes, shared bytes)`` of the cubin's one function."""
    text = _dump(cubin, cuobjdump, "--dump-resource-usage")
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump gave no resource usage:\n{text}")
    registers, stack, shared, local = map(int, found.groups())
    return registers, stack + local, shared


def spill_stores(ptxas_report: str) -> int:
    """The bytes of spill stores in ``ptxas -v``'s report of one function."""
    found = re.search(r"(\d+) bytes spill stores", ptxas_report)
    if found is None:
        raise RuntimeError(f"ptxas -v gave no spill count:\n{ptxas_report}")
    return int(found.group(1))


def _spills(ptx: str, arch: int) -> int:
    """Spill stores of ``ptx`` assembled by the ``ptxas`` Triton compiles with."""
    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", f"-arch=sm_{arch}{suffix}",
                               str(source), "-o", str(Path(folder) / "kernel.cubin")],
                              capture_output=True, text=True, check=True)  # fmt: skip
    return spill_stores(done.stdout + done.stderr)


# a SASS line: its address, then the instruction (an optional predicate, the opcode, operands)
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def _code(sass: str) -> list[tuple[int, str, str]]:
    """``(address, opcode, operands)`` of each instruction."""
    return [(int(a, 16), op, rest) for a, op, rest in _INSTRUCTION.findall(sass)]


def loop_barriers(sass: str) -> int | None:
    """The most barriers in one loop over a row's columns: a loop (a branch back) with two or
    more global loads holding no other such loop (a row's loop holds its column loops; a
    loop of one load, such as a libdevice table walk, is no column loop); None: no loop."""
    code = _code(sass)
    loops = []
    for address, opcode, operands in code:
        back = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if back and int(back.group(1), 16) < address:
            start = int(back.group(1), 16)
            body = [op for a, op, _ in code if start <= a <= address]
            loads = sum(op.startswith("LDG") for op in body)
            loops.append((start, address, loads, sum(op.startswith("BAR.SYNC") for op in body)))
    columns = [(lo, hi, bars) for lo, hi, loads, bars in loops if loads >= 2]

    def holds_another(lo: int, hi: int) -> bool:
        return any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b, _ in columns)

    inner = [bars for lo, hi, bars in columns if not holds_another(lo, hi)]
    return max(inner) if inner else None


def instruction_counts(sass: str) -> tuple[int, int, int]:
    """``(16-byte loads, other multi-element loads, barriers)`` among the SASS's global
    loads and barriers (the scalar loads of a row's few per-row values are left out)."""
    opcodes = [op for _, op, _ in _code(sass)]
    wide = sum(op.startswith("LDG.E.128") for op in opcodes)
    narrow = sum(op.startswith(("LDG.E.64", "LDG.E.U16", "LDG.E.16")) for op in opcodes)
    barriers = sum(op.startswith("BAR.SYNC") for op in opcodes)
    return wide, narrow, barriers


def pipeline_counts(sass: str) -> tuple[int, int]:
    """``(cp.async copies, wgmma products)`` in the SASS: a product's operands copied into
    shared memory ahead of use (``LDGSTS``) and multiplied by Hopper's warpgroup instruction
    (``HGMMA``; none: the older ``HMMA``, a fraction of the tensor cores' rate)."""
    opcodes = [op for _, op, _ in _code(sass)]
    return sum(op.startswith("LDGSTS") for op in opcodes), sum(
        op.startswith("HGMMA") for op in opcodes
    )


def compile_all(arch: int = 90) -> list[Usage]:
    """Every variant compiled for ``sm_<arch>`` as the heads launch it (:data:`ALIGNED`):
    its resource use and loads."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usages = []
    for name, fn, signature, constexprs, warps, stages in _specs():
        aligned = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]]
                   for arg, kind in signature.items()
                   if kind.startswith("*") or arg in ALIGNED}  # fmt: skip
        signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=aligned)
        options = {"num_warps": warps} | ({} if stages is None else {"num_stages": stages})
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        cubin = compiled.asm["cubin"]
        variant = ", ".join(f"{k}={v}" for k, v in constexprs.items()
                            if k in ("FUSE", "HAS_OUTSIDE", "BLOCK", "REPS", "LANES")
                            or k.startswith("BLOCK_"))  # fmt: skip
        sass = _dump(cubin, cuobjdump, "-sass")
        registers, stack, shared = _resources(cubin, cuobjdump)
        usages.append(Usage(name, variant, registers, _spills(compiled.asm["ptx"], arch), shared,
                            warps, *instruction_counts(sass), loop_barriers(sass),
                            *pipeline_counts(sass), stack_bytes=stack))  # fmt: skip
    return usages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    parser.add_argument("--out", default=None, help="folder for a JSON of the table (none: "
                        "printed only; docs/results.md renders it)")  # fmt: skip
    parser.add_argument("--name", default="kernels_sm90", help="the JSON's file stem")
    args = parser.parse_args(argv)
    try:
        import triton  # noqa: F401 - only whether it is there
    except ImportError:
        parser.exit(
            2,
            "error: app.bench.kernels compiles the Triton kernels: it needs Triton "
            "(pip install triton; CUDA builds of torch bring it)\n",
        )
    usages = compile_all(args.arch)
    print(f"{'kernel':24} {'variant':46} {'regs':>5} {'spilled B':>9} {'shared B':>8} "
          f"{'warps':>5} {'warps/SM':>8} {'16B loads':>9} {'narrow':>6} "
          f"{'barriers':>8} {'in a loop':>9} {'cp.async':>8} {'wgmma':>5}")  # fmt: skip
    for u in usages:
        in_loop = "-" if u.loop_barriers is None else str(u.loop_barriers)
        variant = u.variant.replace(" ", "")
        print(f"{u.kernel:24} {variant:46} {u.registers:5d} {u.spilled_bytes:9d} "
              f"{u.shared_bytes:8d} {u.warps:5d} {u.warps_per_sm:8d} {u.wide_loads:9d} "
              f"{u.narrow_loads:6d} {u.barriers:8d} {in_loop:>9} {u.async_copies:8d} "
              f"{u.tensor_core:5d}")  # fmt: skip
    if args.out is not None:
        import json

        import triton

        out = Path(args.out) / f"{args.name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        results = [{**asdict(u), "warps_per_sm": u.warps_per_sm} for u in usages]
        report = {"schema": "kernels/1", "args": vars(args), "triton": triton.__version__,
                  "results": results}  # fmt: skip
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")
    spilled = [u.kernel for u in usages if u.spilled_bytes]
    if spilled:
        print(f"spills to local memory: {', '.join(spilled)}", file=sys.stderr)
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
