"""Errors of the planning core: each carries one line that says what is wrong and what to do.

Pure; imported by every module that raises a FleetError.
"""

from __future__ import annotations


class FleetError(ValueError):
    """Base of every error lightning_fleet raises on purpose; its message is one line for the user."""


class SpecError(FleetError):
    """A cluster or model description (YAML file or object) is malformed or out of range."""


class PlanError(FleetError):
    """A parallel plan is malformed or does not match the world size, the model or the batch."""


class NoFeasiblePlanError(FleetError):
    """No candidate plan fits in device memory; the message names the closest one and its shortfall."""
