"""Register the ``fleet`` strategy names in Lightning's StrategyRegistry without importing Lightning early.

``import lightning_fleet`` must make ``Trainer(strategy="fleet")`` work, yet the planning core and
the ``fleet`` command must not pay Lightning's import time (seconds). So: if ``lightning.pytorch``
is already imported, register now; otherwise register the moment it finishes importing, through a
one-shot meta-path finder that wraps the loader of ``lightning.pytorch``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

_TARGET = "lightning.pytorch"
_done = False


def register_now() -> None:
    """Register FleetStrategy's names (idempotent)."""
    global _done
    if _done:
        return
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_fleet.strategy import FleetStrategy

    FleetStrategy.register_strategies(StrategyRegistry)
    _done = True


class _AfterLightningImport(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` with the other finders and registers once its module has executed."""

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        original = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            register_now()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Register now if Lightning is loaded, else as soon as it is."""
    if _TARGET in sys.modules:
        register_now()
    elif not any(isinstance(f, _AfterLightningImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterLightningImport())
