"""Launcher of the TorchTitan tests: TorchTitan's ``torchtitan.train.main`` on CPU, then each
rank's fastspec records into ``{dump_folder}/records-rank{r}.json``.

    python -m torch.distributed.run --nproc_per_node 2 tests/_torchtitan_train.py \\
        --module tests._torchtitan_configs --config tiny --dump_folder OUT \\
        --parallelism.data_parallel_shard_degree 2

The process-level CPU workarounds of the tests live here (the config-level ones in
``tests/_torchtitan_configs.py``), never in ``fastspec.integrations.torchtitan``:

* TorchTitan has no CPU device: without an accelerator its device type falls back to ``"cuda"``.
  Torch's device-type probe answers ``"cpu"`` here, before TorchTitan reads it at import, and
  the device module it gets for ``"cpu"`` is ``torch.cpu`` with the memory-statistics calls of
  TorchTitan's memory monitor answered by stubs (no device memory to report);
* ``torch.distributed.set_timeout`` (called after the first step) is missing in torch 2.13:
  a no-op stands in (gloo's timeouts stay as initialised).
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
import torch._utils
import torch.distributed

ROOT = Path(__file__).resolve().parents[1]


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the CUDA memory-statistics API TorchTitan's memory monitor calls."""
    shim = types.ModuleType("torch_cpu_for_torchtitan")
    shim.__dict__.update({k: v for k, v in vars(torch.cpu).items() if not k.startswith("__")})
    shim.get_device_name = lambda device=None: "cpu"
    shim.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=1 << 40, name="cpu")
    shim.memory_stats = lambda device=None: {}
    shim.reset_peak_memory_stats = lambda device=None: None
    shim.empty_cache = lambda: None
    shim.current_device = lambda: 0  # an index, as barrier(device_ids=[...]) takes
    return shim


def apply_cpu_workarounds() -> None:
    if not torch.cuda.is_available():
        shim, get_module = _cpu_device_module(), torch._utils._get_device_module
        torch._utils._get_available_device_type = lambda: "cpu"
        torch._utils._get_device_module = lambda device_type="cuda": shim if device_type == "cpu" else get_module(device_type)
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = lambda timeout, group=None: None


def main(argv: list[str] | None = None) -> None:
    apply_cpu_workarounds()
    if str(ROOT) not in sys.path:  # --module tests._torchtitan_configs from the repository root
        sys.path.insert(0, str(ROOT))
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    init_logger()
    config = ConfigManager().parse_args(argv)
    trainer = config.build()
    try:
        if config.checkpoint.create_seed_checkpoint:  # as torchtitan.train.main: the initial weights only
            trainer.checkpointer.save(curr_step=0, last_step=True)
            return
        trainer.train()
        probe = getattr(trainer, "fastspec_probe", None)
        if probe is not None:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            out = Path(config.dump_folder)
            out.mkdir(parents=True, exist_ok=True)
            logged = [r.as_dict() for r in trainer.fastspec_records]
            (out / f"records-rank{rank}.json").write_text(json.dumps(
                {"logged": logged, "history": [r.as_dict() for r in probe.records()]}))
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
