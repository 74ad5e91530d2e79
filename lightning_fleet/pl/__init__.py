"""lightning_fleet for the ``pytorch_lightning`` namespace.

``pytorch_lightning`` is a second copy of Lightning's trainer under another package name; its Trainer
accepts only strategies and callbacks built on its own classes. This package serves the same code
as ``lightning_fleet`` with the imports rewritten, the way Lightning builds ``pytorch_lightning`` from
``lightning.pytorch`` (``lightning.pytorch`` -> ``pytorch_lightning``, ``lightning.fabric`` ->
``lightning_fabric``): every lightning_fleet module that imports Lightning, directly or through
another such module, is loaded a second time as ``lightning_fleet.pl.<module>`` from the same
source file. Nothing is copied into the repository and nothing else is changed.

    import pytorch_lightning as pl
    import lightning_fleet                   # registers "fleet" for pytorch_lightning too
    pl.Trainer(strategy="fleet")
    from lightning_fleet.pl import FleetStrategy, FleetCheckpoint   # explicit classes
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import re
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
"""The lightning_fleet package directory."""
PREFIX = "lightning_fleet.pl."
_LIGHTNING_IMPORT = re.compile(r"\blightning\.(pytorch|fabric)\b")
_NAMESPACE_RENAMES = ((re.compile(r"\blightning\.pytorch\b"), "pytorch_lightning"), (re.compile(r"\blightning\.fabric\b"), "lightning_fabric"))


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE_ROOT).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(("lightning_fleet", *parts))


def _imports(path: Path) -> set[str]:
    """Every module a source file imports, at its top or inside functions (``from a import b``: ``a`` and ``a.b``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return found


@cache
def mirrored() -> dict[str, Path]:
    """lightning_fleet modules that need a pytorch_lightning copy: those importing Lightning, and those importing them
    (read from their import statements, so the pure planning core, which imports neither, is shared, never copied)."""
    sources = {
        _module_name(p): p for p in PACKAGE_ROOT.rglob("*.py") if "pl" not in p.relative_to(PACKAGE_ROOT).parts[:1]
    }
    imports = {name: _imports(path) for name, path in sources.items()}
    chosen = {name for name, found in imports.items() if any(_LIGHTNING_IMPORT.match(i) for i in found)}
    grew = True
    while grew:  # close over "imports a mirrored module"
        grew = False
        for name, found in imports.items():
            if name not in chosen and name != "lightning_fleet" and found & chosen:
                chosen.add(name)
                grew = True
    return {name: sources[name] for name in sorted(chosen)}


def rewrite(source: str) -> str:
    """The pytorch_lightning form of a mirrored module's source."""
    for pattern, replacement in _NAMESPACE_RENAMES:
        source = pattern.sub(replacement, source)
    for name in sorted(mirrored(), key=len, reverse=True):  # longest first: a.b.c before a.b
        source = re.sub(rf"\b{re.escape(name)}\b(?!\.pl\b)", PREFIX + name.removeprefix("lightning_fleet."), source)
    return source


class _MirrorLoader(importlib.abc.Loader):
    def __init__(self, original: str) -> None:
        self.original = original

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        path = mirrored().get(self.original)
        if path is None:  # an intermediate package (lightning_fleet.pl.elastic) that has no mirrored code itself
            module.__path__ = []  # type: ignore[attr-defined]
            return
        module.__file__ = str(path)
        if path.name == "__init__.py":
            module.__path__ = []  # type: ignore[attr-defined]
        exec(compile(rewrite(path.read_text()), str(path), "exec"), module.__dict__)


class _MirrorFinder(importlib.abc.MetaPathFinder):
    """Serves ``lightning_fleet.pl.<module>`` from ``lightning_fleet/<module>.py`` with rewritten imports."""

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(PREFIX):
            return None
        original = "lightning_fleet." + fullname.removeprefix(PREFIX)
        packages = {m.rsplit(".", i)[0] for m in mirrored() for i in range(1, m.count("."))}
        if original not in mirrored() and original not in packages:
            return None
        is_package = original in packages or mirrored()[original].name == "__init__.py"
        return importlib.util.spec_from_loader(fullname, _MirrorLoader(original), is_package=is_package)


if not any(isinstance(f, _MirrorFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _MirrorFinder())


def __getattr__(name: str):
    """FleetStrategy and FleetCheckpoint built on pytorch_lightning's classes (imported on first use)."""
    if name == "FleetStrategy":
        return importlib.import_module(PREFIX + "strategy").FleetStrategy
    if name == "FleetCheckpoint":
        return importlib.import_module(PREFIX + "elastic.callback").FleetCheckpoint
    raise AttributeError(f"module 'lightning_fleet.pl' has no attribute {name!r}")


__all__ = ["FleetCheckpoint", "FleetStrategy", "mirrored", "rewrite"]
