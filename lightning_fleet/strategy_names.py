"""The strategy names lightning_fleet registers in Lightning, and the FleetStrategy keyword arguments each stands for.

Plain data: imports nothing, so that both sides of the registration can read it without importing each other.
:mod:`lightning_fleet.registration` registers these names (on ``import lightning_fleet``, without importing Lightning
or the strategy); :meth:`lightning_fleet.strategy.FleetStrategy.register_strategies` registers the same names with the
class itself. Imported by those two modules only.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "fleet": ("lightning_fleet: profile, plan and train the best layout", {}),
    "fleet_zero3": ("lightning_fleet restricted to ZeRO stage 3", {"zero_stages": (3,)}),
    "fleet_offload": ("lightning_fleet with optimizer/parameter offload to host memory", {"require_offload": True}),
}
"""Registered name -> (description, FleetStrategy keyword arguments)."""
