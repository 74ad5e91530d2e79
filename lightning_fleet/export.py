"""Getting the weights out of any plan's checkpoint: one plain state_dict, or one single-file checkpoint.

Offline (no process group, no model code): :func:`export_state_dict` reads a checkpoint written under any plan
(ZeRO 0-3, offload, AutoTP tensor parallel, DeepSpeed pipeline, and their data-parallel products) and returns the
full fp32 weights with exactly the keys and shapes of the user's LightningModule ``state_dict()``;
:func:`export_checkpoint` writes them as one Lightning-style file that ``MyModule.load_from_checkpoint`` and
``torch.load(weights_only=True)`` read without lightning_fleet. Every file is read with ``weights_only=True``,
memory-mapped, one after another; only the weights are copied out.

This is the runtime-neutral facade: it finds the checkpoint (:func:`locate`), reads the layout file that every save
writes next to the runtime's files, and hands the directory to the reader of the runtime whose layout ``format`` it
records (the runtime table, :data:`lightning_fleet.runtime.RUNTIMES`). The live side -- a running job's full weights,
the user's module handed back after fit, the layout written on save -- is each runtime's own.

Imports torch, no deepspeed and nothing live. Imported by users, the CLI (``fleet export``) and the strategy (evaluating
a checkpoint of any plan).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, Mapping

import torch

from lightning_fleet.elastic.checkpoint import newest_verified
from lightning_fleet.elastic.layout import EXPORT_LAYOUT, MANIFEST, STATE, STEP_PREFIX, verify
from lightning_fleet.planning import FleetError
from lightning_fleet.runtime import RUNTIMES, runtime_of_format
from lightning_fleet.runtime.common import save_atomic


def export_state_dict(checkpoint: str | Path) -> dict[str, torch.Tensor]:
    """The full weights of a checkpoint written under any plan, keyed and shaped like the original module's
    ``state_dict()`` (buffers included); floating tensors in fp32. Raises FleetError (one line) on bad input.

    Files are memory-mapped and read one after another; only the weights are copied out (optimizer moments are never
    read), so the peak memory is about the exported weights plus the part of one file they come from."""
    return _read(locate(checkpoint))[0]


def export_checkpoint(checkpoint: str | Path, out_file: str | Path) -> Path:
    """Write the checkpoint's full weights as one Lightning-style file (:func:`lightning_checkpoint`), atomically:
    ``MyModule.load_from_checkpoint(out_file)`` and ``torch.load(out_file, weights_only=True)`` read it."""
    out = Path(out_file)
    save_atomic(lightning_checkpoint(checkpoint), out)
    return out


def lightning_checkpoint(checkpoint: str | Path) -> dict[str, Any]:
    """A checkpoint written under any plan as one Lightning-style dict of plain types and tensors: ``state_dict`` (full
    weights), ``hyper_parameters`` (when the module saved them; paths as str), ``pytorch-lightning_version``, ``epoch``,
    ``global_step`` and ``lightning_fleet`` (plan and source)."""
    source = locate(checkpoint)
    state_dict, client = _read(source)
    layout = source.layout
    payload: dict[str, Any] = {
        "state_dict": state_dict,
        "pytorch-lightning_version": str(client.get("pytorch-lightning_version", "")),
        "epoch": int(client.get("epoch", 0)),
        "global_step": int(client.get("global_step", 0)),
        "lightning_fleet": {"plan": str(layout["plan"]), "source": str(source.path.resolve()), "layout": str(layout["format"])},
    }
    if client.get("hyper_parameters") is not None:
        payload["hyper_parameters"] = _plain(client["hyper_parameters"])
        if client.get("hparams_name") is not None:
            payload["hparams_name"] = str(client["hparams_name"])
    return payload


def _read(source: Source) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state_dict, Lightning's client state), from the reader of the runtime that wrote the checkpoint."""
    return runtime_of_format(str(source.layout["format"])).load_reader()(source.directory, source.layout)


def _plain(value: Any) -> Any:
    """Hyper-parameters as types ``torch.load(weights_only=True)`` reads anywhere: containers as plain dict/list (Lightning
    may keep them in its own dict types), paths as str, argparse Namespaces as dicts (as Lightning's own
    ``save_hyperparameters`` stores a Namespace)."""
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value) if isinstance(value, tuple) else [_plain(v) for v in value]
    return value


# --- finding the checkpoint and its layout --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Source:
    """A checkpoint located, verified and its layout read."""

    path: Path
    """What the user gave."""
    directory: Path
    """The directory holding the layout next to the runtime's files (DeepSpeed's: ``latest`` and the tag directory)."""
    layout: Mapping[str, Any]
    """The parsed ``fleet_layout.json``."""


def locate(checkpoint: str | Path) -> Source:
    """Find the checkpoint and its layout under ``checkpoint``: a FleetCheckpoint step dir (its manifest is verified
    first), a FleetCheckpoint directory (its newest verified step), a step's ``state/`` dir, or a
    ``trainer.save_checkpoint`` dir. Raises FleetError (one line) for anything else."""
    path = Path(checkpoint)
    if not path.exists():
        raise FleetError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise FleetError(
            f"{path} is a file; give a checkpoint directory (a FleetCheckpoint step-N dir, its state/ dir or a "
            "trainer.save_checkpoint dir)"
        )
    if (path / MANIFEST).is_file():
        verdict = verify(path)
        if not verdict.ok:
            raise FleetError(f"checkpoint {path} cannot be exported: {verdict.reason}")
        return Source(path, path / STATE, _read_layout(path / STATE))
    if not (path / EXPORT_LAYOUT).is_file() and any(p.is_dir() and p.name.startswith(STEP_PREFIX) for p in path.iterdir()):
        verdict = newest_verified(path, log=lambda line: None)
        if verdict is None:
            raise FleetError(f"checkpoint directory {path} holds no step-N checkpoint whose manifest verifies")
        return locate(verdict.path)
    return Source(path, path, _read_layout(path))


def _read_layout(directory: Path) -> dict[str, Any]:
    layout_path = directory / EXPORT_LAYOUT
    if not layout_path.is_file():
        from lightning_fleet.runtime.deepspeed.reader import without_layout  # the files a save without a layout holds

        reason = without_layout(directory)
        raise FleetError(reason or f"{directory} is not a checkpoint: no {MANIFEST}, no {EXPORT_LAYOUT}, no DeepSpeed files")
    try:
        layout = json.loads(layout_path.read_text())
    except ValueError:
        raise FleetError(f"{layout_path} is not valid JSON (corrupted); use another checkpoint") from None
    found = layout.get("format") if isinstance(layout, dict) else None
    formats = [runtime.layout_format for runtime in RUNTIMES]
    if not isinstance(found, str) or found not in formats:
        readable = " or ".join(map(repr, formats))
        raise FleetError(
            f"{layout_path} has layout format {found!r}; this lightning_fleet reads {readable}: "
            "export it with the version that wrote it"
        )
    return layout
