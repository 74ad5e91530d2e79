"""Decide once: (the profiled module, the cluster, the job's options, the checkpoint it continues) -> one Decision.

A :class:`Decision` is everything a fit needs to know before anything is applied: the plan and its estimate, what the
runtime was allowed to execute, whether the job starts fresh, continues a checkpoint at the same world size or
reshards one, and the start-up report that says why. The strategy computes it on rank 0, broadcasts it once and logs
it once; everything after setup only reads it (torchtitan's ``ParallelDims`` -> ``parallelize_*``).

Pure: imports the planning core, :mod:`lightning_fleet.runtime.base` and :mod:`lightning_fleet.elastic.layout` (all
torch-free) and nothing else of the package; imported by the strategy and by tests. Where things go: a new axis is a
planning change (Plan, Constraints, search) plus a runtime's Capabilities; a new runtime brings its own Capabilities;
what a user may fix or ask for is :class:`JobOptions`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from lightning_fleet.elastic.layout import Manifest
from lightning_fleet.planning import (
    ClusterSpec,
    Constraints,
    Estimate,
    FleetError,
    ModelSpec,
    PartialPlan,
    Plan,
    PlanResult,
    RejectionKind,
    estimate,
    narrow,
    parse_partial_plan,
    parse_plan,
)
from lightning_fleet.planning import plan as search_plans
from lightning_fleet.planning.cluster import GIB
from lightning_fleet.planning.search import uneven_split_line
from lightning_fleet.planning.plan import field_text
from lightning_fleet.runtime import capabilities_of
from lightning_fleet.runtime.base import Capabilities, ModuleHooks


class ResumeKind(StrEnum):
    """What a fit does with the checkpoint it was given or found."""

    FRESH = "fresh"
    """No checkpoint: the plan is chosen for this world."""
    CONTINUE = "continue"
    """Same world size: the checkpoint's plan continues exactly, its shards load as written."""
    RESHARD = "reshard"
    """Another world size: a plan is chosen for this world and the checkpoint is resharded to it."""


@dataclass(frozen=True, slots=True, kw_only=True)
class JobOptions:
    """What the user asked of the planner (FleetStrategy's arguments)."""

    plan: str | None = None
    """Axes fixed by the user (``"zero=3"``); the planner chooses the rest."""
    micro_batch_size: int | None = None
    """A micro-batch size the user pinned."""
    global_batch_size: int | None = None
    """Samples per optimizer step; None: the DataLoader's batch size times the world size."""
    allow_offload: bool = True
    """Offload may be chosen."""
    require_offload: bool = False
    """Only offloading plans may be chosen."""
    max_tp: int | None = None
    """Largest tensor-parallel degree."""
    max_pp: int | None = None
    """Largest pipeline degree."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages the planner may choose from."""
    top: int = 3
    """Plans the start-up report lists."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModuleFacts:
    """What profiling found that the decision needs (the torch side reduces a Profile to this)."""

    spec: ModelSpec
    """The profiled module at the job's global batch."""
    hooks: ModuleHooks
    """What the module offers the runtime (layer stack, tensor/pipeline hooks, its optimization loop)."""
    loader_batch_size: int
    """The training DataLoader's batch size."""
    batch_dependent: bool | None = None
    """Whether the loss depends on the micro-batch (None: unknown)."""
    profile_lines: tuple[str, ...] = ()
    """How the module was measured, for the report."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    """The checkpoint a fit continues, and how."""

    kind: ResumeKind
    """Fresh, continue at the same world size, or reshard."""
    path: str | None = None
    """The checkpoint step directory (None when fresh)."""
    manifest: Manifest | None = None
    """Its verified manifest (None when fresh)."""

    @property
    def writer(self) -> str:
        """The name of the runtime that wrote the checkpoint continued (:func:`writer_of` its manifest)."""
        assert self.manifest is not None, "a fresh start continues no checkpoint"
        return writer_of(self.manifest)


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """Everything decided before a fit applies anything; computed once on rank 0, read everywhere afterwards."""

    plan: Plan
    """The plan trained."""
    estimate: Estimate
    """The cost model's prediction for it on :attr:`cluster`."""
    cluster: ClusterSpec
    """The cluster planned for."""
    runtime: str
    """The runtime whose capabilities bounded the choice."""
    resume: Resume
    """Fresh, continue or reshard, and from which checkpoint."""
    report: tuple[str, ...]
    """The start-up report: how the module was measured, what was fixed and why, the plan, the runners-up."""

    @property
    def model(self) -> ModelSpec:
        """The profiled module the plan was priced for."""
        return self.estimate.model


def job_global_batch_size(options: JobOptions, *, loader_batch_size: int, world_size: int, manifest: Manifest | None) -> int:
    """Samples per optimizer step: a resumed checkpoint's (the optimisation continues whatever the new world; an
    explicit other one made it incompatible, elastic/compatibility.py), else the option, else what DDP would use."""
    if manifest is not None and manifest.global_batch_size is not None:
        return manifest.global_batch_size
    return options.global_batch_size or loader_batch_size * world_size


def resume_of(path: str | None, manifest: Manifest | None, world_size: int) -> Resume:
    """How a checkpoint (or none) is continued by a job of ``world_size`` processes (a tp or pp checkpoint reshards
    where the runtime that wrote it reshards them: ``Capabilities.reshard_data_parallel_only``)."""
    if manifest is None:
        return Resume(kind=ResumeKind.FRESH)
    if manifest.world_size == world_size:
        return Resume(kind=ResumeKind.CONTINUE, path=path, manifest=manifest)
    source = parse_plan(manifest.plan or "")
    writer = capabilities_of(writer_of(manifest))
    if (source.tp > 1 or source.pp > 1) and writer.reshard_data_parallel_only:
        raise FleetError(
            f"checkpoint {path} was written by {source} on {manifest.world_size} processes; resharding {writer.label}'s "
            f"checkpoints to {world_size} processes needs a data-parallel one (tp=1, pp=1): relaunch with "
            f"{manifest.world_size} processes"
        )
    return Resume(kind=ResumeKind.RESHARD, path=path, manifest=manifest)


def decide(
    module: ModuleFacts,
    cluster: ClusterSpec,
    *,
    world_size: int,
    options: JobOptions,
    runtimes: tuple[Capabilities, ...],
    resume: Resume,
    cluster_notes: tuple[str, ...] = (),
    runtime_notes: tuple[str, ...] = (),
) -> Decision:
    """The one decision of a fit: the runtime and the plan (continued, fixed or searched), its estimate and the report.
    ``runtimes``: those the job may use, preferred first when their predictions tie (each searched with its own
    capabilities and overlaps; the fastest executable pair wins). ``cluster_notes``: how the caller measured the
    cluster (e.g. why its ranks were judged alike or different), first among the notes; ``runtime_notes``: why a
    runtime is not among ``runtimes`` (not installed, the precision)."""
    if not runtimes:
        raise FleetError("no runtime may train this job: " + "; ".join(runtime_notes))
    partial, notes = fixed_axes(module, options)
    if partial.zero is not None and partial.zero not in options.zero_stages:  # the job's own contradiction, whatever the runtime
        raise FleetError(f"plan {partial}: zero={partial.zero} is outside zero_stages={tuple(options.zero_stages)}")
    notes = [*cluster_notes, *notes]
    if resume.kind is ResumeKind.CONTINUE and _switches_runtime(partial, runtimes, resume):
        resume = replace(resume, kind=ResumeKind.RESHARD)  # another runtime continues it: imported, then planned afresh
    if resume.kind is ResumeKind.CONTINUE:
        capabilities = checkpoint_runtime(resume, runtimes)
        chosen, result = _continued(module, cluster, partial, options, capabilities, resume), None
        notes.append(f"resumed  {resume.path}: its plan continues")
    else:
        allowed = _allowed_runtimes(partial, runtimes, resume)
        free = replace(partial, runtime=None)
        executing, refused = _executing(free, allowed, module, options)
        tried = [(caps, *_planned(module, cluster, free, options, caps, resume)) for caps in executing]
        capabilities, chosen, result = min(tried, key=lambda t: t[1].time.step_s)  # min keeps the first of equals
        notes.append(runtime_line(capabilities, chosen, tried, (*refused, *runtime_notes)))
        notes.extend(pipeline_note(chosen.plan))
    chosen = replace(chosen, plan=chosen.plan.replace(runtime=capabilities.name))
    cluster = cluster.for_runtime(capabilities.name)
    return Decision(
        plan=chosen.plan,
        estimate=chosen,
        cluster=cluster,
        runtime=capabilities.name,
        resume=resume,
        report=report_lines(chosen, result, cluster, notes),
    )


def _planned(
    module: ModuleFacts, cluster: ClusterSpec, partial: PartialPlan, options: JobOptions, capabilities: Capabilities, resume: Resume
) -> tuple[Estimate, PlanResult | None]:
    """The plan one runtime would train: the fixed plan priced, or the search's best (with its result), on the cluster
    as that runtime runs on it (its measured framework overheads, ``Calibration.for_runtime``)."""
    cluster = cluster.for_runtime(capabilities.name)
    constraints = _constraints(module, options, capabilities, resume)
    capabilities.check(partial, constraints, module.hooks)
    if partial.complete:  # everything fixed: train it as given (priced, not searched)
        narrow(constraints, partial)
        fixed = partial.to_plan(module.spec.global_batch_size)
        return estimate(module.spec, cluster, fixed, overlaps=capabilities.overlaps), None
    result = search_plans(module.spec, cluster, top=options.top, constraints=narrow(constraints, partial))
    return result.best, result


def _switches_runtime(partial: PartialPlan, runtimes: tuple[Capabilities, ...], resume: Resume) -> bool:
    """Another runtime than the one that wrote the checkpoint to continue must train (the plan fixes it, or the job may
    not use the writer), and one the job may use imports the writer's checkpoints."""
    writer = resume.writer
    if partial.runtime == writer or partial.runtime is None and writer in {caps.name for caps in runtimes}:
        return False
    return any(writer in caps.imports and partial.runtime in (None, caps.name) for caps in runtimes)


def writer_of(manifest: Manifest) -> str:
    """The name of the runtime that wrote a checkpoint: its plan's ``runtime``, :data:`LEGACY_RUNTIME` for one written
    before plans named one."""
    return parse_partial_plan(manifest.plan or "").runtime or LEGACY_RUNTIME


def _allowed_runtimes(partial: PartialPlan, runtimes: tuple[Capabilities, ...], resume: Resume) -> tuple[Capabilities, ...]:
    """The runtimes the job may use here: the one the plan fixes (``runtime=``); for a checkpoint to be resharded the
    runtime that wrote it first (it wins a tie), then those that import its checkpoints (``Capabilities.imports``);
    else all of ``runtimes``."""
    names = [caps.name for caps in runtimes]
    if resume.kind is ResumeKind.RESHARD:
        writer = resume.writer
        importers = tuple(caps for caps in runtimes if writer in caps.imports)
        own = tuple(caps for caps in runtimes if caps.name == writer)
        runtimes = (*own, *importers) if own or importers else (checkpoint_runtime(resume, runtimes),)
    if partial.runtime is None:
        return runtimes
    if partial.runtime not in names:
        raise FleetError(f"plan {partial} fixes runtime={partial.runtime}, which this job may not use (it may use {', '.join(names)})")
    kept = tuple(caps for caps in runtimes if caps.name == partial.runtime)
    if not kept:
        raise FleetError(f"plan {partial} fixes runtime={partial.runtime}, which cannot continue checkpoint {resume.path} "
                         f"(written by {resume.writer}; {', '.join(c.name for c in runtimes)} can)")
    return kept


def _executing(
    partial: PartialPlan, runtimes: tuple[Capabilities, ...], module: ModuleFacts, options: JobOptions
) -> tuple[tuple[Capabilities, ...], tuple[str, ...]]:
    """Those of ``runtimes`` that execute the axes the user fixed for this module and the job's options, and why each
    other does not ('torch: plan zero=3: torch runs zero 0 only; ...'); FleetError (one line: each runtime and why not)
    when none does."""
    kept, why, specific = [], [], []
    for caps in runtimes:
        refusal = caps.refusal(partial, module.hooks) or caps.job_refusal(require_offload=options.require_offload, zero_stages=options.zero_stages)
        if refusal is None:
            kept.append(caps)
            continue
        why.append(refusal if len(runtimes) == 1 else f"{caps.name}: {refusal}")
        if caps.runs_axes(partial):
            specific.append(refusal)
    if not kept:
        # a runtime that runs the plan's axes but not for this module says what to change; one that lacks an axis does not
        if len(specific) == 1:
            raise FleetError(specific[0])
        raise FleetError(why[0] if len(why) == 1 else "no runtime executes this job: " + "; ".join(why))
    return tuple(kept), tuple(why)


def checkpoint_runtime(resume: Resume, runtimes: tuple[Capabilities, ...]) -> Capabilities:
    """The runtime that wrote the checkpoint ``resume`` continues (its plan's ``runtime``; DeepSpeed for checkpoints
    written before plans named one), which must be among the job's ``runtimes``."""
    name = resume.writer
    for caps in runtimes:
        if caps.name == name:
            return caps
    raise FleetError(
        f"checkpoint {resume.path} was written by the {name} runtime, which this job does not use "
        f"(it may use {', '.join(c.name for c in runtimes)}): allow FleetStrategy(runtime={name!r}) or 'auto' to continue it"
    )


LEGACY_RUNTIME = "deepspeed"
"""The runtime of a checkpoint whose plan names none (every checkpoint written before there were two)."""


def runtime_line(chosen: Capabilities, best: Estimate, tried: list[tuple[Capabilities, Estimate, PlanResult | None]], notes: tuple[str, ...]) -> str:
    """'runtime  torch: predicted 0.12 s/step; deepspeed 0.13 s/step (1.08x); ...' -- which runtime trains, and why."""
    others = [
        f"{caps.name} {other.time.step_s:.4g} s/step ({other.time.step_s / best.time.step_s:.2f}x)"
        for caps, other, _ in tried if caps is not chosen
    ]
    reasons = [*others, *notes]
    why = "the only runtime that executes it" if not reasons else "; ".join(reasons)
    return f"runtime  {chosen.name}: predicted {best.time.step_s:.4g} s/step; {why}"


def _constraints(module: ModuleFacts, options: JobOptions, capabilities: Capabilities, resume: Resume) -> Constraints:
    """What the runtime executes for this module, narrowed by the options (resharding narrows further); the planner
    splits the batch unevenly over devices that differ only for a loss known not to depend on the micro-batch."""
    return replace(_runtime_constraints(module, options, capabilities, resume), search_dp_mbs=module.batch_dependent is False)


def _runtime_constraints(module: ModuleFacts, options: JobOptions, capabilities: Capabilities, resume: Resume) -> Constraints:
    if resume.kind is ResumeKind.RESHARD:
        return capabilities.reshard_constraints(
            module.hooks,
            allow_offload=options.allow_offload,
            require_offload=options.require_offload,
            zero_stages=options.zero_stages,
            checkpoint=str(resume.path),
        )
    return capabilities.constraints(
        module.hooks,
        allow_offload=options.allow_offload,
        require_offload=options.require_offload,
        max_tp=options.max_tp,
        max_pp=options.max_pp,
        zero_stages=options.zero_stages,
    )


def _continued(
    module: ModuleFacts, cluster: ClusterSpec, partial: PartialPlan, options: JobOptions, capabilities: Capabilities, resume: Resume
) -> Estimate:
    """The checkpoint's plan, if this job may run it and fixes nothing else."""
    assert resume.manifest is not None
    cluster = cluster.for_runtime(capabilities.name)
    resumed = parse_plan(resume.manifest.plan or "", global_batch_size=module.spec.global_batch_size).replace(runtime=capabilities.name)
    clash = {k: v for k, v in partial.fixed.items() if getattr(resumed, k) != v}
    if clash and set(clash) <= _SPLIT_KEYS:  # the same layout, the batch split another way: the checkpoint loads as is
        resumed, clash = _with_split(resumed, partial, module), {}
    if clash:
        raise FleetError(
            f"checkpoint {resume.path} was trained with plan {resumed}, but this job fixes "
            f"{', '.join(f'{k}={field_text(v)}' for k, v in clash.items())}: drop those from plan=/micro_batch_size= to "
            "continue it, or start in another checkpoint_dir"
        )
    whole = parse_partial_plan(str(resumed))
    try:
        constraints = _constraints(module, options, capabilities, resume)
        capabilities.check(whole, constraints, module.hooks)
        narrow(constraints, whole)
    except FleetError as err:
        raise FleetError(
            f"checkpoint {resume.path} was trained with plan {resumed}, which this job may not run ({err}): allow it "
            "(FleetStrategy's zero_stages, offload, max_tp/max_pp, the module's hooks) or start in another checkpoint_dir"
        ) from None
    return estimate(module.spec, cluster, resumed, overlaps=capabilities.overlaps)


_SPLIT_KEYS = {"mbs", "gas", "dp_mbs"}
"""Plan keys that say how a step's batch is split over micro-batches and replicas, not where weights and optimizer
states live: a checkpoint continues under any values of them (which samples form a step never depends on them)."""


def _with_split(resumed: Plan, partial: PartialPlan, module: ModuleFacts) -> Plan:
    """``resumed`` with the micro-batch split ``partial`` fixes (dp_mbs, or mbs and gas), gas following from the global
    batch; FleetError (one line) when that split does not fit the checkpoint's layout or the global batch."""
    gbs = module.spec.global_batch_size
    fixed = ", ".join(f"{k}={field_text(v)}" for k, v in partial.fixed.items() if k in _SPLIT_KEYS)
    sizes = partial.dp_mbs if partial.dp_mbs is not None or partial.mbs is not None else resumed.dp_mbs
    mbs = partial.mbs or resumed.mbs
    per_micro_step = sum(sizes) if sizes is not None else resumed.dp * mbs
    gas = partial.gas or max(1, gbs // per_micro_step)
    try:
        plan = resumed.replace(mbs=mbs, gas=gas, dp_mbs=sizes)
    except FleetError as err:
        raise FleetError(f"the checkpoint's plan {resumed} cannot take the fixed {fixed}: {err}") from None
    if plan.global_batch_size != gbs:
        raise FleetError(
            f"the checkpoint's plan {resumed} with the fixed {fixed} takes {plan.global_batch_size} samples a step, "
            f"not the global batch {gbs}: fix a split that makes it"
        )
    return plan


def fixed_axes(module: ModuleFacts, options: JobOptions) -> tuple[PartialPlan, list[str]]:
    """What the planner may not choose (the user's plan and micro-batch, what the loss and the optimization loop
    need) and the report lines that say why."""
    partial = parse_partial_plan(options.plan or "")
    notes = list(module.profile_lines)
    if partial.fixed:
        rest = "" if partial.complete else "; the planner chose the rest"
        notes.append(f"fixed    {partial} (FleetStrategy(plan=...)){rest}")
    if options.micro_batch_size is not None:
        partial = partial.fix(mbs=options.micro_batch_size)
        notes.append(f"fixed    mbs={options.micro_batch_size} (FleetStrategy(micro_batch_size=...))")
    partial, pinned = module_pins(module, partial)
    return partial, notes + pinned


def module_pins(module: ModuleFacts, partial: PartialPlan, *, pin_with: str = "micro_batch_size=N") -> tuple[PartialPlan, list[str]]:
    """The axes the module itself pins on top of ``partial`` and a report line for each: the DataLoader's batch size
    as the micro-batch when the loss depends on it (unless ``partial`` fixes one), gas=1 under manual optimization.
    ``pin_with`` is how the user pins a micro-batch where the report is read (``fleet plan``: ``--fix mbs=N``)."""
    notes = []
    if module.batch_dependent and partial.dp_mbs is not None:
        raise FleetError(
            f"plan {partial}: the loss depends on the micro-batch (BatchNorm, in-batch negatives or a summed loss), so "
            f"replicas with micro-batches {field_text(partial.dp_mbs)} would not train the single-process model: leave dp_mbs out"
        )
    if module.batch_dependent and partial.mbs is None:
        mbs, gbs = module.loader_batch_size, module.spec.global_batch_size
        if gbs % mbs == 0:
            partial = partial.fix(mbs=mbs)
            notes.append(
                f"fixed    mbs={mbs}: the loss depends on the micro-batch (BatchNorm, in-batch negatives or a summed loss), "
                f"so the DataLoader's batch size stays the micro-batch; pass {pin_with} to choose another"
            )
        else:
            notes.append(
                f"note     the loss depends on the micro-batch, but the DataLoader's batch size {mbs} does not divide the "
                f"global batch {gbs}: the planner chooses it; pass {pin_with} to pin one"
            )
    elif module.batch_dependent is None and partial.mbs is None:
        notes.append(f"note     whether the loss depends on the micro-batch is unknown; pass {pin_with} to pin it")
    if not module.hooks.automatic_optimization:
        if partial.gas not in (None, 1):
            raise FleetError(f"plan {partial}: {module.hooks.name} steps its own optimizer once per training_step, so gas must be 1")
        partial = partial.fix(gas=1)
        notes.append("fixed    gas=1, no pipeline: manual optimization steps once per training_step")
    return partial, notes


def pipeline_note(plan: Plan) -> list[str]:
    """What a pipeline plan changes for the user's code (said in the start-up report)."""
    if plan.pp == 1:
        return []
    return [
        "note     pipeline: each step runs fleet_pipeline()'s layers and loss_fn, not training_step (its logging and "
        "metrics do not run; the step's loss is logged as train_loss); validation runs your validation_step"
    ]


def report_lines(chosen: Estimate, result: PlanResult | None, cluster: ClusterSpec, notes: list[str]) -> tuple[str, ...]:
    """The start-up report: how the module was measured and what was fixed, the plan, its predicted memory and time,
    and why the runners-up lost."""
    lines = [
        f"lightning_fleet plan for {chosen.model.name} ({chosen.model.params / 1e6:.2f} M params, global batch "
        f"{chosen.plan.global_batch_size}) on {cluster.name} ({cluster.world_size} x {cluster.groups[0].device.name}):",
        *(f"  {note}" for note in notes),
        f"  chosen   {chosen.plan}",
        f"           predicted {chosen.time.step_s:.4g} s/step, {chosen.memory.total_bytes / GIB:.2f} of "
        f"{chosen.memory.limit_bytes / GIB:.2f} GiB per device ({chosen.time.largest_term()[0]} dominates)",
    ]
    if result is not None:
        lines.append(f"  searched {result.candidates} candidates, {result.feasible} fit, in {result.seconds:.3f} s")
        for runner in result.plans[1:]:
            lines.append(f"  runner-up {runner.plan}: {runner.time.step_s:.4g} s/step ({runner.time.step_s / chosen.time.step_s:.2f}x)")
        for rejection in [r for r in result.rejected if r.kind is not RejectionKind.SLOWER][:2]:
            lines.append(f"  misfit   {rejection.plan}: {rejection.reason}")
        if result.even_best is not None:
            lines.append(f"  {uneven_split_line(result, cluster)}")
        if result.leave_out is not None:
            lines.append(f"  {result.leave_out.line(result.best)}")
    return tuple(lines)
