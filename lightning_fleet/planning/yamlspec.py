"""Strict mapping <-> frozen dataclass conversion for the YAML spec files, and the bounds on what a user may give.

Only ``yaml.safe_load``'s semantics are used (:class:`StrictLoader`: libyaml's parser where present, the safe
constructor), so Python tags (``!!python/object``) are refused; so are duplicate keys (PyYAML keeps the last one
silently), integers of more than 40 characters and a file that is not a small regular UTF-8 file (a FIFO would block,
``/dev/zero`` would fill memory). Unknown keys, missing required keys and values of the wrong type or out of range are
errors that name the key and the file; every value an error quotes goes through :func:`shown`, so a YAML alias bomb
(a few hundred bytes that expand to gigabytes) is quoted in a few dozen characters. :func:`ascii_int` reads integers
given as text (``int()`` also takes ``'١٢'``, ``'１２'`` and ``' 1_0 '``).

Pure (stdlib + yaml, the safe loader only); imported by the cluster and model specs, plan strings, the CLI, the
launcher's argument checks and calibration's cache.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import re
import reprlib
import stat
import types
import typing
from pathlib import Path
from typing import Any, Mapping

import yaml

from lightning_fleet.planning.errors import SpecError

MAX_SPEC_BYTES = 1 << 20
"""Largest spec file read (1 MiB; the biggest shipped preset is under 2 kB): a bigger one is refused, not parsed."""
MAX_SPEC_INT = 2**53
"""Largest magnitude of an integer in a spec file: every such integer is exact as a float, so products of a few of them
(parameters, bytes, FLOPs) stay finite."""
MAX_SPEC_NUMBER = 1e30
"""Largest magnitude of a number (float) in a spec file: products of up to ten of them stay below float's 1.8e308."""
MAX_YAML_VALUES = 1 << 20
"""Most values (scalars, lists and mappings, counted as if every alias were written out) a YAML document may expand to:
more than a 1 MiB file can hold without aliases, far fewer than an alias bomb ("billion laughs") makes of 1 kB."""
MAX_INT_CHARS = 40
"""Longest integer literal the loader converts (Python refuses more than 4300 digits, in time quadratic in them)."""
MAX_INT_DIGITS = 18
"""Most digits :func:`ascii_int` reads (below 2**63, what torch and DeepSpeed hold in an int64)."""
SHOWN_CHARS = 80
"""Longest quotation of a user's value in an error line (:func:`shown`)."""
MAX_NAME_CHARS = 200
"""Longest model or cluster name: a label printed in reports and table titles (whose highlighting is quadratic in its
length: a 100 kB name took 84 s to print), not data."""
MAX_SOURCE_CHARS = 4096
"""Longest spec file path or preset name given on the command line (Linux's PATH_MAX): longer is no file."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""Control characters (NUL, line breaks, escapes): never part of a name, a preset or a spec file path we accept."""


class _Shown(reprlib.Repr):
    """repr() bounded in depth, items and length: it visits at most a few items per level, so a value built of YAML
    aliases that would print as gigabytes costs microseconds."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.maxlevel = 2
        self.maxtuple = self.maxlist = self.maxset = self.maxfrozenset = self.maxdeque = self.maxarray = self.maxdict = 3
        self.maxstring = self.maxother = limit
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:  # str() of a huge int is quadratic, and refused past 4300 digits
            return f"<an integer of about {int(x.bit_length() * math.log10(2)) + 1} digits>"
        return super().repr_int(x, level)


def shown(value: Any, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error line: at most ``limit`` characters (longer ones keep their start and end around
    ``...``), one line, and bounded time and memory whatever the value (a YAML alias bomb, a 1 MB string, a huge int)."""
    text = _Shown(limit).repr(value)
    if len(text) > limit:
        text = text[: limit - 3 - limit // 4] + "..." + text[len(text) - limit // 4 :]
    return text


def ascii_int(text: str) -> int:
    """``text`` as an integer: an optional sign and 1 to 18 ASCII digits, nothing else (no spaces, no ``_``, none of the
    digits of other scripts that ``int()`` accepts). ValueError, with the reason, for anything else."""
    if not isinstance(text, str) or not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ValueError("not an integer in ASCII digits")
    if len(text.lstrip("+-")) > MAX_INT_DIGITS:
        raise ValueError(f"more than {MAX_INT_DIGITS} digits")
    return int(text)


class Strict:
    """What :class:`StrictLoader` adds to a safe loader: a key given twice in one mapping and an integer literal of
    more than :data:`MAX_INT_CHARS` characters are errors. Merge keys (``<<: *base``) may still be overridden, as YAML
    defines. (A mixin, so that the pure-Python ``yaml.SafeLoader`` can take it where libyaml is missing.)"""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"key {shown(key)} is given twice (lines {seen[key]} and {line}): keep one", key_node.start_mark,
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        if len(node.value) > MAX_INT_CHARS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value)} characters is out of range (at most {MAX_INT_CHARS})",
                node.start_mark,
            )
        return super().construct_yaml_int(node)


class StrictLoader(Strict, getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # type: ignore[misc]
    """``yaml.safe_load``'s loader with :class:`Strict`'s checks: libyaml's parser where installed (nesting beyond 1000
    levels is a YAMLError there), the pure-Python one otherwise (a RecursionError there, see :func:`load_yaml`)."""


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_yaml_int)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load(text)`` with :class:`StrictLoader`; yaml.YAMLError for malformed text, a duplicate key, a huge
    integer, nesting beyond libyaml's limit (a RecursionError of the pure-Python parser is turned into one), aliases that
    expand to more than :data:`MAX_YAML_VALUES` values, or a value that contains itself (``&a [*a]``)."""
    try:
        data = yaml.load(text, Loader=StrictLoader)  # noqa: S506 - StrictLoader is a SafeLoader
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
    _check_expansion(data)
    return data


def _check_expansion(data: Any) -> None:
    """yaml.YAMLError when ``data`` (lists and dicts that YAML aliases may share) holds more than MAX_YAML_VALUES values
    written out, or contains itself; each shared value is visited once, so an alias bomb is caught in microseconds."""
    sizes: dict[int, int] = {}
    open_ids: set[int] = set()  # the containers on the path from the root to the one being visited
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, closing = stack.pop()
        if not isinstance(node, (list, dict)) or (not closing and id(node) in sizes):
            continue
        children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
        if closing:
            open_ids.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes.get(id(child), 1) for child in children)
            if sizes[id(node)] > MAX_YAML_VALUES:
                raise yaml.YAMLError(f"its aliases expand it to more than {MAX_YAML_VALUES:,} values: write the values out")
            continue
        if id(node) in open_ids:
            raise yaml.YAMLError("a value contains itself (an alias inside its own anchor): write the values out")
        open_ids.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in children if isinstance(child, (list, dict)))


def read_yaml(path: str | Path, what: str) -> dict[str, Any]:
    """Load a YAML mapping from a regular file of at most :data:`MAX_SPEC_BYTES` UTF-8 bytes (:func:`load_yaml`);
    ``what`` names the file kind in errors. A FIFO, a device or a directory is refused before it is read."""
    path = Path(path)
    name = shown(str(path), 200)
    text = _read_text(path, what, name)
    try:
        data = load_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or (str(err).splitlines() or [type(err).__name__])[0]
        raise SpecError(f"{what} file {name} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        got = "nothing (an empty file)" if data is None else type(data).__name__
        raise SpecError(f"{what} file {name} must hold a mapping of keys, got {got}")
    return data


def _read_text(path: Path, what: str, name: str) -> str:
    """The file's text: opened without blocking (a FIFO), checked to be a regular file, at most MAX_SPEC_BYTES read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise SpecError(f"cannot read {what} file {name}: {err.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SpecError(f"{what} file {name} is {_file_kind(mode)}, not a regular file: give the path of a YAML file")
        try:
            data = f.read(MAX_SPEC_BYTES + 1)
        except OSError as err:
            raise SpecError(f"cannot read {what} file {name}: {err.strerror}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise SpecError(f"{what} file {name} is larger than {MAX_SPEC_BYTES >> 20} MiB: a spec file is a few kB of YAML")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise SpecError(
            f"{what} file {name} is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start}): save it as UTF-8 YAML"
        ) from None


def _file_kind(mode: int) -> str:
    """What a non-regular file is, for an error line."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


def dump_yaml(data: Mapping[str, Any]) -> str:
    """Dump a plain mapping as YAML in the key order given."""
    return yaml.safe_dump(dict(data), sort_keys=False, default_flow_style=None, width=100)


def check_keys(data: Mapping[str, Any], allowed: typing.Iterable[str], required: typing.Iterable[str], where: str) -> None:
    """Raise SpecError naming the first unknown key, or the first missing required key."""
    if not isinstance(data, Mapping):
        raise SpecError(f"{where} must be a mapping of keys, got {type(data).__name__} {shown(data)}")
    allowed = list(allowed)
    for key in data:
        if key not in allowed:
            raise SpecError(f"unknown key {shown(key)} in {where} (known keys: {', '.join(allowed)})")
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
            raise SpecError(f"{where} must be a list, got {shown(value)}")
        return tuple(convert(args[0], item, f"{where}[{i}]") for i, item in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise SpecError(f"{where} must be true or false, got {shown(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{where} must be an integer, got {shown(value)}")
        if abs(value) > MAX_SPEC_INT:
            raise SpecError(f"{where} must be an integer of magnitude at most 2**53, got {shown(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or isinstance(value, float) and math.isnan(value):
            raise SpecError(f"{where} must be a number, got {shown(value)}")
        if not abs(value) <= MAX_SPEC_NUMBER:
            raise SpecError(f"{where} must be a number of magnitude at most {MAX_SPEC_NUMBER:g}, got {shown(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise SpecError(f"{where} must be a string, got {shown(value)}")
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
            raise SpecError(f"{where}{name} must be > 0, got {shown(value)}")


def require_non_negative(where: str, **values: float) -> None:
    """Raise SpecError for the first value that is < 0."""
    for name, value in values.items():
        if value < 0:
            raise SpecError(f"{where}{name} must be >= 0, got {shown(value)}")


def require_name(where: str, name: Any) -> None:
    """Raise SpecError unless ``name`` is a non-empty string of at most :data:`MAX_NAME_CHARS` characters without
    control characters (a NUL, a line break or a terminal escape in a name would corrupt every report that prints it)."""
    if not isinstance(name, str) or not name.strip():
        raise SpecError(f"{where}name must be a non-empty string, got {shown(name)}")
    if len(name) > MAX_NAME_CHARS:
        raise SpecError(f"{where}name is {len(name):,} characters long, more than {MAX_NAME_CHARS}: give a short label")
    control = _CONTROL.search(name)
    if control:
        raise SpecError(f"{where}name {shown(name)} holds the control character {control.group()!r}: give printable text")


def check_source(text: str, what: str) -> None:
    """Raise SpecError unless ``text`` can name a spec file or a preset: at most :data:`MAX_SOURCE_CHARS` characters and
    no control character (checked before the file system is asked, which fails on such a path with an OSError)."""
    if len(text) > MAX_SOURCE_CHARS:
        raise SpecError(f"{what} {shown(text)} is {len(text):,} characters long, more than a path can be ({MAX_SOURCE_CHARS})")
    control = _CONTROL.search(text)
    if control:
        raise SpecError(f"{what} {shown(text)} holds the control character {control.group()!r}: no file or preset has such a name")


def require_at_most(where: str, bound: int, why: str, **values: int) -> None:
    """Raise SpecError for the first value above ``bound``; ``why`` says what the bound protects."""
    for name, value in values.items():
        if value > bound:
            raise SpecError(f"{where}{name} must be at most {bound:,} ({why}), got {shown(value)}")
