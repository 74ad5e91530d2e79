"""Resharding a checkpoint to another world size and ZeRO stage, through DeepSpeed's universal form.

A universal checkpoint stores, per parameter name, the full fp32 weight and optimizer moments
(``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``) plus the optimizer's global state
(``zero/optimizer_state.pt``); DeepSpeed slices it for any data-parallel size at load time.

DeepSpeed 0.19.8 writes it in a form only the ZeRO stage that wrote the checkpoint can read
(measured: a ZeRO-3 one loaded into ZeRO-1 fails with "Empty ds_version in checkpoint"; ZeRO-3
stores flat moments and no ``step.pt``; the model-state file each stage looks for has another
name), and it cannot convert a ZeRO-0 checkpoint at all (no ZeRO shards). :func:`make_universal`
therefore converts with DeepSpeed's ``ds_to_universal`` (ZeRO 1-3) or writes the per-parameter
files itself (ZeRO-0: full weights and a plain torch optimizer state), and then normalises the
result so that every ZeRO stage 1-3 loads it. Tensor- and pipeline-parallel checkpoints are not
resharded (their per-rank layouts have no verified conversion here): a clear error says so.

Every file read here, and by DeepSpeed's converter (``python -m lightning_fleet.runtime.deepspeed.convert``), is
unpickled by the restricted unpickler (:mod:`lightning_fleet.elastic.safe_load`); the source checkpoint is verified
before this module is called, and the universal form is hashed into its manifest when complete.

Imports torch and deepspeed (at call time) and runs DeepSpeed's converter in a subprocess; imported by the DeepSpeed
backend and the strategy.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint, write_derived
from lightning_fleet.elastic.layout import TAG, UNIVERSAL, UNIVERSAL_LATEST, deepspeed_files, universal_dir
from lightning_fleet.elastic.safe_load import load_file
from lightning_fleet.elastic.worker import module_command
from lightning_fleet.planning import FleetError
from lightning_fleet.runtime.base import FullState

_MOMENTS = ("fp32", "exp_avg", "exp_avg_sq")
_MODEL_STATE_NAMES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
"""Universal loading reads rank 0's model-state file for metadata only; ZeRO 1-2 look for the first
name, ZeRO-3 for the second (DeepSpeed 0.19.8 engine._get_all_ckpt_names)."""


def make_universal(checkpoint: VerifiedCheckpoint, source_zero: int, timeout_s: float = 900) -> VerifiedCheckpoint:
    """Write (once) the universal form of a verified checkpoint written with ``source_zero``, and list it in the
    checkpoint's manifest; returns the checkpoint with that manifest.

    Works into a temporary directory that is renamed into place and hashed into the manifest only when the
    conversion and normalisation succeeded, so a kill midway leaves nothing that is ever loaded (an unlisted
    universal form is converted again). A form already listed was verified with the rest of the checkpoint.
    """
    step = checkpoint.path

    def convert(out: Path) -> None:
        source = deepspeed_files(step)
        if source_zero == 0:
            _universal_from_zero0(source, out)
            return
        cmd = module_command("lightning_fleet.runtime.deepspeed.convert", "--input_folder", str(source), "--output_folder", str(out),
                             "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)  # dies with this process (SIGKILL)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise FleetError(f"converting {step} to a universal checkpoint failed: {tail[0]}")

    return _written_universal(checkpoint, convert)


def universal_from_state(checkpoint: VerifiedCheckpoint, state: FullState) -> VerifiedCheckpoint:
    """Write (once) the universal form of another runtime's checkpoint from its whole state (:class:`FullState`), beside
    it, and list it in its manifest: per parameter its full weight as the fp32 master and its Adam moments and step,
    the optimizer's one parameter group, and the model-states metadata DeepSpeed's universal loading reads (shapes,
    counters, Lightning's client state). FleetError (one line) for an optimizer state that is not Adam's (the universal
    form holds ``exp_avg`` and ``exp_avg_sq`` only) or has several parameter groups."""
    return _written_universal(checkpoint, lambda out: _universal_from_state(state, out, checkpoint.manifest.world_size))


def _written_universal(checkpoint: VerifiedCheckpoint, write: Callable[[Path], None]) -> VerifiedCheckpoint:
    """The universal form ``write(folder)`` writes, normalised, with its ``latest_universal`` tag, as the checkpoint's
    derived form (:func:`~lightning_fleet.elastic.checkpoint.write_derived`: once, listed in the manifest when whole)."""

    def written(tmp: Path) -> None:
        out = tmp / TAG
        write(out)
        normalize_universal(out)
        (tmp / UNIVERSAL_LATEST).write_text(TAG)

    return write_derived(checkpoint, UNIVERSAL, written)


def _save(obj: Any, path: Path) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


def _param_shapes(model_state: dict) -> dict[str, Any]:
    groups = model_state.get("param_shapes") or []
    return {name: shape for group in groups for name, shape in group.items()}


def normalize_universal(folder: Path) -> None:
    """Make a universal checkpoint folder loadable into ZeRO stage 1, 2 or 3, whichever stage wrote it.

    Per parameter: every moment file becomes ``{"param": tensor in the parameter's shape,
    "cat_dim": 0}`` and ``step.pt`` exists. Globally: ``optimizer_state.pt`` carries both what
    ZeRO 1-2 read (``ds_version``, ``param_groups``) and what ZeRO-3 reads (the base optimizer's
    ``param_groups`` and step); the model-state metadata exists under both stages' names.
    """
    import torch

    states = [folder / name for name in _MODEL_STATE_NAMES if (folder / name).is_file()]
    if not states:
        raise FleetError(f"universal checkpoint {folder} has no model-state file; it cannot be loaded")
    model_state = load_file(states[0])
    shapes = _param_shapes(model_state)
    optim = load_file(folder / "zero" / "optimizer_state.pt")
    base = optim.get("optimizer_state_dict") or {}
    step = next(iter(base.get("state", {}).values()), {}).get("step")
    for name, shape in shapes.items():
        for key in _MOMENTS:
            path = folder / "zero" / name / f"{key}.pt"
            value = load_file(path)
            if not isinstance(value, dict):
                _save({"param": value.reshape(shape), "cat_dim": 0}, path)
        step_file = folder / "zero" / name / "step.pt"
        if step_file.is_file():
            step = load_file(step_file) if step is None else step
        elif step is not None:
            _save(torch.as_tensor(step, dtype=torch.float32), step_file)
    if step is None:
        raise FleetError(f"universal checkpoint {folder} records no optimizer step; it cannot be resumed exactly")
    optim.setdefault("ds_version", model_state["ds_version"])
    optim["optimizer_state_dict"] = {"state": {0: {"step": torch.as_tensor(step, dtype=torch.float32)}}, "param_groups": optim["param_groups"]}
    _save(optim, folder / "zero" / "optimizer_state.pt")
    for name in _MODEL_STATE_NAMES:
        if not (folder / name).is_file():
            shutil.copyfile(states[0], folder / name)


def _universal_from_zero0(source: Path, out: Path) -> None:
    """Write the universal form of a ZeRO-0 checkpoint: full fp32 weights and a plain torch optimizer state.

    The optimizer's parameters are matched to names by order (the module's parameters, tied ones
    once, buffers excluded), which holds for one parameter group over ``module.parameters()``.
    Anything else is refused with the reason rather than guessed.
    """
    files = sorted(source.glob("mp_rank_*_model_states.pt"))
    if len(files) != 1:
        raise FleetError(f"ZeRO-0 checkpoint {source} has {len(files)} model-state files (tensor parallel?); only tp=1 is resharded")
    model_state = load_file(files[0])
    optimizer = model_state.get("optimizer")
    if not isinstance(optimizer, dict) or "state" not in optimizer or len(optimizer.get("param_groups", [])) != 1:
        raise FleetError(
            f"ZeRO-0 checkpoint {source} has no single-group torch optimizer state (mixed precision or several parameter "
            "groups); relaunch with the world size that wrote it"
        )
    module, buffers = model_state["module"], set(model_state.get("buffer_names") or [])
    names, seen = [], set()
    for name, tensor in module.items():
        if name in buffers or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        names.append(name)
    group = optimizer["param_groups"][0]
    if len(group["params"]) != len(names):
        raise FleetError(
            f"ZeRO-0 checkpoint {source}: the optimizer has {len(group['params'])} parameters but the module {len(names)}; "
            "relaunch with the world size that wrote it"
        )
    step = None
    for index, name in zip(group["params"], names):
        state = optimizer["state"][index]
        step = state["step"]
        _save({"param": module[name].float(), "cat_dim": 0}, out / "zero" / name / "fp32.pt")
        for key in ("exp_avg", "exp_avg_sq"):
            _save({"param": state[key], "cat_dim": 0}, out / "zero" / name / f"{key}.pt")
        _save(step, out / "zero" / name / "step.pt")
    meta = dict(model_state, optimizer=None, param_shapes=[{name: module[name].shape for name in names}])
    _save({"param_groups": [dict(group, params=list(range(len(names))))], "ds_version": model_state["ds_version"],
           "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": optimizer["param_groups"]}}, out / "zero" / "optimizer_state.pt")
    _save(meta, out / _MODEL_STATE_NAMES[0])


_DEEPSPEED_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params", "frozen_param_fragments",
    "lr_scheduler", "data_sampler", "random_ltd", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
    "mp_world_size", "ds_config", "ds_version", "universal_checkpoint_info", "checkpoint_parallel_dimensions",
})
"""What DeepSpeed 0.19.8 writes into a model-states file itself (runtime/engine.py ``_common_checkpoint_state``,
``_checkpoint_parallel_metadata``, ``UNIVERSAL_CHECKPOINT_INFO``); everything else there is the client state it was
given (Lightning's loops, callbacks, schedulers, hyper-parameters)."""


def state_of_universal(checkpoint: VerifiedCheckpoint) -> FullState:
    """The whole state of a DeepSpeed checkpoint's universal form (listed in ``checkpoint``'s manifest, every file read
    by the restricted unpickler against its manifest entry): each parameter's fp32 master as its weight and its Adam
    moments and step, keyed by name; the buffers from the model-states file; Lightning's client state."""
    import torch

    folder = universal_dir(checkpoint.path) / TAG

    def read(path: Path) -> Any:
        name = path.relative_to(checkpoint.path).as_posix()
        entry = checkpoint.manifest.files.get(name)
        if entry is None:
            raise FleetError(f"checkpoint {checkpoint.path}: {name} is not listed in its manifest; use another checkpoint")
        return load_file(path, entry)

    meta = read(folder / _MODEL_STATE_NAMES[0])
    shapes = _param_shapes(meta)
    optim = read(folder / "zero" / "optimizer_state.pt")
    groups = optim.get("param_groups") or []
    if len(groups) != 1:
        raise FleetError(f"checkpoint {checkpoint.path} has {len(groups)} optimizer parameter groups; another runtime continues "
                         "one group only: relaunch with the runtime that wrote it")
    model: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for name, shape in shapes.items():
        parts = {key: read(folder / "zero" / name / f"{key}.pt") for key in (*_MOMENTS, "step")}
        tensors = {key: (value["param"] if isinstance(value, dict) else value) for key, value in parts.items()}
        model[name] = tensors["fp32"].reshape(shape).float()
        state[name] = {"step": torch.as_tensor(float(tensors["step"]), dtype=torch.float32),
                       "exp_avg": tensors["exp_avg"].reshape(shape).float(), "exp_avg_sq": tensors["exp_avg_sq"].reshape(shape).float()}
    module = meta.get("module") or {}
    for name in meta.get("buffer_names") or []:
        if name in module:
            model[name] = module[name]
    group = {key: value for key, value in groups[0].items() if key != "params"}
    optimizer = {"state": state, "param_groups": [dict(group, params=list(shapes))]}
    client = {key: value for key, value in meta.items() if key not in _DEEPSPEED_KEYS}
    return FullState(model=model, optimizer=optimizer, client=client)


def _universal_from_state(state: FullState, out: Path, source_world: int) -> None:
    """Write the universal form of ``state`` into ``out`` (see :func:`universal_from_state`)."""
    import deepspeed
    import torch

    groups = list(state.optimizer.get("param_groups") or [])
    if len(groups) != 1:
        raise FleetError(f"the checkpoint's optimizer has {len(groups)} parameter groups; DeepSpeed's universal form "
                         "continues one group only: relaunch with the runtime that wrote it")
    names = [str(name) for name in groups[0]["params"]]
    moments = state.optimizer.get("state") or {}
    step = None
    for name in names:
        held = moments.get(name) or {}
        if not {"exp_avg", "exp_avg_sq", "step"} <= set(held):
            raise FleetError(f"the checkpoint's optimizer state of {name} is not Adam's (it holds {', '.join(held) or 'nothing'}); "
                             "DeepSpeed's universal form holds exp_avg and exp_avg_sq: relaunch with the runtime that wrote it")
        if name not in state.model:
            raise FleetError(f"the checkpoint's optimizer names {name}, which its model state does not hold; use another checkpoint")
        step = held["step"]
        _save({"param": state.model[name].float(), "cat_dim": 0}, out / "zero" / name / "fp32.pt")
        for key in ("exp_avg", "exp_avg_sq"):
            _save({"param": held[key].float(), "cat_dim": 0}, out / "zero" / name / f"{key}.pt")
        _save(torch.as_tensor(float(step), dtype=torch.float32), out / "zero" / name / "step.pt")
    if step is None:
        raise FleetError("the checkpoint's optimizer holds no parameters; use another checkpoint")
    group = dict(groups[0], params=list(range(len(names))))
    buffers = [key for key in state.model if key not in set(names)]
    client = dict(state.client)
    steps = int(client.get("global_step", 0))
    meta = {**client, "module": dict(state.model), "buffer_names": buffers, "optimizer": None,
            "param_shapes": [{name: state.model[name].shape for name in names}], "frozen_param_shapes": None,
            "shared_params": {}, "frozen_param_fragments": None, "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
            "skipped_steps": 0, "global_steps": steps, "global_samples": 0, "dp_world_size": source_world, "mp_world_size": 1,
            "ds_version": deepspeed.__version__}
    _save({"param_groups": [group], "ds_version": deepspeed.__version__,
           "optimizer_state_dict": {"state": {0: {"step": step}}, "param_groups": [group]}}, out / "zero" / "optimizer_state.pt")
    _save(meta, out / _MODEL_STATE_NAMES[0])
