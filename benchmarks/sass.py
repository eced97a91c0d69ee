"""Static evidence about compiled GPU kernels, without a GPU: ptxas resource lines and SASS loops.

A developer tool, not part of the installed package: the tests and the maintainers use it
(``tests/test_eig_sass.py``, ``tests/test_covariance_triton.py``). What a kernel will cost can
be read, in part, before it ever runs: how many registers it uses and whether it spills
(``ptxas -v``, or ``cuobjdump -res-usage`` of the cubin), which memory instructions the compiler
chose (``LDS``/``STS`` for shared memory vs generic ``LD``/``ST``), and how many instructions
each loop iteration issues (``cuobjdump -sass``). The kernel headers' cost models
(``csrc/eig_kernel.cu``, ``fastspec/covariance/triton_kernels.py``) are built from
these counts, and the tests keep them honest.

Finding the CUDA tools and listing a cubin's instructions is :mod:`fastspec.bench.cubin` (the
benchmarks need it too); this module adds the loops, the opcode counts and the resource lines.

The Triton kernels are compiled for sm_90 here too (:func:`compile_sm90`, as a launch specializes
them) and read back (:func:`triton_cubin`), by the compile scripts of the Triton kernels' tests.

Usage: ``python benchmarks/sass.py FILE.cubin [REGEX]`` prints, per kernel matching REGEX, its
opcode counts and its innermost loops' instruction counts. From a test:
``sys.path.insert(0, "<repo>/benchmarks"); import sass`` (as ``tests/test_eig_sass.py`` does).
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field

from fastspec.bench.cubin import (
    cuobjdump,
    disassemble,
    find_tool,
    instructions,
    triton_tool,
)

__all__ = ["Kernel", "Loop", "compile_sm90", "disassemble", "find_tool", "kernels", "main", "parse_ptxas",
           "resource_usage", "triton_cubin", "triton_tool"]

_PTXAS_FN = re.compile(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?")
_PTXAS_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """``-Xptxas -v`` output -> ``{mangled kernel name: {registers, spill_stores, spill_loads, stack}}``."""
    out: dict[str, dict[str, int]] = {}
    name = None
    for line in log.splitlines():
        m = _PTXAS_FN.search(line)
        if m:
            name = m.group(1)
            out.setdefault(name, {"registers": 0, "spill_stores": 0, "spill_loads": 0, "stack": 0})
            continue
        if name is None:
            continue
        m = _PTXAS_SPILL.search(line)
        if m:
            out[name].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        m = _PTXAS_REGS.search(line)
        if m:
            out[name]["registers"] = int(m.group(1))
    return out


_RES = re.compile(r"Function ([\w$.]+):\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _resources(text: str) -> dict[str, dict[str, int]]:
    return {m.group(1): dict(zip(("registers", "stack", "shared", "local"), map(int, m.groups()[1:])))
            for m in _RES.finditer(text)}


def resource_usage(cubin: str) -> dict[str, dict[str, int]]:
    """``cuobjdump -res-usage`` of a cubin -> ``{kernel: {registers, stack, shared, local}}``;
    spills show as stack (and local) bytes."""
    return _resources(cuobjdump(cubin, "-res-usage"))


@dataclass
class Loop:
    """Instructions from a backward branch's target to the branch itself (one iteration's code)."""

    start: int
    end: int
    ops: Counter = field(default_factory=Counter)  # base opcode (before the first '.') -> count
    full_ops: Counter = field(default_factory=Counter)  # opcode with modifiers -> count

    @property
    def size(self) -> int:
        return sum(self.ops.values())


@dataclass
class Kernel:
    name: str
    ops: Counter  # base opcode -> count over the whole kernel
    full_ops: Counter  # opcode with modifiers (e.g. LDS.128, LD.E) -> count
    loops: list[Loop]  # every loop, by start address (outer before inner at the same start)

    def innermost(self) -> list[Loop]:
        """Loops that contain no other loop."""
        return [lp for lp in self.loops
                if not any(o is not lp and lp.start <= o.start and o.end <= lp.end for o in self.loops)]


def kernels(sass: str) -> list[Kernel]:
    """Split a ``cuobjdump -sass`` listing into kernels with opcode counts and loops."""
    out: list[Kernel] = []
    for name, insns in instructions(sass).items():
        loops = []
        for a, op, args in insns:
            if op.split(".")[0] != "BRA":
                continue
            m = re.search(r"0x([0-9a-f]+)", args)
            if m is None:
                continue
            target = int(m.group(1), 16)
            if target <= a:
                body = [o for (x, o, _) in insns if target <= x <= a]
                loops.append(Loop(target, a, Counter(o.split(".")[0] for o in body), Counter(body)))
        loops.sort(key=lambda lp: (lp.start, -lp.end))
        out.append(Kernel(name, Counter(op.split(".")[0] for _, op, _ in insns),
                          Counter(op for _, op, _ in insns), loops))
    return out


# ------------------------------------------------------------- Triton kernels, for sm_90, without a GPU
def compile_sm90(fn, types: dict[str, str], consts: dict, num_warps: int, num_stages: int = 3, *,
                 ones=(), div16=(), stride_type: str = "i64"):
    """Compile the ``@triton.jit`` kernel ``fn`` for sm_90 with the wheel's ptxas, no GPU needed,
    as a launch would specialize it: constexpr parameters not in ``consts`` take their defaults;
    the arguments named in ``ones`` become the constant 1 (unit strides), those in ``div16`` are
    marked multiples of 16 (pointers, sizes, strides). Runtime arguments are typed by ``types``,
    else ``stride_type`` for a ``stride*`` argument, else ``i32``. Returns Triton's compiled
    kernel (``.asm["cubin"]``, ``.asm["ptx"]``, ``.metadata``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts,
              **{k: 1 for k in ones if k in fn.arg_names}}
    sig = {a: "constexpr" if a in consts else types.get(a, stride_type if a.startswith("stride") else "i32")
           for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]]
             for a in div16 if a in fn.arg_names and a not in consts}
    src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                    constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def triton_cubin(cubin: bytes) -> tuple[dict[str, int], Kernel]:
    """A one-kernel cubin in memory (``compile_sm90(...).asm["cubin"]``), read by the wheel's
    ``cuobjdump``: its ``{registers, stack, shared, local}`` and its :class:`Kernel`."""
    tool = triton_tool("cuobjdump")
    if tool is None:
        raise FileNotFoundError("cuobjdump: the Triton wheel ships none")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        res, sass = [cuobjdump(path, flag, tool) for flag in ("-res-usage", "-sass")]
    (usage,) = _resources(res).values()
    (kernel,) = kernels(sass)
    return usage, kernel


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python benchmarks/sass.py FILE.cubin [REGEX]", file=sys.stderr)
        return 2
    pattern = re.compile(argv[1] if len(argv) > 1 else ".")
    for k in kernels(disassemble(argv[0])):
        if not pattern.search(k.name):
            continue
        print(f"{k.name}: {sum(k.ops.values())} instructions")
        print("  " + ", ".join(f"{op} {n}" for op, n in k.ops.most_common(16)))
        for lp in k.innermost():
            top = ", ".join(f"{op} {n}" for op, n in lp.ops.most_common(10))
            print(f"  loop {lp.start:#06x}-{lp.end:#06x}: {lp.size} instructions ({top})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
