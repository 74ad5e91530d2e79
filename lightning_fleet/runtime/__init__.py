"""Runtimes: what executes a plan, and what each can execute -- one table, :data:`RUNTIMES`.

Rooms:

``base.py``
    Pure. :class:`~lightning_fleet.runtime.base.Capabilities` (what a runtime executes, turned into planner
    constraints and one-line refusals), :class:`~lightning_fleet.runtime.base.ModuleHooks` (what a user's module
    offers a runtime), :class:`~lightning_fleet.runtime.base.TensorParallelSpec`, ``ANY`` (the cost model's
    whole space), and the :class:`~lightning_fleet.runtime.base.Backend` protocol (how a runtime applies a
    Decision: config, engine, step, save, load, reshard), called by the neutral fit core (:mod:`lightning_fleet.fit`)
    with a ``FitView`` of the fit.
``deepspeed/``
    The only place that imports DeepSpeed (ZeRO 0-3, offload, AutoTP, its pipeline engine).
``torch/``
    torch's own stack (DistributedDataParallel, torch.distributed.checkpoint).

A new runtime is a package beside these with its own ``Capabilities``, a class implementing ``Backend``, a reader of
its checkpoints for ``fleet export``, the name of its Lightning face in strategy.py (an existing one where that
Lightning class's precision plugins fit), and one row below. This module imports only
pure modules (no torch, no deepspeed): the CLI and the planner read it offline; the table names the torch-side
objects by import path, loaded on use.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Any

from lightning_fleet.planning import FleetError
from lightning_fleet.runtime.base import ANY, Capabilities
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED
from lightning_fleet.runtime.torch.capabilities import TORCH


@dataclass(frozen=True, slots=True, kw_only=True)
class Runtime:
    """One runtime: what it executes and where its parts live (``module:attribute`` paths, imported on use)."""

    capabilities: Capabilities
    """What it executes (its ``name`` is the runtime's name: ``FleetStrategy(runtime=...)``, ``plan runtime=``)."""
    requires: str
    """The package it needs importable (``deepspeed``; torch's ``torch.distributed``)."""
    backend: str
    """Its :class:`~lightning_fleet.runtime.base.Backend` class."""
    layout_format: str
    """The ``format`` its checkpoints' layout file records (``fleet export`` picks the reader by it)."""
    reader: str
    """Its checkpoint reader: (directory, layout) -> (full state_dict, Lightning's client state)."""
    face: str
    """The name, in the strategy module, of its Lightning face (a FleetStrategy subclass on the Lightning strategy
    class whose precision plugin the runtime needs)."""

    @property
    def name(self) -> str:
        """``torch``, ``deepspeed``."""
        return self.capabilities.name

    def installed(self) -> bool:
        """Whether :attr:`requires` can be imported here."""
        try:
            return importlib.util.find_spec(self.requires) is not None
        except (ImportError, ValueError):
            return False

    def load_backend(self) -> Any:
        """A new instance of its Backend class."""
        return _attribute(self.backend)()

    def load_reader(self) -> Any:
        """Its checkpoint reader function."""
        return _attribute(self.reader)


def _attribute(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


RUNTIMES: tuple[Runtime, ...] = (
    Runtime(
        capabilities=TORCH,
        requires="torch.distributed",
        backend="lightning_fleet.runtime.torch.backend:TorchBackend",
        layout_format="lightning_fleet.torch/1",
        reader="lightning_fleet.runtime.torch.backend:read",
        face="TorchFleetStrategy",
    ),
    Runtime(
        capabilities=DEEPSPEED,
        requires="deepspeed",
        backend="lightning_fleet.runtime.deepspeed.backend:DeepSpeedBackend",
        layout_format="lightning_fleet.layout/1",
        reader="lightning_fleet.runtime.deepspeed.reader:read",
        face="DeepSpeedFleetStrategy",
    ),
)
"""Every runtime, in the order the planner prefers them when their predictions tie."""

RUNTIME_NAMES: tuple[str, ...] = ("any", *(r.name for r in RUNTIMES))
"""The names :func:`capabilities_of` knows ("any": no runtime's limits, the cost model's whole space)."""

AUTO = "auto"
"""``FleetStrategy(runtime="auto")``: the planner chooses among the installed runtimes, per plan."""


def runtime_named(name: str) -> Runtime:
    """The runtime called ``name``; FleetError (one line, the known names) for another name."""
    for runtime in RUNTIMES:
        if runtime.name == name:
            return runtime
    raise FleetError(f"unknown runtime {name!r} (known: {', '.join(r.name for r in RUNTIMES)}, or {AUTO!r} to let the planner choose)")


def runtime_of_format(layout_format: str) -> Runtime:
    """The runtime whose checkpoints' layout file records ``layout_format``; FleetError for another."""
    for runtime in RUNTIMES:
        if runtime.layout_format == layout_format:
            return runtime
    known = ", ".join(r.layout_format for r in RUNTIMES)
    raise FleetError(f"checkpoint layout format {layout_format!r} is not one lightning_fleet writes (known: {known})")


def capabilities_of(name: str) -> Capabilities:
    """The capabilities of the runtime called ``name`` ("any": the cost model's whole space); FleetError (one line, the
    known names) for another name."""
    if name == ANY.name:
        return ANY
    if name not in RUNTIME_NAMES:
        raise FleetError(f"unknown runtime {name!r} (known: {', '.join(RUNTIME_NAMES)})")
    return runtime_named(name).capabilities
