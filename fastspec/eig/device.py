"""What the eigensolver's launch plans need of a GPU (:class:`DeviceSpec`), from torch for the
GPU at hand or from NVIDIA's tuning guides for an arch without one (ahead-of-time compiles, CPU
tests). Its own module so that the launcher (:mod:`.cuda`) and the vendor build (:mod:`.mathdx`)
share it without importing each other."""
from __future__ import annotations

from dataclasses import dataclass

import torch

RESERVED_SMEM = 1024  # shared memory the driver keeps per block on sm_80 and newer


@dataclass(frozen=True)
class DeviceSpec:
    """What the plan needs of a GPU."""

    cc: int               # compute capability, major * 10 + minor
    smem_optin: int       # bytes of shared memory one block may opt in to
    smem_per_sm: int      # bytes of shared memory per SM
    sms: int              # multiprocessors

    @classmethod
    def of_device(cls, index: int) -> DeviceSpec:
        p = torch.cuda.get_device_properties(index)
        return cls(p.major * 10 + p.minor, p.shared_memory_per_block_optin, p.shared_memory_per_multiprocessor,
                   p.multi_processor_count)

    @classmethod
    def for_arch(cls, cc: int) -> DeviceSpec:
        """A GPU of this arch without one at hand (ahead-of-time compiles, CPU tests): its shared
        memory from NVIDIA's tuning guides, the SM count of its largest part."""
        kib = {80: (163, 164, 108), 86: (99, 100, 84), 87: (163, 164, 16), 89: (99, 100, 128),
               90: (227, 228, 132), 100: (227, 228, 148), 103: (227, 228, 148), 110: (227, 228, 20),
               120: (99, 100, 188), 121: (99, 100, 48)}
        if cc not in kib:
            raise ValueError(f"cc: no shared-memory table for sm_{cc}; known: {sorted(kib)}")
        optin, per_sm, sms = kib[cc]
        return cls(cc, optin * 1024, per_sm * 1024, sms)
