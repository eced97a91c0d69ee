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

Usage: ``python benchmarks/sass.py FILE.cubin [REGEX]`` prints, per kernel matching REGEX, its
opcode counts and its innermost loops' instruction counts. From a test:
``sys.path.insert(0, "<repo>/benchmarks"); import sass`` (as ``tests/test_eig_sass.py`` does).
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from dataclasses import dataclass, field

from fastspec.bench.cubin import cuobjdump, disassemble, find_tool, instructions

__all__ = ["Kernel", "Loop", "disassemble", "find_tool", "kernels", "main", "parse_ptxas", "resource_usage"]

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


def resource_usage(cubin: str) -> dict[str, dict[str, int]]:
    """``cuobjdump -res-usage`` of a cubin -> ``{kernel: {registers, stack, shared, local}}``;
    spills show as stack (and local) bytes."""
    text = cuobjdump(cubin, "-res-usage")
    return {m.group(1): dict(zip(("registers", "stack", "shared", "local"), map(int, m.groups()[1:])))
            for m in _RES.finditer(text)}


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
