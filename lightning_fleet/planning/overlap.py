"""Which communications a runtime hides behind compute: :class:`Overlaps`, one value per runtime.

The time model (:mod:`time`) prices every collective; an Overlaps value says which of them the runtime that
executes the plan runs beside compute, and :attr:`Calibration.overlap` says what fraction of such overlappable
time is really hidden (the rest, and all of a communication that is not overlapped, stays on the critical path).
Each field names the mechanism and where a runtime implements it. A search prices every candidate with one value
(:attr:`Constraints.overlaps`), so no layout wins by an overlap the others are denied; :attr:`Overlaps.symmetric`
says whether a value treats every ZeRO stage alike.

Pure: imports only :mod:`planning.errors`; imported by time.py, estimate.py, search.py (Constraints) and
runtime/base.py (a runtime's :class:`~lightning_fleet.runtime.base.Capabilities`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from lightning_fleet.planning.errors import PlanError

ZERO_STAGES = (0, 1, 2, 3)
GATHERING_STAGES = (1, 2, 3)
"""The ZeRO stages that all-gather weights (ZeRO-1/2 the updated partitions after the step, ZeRO-3 each layer)."""
OVERLAP_NAMES = ("dp_grad_reduce", "dp_param_gather", "tp_comm", "pp_p2p", "pp_p2p_split_over_tp")
"""The names :meth:`Overlaps.of` takes: each a field of :class:`Overlaps` that says what is hidden."""


def _stages(name: str, value: object, allowed: tuple[int, ...]) -> tuple[int, ...]:
    """``value`` as a sorted tuple of ZeRO stages from ``allowed``; PlanError (one line) otherwise."""
    try:
        stages = tuple(sorted(set(value)))  # type: ignore[call-overload]
    except TypeError:
        raise PlanError(f"Overlaps {name} must be a tuple of ZeRO stages ({_list(allowed)}), got {value!r}") from None
    wrong = [s for s in stages if isinstance(s, bool) or s not in allowed]
    if wrong:
        raise PlanError(f"Overlaps {name}: {wrong[0]!r} is not one of the ZeRO stages it applies to ({_list(allowed)})")
    return stages


def _list(values: Iterable[object]) -> str:
    return ", ".join(str(v) for v in values)


@dataclass(frozen=True, slots=True, kw_only=True)
class Overlaps:
    """How one runtime runs its communication: which collectives it hides behind compute (the rest it runs on the
    critical path), and the two choices of shape that decide what they cost (whether pipeline sends are split over tp,
    :attr:`pp_p2p_split_over_tp`; whether ZeRO-1/2 reduce gradients by a full all-reduce, :attr:`dp_grad_allreduce`).
    The name says its main part; the time model reads all of it from this one value per runtime.

    ``Overlaps()`` is the cost model's long-standing assumption (:attr:`DEFAULT`): every gradient reduction hides
    behind backward, ZeRO-3's weight gathers behind forward and backward, and nothing else, so ZeRO-1/2's gather
    of the updated weights is fully exposed while ZeRO-3's gathers are not (:attr:`symmetric` is False).
    :meth:`of` builds a value from the names of what a runtime overlaps.
    """

    dp_grad_reduce: tuple[int, ...] = ZERO_STAGES
    """ZeRO stages whose gradient reduction hides behind backward: ZeRO-0's all-reduce and ZeRO-1's reduce-scatter
    behind the last micro-batch's backward, ZeRO-2/3's reduce-scatter behind every micro-batch's (PyTorch DDP's
    buckets; DeepSpeed's ``overlap_comm``; Megatron-LM's ``--overlap-grad-reduce``)."""
    dp_param_gather: tuple[int, ...] = (3,)
    """ZeRO stages (1-3) whose weight all-gathers hide behind compute: ZeRO-1/2's gather of the updated weights after
    the step behind the next step's first forward (Megatron-LM's ``--overlap-param-gather``: "overlap param
    all-gather with forward compute", distributed_data_parallel_config.py); ZeRO-3's per-layer gathers, prefetched
    behind the forward and backward of the layers before (DeepSpeed's PartitionedParameterCoordinator, FSDP)."""
    dp_exposed_in_pipeline: bool = False
    """In a pipeline (pp > 1) no data-parallel communication hides: the engine reduces after its schedule's last
    backward (DeepSpeed's PipelineEngine turns ``overlap_comm`` off, runtime/engine.py _configure_zero_optimizer)."""
    tp_comm: bool = False
    """With sequence parallelism, the tensor-parallel all-gathers and reduce-scatters hide behind the layers' GEMMs
    (Megatron-LM's ``--tp-comm-overlap``, which asserts sequence parallelism, arguments.py; torchtitan's async TP).
    Without sp the all-reduces stay exposed."""
    pp_p2p: bool = False
    """In an interleaved schedule (vpp > 1) the pipeline sends hide behind the compute of other model chunks
    (Megatron-LM's ``overlap_p2p_comm``, which arguments.py turns off without interleaving)."""
    pp_p2p_split_over_tp: bool = False
    """Without sequence parallelism, each of the tp ranks sends 1/tp of the boundary activation and the receiver
    all-gathers it over tp (Megatron-LM's scatter-gather optimization, Narayanan et al. 2021 Sec. 4.1; its
    ``--no-scatter-gather-tensors-in-pipeline`` turned it off). With sp the activation is already split."""
    dp_grad_allreduce: tuple[int, ...] = ()
    """ZeRO stages (1, 2) whose gradient reduction is a full all-reduce rather than a reduce-scatter: not an overlap
    but how the runtime reduces, stated with what it overlaps so that one value describes its data-parallel
    communication (DeepSpeed 0.19's ZeRO-1/2 optimizer, with ``use_multi_rank_bucket_allreduce`` at its default
    True, buckets the gradient slices under ``("allreduce", process_group)`` and runs ``allreduce_and_scatter``,
    deepspeed/runtime/zero/stage_1_and_2.py; Megatron-LM's distributed optimizer and FSDP reduce-scatter)."""

    sp_traffic: float = 1.0
    """The tensor-parallel traffic of a sequence-parallel layer over Megatron's (its all-gather and reduce-scatter pairs,
    priced as the all-reduces they replace): not an overlap but how the runtime lays sequence parallelism out, stated
    here so that one value describes its communication (1: Megatron-LM's and torchtitan's layout, whose residual stream
    stays on sequence shards between layers)."""

    DEFAULT: ClassVar[Overlaps]
    """``Overlaps()``: gradient reductions at every ZeRO stage and ZeRO-3's gathers (asymmetric)."""
    NONE: ClassVar[Overlaps]
    """Nothing hidden: every collective on the critical path."""
    ALL: ClassVar[Overlaps]
    """Everything the time model can hide, at every ZeRO stage (symmetric)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dp_grad_reduce", _stages("dp_grad_reduce", self.dp_grad_reduce, ZERO_STAGES))
        object.__setattr__(self, "dp_param_gather", _stages("dp_param_gather", self.dp_param_gather, GATHERING_STAGES))
        object.__setattr__(self, "dp_grad_allreduce", _stages("dp_grad_allreduce", self.dp_grad_allreduce, (1, 2)))
        for name in ("dp_exposed_in_pipeline", "tp_comm", "pp_p2p", "pp_p2p_split_over_tp"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"Overlaps {name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.sp_traffic, bool) or not isinstance(self.sp_traffic, (int, float)) or not self.sp_traffic >= 1:
            raise PlanError(f"Overlaps sp_traffic must be a number >= 1 (Megatron's layout is 1), got {self.sp_traffic!r}")

    @classmethod
    def of(cls, names: Iterable[str]) -> Overlaps:
        """The runtime that overlaps exactly ``names`` (field names; ``dp_grad_reduce`` and ``dp_param_gather`` at every
        ZeRO stage they apply to): ``Overlaps.of(["dp_grad_reduce", "dp_param_gather", "tp_comm", "pp_p2p"])`` is
        Megatron-LM with ``--overlap-grad-reduce --overlap-param-gather --tp-comm-overlap`` and an interleaved schedule.
        ``dp_exposed_in_pipeline`` (a limitation, not an overlap) stays False."""
        if isinstance(names, str):
            raise PlanError(f"Overlaps.of takes a list of names, got the string {names!r}: write [{names!r}]")
        chosen: dict[str, object] = {"dp_grad_reduce": (), "dp_param_gather": ()}
        for name in names:
            if name not in OVERLAP_NAMES:
                raise PlanError(f"unknown overlap {name!r}: choose from {_list(OVERLAP_NAMES)}")
            chosen[name] = {"dp_grad_reduce": ZERO_STAGES, "dp_param_gather": GATHERING_STAGES}.get(name, True)
        return cls(**chosen)  # type: ignore[arg-type]

    @property
    def symmetric(self) -> bool:
        """Every ZeRO stage hides the same kinds of data-parallel communication (its gradient reduction, and from
        ZeRO-1 on its weight gathers), so a search never prefers a stage for an overlap the others are denied."""
        return self.dp_grad_reduce in ((), ZERO_STAGES) and self.dp_param_gather in ((), GATHERING_STAGES)

    def hides_grad_reduce(self, zero: int, pp: int) -> bool:
        """The gradient reduction of ZeRO stage ``zero`` in a ``pp``-stage pipeline runs beside backward."""
        return zero in self.dp_grad_reduce and not (pp > 1 and self.dp_exposed_in_pipeline)

    def hides_param_gather(self, zero: int, pp: int) -> bool:
        """The weight all-gathers of ZeRO stage ``zero`` in a ``pp``-stage pipeline run beside compute."""
        return zero in self.dp_param_gather and not (pp > 1 and self.dp_exposed_in_pipeline)

    def hides_tp_comm(self, sp: bool) -> bool:
        """Tensor-parallel collectives of a plan with (``sp``) or without sequence parallelism run beside its GEMMs."""
        return self.tp_comm and sp

    def hides_pp_p2p(self, vpp: int) -> bool:
        """Pipeline sends of a plan with ``vpp`` virtual stages run beside compute."""
        return self.pp_p2p and vpp > 1

    def reduces_grads_by_allreduce(self, zero: int) -> bool:
        """ZeRO stage ``zero`` reduces its gradients with a full all-reduce (ZeRO-0 always; ZeRO-1/2 where
        :attr:`dp_grad_allreduce` says so), not a reduce-scatter."""
        return zero == 0 or zero in self.dp_grad_allreduce

    def splits_pp_p2p(self, tp: int, sp: bool) -> bool:
        """Pipeline sends of a plan with this tp degree and sp carry 1/tp of the boundary and are all-gathered over tp."""
        return self.pp_p2p_split_over_tp and tp > 1 and not sp

    def names(self) -> list[str]:
        """What is hidden, as readable names ("dp_grad_reduce(zero 0-3)", "tp_comm", ...); empty for :attr:`NONE`."""
        out = [f"{name}(zero {_list(stages)})" for name, stages in (("dp_grad_reduce", self.dp_grad_reduce),
                                                                   ("dp_param_gather", self.dp_param_gather)) if stages]
        if self.dp_exposed_in_pipeline and out:
            out.append("neither with pp > 1")
        out += [name for name in ("tp_comm", "pp_p2p", "pp_p2p_split_over_tp") if getattr(self, name)]
        if self.dp_grad_allreduce:
            out.append(f"gradients all-reduced at zero {_list(self.dp_grad_allreduce)}")
        if self.sp_traffic != 1:
            out.append(f"sequence-parallel traffic {self.sp_traffic:g}x Megatron's")
        return out

    def __str__(self) -> str:
        return ", ".join(self.names()) or "nothing"


Overlaps.DEFAULT = Overlaps()
Overlaps.NONE = Overlaps(dp_grad_reduce=(), dp_param_gather=())
Overlaps.ALL = Overlaps.of(OVERLAP_NAMES)
