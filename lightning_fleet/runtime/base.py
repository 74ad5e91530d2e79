"""What a runtime can execute, stated once: :class:`Capabilities`; what a user's module offers it: :class:`ModuleHooks`;
and how a runtime applies a decision: the :class:`Backend` protocol.

A runtime's capabilities turn into planner :class:`~lightning_fleet.planning.Constraints` (what the search may
choose), and refuse, in one line, a plan a user fixed that the runtime cannot execute for their module. The
planner, the strategy, ``fleet plan --runtime`` and the benchmarks all read the same value.

Pure: imports only the standard library and :mod:`lightning_fleet.planning` (no torch, no deepspeed); imported by
the runtimes (``runtime/deepspeed/``), the module's hooks (:mod:`lightning_fleet.hooks`), the decision, the strategy
and the CLI.

The rules between two plan fields that define what the cost model's offload, sp and vpp *mean* (offload needs
ZeRO >= 1, sp needs tp > 1, ...) are not runtime limits: they stay in ``Plan.__post_init__`` (planning/plan.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Iterable, Mapping, Protocol, Sequence

from lightning_fleet.planning import Constraints, FleetError, Offload, Overlaps, PartialPlan, Plan, Recompute
from lightning_fleet.planning.plan import DEFAULT_ORDER, field_text

if TYPE_CHECKING:
    from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint


ANY_ZERO_STAGES = (0, 1, 2, 3)
"""Every shard level a plan can name (Plan.zero)."""
HOST_OFFLOADS = (Offload.OPTIMIZER, Offload.OPTIMIZER_PARAMS)
"""Every host offload a plan can name (``Plan.offload`` besides none)."""


REPLICATED_CHECK, SHARDED_CHECK, ENGINE_CHECK = "replicated", "sharded", "engine"
"""How a runtime's gradient is checked for non-finite values (``Backend.gradient_check``): in ``param.grad``, the same
whole on every rank (a local check), in ``param.grad``, a shard on each rank (a local check agreed by one all-reduce),
or in the engine's own buffers (the loss is agreed before backward; the engine's overflow check skips)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorParallelSpec:
    """Which Linear weights tensor parallelism splits: regexes over parameter names (the ``fleet_tensor_parallel()``
    hook's patterns; DeepSpeed's AutoTP reads them as its ``partition_config``)."""

    column: tuple[str, ...]
    """Weights split along the output dimension (QKV, MLP up-projection)."""
    row: tuple[str, ...]
    """Weights split along the input dimension (attention output, MLP down-projection)."""
    sequence: tuple[str, ...] = ()
    """Parameters of the modules inside the layer stack that run on sequence shards under sequence parallelism (its
    norms); empty: the module runs no sequence parallelism."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorParallelLimit:
    """One layer that tensor parallelism splits, and how far: a tp degree must divide ``parts`` (1: no tp > 1 splits it).
    :func:`lightning_fleet.hooks.tensor_parallel_limits` reads them off a module's split layers."""

    layer: str
    """The layer's name in the module (``model.layers.0.self_attn.k_proj``)."""
    parts: int
    """Equal parts it can be split into: its heads (attention projections), its features (others), 1 when it cannot be
    split at all (a fused query/key/value weight, a layer that is not an nn.Linear)."""
    reason: str
    """Why a tp that does not divide ``parts`` cannot split it and what to do, with ``{tp}`` for the degree
    ("its 1 key/value head is not divisible by tp={tp}; use tp=1")."""

    def refusal(self, tp: int) -> str | None:
        """'tp=2 cannot split <layer>: <reason>', or None when ``tp`` divides ``parts``."""
        return None if self.parts % tp == 0 else f"tp={tp} cannot split {self.layer}: {self.reason.format(tp=tp)}"


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleHooks:
    """What a user's module offers a runtime (:func:`lightning_fleet.hooks.module_hooks` reads it off a module)."""

    name: str
    """The module's class name, as error messages say it."""
    tensor_parallel: bool
    """It defines ``fleet_tensor_parallel()`` (head count and the weights to split)."""
    pipeline: bool
    """It defines ``fleet_pipeline()`` (the forward pass as a sequence of layers and a loss) and has a layer stack
    (the stages are balanced over it)."""
    layers: bool
    """A layer stack was found: ``fleet_layers()``, or the largest ModuleList/Sequential of one repeated type."""
    automatic_optimization: bool
    """Lightning steps the optimizer (False: ``training_step`` steps it itself, manual optimization)."""
    sparse_params: tuple[str, ...] = ()
    """Its trainable parameters whose gradients are sparse (embedding lookups with ``sparse=True``, found by profiling:
    :attr:`lightning_fleet.profiling.Profile.sparse_params`)."""

    tp_limits: tuple[TensorParallelLimit, ...] = ()
    """The layers ``fleet_tensor_parallel()`` splits, each with the parts a tp degree must divide (empty without the hook,
    or when planning a spec offline: no layer known to limit tp)."""

    @property
    def tp_divides(self) -> int | None:
        """The number every tensor-parallel degree must divide for this module (the gcd of its split layers' parts);
        None: no split layer is known."""
        return math.gcd(*(limit.parts for limit in self.tp_limits)) if self.tp_limits else None

    sequence_parallel: bool = False
    """Its ``fleet_tensor_parallel()`` names the ``sequence`` modules and its layers lay out along the sequence
    (:func:`lightning_fleet.hooks.sequence_parallel_layout`)."""
    sequence_problem: str = ""
    """Why it cannot run sequence parallelism ('names no ...: add ...'; '' when it can, or without the tensor-parallel
    hook)."""

    pipeline_problem: str = ""
    """Why ``fleet_pipeline()``'s layers cannot run as a pipeline, found by the profiler's dry run on the example batch
    ('' when they can or it did not run); ``pipeline`` is False then."""

    @classmethod
    def assumed(cls, name: str = "the model") -> "ModuleHooks":
        """Every hook present and automatic optimization: for planning a model spec offline (``fleet plan``, the
        benchmarks), where no module exists yet and the plan says which hooks the module will need."""
        return cls(name=name, tensor_parallel=True, pipeline=True, layers=True, automatic_optimization=True, sequence_parallel=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class Capabilities:
    """What one runtime executes. Every limit is a field, with the reason it exists."""

    name: str
    """How ``fleet plan --runtime`` and the registry (:func:`lightning_fleet.runtime.capabilities_of`) name it."""
    label: str
    """How messages name it ("DeepSpeed")."""
    zero_stages: tuple[int, ...] = ANY_ZERO_STAGES
    """Shard levels (``Plan.zero``) it executes, each mapped to its own mechanism (DeepSpeed: ZeRO-k; torch: DDP,
    ZeroRedundancyOptimizer, FSDP2 without and with resharding after forward)."""
    tensor_parallel: bool = True
    """Runs tensor parallelism (tp > 1) at all (what it needs of the module: :attr:`tp_needs_hook`)."""
    pipeline: bool = True
    """Runs pipeline parallelism (pp > 1) at all (what it needs of the module: :attr:`pp_needs_hook`)."""
    offloads: tuple[Offload, ...] = (Offload.OPTIMIZER, Offload.OPTIMIZER_PARAMS)
    """The host offloads it runs (``Plan.offload`` besides none); empty: none."""
    sequence_parallel: bool
    """Runs Megatron-style sequence parallelism (sp=true)."""
    interleaved_pipeline: bool
    """Runs interleaved pipeline schedules (vpp > 1)."""
    uneven_stages: bool
    """Runs pipeline stages holding different numbers of layers (``Plan.stage_layers``; pp need not divide the layers)."""
    uneven_dp: bool
    """Runs data-parallel replicas with different micro-batch sizes (``Plan.dp_mbs``), each replica's loss weighted by
    its share (``Plan.loss_weight``) so that the averaged gradient is the global batch's mean."""
    uneven_dp_with_pp: bool
    """Runs them inside a pipeline too (the pipeline engine computes the loss itself)."""
    max_zero_with_pp: int
    """Highest ZeRO stage it runs together with pp > 1."""
    tp_with_pp: bool
    """Runs tensor parallelism inside a pipeline (tp > 1 with pp > 1)."""
    offload_with_pp: bool
    """Runs host offload inside a pipeline."""
    any_placement: bool
    """Places the axes on ranks in any order (False: the default tp-dp-pp only)."""
    selective_recompute: bool
    """Runs selective recomputation (the attention core only)."""
    op_recompute: bool
    """Runs op-level selective recomputation (``recompute=op``: a per-operator save policy inside each layer's
    checkpoint, torch.utils.checkpoint's ``create_selective_checkpoint_contexts`` as torchtitan applies it); it wraps
    the layers like full recomputation, so it needs a layer stack where that does (``full_recompute_needs_layers``)."""
    full_recompute_needs_layers: bool
    """Full recomputation wraps the layers of the module's layer stack: without one it cannot."""
    tp_needs_hook: bool
    """Tensor parallelism needs ``fleet_tensor_parallel()`` (which weights to split, and how)."""
    sp_needs_hook: bool = True
    """Sequence parallelism needs ``fleet_tensor_parallel()``'s ``sequence`` modules and a layer stack laid out for it
    (:attr:`ModuleHooks.sequence_parallel`)."""
    pp_needs_hook: bool
    """A pipeline needs ``fleet_pipeline()`` and a layer stack (:attr:`ModuleHooks.pipeline`)."""
    pp_needs_automatic_optimization: bool
    """A pipeline runs forward, backward and the optimizer step itself: not with the user's own optimization loop."""
    reshard_zero_stages: tuple[int, ...]
    """ZeRO stages a checkpoint written at another world size can be resharded into."""
    reshard_data_parallel_only: bool
    """Only data-parallel plans (tp=1, pp=1) are resharded into (their per-rank layouts have a verified conversion)."""
    overlaps: Overlaps
    """Which communications it runs beside compute: the search prices every candidate with them, and ``fleet estimate``
    a fixed plan."""
    sparse_grad_zero_stages: tuple[int, ...]
    """ZeRO stages (shard levels) at which it runs parameters whose gradients are sparse: a module with some is planned
    on these only (``Constraints.sparse_zero_stages``), and a plan fixing another is refused."""
    imports: tuple[str, ...] = ()
    """The runtimes whose checkpoints it continues through their full state (:class:`FullState`: each exports its own,
    this one imports it into its own form), so that a job may change runtime when it resumes; those runtimes' own
    limits on what they export apply (``reshard_data_parallel_only``)."""
    hybrid_shard_zero_stages: tuple[int, ...] = ()
    """Shard levels at which it runs hybrid sharding (``Plan.dp_shard``: the sharded state split within groups of
    replicas, replicated across them); empty: none."""

    def constraints(
        self,
        hooks: ModuleHooks,
        *,
        allow_offload: bool = True,
        require_offload: bool = False,
        max_tp: int | None = None,
        max_pp: int | None = None,
        zero_stages: tuple[int, ...] = (0, 1, 2, 3),
    ) -> Constraints:
        """What this runtime executes for a module with ``hooks``, as planner constraints, narrowed by the job's
        options (``max_tp``/``max_pp`` None or 0: no limit beyond the model and the world)."""
        return Constraints(
            allow_sp=self.sequence_parallel and (hooks.sequence_parallel or not self.sp_needs_hook),
            max_vpp=None if self.interleaved_pipeline else 1,
            uneven_stages=self.uneven_stages,
            uneven_dp=self.uneven_dp,
            uneven_dp_with_pp=self.uneven_dp_with_pp,
            max_zero_with_pp=self.max_zero_with_pp,
            search_placement=self.any_placement,
            tp_with_pp=self.tp_with_pp,
            offload_with_pp=self.offload_with_pp,
            allow_offload=allow_offload and bool(self.offloads),
            require_offload=require_offload,
            offloads=None if set(self.offloads) >= set(HOST_OFFLOADS) else (Offload.NONE, *self.offloads),
            recompute=self._recompute_modes(hooks),
            max_tp=(max_tp or None) if self._runs_tp(hooks) else 1,
            tp_divides=hooks.tp_divides if self._runs_tp(hooks) else None,
            max_pp=(max_pp or None) if self._runs_pp(hooks) else 1,
            zero_stages=self._runnable_stages(zero_stages),
            overlaps=self.overlaps,
            sparse_zero_stages=self.sparse_grad_zero_stages,
            hybrid_zero_stages=self.hybrid_shard_zero_stages,
        )

    def reshard_constraints(
        self,
        hooks: ModuleHooks,
        *,
        allow_offload: bool,
        require_offload: bool,
        zero_stages: tuple[int, ...],
        checkpoint: str,
    ) -> Constraints:
        """:meth:`constraints` for a job that reshards ``checkpoint`` (written at another world size); FleetError when
        the job's ``zero_stages`` leave none this runtime reshards into."""
        stages = tuple(z for z in zero_stages if z in self.reshard_zero_stages)
        if not stages:
            raise FleetError(
                f"checkpoint {checkpoint} must be resharded to this job's world size, which needs ZeRO stage "
                f"{_either(self.reshard_zero_stages)}, but FleetStrategy(zero_stages={zero_stages}): allow one of them"
            )
        base = self.constraints(hooks, allow_offload=allow_offload, require_offload=require_offload, zero_stages=stages)
        return dataclasses.replace(base, max_tp=1, max_pp=1) if self.reshard_data_parallel_only else base

    def refusal(self, plan: Plan | PartialPlan, hooks: ModuleHooks) -> str | None:
        """Why this runtime cannot execute ``plan`` (its fixed axes, for a partial one) for a module with ``hooks``, in
        one line; None when it can. The job's own limits (zero_stages, allow_offload, max_tp, ...) are not judged here."""
        tp, pp, zero = plan.tp or 1, plan.pp or 1, plan.zero or 0
        offloads = plan.offload not in (None, Offload.NONE)
        missing = self._missing_axis(tp=tp, pp=pp, zero=zero, offload=plan.offload)
        if missing:
            return f"plan {plan}: {self.label} runs {missing}"
        if hooks.sparse_params and zero not in self.sparse_grad_zero_stages:
            return f"plan {plan}: {self._sparse_refusal(hooks, zero)}"
        if tp > 1 and not self._runs_tp(hooks):
            return f"plan {plan} has tp={tp}, but {hooks.name} defines no fleet_tensor_parallel() hook: add it or use tp=1"
        split = next(filter(None, (limit.refusal(tp) for limit in hooks.tp_limits)), None) if tp > 1 else None
        if split:
            return f"plan {plan}: {split}"
        if pp > 1 and not self._runs_pp(hooks):
            return f"plan {plan} has pp={pp}, but {hooks.name} {self._no_pipeline_because(hooks)}"
        if pp > 1 and (tp > 1 and not self.tp_with_pp or offloads and not self.offload_with_pp or zero > self.max_zero_with_pp):
            return f"plan {plan}: {self.label}'s pipeline engine runs {self._pipeline_limits()}"
        if plan.sp and not self.sequence_parallel or (plan.vpp or 1) > 1 and not self.interleaved_pipeline:
            return f"plan {plan}: {self.label} runs {self._missing_schedules()}"
        if plan.sp and self.sp_needs_hook and not hooks.sequence_parallel:
            why = hooks.sequence_problem or (
                "names no 'sequence' modules (its norms) in fleet_tensor_parallel(): add them or use sp=false" if hooks.tensor_parallel
                else "defines no fleet_tensor_parallel() hook: add it (with its 'sequence' modules) or use sp=false")
            return f"plan {plan} has sp=true, but {hooks.name} {why}"
        if plan.dp_shard is not None and plan.dp_shard != plan.dp and zero not in self.hybrid_shard_zero_stages:
            if not self.hybrid_shard_zero_stages:
                return f"plan {plan}: {self.label} shards over all data-parallel replicas only (no hybrid sharding); leave dp_shard out"
            return (f"plan {plan}: {self.label} runs hybrid sharding at zero {_either(self.hybrid_shard_zero_stages)} only; "
                    "use one of them or leave dp_shard out")
        if plan.stage_layers is not None and len(set(plan.stage_layers)) > 1 and not self.uneven_stages:
            return f"plan {plan}: {self.label} splits the layers of a pipeline evenly only; leave stage_layers out"
        if plan.dp_mbs is not None:
            if not self.uneven_dp:
                return f"plan {plan}: {self.label} runs one micro-batch size on every replica; leave dp_mbs out"
            if pp > 1 and not self.uneven_dp_with_pp:
                return (f"plan {plan}: {self.label}'s pipeline engine computes the loss itself and cannot weight a replica's "
                        "share; use pp=1 with dp_mbs, or leave dp_mbs out")
        if plan.recompute is Recompute.SELECTIVE and not self.selective_recompute:
            return f"plan {plan}: selective recomputation needs attention internals; use recompute=full or none"
        if plan.recompute is Recompute.OP and not self.op_recompute:
            modes = _either(self._recompute_modes(hooks))
            return f"plan {plan}: {self.label} runs no op-level recomputation; use recompute {modes}"
        if plan.recompute is Recompute.OP and Recompute.OP not in self._recompute_modes(hooks):
            return f"plan {plan}: recompute=op needs the layer stack: add fleet_layers() to {hooks.name}"
        if plan.recompute is Recompute.FULL and Recompute.FULL not in self._recompute_modes(hooks):
            return f"plan {plan}: recompute=full needs the layer stack: add fleet_layers() to {hooks.name}"
        if plan.order not in (None, DEFAULT_ORDER) and not self.any_placement:
            return (
                f"plan {plan}: {self.label} places the axes {field_text(DEFAULT_ORDER)} only (it builds its own process groups, "
                f"and the data order follows them); use order={field_text(DEFAULT_ORDER)} or leave order out"
            )
        return None

    def check(self, partial: PartialPlan, constraints: Constraints, hooks: ModuleHooks) -> None:
        """Raise FleetError (one line) unless the axes a user fixed are something this runtime executes for this module
        and ``constraints`` (the job's zero_stages and offload setting) allow; the rest is :func:`planning.narrow`'s."""
        why = self.refusal(partial, hooks)
        if why:
            raise FleetError(why)
        if partial.zero is not None and partial.zero not in constraints.zero_stages:
            raise FleetError(f"plan {partial}: zero={partial.zero} is outside zero_stages={constraints.zero_stages}")
        if partial.offload not in (None, Offload.NONE) and not constraints.allow_offload:
            raise FleetError(f"plan {partial} offloads, but allow_offload=False")

    def _runnable_stages(self, zero_stages: tuple[int, ...]) -> tuple[int, ...]:
        """The job's shard levels this runtime runs (a value that is no shard level stays, for Constraints to refuse)."""
        if not set(zero_stages) <= set(ANY_ZERO_STAGES):
            return zero_stages
        return tuple(z for z in zero_stages if z in self.zero_stages)

    def job_refusal(self, *, require_offload: bool, zero_stages: tuple[int, ...]) -> str | None:
        """Why this runtime can run no plan the job's options allow (it offloads nothing but offload is required, or it
        runs none of the allowed shard levels), in one line; None when some plan may be possible."""
        if require_offload and not self.offloads:
            return f"{self.label} runs no offload, and FleetStrategy(require_offload=True)"
        if not set(zero_stages) & set(self.zero_stages):
            return f"{self.label} runs zero {_either(self.zero_stages)}, and FleetStrategy(zero_stages={tuple(zero_stages)})"
        return None

    def runs_axes(self, plan: Plan | PartialPlan) -> bool:
        """Whether this runtime runs every axis ``plan`` (its fixed axes, for a partial one) uses at all, whatever the
        module (a refusal then comes from the module or the combination, not from a missing axis)."""
        return not self._missing_axis(tp=plan.tp or 1, pp=plan.pp or 1, zero=plan.zero or 0, offload=plan.offload)

    def _missing_axis(self, *, tp: int, pp: int, zero: int, offload: Offload | None) -> str:
        """'no tensor parallelism; use tp=1' for the first axis of a plan this runtime does not run at all, else ''."""
        if zero not in self.zero_stages:
            return f"zero {_either(self.zero_stages)} only; use one of them"
        if tp > 1 and not self.tensor_parallel:
            return "no tensor parallelism; use tp=1"
        if pp > 1 and not self.pipeline:
            return "no pipelines; use pp=1"
        if offload not in (None, Offload.NONE) and offload not in self.offloads:
            if not self.offloads:
                return "no offload; use offload=none"
            return f"offload={_either(self.offloads)} only; use it or offload=none"
        return ""

    def _sparse_refusal(self, hooks: ModuleHooks, zero: int) -> str:
        """'emb.weight gets sparse gradients ..., which DeepSpeed runs at zero 0 only: use zero=0 ...'."""
        names = hooks.sparse_params
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        verb = "gets" if len(names) == 1 else "get"
        return (
            f"{hooks.name}'s {shown} {verb} sparse gradients (an embedding with sparse=True), which {self.label} runs at "
            f"zero {_either(self.sparse_grad_zero_stages)} only, not zero={zero}: use zero={self.sparse_grad_zero_stages[0]} "
            "(or leave zero to the planner), or build the embedding with sparse=False to shard it"
        )

    def _runs_tp(self, hooks: ModuleHooks) -> bool:
        return self.tensor_parallel and (hooks.tensor_parallel or not self.tp_needs_hook)

    def _runs_pp(self, hooks: ModuleHooks) -> bool:
        has_hook = self.pipeline and (hooks.pipeline or not self.pp_needs_hook)
        return has_hook and (hooks.automatic_optimization or not self.pp_needs_automatic_optimization)

    def _recompute_modes(self, hooks: ModuleHooks) -> tuple[Recompute, ...]:
        modes = [Recompute.NONE]
        if self.selective_recompute:
            modes.append(Recompute.SELECTIVE)
        wraps_layers = hooks.layers or not self.full_recompute_needs_layers
        if self.op_recompute and wraps_layers:
            modes.append(Recompute.OP)
        if wraps_layers:
            modes.append(Recompute.FULL)
        return tuple(modes)

    def _no_pipeline_because(self, hooks: ModuleHooks) -> str:
        if self.pp_needs_automatic_optimization and not hooks.automatic_optimization:
            return "optimizes manually, and a pipeline runs forward, backward and step itself: use pp=1"
        if hooks.pipeline_problem:
            return f"has a fleet_pipeline() that cannot run: {hooks.pipeline_problem}"
        return "defines no fleet_pipeline() (and fleet_layers()) hook: add it or use pp=1"

    def _pipeline_limits(self) -> str:
        """'with zero <= 1, without tp and without offload' (what it lacks inside a pipeline)."""
        limits = [f"zero <= {self.max_zero_with_pp}"] if self.max_zero_with_pp < 3 else []
        without = [name for name, runs in (("tp", self.tp_with_pp), ("offload", self.offload_with_pp)) if not runs]
        parts = (["with " + limits[0]] if limits else []) + [f"without {name}" for name in without]
        return ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]

    def _missing_schedules(self) -> str:
        if not self.sequence_parallel and not self.interleaved_pipeline:
            return "neither sequence parallelism nor interleaved pipelines; use sp=false, vpp=1"
        if not self.sequence_parallel:
            return "no sequence parallelism; use sp=false"
        return "no interleaved pipelines; use vpp=1"


def _either(values: tuple[object, ...]) -> str:
    """'1, 2 or 3'."""
    names = [str(s) for s in values]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


ANY = Capabilities(
    name="any",
    label="any runtime",
    sequence_parallel=True,
    interleaved_pipeline=True,
    uneven_stages=True,
    uneven_dp=True,
    uneven_dp_with_pp=True,
    max_zero_with_pp=3,
    tp_with_pp=True,
    offload_with_pp=True,
    any_placement=True,
    selective_recompute=True,
    op_recompute=True,
    full_recompute_needs_layers=False,
    tp_needs_hook=False,
    sp_needs_hook=False,
    pp_needs_hook=False,
    pp_needs_automatic_optimization=False,
    reshard_zero_stages=(0, 1, 2, 3),
    reshard_data_parallel_only=False,
    # the cost model's long-standing assumption: gradient reductions and ZeRO-3's gathers hide, nothing else
    overlaps=Overlaps.DEFAULT,
    # every shard level: the cost model prices sparse gradients by their rows at ZeRO-0 and dense above it
    # (planning/memory.py sparse_gradients_priced), whichever runtime would run them
    sparse_grad_zero_stages=(0, 1, 2, 3),
    hybrid_shard_zero_stages=(1, 2, 3),
)
"""The cost model's whole space: every plan it can price, as if some runtime executed each (``fleet plan``'s default,
for comparing layouts before choosing a runtime)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FullState:
    """A checkpoint's whole state in no runtime's layout: what one runtime exports and another imports
    (:meth:`Backend.export_state`, :meth:`Backend.import_state`). The tensors are whole, named as the module names them
    (``state_dict()`` keys), in torch.distributed.checkpoint.state_dict's form."""

    model: Mapping[str, Any]
    """The module's state: every parameter (full precision where the runtime keeps a master copy) and persistent
    buffer, by ``state_dict()`` key."""
    optimizer: Mapping[str, Any]
    """The optimizer's state keyed by parameter name: ``{"state": {name: {"step", "exp_avg", ...}}, "param_groups":
    [{..., "params": [name, ...]}]}``."""
    client: Mapping[str, Any]
    """What Lightning saved besides weights and optimizer states (loops, callbacks, schedulers, hyper-parameters)."""


class FitView(Protocol):
    """What a backend reads of the fit it serves (:class:`lightning_fleet.fit.FitCore` has each): handed in, so that a
    backend never reaches into a Lightning strategy."""

    engine: Any
    """The runtime's engine of the fit (a backend that lets its engine go at hand-back sets it to the plain module)."""
    module: Any
    """The user's module."""

    @property
    def plan(self) -> Plan | None:
        """The plan being trained (None before a fit decided one)."""
        ...

    @property
    def device(self) -> Any:
        """This rank's device."""
        ...

    @property
    def global_rank(self) -> int:
        """This rank."""
        ...

    @property
    def world_size(self) -> int:
        """Every process of the job."""
        ...


class Backend(Protocol):
    """How a runtime applies a Decision; the neutral fit core (lightning_fleet/fit.py) and the Lightning faces call only
    these.

    Implemented by :class:`lightning_fleet.runtime.deepspeed.backend.DeepSpeedBackend` and
    :class:`lightning_fleet.runtime.torch.backend.TorchBackend`, each named in the runtime table
    (:data:`lightning_fleet.runtime.RUNTIMES`). A new runtime states its :class:`Capabilities` and implements these calls
    in its own package; the calls under "pipelines" only where its capabilities run pipelines (``pipeline``).
    """

    capabilities: Capabilities
    """What the runtime executes."""
    averages_micro_batches: bool
    """Its engine averages a step's micro-batch gradients itself (False: they are summed, and the strategy weights each
    micro-batch's loss by 1/gas)."""
    zeroes_gradients: bool
    """Its engine zeroes the gradients after each optimizer step itself (False: the strategy calls the module's own
    ``optimizer_zero_grad`` before a step's first micro-batch)."""

    def gradient_check(self, plan: Plan) -> str:
        """Where a step's reduced gradient is, for the non-finite check (lightning_fleet.elastic.callback):
        ``replicated`` (whole in ``param.grad`` on every rank), ``sharded`` (a shard in ``param.grad`` on each rank) or
        ``engine`` (in the engine's own buffers)."""
        ...

    def config(self, plan: Plan, *, gradient_clipping: float, device_type: str, tensor_parallel: TensorParallelSpec | None,
               universal: bool) -> dict[str, Any]:
        """The runtime's configuration of ``plan`` (``universal``: it will load a resharded checkpoint)."""
        ...

    def preload(self) -> None:
        """Import the runtime's packages, as a training process has them loaded (a memory baseline is measured after)."""
        ...

    def precision_refusal(self, precision: str, device_type: str) -> str | None:
        """One line when the runtime cannot train the Lightning ``precision`` on this kind of device (checked before the
        fit starts), else None."""
        ...

    def process_globals(self) -> Iterable[tuple[Any, str]]:
        """Process-wide (object, attribute) pairs the runtime may replace while it builds an engine (put back after fit)."""
        ...

    def module_patches(self, module: Any, plan: Plan, layers: Any, precision: Any) -> list[tuple[Any, str, Any]]:
        """(object, attribute, value) changes the user's module (and Lightning's ``precision`` plugin) need for one fit
        under ``plan`` (undone afterwards)."""
        ...

    def build(self, module: Any, optimizer: Any, scheduler: Any, *, plan: Plan, config: dict[str, Any], device_rank: int,
              layers: Sequence[Any] | None) -> tuple[Any, Any]:
        """(engine, optimizer) executing ``plan`` over ``module`` on the live process group (``optimizer`` None: the
        face builds the optimizers after the engine and hands each to :meth:`optimizer`); ``layers``: the module's layer
        stack (lightning_fleet.hooks.find_layers), None when it has none."""
        ...

    def no_sync(self, engine: Any) -> ContextManager[Any]:
        """The context of a micro-batch that is not its step's last (forward and backward): no gradient reduction."""
        ...

    def accumulate(self, engine: Any, loss: Any, backward: Callable[[Any], Any]) -> None:
        """Backward of a micro-batch that is not its step's last (``backward``: Lightning's, for an engine without its own)."""
        ...

    def save(self, engine: Any, directory: str | Path, client_state: dict[str, Any]) -> None:
        """The engine's sharded checkpoint under ``directory`` with the trainer's client state (every rank)."""
        ...

    def load(
        self, engine: Any, directory: str | Path, *, optimizer_states: bool, strict: bool, checkpoint: VerifiedCheckpoint | None
    ) -> dict[str, Any]:
        """Load a checkpoint the engine's plan wrote (or a resharded one) and return the client state; every file is
        unpickled without running code, and checked against ``checkpoint``'s manifest as it is read when given."""
        ...

    def reshard(self, checkpoint: VerifiedCheckpoint) -> VerifiedCheckpoint:
        """Rank 0: a checkpoint written at another world size, converted once into a form this runtime loads at any,
        which is then listed in its manifest (the returned checkpoint carries that manifest)."""
        ...

    def export_state(self, checkpoint: VerifiedCheckpoint) -> FullState:
        """Rank 0, offline: the whole state of a checkpoint this runtime wrote (every file read by the restricted
        unpickler, checked against the manifest), for another runtime to import."""
        ...

    def import_state(self, checkpoint: VerifiedCheckpoint, state: FullState) -> VerifiedCheckpoint:
        """Rank 0: ``state`` (another runtime's checkpoint, :meth:`export_state`) written once into this runtime's own
        form beside it and listed in its manifest; :meth:`derived_of` then names it."""
        ...

    def derived_of(self, checkpoint: VerifiedCheckpoint) -> Path:
        """Where a resharded or imported checkpoint is loaded from (the converted form its manifest lists, or the state
        itself)."""
        ...

    def record(self, module: Any) -> Any:
        """What the user's module is before the runtime changes it (what :meth:`hand_back` restores)."""
        ...

    def hand_back_bytes(self, record: Any) -> int:
        """Host bytes one process needs for :meth:`hand_back` (checked against the free memory first)."""
        ...

    def hand_back(self, fit: FitView, record: Any) -> None:
        """End of fit (collective): the user's module, plain again, holding the trained weights on every rank (a no-op
        when it was handed back already); where the runtime lets its engine go, ``fit.engine`` becomes the module."""
        ...

    def write_layout(self, fit: FitView, directory: str | Path, record: Any) -> None:
        """After :meth:`save`: whatever lets the checkpoint be read back as full weights without the model's code."""
        ...

    def state_of(self, step: Path) -> Path:
        """Where a FleetCheckpoint step keeps this runtime's checkpoint."""
        ...

    # --- pipelines (only a runtime whose capabilities run them) ---

    def pipeline_step(self, engine: Any, micro_batches: list[Any]) -> Any:
        """One whole optimizer step of a pipeline plan; returns the step's loss."""
        ...

    def gather_stages(self, engine: Any, module: Any) -> None:
        """Every pipeline stage's current weights into every rank's module (collective)."""
        ...


PIPELINE_CALLS = ("pipeline_step", "gather_stages")
"""The Backend calls only a runtime that runs pipelines implements."""
