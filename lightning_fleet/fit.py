"""The neutral fit core: everything one ``strategy="fleet"`` fit does that is neither Lightning's nor a runtime's.

:class:`FitCore` is a plain object. It holds the user's settings, the fit's one :class:`~lightning_fleet.decide.Decision`
and what setup hands to the later steps, and does, in this order: read the training data, measure (or read) the
cluster, choose the checkpoint to continue, profile the module, decide on rank 0 and broadcast once, apply the decision
through the runtime's backend, build the engine; then, step by step: the data re-batched by the plan, the replicas'
loss weights, rebalancing, saving, the load route (as written or resharded, from either runtime), and at the end the
module handed back. What it needs of the processes arrives as a :class:`Ranks` value (a Lightning face is one), what it
needs of the runtime through :class:`~lightning_fleet.runtime.base.Backend`; it never calls Lightning and names no
runtime. The Lightning faces (:mod:`lightning_fleet.strategy`, one per Lightning base class) only translate
Lightning's hooks into its calls.

A backend reads the fit through the :class:`~lightning_fleet.runtime.base.FitView` attributes (``engine``, ``module``,
``plan``, ``device``, ``global_rank``, ``world_size``), which :class:`FitCore` has.

Imports torch-side helpers of the package (profiling, calibration, data); never ``lightning`` itself
(tests/test_layering.py); imported by the strategy only.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import psutil

from lightning_fleet.calibrate.measure import (
    RANK_PROBE_S,
    WorldShape,
    across_ranks,
    cache_path,
    device_memory_gib,
    load_cached,
    measure,
    measure_ranks,
    save_cache,
    with_rank_devices,
)
from lightning_fleet.calibrate.ranks import rebalance_by
from lightning_fleet.data import TrainingData, example_batch, inspect_training_loader, step_loader
from lightning_fleet.decide import (
    Decision,
    JobOptions,
    ModuleFacts,
    Resume,
    ResumeKind,
    decide,
    job_global_batch_size,
    resume_of,
    writer_of,
)
from lightning_fleet.elastic.callback import NON_FINITE_POLICIES
from lightning_fleet.elastic.checkpoint import VerifiedCheckpoint
from lightning_fleet.elastic.compatibility import RESUME_POLICIES, JobFacts, checkpoint_to_continue, job_facts
from lightning_fleet.elastic.layout import MANIFEST, rank_file, rank_file_name
from lightning_fleet.elastic.safe_load import load_file
from lightning_fleet.elastic.sampler import ShareSchedule
from lightning_fleet.elastic.worker import deterministic_errors
from lightning_fleet.hooks import find_layers, module_hooks, per_rank_attributes, tensor_parallel_hook
from lightning_fleet.planning import ClusterSpec, Estimate, FleetError, Plan, Precision, load_cluster
from lightning_fleet.planning.cluster import GIB
from lightning_fleet.planning.plan import share_weight
from lightning_fleet.profiling import Profile, profile
from lightning_fleet.rng import RngState
from lightning_fleet.runtime import AUTO, RUNTIMES, Runtime, runtime_named
from lightning_fleet.runtime.base import ENGINE_CHECK, Backend

REBALANCE_EVERY_N_STEPS = 100
"""How often (in optimizer steps) the ranks probe their speed when ``rebalance_every_n_steps`` is left at None."""
REBALANCE_OVERHEAD = 0.01
"""The most of the time trained that automatic rebalancing's probes may take (each takes RANK_PROBE_S)."""


class Ranks(Protocol):
    """What the fit core needs of the job's processes (a Lightning face is one: Lightning's ParallelStrategy has each)."""

    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def root_device(self) -> Any: ...
    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class FitSettings:
    """What the user set for the fit beyond the planner's :class:`~lightning_fleet.decide.JobOptions` (FleetStrategy's
    arguments of the same names; checked here, one line each)."""

    cluster: Any = None
    """Cluster YAML path, preset name or ClusterSpec; None: measure this machine."""
    checkpoint_dir: Path | None = None
    """Where the FleetCheckpoint the strategy adds saves (None: none is added)."""
    checkpoint_every_n_steps: int | None = None
    """Its step interval."""
    checkpoint_every_n_seconds: float | None = None
    """Its time interval."""
    resume: str = "auto"
    """What a fit without ``ckpt_path`` does with the newest checkpoint (:data:`RESUME_POLICIES`)."""
    progress: bool = True
    """Print progress lines and the end-of-fit summary."""
    hand_back: bool = True
    """Give the module back whole at the end of fit."""
    rebalance_every_n_steps: int | None = None
    """Probe the ranks' speed every N steps (0: never; None: automatic)."""
    non_finite: str = "stop"
    """What a non-finite step does (:data:`NON_FINITE_POLICIES`)."""

    def __post_init__(self) -> None:
        every = self.rebalance_every_n_steps
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 0):
            raise FleetError(f"FleetStrategy(rebalance_every_n_steps={every!r}): must be a non-negative integer (0: never) or None")
        if self.resume not in RESUME_POLICIES:
            raise FleetError(f"FleetStrategy(resume={self.resume!r}): must be one of {', '.join(map(repr, RESUME_POLICIES))}")
        if self.non_finite not in NON_FINITE_POLICIES:
            choices = ", ".join(map(repr, NON_FINITE_POLICIES))
            raise FleetError(f"FleetStrategy(non_finite={self.non_finite!r}): must be one of {choices}")
        if self.checkpoint_dir is not None and not isinstance(self.checkpoint_dir, Path):
            object.__setattr__(self, "checkpoint_dir", Path(self.checkpoint_dir))


def check_batch_sizes(**sizes: int | None) -> None:
    """Each given batch size (``global_batch_size=``, ``micro_batch_size=``) is a positive integer or None."""
    for name, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise FleetError(f"FleetStrategy({name}={value!r}): must be a positive integer or None")


class FitCore:
    """One strategy's fits, runtime-neutral and Lightning-free (see the module docstring).

    Args:
        ranks: the job's processes (rank, world, device, broadcast).
        options: what the planner is asked.
        settings: the rest of the user's settings.
        runtime: the runtime asked for (a name, or ``"auto"``).
        backend: the backend of the runtime in use (the asked one's; the chosen one's from :meth:`use` on).
    """

    def __init__(self, ranks: Ranks, options: JobOptions, settings: FitSettings, runtime: str, backend: Backend) -> None:
        self.ranks, self.options, self.settings = ranks, options, settings
        self.runtime = runtime
        """The runtime asked for: a name, or "auto" (the decision's ``runtime`` says which one trains)."""
        self.backend = backend
        """The runtime that applies the decision."""
        self.decision: Decision | None = None
        """What this fit decided at setup (plan, estimate, cluster, resume); read-only afterwards but for rebalancing."""
        self.profile: Profile | None = None
        """How the module was measured (method, fallbacks, what it means for the plan)."""
        self.startup_s: dict[str, float] = {}
        """Seconds spent at setup reading/measuring the cluster, choosing (verifying) the checkpoint to continue,
        profiling, and deciding (incl. broadcasts)."""
        self.resumed_from: Path | None = None
        """The checkpoint this fit resumed from (None for a fresh start)."""
        self.module: Any = None
        """The user's module (from :meth:`begin`, or the evaluation's)."""
        self.engine: Any = None
        """The runtime's engine of the last fit (kept for saving after evaluation); the plain module once handed back
        by a runtime that lets its engine go."""
        self.facts: JobFacts | None = None  # what a checkpoint of this job records (elastic/compatibility.py)
        self.data: TrainingData | None = None  # the user's training data, as the fit re-batches it
        self.universal: VerifiedCheckpoint | None = None  # the decided checkpoint listing its resharded form (rank 0 converted it)
        self.handed_back = False  # the end of that fit handed the user's module back (the engine no longer runs it)
        self.module_record: Any = None  # what the backend's hand_back restores at the end of fit
        self.runtime_config: Any = None  # the runtime's configuration of the decided plan (Backend.config)
        self.restorers: list[Any] = []  # how to undo this fit's patches
        self.shares: ShareSchedule | None = None  # the replicas' shares by step (the sampler cuts by it, losses are weighted by it)
        self.prefetched_steps = 2  # steps the data pipeline may have cut ahead of the one training (a share change starts later)
        self.rebalanced: list[str] = []  # what each rebalance did, as reported
        self.pending: tuple[int, Estimate] | None = None  # a share change decided, and the step it starts at
        self.last_probe = time.perf_counter()  # when the ranks last probed their speed (the fit's start before that)
        self.ranks_line: str | None = None  # why the measured ranks were judged alike or different (start-up report)

    # --- what a backend reads (runtime.base.FitView) --------------------------------------------------

    @property
    def plan(self) -> Plan | None:
        """The plan being trained (set at setup)."""
        return self.decision.plan if self.decision is not None else None

    @property
    def device(self) -> Any:
        """This rank's device."""
        return self.ranks.root_device

    @property
    def global_rank(self) -> int:
        """This rank."""
        return int(self.ranks.global_rank)

    @property
    def world_size(self) -> int:
        """Every process of the job."""
        return int(self.ranks.world_size)

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica index under the plan (its placement: Plan.coordinates)."""
        assert self.plan is not None
        return self.plan.coordinates(self.global_rank).dp

    # --- setup: read, decide once, apply ----------------------------------------------------------------

    def begin(self, module: Any, loader: Any, *, data_seed: int) -> None:
        """A fit starts: the user's module, what its checkpoints record (with rank 0's ``data_seed``), its training
        data read once."""
        self.module = module
        self.facts = job_facts(module, global_batch_size=self.options.global_batch_size, data_seed=data_seed)
        self.data = inspect_training_loader(loader)

    def decide(self, *, requested: Any, directory: Path | None, precision: str, shape: WorldShape) -> Decision:
        """The fit's one Decision: rank 0 chooses the checkpoint to continue (``requested``: the user's ``ckpt_path``;
        else the newest in ``directory``, verified once), every rank profiles the module at the resulting global
        batch, rank 0 decides; each step is broadcast once. ``precision``: Lightning's precision setting."""
        started = time.perf_counter()
        cluster = self.resolve_cluster(shape)
        measured = time.perf_counter()
        chosen = self.on_rank_zero(
            lambda: checkpoint_to_continue(Path(requested) if requested is not None else None, directory, self.facts,
                                           self.settings.resume)
        )
        path, manifest = (str(chosen.path), chosen.manifest) if chosen is not None else (None, None)
        assert self.data is not None
        gbs = job_global_batch_size(self.options, loader_batch_size=self.data.batch_size, world_size=self.world_size,
                                    manifest=manifest)
        chosen_at = time.perf_counter()
        facts = self.profile_module(self.data, gbs, precision)
        profiled = time.perf_counter()
        runtimes, runtime_notes = self.usable_runtimes(precision)

        def decide_here() -> Decision:
            resume = resume_of(path, manifest, self.world_size)
            decision = decide(facts, cluster, world_size=self.world_size, options=self.options,
                              runtimes=tuple(r.capabilities for r in runtimes), resume=resume,
                              cluster_notes=(self.ranks_line,) if self.ranks_line else (), runtime_notes=runtime_notes)
            print("\n".join(decision.report), flush=True)  # logged once, by the rank that decided
            return decision

        self.decision = self.on_rank_zero(decide_here)
        self.startup_s = {
            "cluster_s": measured - started,
            "checkpoint_s": chosen_at - measured,
            "profile_s": profiled - chosen_at,
            "plan_s": time.perf_counter() - profiled,
        }
        return self.decision

    def usable_runtimes(self, precision: str) -> tuple[list[Runtime], tuple[str, ...]]:
        """The runtimes this fit may use (the one asked for, or under "auto" every installed one), those whose backend
        refuses the Lightning ``precision`` on this device left out, and a note for each left out."""
        asked = [runtime_named(self.runtime)] if self.runtime != AUTO else [r for r in RUNTIMES if r.installed()]
        usable, notes = [], []
        for runtime in asked:
            backend = self.backend if runtime.name == self.backend.capabilities.name else runtime.load_backend()
            refusal = backend.precision_refusal(precision, self.device.type)
            if refusal is None:
                usable.append(runtime)
            elif len(asked) == 1:
                raise FleetError(refusal)
            else:
                notes.append(f"not {runtime.name}: {refusal}")
        return usable, tuple(notes)

    def use(self, runtime: Runtime) -> None:
        """Train with ``runtime`` (the decision's): its backend from now on."""
        if runtime.name != self.backend.capabilities.name:
            self.backend = runtime.load_backend()

    def profile_module(self, data: TrainingData, global_batch_size: int, precision: str) -> ModuleFacts:
        """Profile the module on the first samples of its training data (every rank; nothing of the module changes) and
        reduce the profile to what the decision needs."""
        module = self.module
        example = example_batch(data, data.batch_size)
        self.profile = profile(module, example, global_batch_size=global_batch_size,
                               precision=Precision.from_lightning(precision), name=type(module).__name__)
        return ModuleFacts(
            spec=self.profile.spec,
            hooks=module_hooks(module, sparse_params=self.profile.sparse_params, pipeline_problem=self.profile.pipeline_problem),
            loader_batch_size=data.batch_size,
            batch_dependent=self.profile.batch_dependent,
            profile_lines=tuple(self.profile.report_lines()),
        )

    def resolve_cluster(self, shape: WorldShape) -> ClusterSpec:
        """The cluster to plan for: the one given (its size checked against the job), else this machine's measurement
        (rank 0's numbers, cached per host and world shape), its ranks probed at every start: a rank is described on
        its own only where this start's probe rounds all find it slower (the cache keeps no per-rank speed). Why the
        ranks were judged alike or different goes into the start-up report (``ranks_line``)."""
        source, ranks = self.settings.cluster, self.ranks
        if source is not None:
            cluster = source if isinstance(source, ClusterSpec) else load_cluster(source)
            if cluster.world_size != shape.world_size:
                raise FleetError(
                    f"cluster {cluster.name!r} has {cluster.world_size} devices ({cluster.num_nodes} nodes x "
                    f"{cluster.devices_per_node}) but this job runs {shape.world_size} processes ({shape.num_nodes} nodes x "
                    f"{shape.local_world_size}): fix the cluster file or drop cluster= to measure this machine"
                )
            return cluster
        path = cache_path(self.device, shape)
        cached = ranks.broadcast(load_cached(path) if ranks.is_global_zero else None)
        if cached is not None:
            speeds = measure_ranks(self.device, device_memory_gib(self.device, shape.local_world_size))
            measured = with_rank_devices(cached, speeds)  # every rank gathered the same rounds: the same cluster
        else:
            measurement = measure(self.device, shape)
            speeds = measurement.ranks
            measured = ranks.broadcast(measurement.cluster)  # every rank plans with rank 0's numbers
            if ranks.is_global_zero:
                save_cache(measured, path)
        assert speeds is not None
        self.ranks_line = speeds.judged().line()
        return measured

    def apply(self, *, gradient_clipping: float, precision_plugin: Any) -> Any:
        """Apply the decision: a resharded checkpoint's conversion (rank 0, once), the runtime's configuration of the
        plan (returned), and the module changes the runtime needs for this fit (undone by :meth:`undo_patches`)."""
        decision = self.decision
        assert decision is not None
        resume = decision.resume
        if resume.kind is ResumeKind.RESHARD:
            assert resume.path is not None and resume.manifest is not None
            verified = VerifiedCheckpoint(Path(resume.path), resume.manifest)
            self.universal = self.on_rank_zero(lambda: self.converted(verified))
        module = self.module
        tp = tensor_parallel_hook(module)
        self.runtime_config = self.backend.config(
            decision.plan,
            gradient_clipping=gradient_clipping,
            device_type=self.device.type,
            tensor_parallel=tp[1] if tp else None,
            universal=resume.kind is ResumeKind.RESHARD,
        )
        for obj, name, value in self.backend.module_patches(module, decision.plan, find_layers(module), precision_plugin):
            self.patch(obj, name, value)
        return self.runtime_config

    def converted(self, checkpoint: VerifiedCheckpoint) -> VerifiedCheckpoint:
        """Rank 0: the checkpoint to reshard in the form this fit's runtime loads: converted by that runtime when it wrote
        it; else its whole state exported by the runtime that did and imported by this one (each listed in the
        manifest once)."""
        writer = writer_of(checkpoint.manifest)
        if writer == self.backend.capabilities.name:
            return self.backend.reshard(checkpoint)
        exported = runtime_named(writer).load_backend().export_state(checkpoint)
        return self.backend.import_state(checkpoint, exported)

    def build_engine(self, model: Any, optimizer: Any, lr_scheduler: Any, *, device_rank: int) -> tuple[Any, Any]:
        """The runtime's engine over the module (recorded first: what the end of fit hands back)."""
        assert self.plan is not None
        self.module_record = self.backend.record(model)  # before the runtime changes it
        for obj, name in self.backend.process_globals():
            self.patch(obj, name, getattr(obj, name))
        counts = per_rank_attributes(self.module) if self.plan.tp > 1 else []  # the user's module, whatever wraps it here
        for _, owner, name, value in counts:  # the original comes back with the module (DeepSpeed's AutoTP may divide a known name itself)
            self.patch(owner, name, value)
        stack = find_layers(model)
        engine, optimizer = self.backend.build(
            model,
            optimizer,
            lr_scheduler,
            plan=self.plan,
            config=self.runtime_config,
            device_rank=device_rank,
            layers=list(stack) if stack is not None else None,
        )
        for _, owner, name, value in counts:  # each rank holds a tp-th of what they count
            setattr(owner, name, value // self.plan.tp)
        self.engine, self.handed_back = engine, False
        return engine, optimizer

    def on_rank_zero(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 and give every rank its result, or raise its FleetError on every rank. Any other
        exception on rank 0 is raised there as it is and as a FleetError naming it on the others (none waits forever)."""
        result: Any = None
        failure: BaseException | None = None
        if self.ranks.is_global_zero:
            try:
                result = fn()
            except FleetError as err:
                result = err
            except Exception as err:  # a bug or an OS error: the other ranks must not wait for a broadcast
                failure, result = err, FleetError(f"rank 0 failed while deciding for every rank: {type(err).__name__}: {err}")
        result = self.ranks.broadcast(result)
        if failure is not None:
            raise failure
        if isinstance(result, FleetError):
            raise result
        return result

    # --- changes for a fit, undone at its end -------------------------------------------------------

    def patch(self, obj: Any, name: str, value: Any) -> None:
        """Set ``obj.name = value`` for this fit, remembering how to undo it."""
        had = name in vars(obj)
        self.restorers.append((obj, name, had, vars(obj).get(name)))
        setattr(obj, name, value)

    def undo_patches(self) -> None:
        """Undo every :meth:`patch`, newest first."""
        while self.restorers:
            obj, name, had, old = self.restorers.pop()
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

    # --- the engine and the module -------------------------------------------------------------------

    def engine_in_use(self, model: Any) -> bool:
        """Whether the runtime's engine trains or evaluates now, ``model`` being what the face runs (not after the
        module was handed back)."""
        return self.engine is not None and model is self.engine and not self.handed_back

    def gradient_check(self, model: Any) -> str:
        """How NonFiniteGuard checks a step's gradient while the engine trains (``Backend.gradient_check`` of the plan;
        under a pipeline, or outside fit, the engine's own way)."""
        plan = self.plan
        if not self.engine_in_use(model) or plan is None or plan.pp > 1:
            return ENGINE_CHECK
        return self.backend.gradient_check(plan)

    def pipelined(self, model: Any) -> bool:
        """Whether the engine runs a pipeline schedule now."""
        return self.engine_in_use(model) and self.plan is not None and self.plan.pp > 1

    def release_engine(self, module: Any) -> None:
        """Evaluation of ``module`` itself: after a fit in this process it is already a plain module holding the trained
        weights (the end of training handed it back; else it is handed back here); the engine is kept only for saving."""
        self.module = module
        if self.engine is not None and self.module_record is not None:
            self.backend.hand_back(self, self.module_record)  # a no-op when the end of training handed it back already
        self.undo_patches()

    def hand_back_at_end(self) -> bool:
        """End of fit (collective): the user's module as a plain module in its original structure holding the trained
        weights on every rank. Skipped, with one line, when ``hand_back=False`` or when the whole model in fp32 on every
        local rank would not fit the host's memory. True when it was handed back."""
        record = self.module_record
        if self.engine is None or record is None or not self.settings.hand_back:
            return False
        local = self.ranks.num_processes
        needed = local * self.backend.hand_back_bytes(record)
        available = across_ranks(float(psutil.virtual_memory().available), self.device)  # the least free
        if needed > 0.8 * available:
            if self.ranks.is_global_zero:
                print(
                    f"lightning_fleet: the module is left as {self.backend.capabilities.label} trained it: handing its {needed / local / GIB:.1f} GiB "
                    f"of fp32 weights back to {local} processes per node needs {needed / GIB:.1f} GiB of host memory, "
                    f"{available / GIB:.1f} GiB is free; export the weights instead (fleet export, README 'Getting the weights out')",
                    flush=True,
                )
            return False
        self.backend.hand_back(self, record)
        self.handed_back = True
        return True

    # --- the training data and the step -------------------------------------------------------------------

    def step_batches(self, first_step: Callable[[], int]) -> Any:
        """This rank's training data re-batched into step batches of ``gas`` micro-batches of ``mbs`` in the global
        batch's order (see data.py), from the step ``first_step()`` says on."""
        data, plan = self.data, self.plan
        assert data is not None and plan is not None and self.facts is not None
        self.shares = ShareSchedule(plan.uneven_shares())
        workers = data.options.num_workers
        self.prefetched_steps = 2 + (data.options.prefetch_factor or 2) * workers if workers else 2
        with deterministic_errors():  # e.g. fewer samples than one global batch: every attempt would say so again
            return step_loader(
                data,
                global_batch_size=plan.global_batch_size,
                dp_size=plan.dp,
                dp_rank=self.dp_rank,
                gas=plan.gas,
                shares=self.shares,
                seed=self.facts.data_seed,  # the seed the checkpoints record
                first_step=first_step,
            )

    def loss_weight(self, step: int) -> float:
        """What this replica's loss is multiplied by at ``step``: its share of the step over an equal share, when the
        replicas' shares differ (``dp_mbs``, :class:`ShareSchedule`): the runtime averages the replicas' gradients,
        which is then the mean over the global batch; and over the step's micro-batches where the runtime sums their
        gradients (``Backend.averages_micro_batches`` False)."""
        schedule = self.shares
        shares = schedule.at(step) if schedule is not None else None
        weight = share_weight(shares, self.dp_rank) if shares is not None else 1.0
        if not self.backend.averages_micro_batches and self.plan is not None and self.plan.gas > 1:
            weight /= self.plan.gas
        return weight

    def rebalance(self, step: int, *, may: bool) -> None:
        """Every ``rebalance_every_n_steps`` steps (collective: every rank trains the same ``step``; ``may``: the face
        says the step is one the engine trains under automatic optimization): probe each rank's sustained speed; when
        the planner finds a split of each micro-step's samples by them predicted REBALANCE_GAIN faster than the one in
        use (:func:`planning.search.rebalance`), use it from the first step the data pipeline has not cut yet (the
        sampler and the loss weights read the same :class:`ShareSchedule`); the plan and its estimate follow from that
        step on."""
        decision, every_set = self.decision, self.settings.rebalance_every_n_steps
        every = REBALANCE_EVERY_N_STEPS if every_set is None else every_set
        if decision is None or self.shares is None:
            return
        pending = self.pending
        if pending is not None and step >= pending[0]:
            self.decision, self.pending = dataclasses.replace(decision, plan=pending[1].plan, estimate=pending[1]), None
            return
        if not every or step == 0 or step % every or not may or not self.may_rebalance() or pending is not None:
            return
        if every_set is None:  # automatic: keep the probes' share of the time trained small
            since = across_ranks(time.perf_counter() - self.last_probe, self.device)  # the same answer on every rank
            if since * REBALANCE_OVERHEAD < RANK_PROBE_S:
                return
        self.last_probe = time.perf_counter()
        speeds = measure_ranks(self.device, device_memory_gib(self.device, self.ranks.num_processes))
        start = step + self.prefetched_steps
        change = rebalance_by(speeds, decision.estimate.model, decision.cluster, decision.estimate.plan,
                              overlaps=self.backend.capabilities.overlaps, step=step, start=start)
        if change is None:
            return
        new, line = change
        self.shares.set_from(start, new.plan.uneven_shares())
        self.pending = (start, new)
        self.rebalanced.append(line)
        if self.global_rank == 0:
            print(line, flush=True)

    def may_rebalance(self) -> bool:
        """Rebalancing keeps the optimisation only for a data-parallel plan of a loss known to be a per-sample mean, on a
        runtime that weights replicas."""
        plan = self.plan
        return (plan is not None and plan.dp > 1 and plan.pp == 1 and self.backend.capabilities.uneven_dp
                and self.profile is not None and self.profile.batch_dependent is False)

    # --- checkpoints -------------------------------------------------------------------------------------

    def save(self, engine: Any, directory: Any, client_state: dict) -> None:
        """``engine``'s sharded checkpoint in ``directory`` (every rank; the fit's engine, or before any fit the face's
        module) and the layout file that lets :func:`lightning_fleet.export.export_state_dict` rebuild the full
        weights."""
        self.backend.save(engine, directory, client_state)
        self.backend.write_layout(self, directory, self.module_record)  # every rank (collective for ZeRO-0 fp16/bf16 masters); rank 0 writes

    def load(self, path: Path, *, strict: bool) -> dict[str, Any]:
        """A fit's checkpoint: the FleetCheckpoint step decided at setup (verified once then, each file checked again as
        it is read; resharded or as written, with each rank's RNG), else a ``trainer.save_checkpoint`` dir. Every file
        is read by the restricted unpickler."""
        resume = self.decision.resume if self.decision is not None else None
        if resume is None or resume.path is None or Path(resume.path) != path:
            return self._load_plain(path, strict=strict)
        return self._load_decided(path, resume, strict=strict)

    def _load_plain(self, path: Path, *, strict: bool) -> dict[str, Any]:
        """A ``trainer.save_checkpoint`` dir given as ``ckpt_path`` (no manifest): loaded by the restricted unpickler."""
        if (path / MANIFEST).is_file():  # only the step decided at setup is continued
            raise FleetError(f"checkpoint {path} was not the one this fit decided to continue at setup; pass it as ckpt_path")
        if not path.is_dir():
            raise FleetError(f"checkpoint {path} is not a directory: strategy 'fleet' resumes a fit from a FleetCheckpoint "
                             "step or a trainer.save_checkpoint dir")
        return self.backend.load(self.engine, path, optimizer_states=True, strict=strict, checkpoint=None)

    def _load_decided(self, path: Path, resume: Resume, *, strict: bool) -> dict[str, Any]:
        """The FleetCheckpoint step the decision continues: its universal form when resharded, else its shards and this
        rank's RNG state."""
        manifest = resume.manifest
        assert manifest is not None
        engine = self.engine
        if resume.kind is ResumeKind.RESHARD:
            assert self.universal is not None
            state = self.backend.load(engine, self.backend.derived_of(self.universal), optimizer_states=True, strict=strict,
                                      checkpoint=self.universal)
            how = f"resharded from {manifest.world_size} to {self.world_size} processes, {manifest.plan} -> {self.plan}"
        else:
            checkpoint = VerifiedCheckpoint(path, manifest)
            state = self.backend.load(engine, self.backend.state_of(path), optimizer_states=True, strict=strict, checkpoint=checkpoint)
            name = rank_file_name(self.global_rank)
            rng = manifest.files.get(name)
            if rng is not None:
                RngState.from_checkpoint(load_file(rank_file(path, self.global_rank), rng, kind=manifest.kinds[name])).install()
            how = "same plan and world"
        self.resumed_from = path
        if self.ranks.is_global_zero:
            print(f"lightning_fleet: resumed from {path} (step {manifest.step}; {how})", flush=True)
        return state

