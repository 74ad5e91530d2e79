"""The house rules of lightning_fleet's module layering, stated in one place and checked over every module's source.

Tier 1: reads each ``lightning_fleet/**/*.py`` with ``ast`` and imports none of them (nor torch, Lightning or
DeepSpeed). Every import statement counts, at any depth: module level, inside functions, under ``if``/``try``.

What a statement imports: ``import a.b`` imports ``a.b``; ``from a import b`` imports the module ``a.b`` when there
is one, else ``a`` (``b`` is a name in it). A lightning_fleet name that is no file (the ``lightning_fleet.pl.*``
copies) stands for the nearest package above it that is one. Importing a module also runs its packages'
``__init__.py``: that counts for purity (what gets loaded), not as an edge of the graph (a package importing its own
modules would otherwise be a cycle with each of them).

Imports by name at run time (``importlib.import_module``) are no statements and are not seen here:
``registration.py``'s factories and ``pl/__init__.py``'s ``__getattr__`` reach FleetStrategy that way, on a
Trainer's request; both sit above the strategy, and the strategy imports neither.
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_fleet"
"""The lightning_fleet source tree."""

# --- the rules -------------------------------------------------------------------------------------------------------

PLANNING = "lightning_fleet.planning"
"""The planning core: imports only the standard library, ``yaml`` and itself."""
PLANNING_MAY_IMPORT = frozenset({"yaml"})
"""What the planning core may import beyond the standard library and itself."""

PURE_MODULES = frozenset({
    "lightning_fleet.calibrate.ranks",
    "lightning_fleet.decide",
    "lightning_fleet.runtime.base",
    "lightning_fleet.runtime.deepspeed.capabilities",
    "lightning_fleet.runtime.deepspeed.config",
})
"""The one list of the pure modules beside the planning core (which is pure by its own, stricter rule): neither they,
nor any lightning_fleet module they load, imports a HEAVY package. A listed module that does not exist is skipped."""
HEAVY = frozenset({"torch", "lightning", "pytorch_lightning", "lightning_fabric", "deepspeed"})
"""Packages a pure module never loads (seconds of import time; a GPU stack)."""

DEEPSPEED_HOME = "lightning_fleet.runtime.deepspeed"
"""The only package that imports ``deepspeed``."""
DEEPSPEED_ELSEWHERE: dict[str, str] = {}
"""Known exceptions to DEEPSPEED_HOME, each with its reason; remove an entry when its module stops importing deepspeed."""
TORCH_HOME = "lightning_fleet.runtime.torch"
"""The only package that imports torch's parallel stack (:data:`TORCH_PARALLEL`)."""
TORCH_PARALLEL = ("torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.checkpoint",
                  "torch.distributed.pipelining", "torch.distributed.optim", "torch.nn.parallel")
"""torch's packages that apply a layout (FSDP2, DTensor tensor parallelism, DCP, pipelining, ZeroRedundancyOptimizer,
DistributedDataParallel): a runtime's business, so only the torch runtime imports them."""
TORCH_ELSEWHERE: dict[str, str] = {
    "lightning_fleet.elastic.safe_load": "checks an unpickled DCP .metadata against DCP's own record types (every file kind "
                                         "is checked in this one module, before any runtime sees it)",
}
"""Known exceptions to TORCH_HOME, each with its reason."""

FIT_CORE = "lightning_fleet.fit"
"""The neutral fit core: it imports no Lightning package and no runtime's package (it reaches a runtime through the
runtime table and the Backend protocol, Lightning through the faces that call it), and only the strategy imports it."""
LIGHTNING = frozenset({"lightning", "pytorch_lightning", "lightning_fabric"})
"""Lightning's packages."""
RUNTIME_PACKAGES = ("lightning_fleet.runtime.deepspeed", "lightning_fleet.runtime.torch", "deepspeed")
"""The runtimes' own packages (the fit core names none)."""
STRATEGY = "lightning_fleet.strategy"
"""The Lightning adapter: only the modules above it import it."""
ABOVE_THE_STRATEGY = {
    "lightning_fleet": "its lazy ``FleetStrategy`` attribute (``__getattr__``): ``from lightning_fleet import FleetStrategy``",
    "lightning_fleet.calibrate.probe": "trains a probe model through FleetStrategy to measure the framework's own time",
}
"""The modules that import the strategy, each with its reason: kept minimal (the calibration command reaches it only
through the probe; registration and pl/ by name, see the module docstring)."""


# --- reading the source ----------------------------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    relative = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    """Every lightning_fleet module, by dotted name."""
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(module: str, path: Path, level: int, name: str | None) -> str:
    """The absolute name a (possibly relative) ``from`` import refers to."""
    if not level:
        return name or ""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    base = package.rsplit(".", level - 1)[0] if level > 1 else package
    return f"{base}.{name}" if name else base


def _nearest_module(name: str) -> str:
    """A lightning_fleet name as the module that holds it: itself, or the nearest package above it that is a file."""
    while name not in modules() and "." in name:
        name = name.rpartition(".")[0]
    return name


def _statements(tree: ast.AST, *, in_functions: bool) -> list[ast.stmt]:
    """The import statements of a parsed file: all of them, or only those its import runs (none inside a function)."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif in_functions or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return found


def imported_by(path: Path, *, in_functions: bool = True) -> set[str]:
    """Every module the file imports, at any depth or (``in_functions=False``) only those its import runs; internal
    names resolved to their module files."""
    module = _module_name(path)
    found: set[str] = set()
    for node in _statements(ast.parse(path.read_text(), str(path)), in_functions=in_functions):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, path, node.level, node.module)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                found.add(submodule if submodule in modules() else source)
    return {_nearest_module(name) if name.split(".")[0] == "lightning_fleet" else name for name in found}


@cache
def graph() -> dict[str, frozenset[str]]:
    """lightning_fleet module -> the lightning_fleet modules it imports (not itself)."""
    return {name: _internal(imported_by(path), name) for name, path in modules().items()}


def _internal(imports: set[str], name: str) -> frozenset[str]:
    """The lightning_fleet modules among ``imports`` of module ``name``, itself left out."""
    return frozenset(i for i in imports if i in modules() and i != name)


def _top(name: str) -> str:
    return name.split(".")[0]


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _packages_above(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def loaded_by(name: str) -> dict[str, list[str]]:
    """Every lightning_fleet module that ``name`` and what it imports can load, each with the chain of imports that
    reaches it. An imported module counts with all its imports (its functions may be called); a package above one
    counts with those its ``__init__.py`` runs on import (``lightning_fleet``'s lazy ``FleetStrategy`` is not loaded by
    importing ``lightning_fleet.planning``)."""
    chains = {name: [name]}
    todo = [(name, True)]
    while todo:
        current, called = todo.pop(0)  # breadth first: the shortest chain to each
        imports = graph()[current] if called else _internal(imported_by(modules()[current], in_functions=False), current)
        for nxt, nxt_called in sorted({(i, True) for i in imports} | {(p, False) for p in _packages_above(current)}):
            if nxt in modules() and nxt not in chains:
                chains[nxt] = chains[current] + [nxt]
                todo.append((nxt, nxt_called))
    return chains


def find_cycle(edges: dict[str, frozenset[str]]) -> list[str] | None:
    """One cycle of the directed graph as [a, b, ..., a], or None when it has none (depth-first search, sorted order)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


# --- the checks ------------------------------------------------------------------------------------------------------


def test_the_scan_sees_every_module_and_imports_inside_functions() -> None:
    """The scan covers the package (the planning core, the strategy) and sees a function-level import (the lazy
    ``FleetStrategy`` of ``lightning_fleet/__init__.py``): the rules below are checked over real edges."""
    assert {PLANNING, f"{PLANNING}.search", STRATEGY, "lightning_fleet"} <= set(modules())
    assert STRATEGY in graph()["lightning_fleet"]


def test_planning_imports_only_the_standard_library_yaml_and_itself() -> None:
    offenders = {
        name: sorted(
            i for i in imported_by(path)
            if not (_top(i) in sys.stdlib_module_names or _top(i) in PLANNING_MAY_IMPORT or _within(i, PLANNING))
        )
        for name, path in modules().items() if _within(name, PLANNING)
    }
    assert not {k: v for k, v in offenders.items() if v}, "the planning core imports beyond stdlib, yaml and itself"


def test_pure_modules_load_neither_torch_lightning_nor_deepspeed() -> None:
    offenders = []
    for name in sorted(PURE_MODULES & set(modules())):
        for loaded, chain in loaded_by(name).items():
            heavy = sorted(i for i in imported_by(modules()[loaded]) if _top(i) in HEAVY)
            if heavy:
                offenders.append(f"{' -> '.join(chain)} imports {', '.join(heavy)}")
    assert not offenders, "pure modules load heavy packages:\n" + "\n".join(offenders)


def test_only_the_deepspeed_runtime_imports_deepspeed() -> None:
    offenders = sorted(
        name for name, path in modules().items()
        if not _within(name, DEEPSPEED_HOME) and name not in DEEPSPEED_ELSEWHERE
        and any(_top(i) == "deepspeed" for i in imported_by(path))
    )
    assert not offenders, f"deepspeed is imported outside {DEEPSPEED_HOME}: {offenders}"


def test_only_the_torch_runtime_imports_torchs_parallel_stack() -> None:
    offenders = sorted(
        f"{name} ({i})" for name, path in modules().items() if not _within(name, TORCH_HOME) and name not in TORCH_ELSEWHERE
        for i in imported_by(path) if any(_within(i, package) for package in TORCH_PARALLEL)
    )
    assert not offenders, f"torch's parallel stack is imported outside {TORCH_HOME}: {offenders}"
    assert any(_within(i, "torch.distributed.checkpoint") for i in imported_by(modules()[f"{TORCH_HOME}.dcp"]))  # the rule bites


def test_only_the_modules_above_the_strategy_import_it() -> None:
    offenders = sorted(
        name for name, edges in graph().items()
        if not _within(name, STRATEGY) and name not in ABOVE_THE_STRATEGY and any(_within(i, STRATEGY) for i in edges)
    )
    assert not offenders, f"modules below the strategy import it: {offenders}"


def test_the_fit_core_names_neither_lightning_nor_a_runtime_and_only_the_strategy_imports_it() -> None:
    own = imported_by(modules()[FIT_CORE])
    named = sorted(i for i in own if _top(i) in LIGHTNING or any(_within(i, p) for p in RUNTIME_PACKAGES))
    assert not named, f"{FIT_CORE} imports {named}: hand it values (Ranks, Backend) instead"
    importers = sorted(name for name, edges in graph().items() if name != FIT_CORE and any(_within(i, FIT_CORE) for i in edges))
    assert importers == [STRATEGY], f"{FIT_CORE} is imported by {importers}"


def test_every_known_exception_still_applies() -> None:
    """An exception whose module is gone, or no longer does what it excuses, is removed from its list."""
    stale = [f"DEEPSPEED_ELSEWHERE: {name}" for name in DEEPSPEED_ELSEWHERE
             if name not in modules() or not any(_top(i) == "deepspeed" for i in imported_by(modules()[name]))]
    stale += [f"TORCH_ELSEWHERE: {name}" for name in TORCH_ELSEWHERE
              if name not in modules() or not any(_within(i, p) for i in imported_by(modules()[name]) for p in TORCH_PARALLEL)]
    stale += [f"ABOVE_THE_STRATEGY: {name}" for name in ABOVE_THE_STRATEGY
              if name not in modules() or not any(_within(i, STRATEGY) for i in graph()[name])]
    assert not stale, f"exceptions that no longer apply: {stale}"


def test_every_module_opens_with_what_lives_there_and_who_imports_it() -> None:
    """A newcomer reads each file's first lines to find its room: they say what lives there and what may import it."""
    silent = [name for name, path in modules().items()
              if "import" not in (ast.get_docstring(ast.parse(path.read_text())) or "").lower()]
    assert not silent, f"modules whose docstring does not say what may import them: {silent}"


def test_the_import_graph_has_no_cycle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(("edges", "expected"), [
    ({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"}), "d": frozenset({"a"})}, ["a", "b", "c", "a"]),
    ({"a": frozenset({"b", "c"}), "b": frozenset({"c"}), "c": frozenset()}, None),
    ({"a": frozenset({"a"})}, ["a", "a"]),
])
def test_the_cycle_finder_names_the_cycle(edges, expected) -> None:
    assert find_cycle(edges) == expected
