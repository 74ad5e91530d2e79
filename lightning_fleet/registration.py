"""Register the ``fleet`` strategy names in Lightning's StrategyRegistry without importing Lightning early.

``import lightning_fleet`` must make ``Trainer(strategy="fleet")`` work in both Lightning namespaces
(``lightning.pytorch`` and ``pytorch_lightning``), in any import order, yet the planning core and the
``fleet`` command must not pay Lightning's import time (seconds). So: if a namespace is already
imported, register now; otherwise register the moment it finishes importing, through a one-shot
meta-path finder that wraps its loader.

What is registered is a small factory per name, not the strategy class: the class is imported only
when a Trainer asks for it (Lightning's registry calls ``entry["strategy"](**init_params)``). Importing
the strategy inside Lightning's own import would re-enter modules that are still initialising (the
circular ImportError of ``from lightning_fleet import FleetCheckpoint, FleetStrategy`` before Lightning).

Above the strategy, which it builds on request (by module name, through importlib); the strategy does
not import it: the names and their arguments are plain data in :mod:`lightning_fleet.strategy_names`,
which both read. Imported by ``lightning_fleet/__init__.py`` only.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any, Callable

from lightning_fleet.strategy_names import PRESETS

NAMESPACES = {"lightning.pytorch": "lightning_fleet.strategy", "pytorch_lightning": "lightning_fleet.pl.strategy"}
"""Lightning namespace -> the module whose FleetStrategy subclasses that namespace's classes."""

_registered: set[str] = set()


def strategy_factory(module: str) -> Callable[..., Any]:
    """A callable that builds ``<module>.FleetStrategy(**kwargs)``, importing it only when called."""

    def make_fleet_strategy(**kwargs: Any) -> Any:
        return importlib.import_module(module).FleetStrategy(**kwargs)

    return make_fleet_strategy


def register_now(namespace: str) -> None:
    """Register the preset names in ``namespace``'s StrategyRegistry (idempotent)."""
    if namespace in _registered:
        return
    registry = importlib.import_module(f"{namespace}.strategies").StrategyRegistry
    factory = strategy_factory(NAMESPACES[namespace])
    for name, (description, init_params) in PRESETS.items():
        if name not in registry:
            registry.register(name, factory, description=description, **init_params)
    _registered.add(namespace)


class _AfterLightningImport(importlib.abc.MetaPathFinder):
    """Finds a Lightning namespace with the other finders and registers once its module has executed."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.namespace:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            register_now(fullname)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Register now in every Lightning namespace already loaded, else as soon as it is."""
    for namespace in NAMESPACES:
        if namespace in sys.modules:
            register_now(namespace)
        elif not any(isinstance(f, _AfterLightningImport) and f.namespace == namespace for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterLightningImport(namespace))
