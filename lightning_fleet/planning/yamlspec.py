"""Strict mapping <-> frozen dataclass conversion for the YAML spec files.

Only ``yaml.safe_load`` is used, so Python tags (``!!python/object``) are refused. Unknown keys,
missing required keys and values of the wrong type are errors that name the key and the file.

Pure (stdlib + yaml, ``safe_load`` only); imported by the cluster and model specs and by calibration's cache.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from lightning_fleet.planning.errors import SpecError


def read_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """Load a YAML file with ``yaml.safe_load``; ``what`` names the file kind in errors."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise SpecError(f"cannot read {what} file {str(path)!r}: {err.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(f"{what} file {str(path)!r} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{what} file {str(path)!r} must hold a mapping of keys, got {type(data).__name__}")
    return data


def dump_yaml(data: Mapping[str, Any]) -> str:
    """Dump a plain mapping as YAML in the key order given."""
    return yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=None, width=100)


def check_keys(data: Mapping[str, Any], allowed: typing.Iterable[str], required: typing.Iterable[str], where: str) -> None:
    """Raise SpecError naming the first unknown key, or the first missing required key."""
    if not isinstance(data, Mapping):
        raise SpecError(f"{where} must be a mapping of keys, got {type(data).__name__} {data!r}")
    allowed = list(allowed)
    for key in data:
        if key not in allowed:
            raise SpecError(f"unknown key {key!r} in {where} (known keys: {', '.join(allowed)})")
    for key in required:
        if key not in data:
            raise SpecError(f"missing key {key!r} in {where}")


def from_mapping(cls: type, data: Mapping[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from ``data``: keys are its fields, fields without default are required.

    Nested dataclass fields are built recursively; ``int``/``float``/``bool``/``str`` fields are
    type-checked so that ``nodes: "4"`` or ``memory_gib: true`` are errors naming the key.
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    check_keys(data, fields, required, where)
    hints = typing.get_type_hints(cls)
    kwargs = {name: convert(hints[name], value, f"{where}.{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except SpecError:
        raise
    except ValueError as err:  # PlanError and friends raised by __post_init__
        raise SpecError(f"{where}: {err}") from None


def convert(hint: Any, value: Any, where: str) -> Any:
    """Convert one YAML value to the annotated type, or raise SpecError naming ``where``."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return convert(inner[0], value, where)
    if dataclasses.is_dataclass(hint):
        return from_mapping(hint, value, where)
    if origin is tuple:
        if not isinstance(value, list):
            raise SpecError(f"{where} must be a list, got {value!r}")
        return tuple(convert(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{where} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{where} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SpecError(f"{where} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise SpecError(f"{where} must be a string, got {value!r}")
        return value
    return value


def to_mapping(obj: Any) -> Any:
    """Inverse of :func:`from_mapping`: a dataclass as nested plain dicts/lists, in field order."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, tuple):
        return [to_mapping(v) for v in obj]
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, float) and obj.is_integer():
        return int(obj)
    return obj


def require_positive(where: str, **values: float) -> None:
    """Raise SpecError for the first value that is not > 0."""
    for name, value in values.items():
        if not value > 0:
            raise SpecError(f"{where}{name} must be > 0, got {value!r}")


def require_non_negative(where: str, **values: float) -> None:
    """Raise SpecError for the first value that is < 0."""
    for name, value in values.items():
        if value < 0:
            raise SpecError(f"{where}{name} must be >= 0, got {value!r}")
