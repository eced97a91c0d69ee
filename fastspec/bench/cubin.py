"""Read a compiled GPU kernel (cubin) without a GPU: find the CUDA binary tools, list the SASS.

What ``fastspec bench`` needs of a cubin: whether two builds of the CUDA eigensolver are the same
code (the ``compile-*`` cases of :mod:`fastspec.bench.suites.eigvalsh`: NVRTC 13's float64
output differs from run to run in the operand order of commutative DFMAs, so equal code need not
be equal bytes). The developer tools that read more out of a listing (loops, registers, spills)
build on this module: ``benchmarks/sass.py``.

Tools are looked up in ``$CUDA_HOME/bin`` and on ``PATH`` first, then in the Triton wheel
(``triton/backends/nvidia/bin`` ships ``ptxas``, ``cuobjdump`` and ``nvdisasm``).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter

__all__ = ["cuobjdump", "disassemble", "find_tool", "instructions", "same_code", "triton_tool"]


def find_tool(name: str) -> str | None:
    """Path of a CUDA binary tool (``nvcc``, ``cuobjdump``, ``nvdisasm``, ``ptxas``), or None:
    ``$CUDA_HOME/bin``, ``$CUDA_PATH/bin``, ``PATH``, then the Triton wheel."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and os.access(os.path.join(home, "bin", name), os.X_OK):
            return os.path.join(home, "bin", name)
    return shutil.which(name) or triton_tool(name)  # Triton is slow to import: only when PATH has none


def triton_tool(name: str) -> str | None:
    """Path of a CUDA binary tool the Triton wheel ships (``triton/backends/nvidia/bin``), or None.
    Its ``cuobjdump`` is the one released with the ``ptxas`` that built Triton's cubins; a
    toolkit's on PATH may be older or newer."""
    try:
        import triton  # optional
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.access(path, os.X_OK) else None


def cuobjdump(cubin: str, flag: str, tool: str | None = None) -> str:
    """``cuobjdump FLAG CUBIN``'s output (a cubin, or an object/executable holding one), with
    ``tool`` (a cuobjdump's path) or else :func:`find_tool`'s."""
    tool = tool or find_tool("cuobjdump")
    if tool is None:
        raise FileNotFoundError("cuobjdump: not on PATH and not in the Triton wheel")
    return subprocess.run([tool, flag, cubin], capture_output=True, text=True, check=True).stdout


def disassemble(cubin: str) -> str:
    """``cuobjdump -sass`` of a cubin (or of an object/executable holding one)."""
    return cuobjdump(cubin, "-sass")


_FUNC = re.compile(r"^\s*Function : (\S+)")
# "        /*0150*/                   @!P0 LDS.128 R4, [R2+0x10] ;"
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")


def instructions(sass: str) -> dict[str, list[tuple[int, str, str]]]:
    """A ``cuobjdump -sass`` listing as ``{kernel: [(address, opcode, operands)]}`` in listing
    order; the opcode keeps its modifiers (``LDS.128``), a predicate (``@!P0``) is dropped."""
    out: dict[str, list[tuple[int, str, str]]] = {}
    insns = None
    for line in sass.splitlines():
        m = _FUNC.match(line)
        if m:
            insns = out.setdefault(m.group(1), [])
            continue
        m = _INSN.match(line)
        if m and insns is not None:
            insns.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def same_code(a: bytes, b: bytes) -> bool:
    """Byte-identical images, or two cubins whose kernels have the same SASS opcodes (with their
    modifiers) the same number of times; False when they differ and cuobjdump is not at hand."""
    if a == b:
        return True
    if find_tool("cuobjdump") is None or a[:4] != b"\x7fELF" or b[:4] != b"\x7fELF":
        return False
    ops = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, image in enumerate((a, b)):
            path = os.path.join(tmp, f"{i}.cubin")
            with open(path, "wb") as f:
                f.write(image)
            ops.append([Counter(op for _, op, _ in insns) for insns in instructions(disassemble(path)).values()])
    return ops[0] == ops[1]
