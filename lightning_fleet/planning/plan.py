"""Plan: one parallel layout, as a value.

String form (also ``str(plan)``)::

    dp=32,tp=8,pp=4,zero=1,mbs=2,gas=28,recompute=full,sp=false,vpp=1,offload=none

Keys may be left out when parsing: zero=0, mbs=1, recompute=none, sp=false, vpp=1, offload=none,
gas derived from the global batch size. ``order=tp-dp-pp`` (innermost axis first) is printed only
when it differs from the default placement.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Mapping

from lightning_fleet.planning.errors import PlanError


class Axis(StrEnum):
    """Mesh axes: data, tensor and pipeline parallel."""

    DP = "dp"
    TP = "tp"
    PP = "pp"


class Recompute(StrEnum):
    """Activation recomputation: none, selective (attention core), full (whole layers)."""

    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"


class Offload(StrEnum):
    """What lives in host memory: nothing, the optimizer (ZeRO-Offload), or optimizer and parameters (ZeRO-Infinity)."""

    NONE = "none"
    OPTIMIZER = "optimizer"
    OPTIMIZER_PARAMS = "optimizer+params"


DEFAULT_ORDER: tuple[Axis, ...] = (Axis.TP, Axis.DP, Axis.PP)
"""Default placement, innermost first: tp on consecutive ranks of a node, then dp, then pp."""

_KEYS = ("dp", "tp", "pp", "zero", "mbs", "gas", "recompute", "sp", "vpp", "offload", "order")


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A parallel layout and its batch split. Meshes and engines live in the strategy, never here."""

    dp: int
    """Data-parallel degree."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (stages)."""
    zero: int = 0
    """DeepSpeed ZeRO stage 0-3."""
    mbs: int = 1
    """Micro-batch size per data-parallel replica."""
    gas: int = 1
    """Micro-batches per optimizer step (gradient accumulation / pipeline micro-batches)."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation."""
    sp: bool = False
    """Sequence parallelism (Megatron style, needs tp > 1)."""
    vpp: int = 1
    """Virtual pipeline stages per device (interleaved 1F1B, needs pp > 1)."""
    offload: Offload = Offload.NONE
    """Host offload."""
    order: tuple[Axis, ...] = DEFAULT_ORDER
    """Placement of the axes on ranks, innermost (consecutive ranks) first."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "mbs", "gas", "vpp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"plan: {name} must be a positive integer, got {value!r}")
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise PlanError(f"plan: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if type(self.recompute) is not Recompute:
            object.__setattr__(self, "recompute", _enum(Recompute, self.recompute, "recompute"))
        if type(self.offload) is not Offload:
            object.__setattr__(self, "offload", _enum(Offload, self.offload, "offload"))
        if self.order is not DEFAULT_ORDER:
            object.__setattr__(self, "order", tuple(_enum(Axis, a, "order") for a in self.order))
        if self.order is not DEFAULT_ORDER and sorted(self.order) != sorted(Axis):
            raise PlanError(f"plan: order must name dp, tp and pp once each, got {'-'.join(self.order)}")
        if self.sp and self.tp == 1:
            raise PlanError("plan: sp=true needs tp > 1 (sequence parallelism splits along the tensor-parallel group)")
        if self.vpp > 1 and self.pp == 1:
            raise PlanError(f"plan: vpp={self.vpp} needs pp > 1 (virtual stages interleave a pipeline)")
        if self.offload is not Offload.NONE and self.zero == 0:
            raise PlanError(f"plan: offload={self.offload} needs zero >= 1 (DeepSpeed offloads ZeRO partitions)")
        if self.offload is Offload.OPTIMIZER_PARAMS and self.zero != 3:
            raise PlanError(f"plan: offload=optimizer+params needs zero=3, got zero={self.zero}")

    @property
    def world_size(self) -> int:
        """Devices the plan uses: dp * tp * pp."""
        return self.dp * self.tp * self.pp

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step: dp * mbs * gas."""
        return self.dp * self.mbs * self.gas

    def __str__(self) -> str:
        text = (
            f"dp={self.dp},tp={self.tp},pp={self.pp},zero={self.zero},mbs={self.mbs},gas={self.gas},"
            f"recompute={self.recompute},sp={str(self.sp).lower()},vpp={self.vpp},offload={self.offload}"
        )
        if self.order != DEFAULT_ORDER:
            text += f",order={'-'.join(self.order)}"
        return text

    def to_dict(self) -> dict[str, object]:
        """The plan as JSON-ready values (order as 'tp-dp-pp')."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["recompute"] = str(self.recompute)
        out["offload"] = str(self.offload)
        out["order"] = "-".join(self.order)
        return out

    def replace(self, **changes: object) -> "Plan":
        """A copy with some fields changed (validated again)."""
        return Plan(**{**{name: getattr(self, name) for name in _FIELDS}, **changes})

    def check(self, *, world_size: int, num_layers: int, num_heads: int, global_batch_size: int) -> None:
        """Raise PlanError naming every factor when the plan does not fit this world, model and batch."""
        problems = []
        if self.world_size != world_size:
            problems.append(f"dp({self.dp}) * tp({self.tp}) * pp({self.pp}) = {self.world_size} != world size {world_size}")
        if num_heads % self.tp:
            problems.append(f"tp({self.tp}) does not divide num_heads({num_heads})")
        if num_layers % (self.pp * self.vpp):
            problems.append(f"pp({self.pp}) * vpp({self.vpp}) = {self.pp * self.vpp} does not divide num_layers({num_layers})")
        if self.global_batch_size != global_batch_size:
            problems.append(
                f"dp({self.dp}) * mbs({self.mbs}) * gas({self.gas}) = {self.global_batch_size} != global batch size {global_batch_size}"
            )
        if problems:
            raise PlanError("plan " + str(self) + " is invalid: " + "; ".join(problems))


_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))


def _enum(cls: type, value: object, name: str):
    try:
        return cls(value)
    except ValueError:
        raise PlanError(f"plan: {name} must be one of {', '.join(cls)}, got {value!r}") from None


def parse_plan(text: str, *, global_batch_size: int | None = None) -> Plan:
    """Parse ``dp=..,tp=..,...``; gas, when left out, is global_batch_size / (dp * mbs)."""
    fields = _split_plan(text)
    if "dp" not in fields:
        raise PlanError(f"plan {text!r} needs dp=N")
    if "gas" not in fields:
        if global_batch_size is None:
            raise PlanError(f"plan {text!r} has no gas= and no global batch size to derive it from")
        per_step = fields["dp"] * fields.get("mbs", 1)
        if global_batch_size % per_step:
            raise PlanError(
                f"plan {text!r}: global batch size {global_batch_size} is not divisible by "
                f"dp({fields['dp']}) * mbs({fields.get('mbs', 1)}) = {per_step}"
            )
        fields["gas"] = global_batch_size // per_step
    return Plan(**fields)


def _split_plan(text: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not value:
            raise PlanError(f"plan {text!r}: {part!r} is not key=value")
        if key not in _KEYS:
            raise PlanError(f"plan {text!r}: unknown key {key!r} (known: {', '.join(_KEYS)})")
        if key in out:
            raise PlanError(f"plan {text!r}: {key} given twice")
        out[key] = _parse_value(key, value, text)
    return out


def _parse_value(key: str, value: str, text: str) -> object:
    if key == "sp":
        if value.lower() not in ("true", "false"):
            raise PlanError(f"plan {text!r}: sp must be true or false, got {value!r}")
        return value.lower() == "true"
    if key == "order":
        return tuple(value.split("-"))
    if key in ("recompute", "offload"):
        return value
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"plan {text!r}: {key} must be an integer, got {value!r}") from None


def plan_from_mapping(data: Mapping[str, object]) -> Plan:
    """A Plan from a dict such as :meth:`Plan.to_dict` produces."""
    data = dict(data)
    if isinstance(data.get("order"), str):
        data["order"] = tuple(str(data["order"]).split("-"))
    return Plan(**data)
