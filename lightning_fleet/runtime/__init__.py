"""Runtimes: what executes a plan, and what each can execute.

Rooms:

``base.py``
    Pure. :class:`~lightning_fleet.runtime.base.Capabilities` (what a runtime executes, turned into planner
    constraints and one-line refusals), :class:`~lightning_fleet.runtime.base.ModuleHooks` (what a user's module
    offers a runtime), :class:`~lightning_fleet.runtime.base.TensorParallelSpec`, ``ANY`` (the cost model's
    whole space), and the :class:`~lightning_fleet.runtime.base.Backend` protocol (how a runtime applies a
    Decision: config, engine, step, save, load, reshard).
``deepspeed/``
    The only place that imports DeepSpeed: ``capabilities.py`` (pure, ``DEEPSPEED``), ``config.py`` (pure: Plan ->
    DeepSpeed config dict), ``pipeline.py`` (its PipelineModule and pipeline engine), ``universal.py`` (resharding
    through its universal checkpoint), ``backend.py`` (``DeepSpeedBackend``, the Backend the strategy calls),
    ``weights.py`` and ``reader.py`` (full weights out of a live engine / out of checkpoint files).

A new runtime is a package beside ``deepspeed/`` with its own ``Capabilities``, registered below, and a class
implementing ``Backend``. This module
imports only pure modules (no torch, no deepspeed): the CLI and the planner read it offline.
"""

from __future__ import annotations

from lightning_fleet.planning import FleetError
from lightning_fleet.runtime.base import ANY, Capabilities
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED

_CAPABILITIES = {caps.name: caps for caps in (ANY, DEEPSPEED)}

RUNTIMES: tuple[str, ...] = tuple(_CAPABILITIES)
"""The runtime names :func:`capabilities_of` knows ("any": no runtime's limits, the cost model's whole space)."""


def capabilities_of(name: str) -> Capabilities:
    """The capabilities of the runtime called ``name``; FleetError (one line, the known names) for another name."""
    if name not in _CAPABILITIES:
        raise FleetError(f"unknown runtime {name!r} (known: {', '.join(RUNTIMES)})")
    return _CAPABILITIES[name]
