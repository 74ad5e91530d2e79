"""Worker for tests/test_dcp.py: 2 processes on gloo shard a tiny model with FSDP2 (``fully_shard``,
``reshard_after_forward=True``), take one Adam step and save model and optimizer with
:func:`lightning_fleet.runtime.torch.dcp.save_state` into ``--dir``; then load that save back into a fresh sharded model
and optimizer with :func:`~lightning_fleet.runtime.torch.dcp.load_state` (the collective path).

Rank 0 writes ``--out`` (torch.save of plain tensors): the full weights gathered before the save (``saved``), the full
optimizer state before the save (``saved_optimizer``), and the full weights and optimizer state after the load back
(``loaded``, ``loaded_optimizer``). Run by the test with torchrun-like environment variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from lightning_fleet.runtime.torch.dcp import load_state, save_state  # noqa: E402


def tiny(seed: int) -> torch.nn.Module:
    """The test's model: two linear layers whose first dimensions (7, 3) do not divide evenly by 2 ranks."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model sharded with FSDP2 per layer and as a whole, and its Adam optimizer."""
    model = tiny(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def full(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The full (gathered) model and optimizer state dicts, as plain CPU tensors (collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=options)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model, optimizer = sharded(seed=0)
    torch.manual_seed(1 + dist.get_rank())
    model(torch.randn(4, 5)).square().sum().backward()
    optimizer.step()
    saved, saved_optimizer = full(model, optimizer)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    save_state(args.dir, {"model": model_state, "optimizer": optimizer_state})

    fresh, fresh_optimizer = sharded(seed=2)
    model_state, optimizer_state = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    load_state(args.dir, state, checkpoint=None)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    loaded, loaded_optimizer = full(fresh, fresh_optimizer)
    if dist.get_rank() == 0:
        torch.save({"saved": saved, "saved_optimizer": saved_optimizer["state"], "loaded": loaded,
                    "loaded_optimizer": loaded_optimizer["state"]}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
