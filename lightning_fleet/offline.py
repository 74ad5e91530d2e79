"""Profile a user's module offline: ``fleet plan --module pkg.mod:Class`` (and ``fleet estimate --module ...``).

A dry run before asking for GPUs: the module class is imported, built once on the meta device (no weights
allocated; on the CPU, with a one-line note, when its constructor cannot run on meta), given an example batch and
measured by :func:`lightning_fleet.profiling.profile` exactly as ``strategy="fleet"`` measures it at ``fit`` (an
isolated copy; the module is never changed). No GPU and no process group are needed.

Where its parts come from:

- the class: ``--module`` (``pkg.mod:Class``, ``pkg.mod.Class`` or ``path/to/file.py:Class``), or the
  ``model.class_path`` of a LightningCLI ``--config``;
- its arguments: the config's ``model`` section (``init_args``, or the section itself when the CLI fixes the class),
  updated by ``--init-args``; they are checked against the constructor's signature as LightningCLI checks them
  (jsonargparse, which LightningCLI uses), so a config that trains with LightningCLI builds the same module here;
- the example batch: ``--batch`` (the small grammar of :func:`parse_batch`), else the first batch of a
  LightningDataModule's ``train_dataloader()`` (``--datamodule`` or the config's ``data`` section), read as the
  strategy reads it (:func:`lightning_fleet.data.example_batch`);
- precision and global batch: ``--precision`` / ``--global-batch-size``, else the config's ``trainer.precision`` and
  FleetStrategy ``global_batch_size``, else 32-true and the example batch's size times the world size (what
  ``strategy="fleet"`` uses by default).

A LightningModule is profiled through its ``training_step``; a plain ``nn.Module`` (no ``training_step``) as
``module(batch)``, the forward only (the loss is not counted; backward is priced as 2x forward either way). The
axes the strategy would pin for this module (the micro-batch when the loss depends on it, gas=1 under manual
optimization) are pinned here too (:meth:`OfflineModule.pinned`).

Every failure the user can cause is one FleetError line. Imports torch, the profiler, the module's hooks, the data
reader and (per call) jsonargparse, yaml and the user's code; imported lazily by :mod:`lightning_fleet.cli` only
when a module is planned, so ``fleet plan --model`` never loads torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import yaml
from torch import nn

from lightning_fleet.decide import ModuleFacts, module_pins
from lightning_fleet.hooks import module_hooks
from lightning_fleet.planning import FleetError, ModelSpec, PartialPlan, Precision
from lightning_fleet.planning.model import LIGHTNING_PRECISIONS
from lightning_fleet.planning.yamlspec import load_yaml, read_yaml, shown
from lightning_fleet.profiling import Profile, batch_size_of, profile
from lightning_fleet.runtime.base import ModuleHooks

LEGACY_PRECISIONS = {"16": "16-mixed", "bf16": "bf16-mixed"}
"""Lightning's short spellings and what its Trainer turns them into (lightning.fabric.connector, ``_convert_precision``)."""
_FORWARD_ONLY = "note     a plain nn.Module: profiled as module(batch), the forward only (the loss is not counted)"
"""The report line for a module without ``training_step``."""
_ERROR_CHARS = 240
"""Longest message quoted from the user's code in an error line."""


# --- the example batch: a small grammar ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorShape:
    """One tensor of an example batch: a torch dtype name and its dims (the first is the batch dimension)."""

    dtype: str
    """A torch dtype name: float, float32, bfloat16, half, long, int64, int, bool, uint8, ..."""
    shape: tuple[int, ...]
    """Positive dims, at least one."""


BATCH_EXAMPLES = '"long[8,512]", "(long[8,512], long[8,512])" or "{input_ids: long[8,512], labels: long[8,512]}"'
"""What a ``--batch`` error suggests (``fleet plan --help`` states the whole grammar)."""

_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<int>-?[0-9]{1,18})|(?P<punct>[()\[\]{},:])|(?P<bad>\S))")
_CLOSE = {"(": ")", "[": "]", "{": "}"}


class _BatchParser:
    """Recursive descent over the tokens of a ``--batch`` string; every error names the position."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens = [(m.lastgroup or "", m.group(m.lastgroup or 0), m.start(m.lastgroup or 0)) for m in _TOKEN.finditer(text)]
        self.tokens = [t for t in self.tokens if t[0]]
        self.i = 0

    def fail(self, expected: str) -> FleetError:
        if self.i < len(self.tokens):
            _, value, pos = self.tokens[self.i]
            found = f"{value!r} at position {pos + 1}"
        else:
            found = "the end"
        return FleetError(
            f"--batch {self.text!r}: expected {expected}, found {found}; write e.g. {BATCH_EXAMPLES} (fleet plan --help)"
        )

    def peek(self) -> str | None:
        return self.tokens[self.i][1] if self.i < len(self.tokens) else None

    def take(self, kind: str, expected: str) -> str:
        if self.i >= len(self.tokens) or self.tokens[self.i][0] != kind:
            raise self.fail(expected)
        self.i += 1
        return self.tokens[self.i - 1][1]

    def expect(self, punct: str) -> None:
        if self.peek() != punct:
            raise self.fail(repr(punct))
        self.i += 1

    def batch(self) -> Any:
        opening = self.peek()
        if opening in _CLOSE:
            self.i += 1
            items = self.items(_CLOSE[opening], mapping=opening == "{")
            return dict(items) if opening == "{" else tuple(items) if opening == "(" else list(items)
        return self.tensor()

    def items(self, closing: str, *, mapping: bool) -> list[Any]:
        out: list[Any] = []
        while self.peek() != closing:
            if mapping:
                key = self.take("name", "a key name")
                self.expect(":")
                out.append((key, self.batch()))
            else:
                out.append(self.batch())
            if self.peek() != closing:
                self.expect(",")
        self.i += 1
        if not out:
            raise self.fail("at least one tensor inside the brackets")
        return out

    def tensor(self) -> TensorShape:
        name = self.take("name", "a dtype such as long or float")
        if not isinstance(getattr(torch, name, None), torch.dtype):
            self.i -= 1
            raise self.fail("a torch dtype name (float, bfloat16, half, long, int, bool, uint8, ...)")
        self.expect("[")
        dims = [self.dim()]
        while self.peek() == ",":
            self.i += 1
            dims.append(self.dim())
        self.expect("]")
        return TensorShape(dtype=name, shape=tuple(dims))

    def dim(self) -> int:
        value = int(self.take("int", "a dimension (a positive integer)"))
        if value < 1:
            self.i -= 1
            raise self.fail("a positive dimension")
        return value


def parse_batch(text: str) -> Any:
    """The structure a ``--batch`` string describes: :class:`TensorShape` leaves in tuples, lists and dicts
    (FleetError, one line with the position and the grammar, for anything else)."""
    parser = _BatchParser(text)
    try:
        tree = parser.batch()
    except RecursionError:
        raise FleetError(f"--batch {shown(text)} is nested too deeply; write e.g. {BATCH_EXAMPLES}") from None
    if parser.i != len(parser.tokens):
        raise parser.fail("the end of the batch")
    return tree


def materialize(tree: Any, device: torch.device) -> Any:
    """The batch a :func:`parse_batch` tree describes, on ``device``: meta tensors there; elsewhere integer and bool
    tensors are zeros (valid token ids and class labels) and floating ones standard normal from a generator of their
    own (seed 0; the process's RNG streams are not touched)."""
    generator = torch.Generator().manual_seed(0)

    def make(leaf: TensorShape) -> torch.Tensor:
        dtype = getattr(torch, leaf.dtype)
        if device.type == "meta":
            return torch.empty(leaf.shape, dtype=dtype, device=device)
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(leaf.shape, generator=generator, dtype=dtype).to(device)
        return torch.zeros(leaf.shape, dtype=dtype, device=device)

    def walk(node: Any) -> Any:
        if isinstance(node, TensorShape):
            return make(node)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return type(node)(walk(v) for v in node)

    return walk(tree)


def describe_batch(batch: Any) -> str:
    """A batch in the ``--batch`` grammar (its tensors' dtypes and shapes), for the report."""
    if isinstance(batch, torch.Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')}[{','.join(str(d) for d in batch.shape)}]"
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{k}: {describe_batch(v)}" for k, v in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        inner = ", ".join(describe_batch(v) for v in batch)
        return f"[{inner}]" if isinstance(batch, list) else f"({inner})"
    return type(batch).__name__


# --- the LightningCLI config -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LightningConfig:
    """What a LightningCLI config file says about the module, its data and the job (the rest of it is ignored)."""

    model_class: str | None = None
    """``model.class_path`` (None: the CLI that reads the file fixes the class)."""
    model_args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The model's constructor arguments."""
    data_class: str | None = None
    """``data.class_path``."""
    data_args: dict[str, Any] | None = None
    """The datamodule's constructor arguments (None: no ``data`` section)."""
    precision: str | None = None
    """``trainer.precision``."""
    global_batch_size: int | None = None
    """``trainer.strategy.init_args.global_batch_size`` (FleetStrategy's)."""


def read_config(path: str) -> LightningConfig:
    """The parts of a LightningCLI config that plan a module (``fit:`` sections are read too)."""
    data = read_yaml(path, "LightningCLI config")
    if not {"model", "data", "trainer"} & set(data) and isinstance(data.get("fit"), dict):
        data = data["fit"]
    model_class, model_args = _section(data.get("model"), f"{path}: model")
    data_class, data_args = _section(data.get("data"), f"{path}: data")
    trainer = data.get("trainer") or {}
    if not isinstance(trainer, dict):
        raise FleetError(f"{path}: trainer must be a mapping, got {type(trainer).__name__}")
    strategy = trainer.get("strategy")
    fleet_args = (strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}
    gbs = fleet_args.get("global_batch_size") if isinstance(fleet_args, dict) else None
    if gbs is not None and (not isinstance(gbs, int) or isinstance(gbs, bool)):
        raise FleetError(f"{path}: trainer.strategy.init_args.global_batch_size must be an integer, got {shown(gbs)}")
    precision = trainer.get("precision")
    return LightningConfig(
        model_class=model_class,
        model_args=model_args or {},
        data_class=data_class,
        data_args=data_args if "data" in data else None,
        precision=None if precision is None else str(precision),
        global_batch_size=gbs,
    )


def _section(value: Any, where: str) -> tuple[str | None, dict[str, Any] | None]:
    """(class_path, init args) of a config section: ``{class_path, init_args}``, a bare class path, or the arguments
    themselves (a CLI with a fixed class)."""
    if value is None:
        return None, None
    if isinstance(value, str):
        return value, {}
    if not isinstance(value, dict):
        raise FleetError(f"{where} must be a mapping or a class path, got {type(value).__name__}")
    if "class_path" not in value:
        return None, dict(value)
    args = value.get("init_args") or {}
    if not isinstance(args, dict):
        raise FleetError(f"{where}.init_args must be a mapping, got {type(args).__name__}")
    extra = {k: v for k, v in value.items() if k not in ("class_path", "init_args", "dict_kwargs")}
    return str(value["class_path"]), {**args, **extra, **(value.get("dict_kwargs") or {})}


def parse_mapping(text: str | None, flag: str) -> dict[str, Any]:
    """A JSON or YAML mapping given on the command line (``yaml.safe_load``); {} for None or an empty string."""
    if text is None:
        return {}
    try:
        value = load_yaml(text)  # safe_load, refusing duplicate keys and alias bombs
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise FleetError(
            f"{flag} {text!r} is not JSON or YAML ({problem}); write a mapping such as '{{num_layers: 4}}'"
        ) from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise FleetError(f"{flag} {text!r} must be a mapping of argument names to values, such as '{{num_layers: 4}}'")
    return value


# --- the class and its construction ----------------------------------------------------------------------------------


def load_class(spec: str, flag: str, base: type) -> type:
    """The class ``spec`` names: ``pkg.mod:Class``, ``pkg.mod.Class`` (importable from the current directory or
    PYTHONPATH) or ``path/to/file.py:Class``; it must subclass ``base``."""
    if ":" in spec:
        where, _, attr = spec.rpartition(":")
    else:
        where, _, attr = spec.rpartition(".")
    if not where or not attr:
        raise FleetError(f"{flag} {spec!r}: expected pkg.module:Class, pkg.module.Class or path/to/file.py:Class")
    module = _import_file(where, flag) if where.endswith(".py") or os.sep in where or "/" in where else _import(where, flag)
    found: Any = module
    for part in attr.split("."):
        if not hasattr(found, part):
            raise FleetError(f"{flag} {spec!r}: {module.__name__} has no attribute {part!r}")
        found = getattr(found, part)
    if not isinstance(found, type) or not issubclass(found, base):
        kind = found.__name__ if isinstance(found, type) else type(found).__name__
        raise FleetError(f"{flag} {spec!r} is not a subclass of {_public_name(base)} (it is {kind})")
    return found


def _public_name(cls: type) -> str:
    """How users import ``cls``: torch.nn.Module, lightning.pytorch.LightningDataModule."""
    package = {"torch.nn.modules.module": "torch.nn", "lightning.pytorch.core.datamodule": "lightning.pytorch"}
    return f"{package.get(cls.__module__, cls.__module__)}.{cls.__qualname__}"


def _import(name: str, flag: str) -> Any:
    """Import ``name`` with the current directory on the path (where ``python -m`` would find it)."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name and (name == err.name or name.startswith(err.name + ".")):
            raise FleetError(
                f"{flag}: cannot import {name} (no module named {err.name!r}); run from the directory that holds it or add "
                "that directory to PYTHONPATH"
            ) from None
        raise FleetError(f"{flag}: importing {name} failed: {_one_line(err)}") from None
    except Exception as err:
        raise FleetError(f"{flag}: importing {name} failed: {_one_line(err)}") from None


def _import_file(path: str, flag: str) -> Any:
    """Import a Python file as a module, its directory on the path (as running it as a script would put it)."""
    file = Path(path)
    if not file.is_file():
        raise FleetError(f"{flag}: no such file {path!r}")
    name = file.stem
    while name in sys.modules and getattr(sys.modules[name], "__file__", None) != str(file.resolve()):
        name += "_"
    if name in sys.modules:
        return sys.modules[name]
    folder = str(file.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, file.resolve())
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise FleetError(f"{flag}: importing {path} failed: {_one_line(err)}") from None
    return module


def _one_line(err: BaseException) -> str:
    text = f"{type(err).__name__}: {' '.join(str(err).split())}".rstrip(": ")
    return text if len(text) <= _ERROR_CHARS else text[: _ERROR_CHARS - 3] + "..."


def _checked_args(cls: type, args: dict[str, Any], key: str, where: str) -> Any:
    """A jsonargparse parser of ``cls``'s signature (as LightningCLI adds a class) and ``args`` parsed by it: types
    checked, unknown names refused, nested ``class_path`` values resolved, defaults filled in."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    try:
        parser.add_class_arguments(cls, key, fail_untyped=False, sub_configs=True)
    except Exception as err:
        raise FleetError(f"cannot read the signature of {cls.__qualname__}: {_one_line(err)}") from None
    try:
        config = parser.parse_object({key: args})
    except Exception as err:
        raise FleetError(f"{cls.__qualname__} arguments ({where}): {' '.join(str(err).split())}") from None
    return parser, config


def build(cls: type, args: dict[str, Any], *, key: str, where: str, on_meta: bool) -> tuple[Any, str]:
    """``cls`` built from ``args`` (checked first), once: under ``torch.device("meta")`` when ``on_meta`` (no weights
    allocated), on the CPU when that fails. Returns the object and a note ('' when it was built as asked)."""
    parser, config = _checked_args(cls, args, key, where)
    failure = ""
    if on_meta:
        try:
            with torch.device("meta"), _user_output():
                return _instantiate(parser, config)[key], ""
        except Exception as err:
            failure = _one_line(_cause(err))
    try:
        with _user_output():
            built = _instantiate(parser, config)[key]
    except Exception as err:
        raise FleetError(f"building {cls.__qualname__} failed: {_one_line(_cause(err))}") from None
    note = f"built on the CPU (weights allocated): building it on the meta device failed: {failure}" if failure else ""
    return built, note


def _instantiate(parser: Any, config: Any) -> Any:
    """The objects of a parsed config (jsonargparse's ``instantiate``, ``instantiate_classes`` before 4.49)."""
    method = getattr(parser, "instantiate", None) or parser.instantiate_classes
    return method(config)


def _cause(err: BaseException) -> BaseException:
    """The user's exception behind jsonargparse's wrapper, where there is one."""
    return err.__cause__ if err.__cause__ is not None and type(err).__module__.startswith("jsonargparse") else err


@contextlib.contextmanager
def _user_output() -> Iterator[None]:
    """The user's code prints to stderr while it runs here: stdout holds the plan (one JSON object with --json)."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _lightning_training_step_missing(module: nn.Module) -> bool:
    """A LightningModule that does not override ``training_step`` (Lightning's own only warns and returns None)."""
    step = getattr(type(module), "training_step", None)
    if step is None:
        return False
    return getattr(step, "__module__", "").startswith(("lightning.pytorch.", "pytorch_lightning."))


def lightning_precision(name: str, source: str = "--precision") -> Precision:
    """The cost model's precision for a Lightning spelling (``32-true``, ``bf16-mixed``, ...; ``16``, ``bf16`` too);
    ``source`` names where the spelling came from in the error."""
    unified = LEGACY_PRECISIONS.get(name, name)
    if unified not in LIGHTNING_PRECISIONS:
        raise FleetError(f"{source} {name!r}: strategy 'fleet' trains {', '.join(LIGHTNING_PRECISIONS)}")
    return LIGHTNING_PRECISIONS[unified]


# --- the request and its answer --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleRequest:
    """What ``fleet plan``/``fleet estimate`` was asked about the user's module (the flags as typed; None: not given)."""

    module: str | None = None
    """``--module``: the class."""
    init_args: str | None = None
    """``--init-args``: a JSON or YAML mapping, over the config's."""
    config: str | None = None
    """``--config``: a LightningCLI config file."""
    batch: str | None = None
    """``--batch``: the example batch (:func:`parse_batch`)."""
    datamodule: str | None = None
    """``--datamodule``: a LightningDataModule class giving the example batch."""
    datamodule_args: str | None = None
    """``--datamodule-args``: its arguments, over the config's ``data`` section."""
    precision: str | None = None
    """``--precision``: Lightning's spelling."""
    global_batch_size: int | None = None
    """``--global-batch-size``."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OfflineModule:
    """A user's module profiled offline: the spec the planner prices, its hooks, and how it was obtained."""

    spec: ModelSpec
    """The profiled module at the job's global batch and precision."""
    hooks: ModuleHooks
    """What it offers a runtime (its real hooks)."""
    profile: Profile
    """How the profiler measured it."""
    class_path: str
    """``pkg.mod:Class`` of the module."""
    on_meta: bool
    """Built on the meta device (no weights allocated)."""
    batch_size: int
    """Samples of the example batch (the micro-batch kept when the loss depends on it)."""
    lines: tuple[str, ...]
    """What was built, from what, and the profiler's report: printed above the plan."""

    def pinned(self, fixed: PartialPlan) -> tuple[PartialPlan, tuple[str, ...]]:
        """``fixed`` (the user's ``--fix``) with the axes ``strategy="fleet"`` would pin for this module, and a line
        for each (the same rule as at fit: :func:`lightning_fleet.decide.module_pins`)."""
        facts = ModuleFacts(spec=self.spec, hooks=self.hooks, loader_batch_size=self.batch_size,
                            batch_dependent=self.profile.batch_dependent)
        pinned, notes = module_pins(facts, fixed, pin_with="--fix mbs=N")
        return pinned, tuple(notes)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: the class, where it was built, the profiling method and the report lines."""
        return {
            "class_path": self.class_path,
            "built_on": "meta" if self.on_meta else "cpu",
            "profiling": self.profile.method.value,
            "batch_dependent": self.profile.batch_dependent,
            "report": list(self.lines),
        }


def profile_offline(request: ModuleRequest, *, world_size: int) -> OfflineModule:
    """Build the module a request names (once, on meta when possible), get its example batch and profile it; the
    global batch defaults to the config's, else the example batch's size times ``world_size``."""
    config = read_config(request.config) if request.config else LightningConfig()
    class_path = request.module or config.model_class
    if class_path is None:
        raise FleetError(
            f"--config {request.config} has no model.class_path: name the module's class with --module pkg.mod:Class"
        )
    tree = parse_batch(request.batch) if request.batch is not None else None
    precision_name = request.precision or config.precision or "32-true"
    precision = lightning_precision(
        precision_name, "--precision" if request.precision else f"--config {request.config}: trainer.precision"
    )
    cls = load_class(class_path, "--module" if request.module else f"--config {request.config}: model.class_path", nn.Module)
    args = {**config.model_args, **parse_mapping(request.init_args, "--init-args")}
    where = _sources(("--config model", config.model_args), ("--init-args", request.init_args))
    module, build_note = build(cls, args, key="model", where=where, on_meta=True)
    if _lightning_training_step_missing(module):
        raise FleetError(
            f"{cls.__qualname__} is a LightningModule without training_step: implement it (profiling runs it on the example "
            "batch)"
        )
    on_meta = not build_note
    batch, source = _example_batch(request, config, tree, on_meta)
    samples = batch_size_of(batch)
    if samples < 1:
        raise FleetError(f"the example batch {describe_batch(batch)} ({source}) holds no tensor with a batch dimension")
    gbs, gbs_source = _global_batch(request, config, samples, world_size)
    with _user_output():
        measured = profile(module, batch, global_batch_size=gbs, precision=precision, name=cls.__name__)
        hooks = module_hooks(module, sparse_params=measured.sparse_params, pipeline_problem=measured.pipeline_problem)
    forward_only = not callable(getattr(module, "training_step", None))
    lines = (
        f"module   {class_path}: {cls.__qualname__}({_short_args(args)}) built "
        + ("on the meta device (no weights allocated)" if on_meta else build_note),
        f"batch    {describe_batch(batch)} ({source}); precision {precision_name}; global batch {gbs} ({gbs_source})",
        *([_FORWARD_ONLY] if forward_only else []),
        *measured.report_lines(),
    )
    return OfflineModule(
        spec=measured.spec,
        hooks=hooks,
        profile=measured,
        class_path=class_path,
        on_meta=on_meta,
        batch_size=samples,
        lines=lines,
    )


def _sources(*given: tuple[str, Any]) -> str:
    """Where constructor arguments came from, for an error line: the flags that gave some, else 'defaults'."""
    return ", ".join(name for name, value in given if value) or "defaults"


def _short_args(args: dict[str, Any]) -> str:
    text = ", ".join(f"{k}={v!r}" for k, v in args.items())
    return text if len(text) <= 120 else text[:117] + "..."


def _example_batch(request: ModuleRequest, config: LightningConfig, tree: Any, on_meta: bool) -> tuple[Any, str]:
    """The example batch and where it came from: ``--batch`` (meta tensors for a meta module), else a datamodule's
    first training batch."""
    if tree is not None:
        return materialize(tree, torch.device("meta" if on_meta else "cpu")), "--batch"
    data_class = request.datamodule or config.data_class
    if data_class is None:
        hint = " (the config's data: section has no class_path: name its class with --datamodule)" if config.data_args else ""
        raise FleetError(
            "planning a module needs an example batch: --batch \"(long[8,512], long[8,512])\" or --datamodule pkg.mod:Class"
            + hint
        )
    from lightning.pytorch import LightningDataModule

    flag = "--datamodule" if request.datamodule else f"--config {request.config}: data.class_path"
    cls = load_class(data_class, flag, LightningDataModule)
    args = {**(config.data_args or {}), **parse_mapping(request.datamodule_args, "--datamodule-args")}
    where = _sources(("--config data", config.data_args), ("--datamodule-args", request.datamodule_args))
    datamodule, _ = build(cls, args, key="data", where=where, on_meta=False)
    return _first_batch(datamodule, cls.__qualname__), f"the first training batch of {cls.__qualname__}"


def _first_batch(datamodule: Any, name: str) -> Any:
    """The first ``batch_size`` samples of the datamodule's training data, read as the strategy reads them."""
    from lightning_fleet.data import example_batch, inspect_training_loader

    try:
        with _user_output():
            datamodule.prepare_data()
            datamodule.setup("fit")
            loader = datamodule.train_dataloader()
    except Exception as err:
        raise FleetError(f"{name} gave no training data (prepare_data, setup('fit'), train_dataloader()): {_one_line(err)}; "
                         "or describe the batch with --batch") from None
    data = inspect_training_loader(loader)
    try:
        with _user_output():
            return example_batch(data, data.batch_size)
    except FleetError:
        raise
    except Exception as err:
        raise FleetError(f"reading the first batch of {name} failed: {_one_line(err)}") from None


def _global_batch(request: ModuleRequest, config: LightningConfig, samples: int, world_size: int) -> tuple[int, str]:
    if request.global_batch_size is not None:
        return request.global_batch_size, "--global-batch-size"
    if config.global_batch_size is not None:
        return config.global_batch_size, "the config's FleetStrategy global_batch_size"
    return samples * world_size, f"the example batch's {samples} samples x {world_size} devices, as strategy='fleet' defaults"


__all__ = [
    "BATCH_EXAMPLES",
    "LEGACY_PRECISIONS",
    "LIGHTNING_PRECISIONS",
    "LightningConfig",
    "ModuleRequest",
    "OfflineModule",
    "TensorShape",
    "build",
    "describe_batch",
    "lightning_precision",
    "load_class",
    "materialize",
    "parse_batch",
    "parse_mapping",
    "profile_offline",
    "read_config",
]
