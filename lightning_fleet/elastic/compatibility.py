"""Whether a checkpoint belongs to this job, and which one a fit continues: the facts a resume must keep, recorded at
save and compared at start, and the resume policy that picks the checkpoint (:func:`checkpoint_to_continue`).

A checkpoint is resumed into a job only when the job would continue the same optimisation: the same
model (every parameter and buffer name with its shape and dtype), the same global batch, and the
same data-order seed. Anything else (a changed model pointed at an old ``checkpoint_dir``, a new
``seed_everything``) would crash deep inside DeepSpeed at every restart, or silently read samples
twice; instead the difference is named in one line before anything is loaded.

Imports torch (to read a module's state_dict), the pure checkpoint layout, the checkpoint files' helpers and the
restricted unpickler; imported
by the strategy (which runs :func:`checkpoint_to_continue` on rank 0 and hands its answer to the decision).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint, accept, check_private, committed, newest_verified, set_aside
from lightning_fleet.elastic.layout import MANIFEST, Manifest, ModelFacts, TensorFact, Verdict, verify
from lightning_fleet.elastic.safe_load import unpickles
from lightning_fleet.planning import FleetError

RESUME_POLICIES = ("auto", "if_compatible", "never")
"""``auto``: resume the newest checkpoint, refuse an incompatible one; ``if_compatible``: resume the newest compatible
checkpoint and set incompatible ones aside; ``never``: do not resume automatically (existing checkpoints are set aside)."""


@dataclass(frozen=True, slots=True)
class JobFacts:
    """What a checkpoint of this job records besides its shards, and what a resume compares with its manifest."""

    model: ModelFacts
    """The module's structure."""
    global_batch_size: int | None
    """The global batch the job asks for (None: not fixed by the job)."""
    data_seed: int
    """The data-order seed (seed_everything's)."""


def model_facts(module: torch.nn.Module) -> ModelFacts:
    """Names, shapes and dtypes of a module's parameters and buffers (the checkpoint's structure), and their digest."""
    state = module.state_dict(keep_vars=True)
    entries = [[name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in state.items()]
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()  # the digest every manifest has recorded: keep its input
    return ModelFacts(sha256=digest, tensors=tuple(TensorFact(name=n, shape=tuple(s), dtype=d) for n, s, d in entries))


def job_facts(module: torch.nn.Module, *, global_batch_size: int | None, data_seed: int) -> JobFacts:
    """What a checkpoint of this job records besides its shards: model structure, global batch, data-order seed."""
    return JobFacts(model=model_facts(module), global_batch_size=global_batch_size, data_seed=data_seed)


def incompatibility(recorded: Manifest, current: JobFacts) -> str:
    """'' when a checkpoint with the ``recorded`` manifest can be resumed by a job with ``current`` facts, else the first
    difference.

    Checkpoints written before these facts were recorded (no model, no data seed) are taken as compatible.
    A global batch of None on either side (not fixed by the job) is not compared.
    """
    if recorded.model is not None and recorded.model.sha256 != current.model.sha256:
        return _model_difference(recorded.model.tensors, current.model.tensors)
    if recorded.data_seed is not None and recorded.data_seed != current.data_seed:
        seeds = recorded.data_seed, current.data_seed
        return f"its data order was seeded with {seeds[0]}, this job seeds it with {seeds[1]} (seed_everything)"
    gbs = recorded.global_batch_size, current.global_batch_size
    if None not in gbs and gbs[0] != gbs[1]:
        return f"it was trained with global batch size {gbs[0]}, this job asks for {gbs[1]}"
    return ""


def checkpoint_to_continue(
    requested: Path | None, directory: Path | None, facts: JobFacts, policy: str
) -> VerifiedCheckpoint | None:
    """The FleetCheckpoint step a fit continues: ``requested`` (the fit's ``ckpt_path``) when it is one, else the newest
    verified one of this job in ``directory`` as ``policy`` says (setting aside what it says to). Its files are hashed
    against the manifest here, once, and unpickled by the restricted unpickler (memory-mapped) before any rank loads
    its part; a directory others could write is refused. None: start fresh (or
    ``requested`` is not a FleetCheckpoint step: a plain ``trainer.save_checkpoint`` dir, loaded by the restricted unpickler).
    Run on one rank (it may move directories)."""
    if requested is not None:
        if not (requested / MANIFEST).is_file():
            return None
        check_private(requested)
        verdict = verify(requested)
        if verdict.ok and verdict.manifest is not None and (why := incompatibility(verdict.manifest, facts)):
            raise FleetError(f"checkpoint {requested} cannot be resumed by this job: {why}")
        return _loadable(accept(verdict))
    if directory is None:
        return None
    check_private(directory)
    verdict = _newest_compatible(directory, facts, policy)
    return _loadable(accept(verdict)) if verdict is not None else None


def _loadable(checkpoint: VerifiedCheckpoint) -> VerifiedCheckpoint:
    """The checkpoint, once every file of it unpickles with the restricted unpickler (FleetError naming the first that
    does not: then no rank starts loading its part)."""
    unpickles(checkpoint.path, checkpoint.manifest.files, checkpoint.manifest.kinds)
    return checkpoint


def _newest_compatible(directory: Path, facts: JobFacts, policy: str) -> Verdict | None:
    """The newest verified checkpoint in ``directory`` this job may resume, setting aside what ``policy`` says to."""
    if policy == "never":
        for old in committed(directory):
            print(f"lightning_fleet: resume='never': moved {old} to {set_aside(directory, old)}", flush=True)
        return None
    while (verdict := newest_verified(directory)) is not None:
        assert verdict.manifest is not None  # an ok verdict has one
        why = incompatibility(verdict.manifest, facts)
        if not why:
            return verdict
        if policy == "auto":
            raise FleetError(
                f"checkpoint {verdict.path} cannot be resumed by this job: {why}; use another checkpoint_dir, or "
                "FleetStrategy(resume='if_compatible') to set incompatible checkpoints aside and start fresh"
            )
        print(f"lightning_fleet: {verdict.path} is not this job's ({why}); moved to {set_aside(directory, verdict.path)}", flush=True)
    return None


def _model_difference(recorded: tuple[TensorFact, ...], current: tuple[TensorFact, ...]) -> str:
    """The first tensor that differs between two modules' tensor lists, in words."""
    old = {t.name: (t.shape, t.dtype) for t in recorded}
    new = {t.name: (t.shape, t.dtype) for t in current}
    for name, (shape, dtype) in new.items():
        if name not in old:
            return f"this module has {name!r} ({_shape(shape)}), which the checkpoint lacks"
        if old[name] != (shape, dtype):
            was = f"{_shape(old[name][0])} {old[name][1]}"
            return f"{name!r} is {was} in the checkpoint but {_shape(shape)} {dtype} in this module"
    missing = [name for name in old if name not in new]
    if missing:
        return f"the checkpoint has {missing[0]!r}, which this module lacks"
    return "its model structure differs from this module's"


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"
