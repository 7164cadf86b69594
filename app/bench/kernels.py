"""The heads' Triton kernels compiled for a GPU without one: ``python -m app.bench.kernels``.

Each kernel of ``heads/kernels/triton_rows_kernels.py`` and
``heads/kernels/triton_mixtape_kernels.py`` is compiled, in the variants the heads launch (bf16
products, float32 statistics; Mixtape's K = 2, 4, 8 with gate noise and label smoothing on),
down to a cubin for ``--arch`` (default 90: Hopper, H100/H200) with Triton's own ``ptxas``, and
the cubin's resource use is read with Triton's ``cuobjdump``: registers per thread, spilled
bytes (local memory: a spill is a slow kernel) and shared memory. What this proves on a
machine without a GPU: the kernels compile for the GPU (the interpreter the CPU tests use is
more lenient: it takes a bf16 ``tl.sigmoid``, which ``ptxas`` refuses), and how many warps of
them fit an SM. Their speed needs a GPU (``bash .ci/gpu``).

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
from dataclasses import dataclass
from pathlib import Path

# the heads' launch settings: the variants and warps the wrappers use
ROWS_COMMON = {"v": "i32", "stride": "i32"}
MIXTAPE_COMMON = {"s": "i32", "stride_v": "i32", "stride_p": "i32", "noise_std": "fp32",
                  "row0": "i32"}  # fmt: skip


@dataclass
class Usage:
    """One compiled variant's resource use."""

    kernel: str
    variant: str
    registers: int
    spilled_bytes: int
    shared_bytes: int
    warps: int

    @property
    def warps_per_sm(self) -> int:
        """Warps one SM runs at once by its 64k registers (other limits aside)."""
        blocks = 65536 // max(1, self.registers * 32 * self.warps)
        return blocks * self.warps


def _specs():
    """``(kernel name, function, signature, constexprs, warps)`` of every variant."""
    import triton.language as tl

    from heads.kernels import triton_mixtape, triton_rows, triton_rows_kernels
    from heads.kernels import triton_mixtape_kernels as mixtape

    ptr = {name: "*fp32" for name in ("lse_ptr", "picked_ptr", "sum_ptr", "scale_ptr",
                                      "onehot_ptr", "uniform_ptr", "bias_ptr")}  # fmt: skip
    rows_args = {"z_ptr": "*bf16", "target_ptr": "*i64", **ptr}
    rows_flags = {"HAS_BIAS": True, "HAS_UNIFORM": True, "ACC": tl.float32,
                  "BLOCK": triton_rows._BLOCK}  # fmt: skip
    specs = []
    for fuse in (False, True):
        specs.append((
            "rows.statistics", triton_rows_kernels.statistics,
            _ordered(triton_rows_kernels.statistics, {**rows_args, **ROWS_COMMON}),
            {**rows_flags, "HAS_SUM": True, "FUSE": fuse}, triton_rows._WARPS,
        ))  # fmt: skip
    specs.append(("rows.gradient", triton_rows_kernels.gradient,
                  _ordered(triton_rows_kernels.gradient, {**rows_args, **ROWS_COMMON}),
                  rows_flags, triton_rows._WARPS))  # fmt: skip
    mixtape_args = {"values_ptr": "*bf16", "pre_ptr": "*bf16", "target_ptr": "*i64",
                    "seed_ptr": "*i64", **ptr, **MIXTAPE_COMMON}  # fmt: skip
    for k in (2, 4, 8):
        flags = {"K": k, "LEVELS": k.bit_length() - 1, "HAS_BIAS": True, "HAS_NOISE": True,
                 "ACC": tl.float32, "BLOCK": triton_mixtape._block(k)}  # fmt: skip
        for name, extra in (("statistics", {"HAS_SUM": True}), ("gradient", {"HAS_UNIFORM": True})):
            fn = getattr(mixtape, name)
            specs.append((f"mixtape.{name} K={k}", fn, _ordered(fn, mixtape_args),
                          {**flags, **extra}, triton_mixtape._WARPS))  # fmt: skip
    return specs


def _ordered(fn, types: dict[str, str]) -> dict[str, str]:
    """The signature in the kernel's own argument order (constexprs filled in later)."""
    return {name: types.get(name, "constexpr") for name in fn.arg_names}


def _resources(cubin: bytes, cuobjdump: Path) -> tuple[int, int, int]:
    """``(registers, spilled bytes, shared bytes)`` of the cubin's one function."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", text)
    if found is None:
        raise RuntimeError(f"cuobjdump gave no resource usage:\n{text}")
    registers, stack, shared, local = map(int, found.groups())
    return registers, stack + local, shared


def compile_all(arch: int = 90) -> list[Usage]:
    """Every variant compiled for ``sm_<arch>``: its resource use."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usages = []
    for name, fn, signature, constexprs, warps in _specs():
        signature = {**signature, **dict.fromkeys(constexprs, "constexpr")}
        source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": warps})  # fmt: skip
        variant = ", ".join(f"{k}={v}" for k, v in constexprs.items() if k in ("FUSE", "BLOCK"))
        usages.append(Usage(name, variant, *_resources(compiled.asm["cubin"], cuobjdump), warps))
    return usages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    args = parser.parse_args(argv)
    usages = compile_all(args.arch)
    print(f"{'kernel':24} {'variant':22} {'regs':>5} {'spilled B':>9} {'shared B':>8} "
          f"{'warps':>5} {'warps/SM':>8}")  # fmt: skip
    for u in usages:
        print(f"{u.kernel:24} {u.variant:22} {u.registers:5d} {u.spilled_bytes:9d} "
              f"{u.shared_bytes:8d} {u.warps:5d} {u.warps_per_sm:8d}")  # fmt: skip
    spilled = [u.kernel for u in usages if u.spilled_bytes]
    if spilled:
        print(f"spills to local memory: {', '.join(spilled)}", file=sys.stderr)
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
