"""Whether a checkpoint belongs to this job: the facts a resume must keep, recorded at save and compared at start.

A checkpoint is resumed into a job only when the job would continue the same optimisation: the same
model (every parameter and buffer name with its shape and dtype), the same global batch, and the
same data-order seed. Anything else (a changed model pointed at an old ``checkpoint_dir``, a new
``seed_everything``) would crash deep inside DeepSpeed at every restart, or silently read samples
twice; instead the difference is named in one line before anything is loaded.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping

import torch

RESUME_POLICIES = ("auto", "if_compatible", "never")
"""``auto``: resume the newest checkpoint, refuse an incompatible one; ``if_compatible``: resume the newest compatible
checkpoint and set incompatible ones aside; ``never``: do not resume automatically (existing checkpoints are set aside)."""


def model_facts(module: torch.nn.Module) -> dict[str, Any]:
    """Names, shapes and dtypes of a module's parameters and buffers (the checkpoint's structure), and their digest."""
    entries = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in module.state_dict(keep_vars=True).items()]
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()
    return {"sha256": digest, "tensors": entries}


def job_facts(module: torch.nn.Module, *, global_batch_size: int | None, data_seed: int) -> dict[str, Any]:
    """What a checkpoint of this job records besides its shards: model structure, global batch, data-order seed."""
    return {"model": model_facts(module), "global_batch_size": global_batch_size, "data_seed": data_seed}


def incompatibility(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    """'' when a checkpoint with ``recorded`` facts can be resumed by a job with ``current`` facts, else the first difference.

    Checkpoints written before these facts were recorded (no ``model`` entry) are taken as compatible.
    A global batch of None on either side (not fixed by the job) is not compared.
    """
    model = recorded.get("model")
    if isinstance(model, Mapping) and model.get("sha256") != current["model"]["sha256"]:
        return _model_difference(model.get("tensors") or [], current["model"]["tensors"])
    if "data_seed" in recorded and recorded["data_seed"] != current["data_seed"]:
        return f"its data order was seeded with {recorded['data_seed']}, this job seeds it with {current['data_seed']} (seed_everything)"
    gbs = recorded.get("global_batch_size"), current.get("global_batch_size")
    if None not in gbs and gbs[0] != gbs[1]:
        return f"it was trained with global batch size {gbs[0]}, this job asks for {gbs[1]}"
    return ""


def _model_difference(recorded: list, current: list) -> str:
    """The first tensor that differs between two ``model_facts(...)["tensors"]`` lists, in words."""
    old = {name: (shape, dtype) for name, shape, dtype in recorded}
    new = {name: (shape, dtype) for name, shape, dtype in current}
    for name, (shape, dtype) in new.items():
        if name not in old:
            return f"this module has {name!r} ({_shape(shape)}), which the checkpoint lacks"
        if old[name] != (shape, dtype):
            return f"{name!r} is {_shape(old[name][0])} {old[name][1]} in the checkpoint but {_shape(shape)} {dtype} in this module"
    missing = [name for name in old if name not in new]
    if missing:
        return f"the checkpoint has {missing[0]!r}, which this module lacks"
    return "its model structure differs from this module's"


def _shape(shape: list[int]) -> str:
    return "x".join(map(str, shape)) or "scalar"
