"""The planner: enumerate layouts, prune by memory, rank by predicted step time, explain the rest.

Search is separate from execution: it takes specs and returns ranked estimates; it never launches
anything. Three pruning rules keep it fast and exact (tests compare it with brute force):

* memory never shrinks as the micro-batch grows, so the first micro-batch size that does not fit
  ends that branch;
* recomputation (none < selective < full) and offload (none < optimizer < optimizer+params) only
  add time and only remove memory, so a fitting variant is priced only when no variant with less
  of both fits;
* placements other than the default are priced only when the default puts a collective across nodes.
"""

from __future__ import annotations

import heapq
import itertools
import time as _clock
from dataclasses import dataclass, field

from lightning_fleet.planning.cluster import GIB, ClusterSpec, LinkLevel
from lightning_fleet.planning.comm import axis_level
from lightning_fleet.planning.errors import NoFeasiblePlanError, PlanError
from lightning_fleet.planning.estimate import (
    Estimate,
    Hardware,
    compute_bound_s,
    estimate_with,
    memory_estimate,
    stage_activation_bytes,
    stage_state_bytes,
    time_estimate,
)
from lightning_fleet.planning.memory import MemoryEstimate
from lightning_fleet.planning.model import ModelSpec
from lightning_fleet.planning.plan import DEFAULT_ORDER, Axis, Offload, Plan, Recompute
from lightning_fleet.planning.stages import stage_loads


@dataclass(frozen=True, slots=True, kw_only=True)
class Constraints:
    """What the search may choose. Runtimes narrow it to what they really execute."""

    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages to consider."""
    max_tp: int | None = None
    """Largest tensor-parallel degree (None: no limit beyond the heads)."""
    max_pp: int | None = None
    """Largest pipeline degree (None: no limit beyond the layers)."""
    max_zero_with_pp: int = 3
    """Highest ZeRO stage allowed together with pp > 1 (DeepSpeed's pipeline engine: 1)."""
    allow_offload: bool = True
    """Consider optimizer / parameter offload (needs a host section in the cluster)."""
    require_offload: bool = False
    """Consider only plans that offload (implies allow_offload)."""
    recompute: tuple[Recompute, ...] = (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL)
    """Recomputation modes to consider."""
    allow_sp: bool = True
    """Consider sequence parallelism."""
    max_vpp: int | None = None
    """Largest number of virtual pipeline stages (1 disables interleaving)."""
    mbs: tuple[int, ...] | None = None
    """Micro-batch sizes to consider (None: every divisor of the per-replica batch)."""
    search_placement: bool = True
    """Price placements other than tp-dp-pp when the default crosses nodes."""
    tp_with_pp: bool = True
    """Allow tp > 1 and pp > 1 together."""
    offload_with_pp: bool = True
    """Allow offload when pp > 1."""

    def __post_init__(self) -> None:
        order = list(Recompute)  # none < selective < full: the search relies on this order
        object.__setattr__(self, "recompute", tuple(sorted({Recompute(r) for r in self.recompute}, key=order.index)))
        for stage in self.zero_stages:
            if stage not in (0, 1, 2, 3):
                raise PlanError(f"constraint zero_stages: {stage!r} is not a ZeRO stage (0-3)")
        for name in ("max_tp", "max_pp", "max_vpp"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise PlanError(f"constraint {name} must be >= 1, got {value}")
        if not self.zero_stages or not self.recompute:
            raise PlanError("constraints leave no ZeRO stage or no recompute mode to choose from")


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejection:
    """A candidate (or a family of them) that was not chosen, and why."""

    plan: str
    """The plan string (for a family, its smallest member)."""
    reason: str
    """Which term did not fit and by how much, or why it lost."""

    def to_dict(self) -> dict[str, str]:
        """JSON form."""
        return {"plan": self.plan, "reason": self.reason}


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanResult:
    """The planner's answer: the best plans first, why others lost, and how big the search was."""

    plans: tuple[Estimate, ...]
    """Top plans, fastest first."""
    rejected: tuple[Rejection, ...]
    """Plans that lost, with a reason each: the runners-up beyond the top, then those that did not fit (closest first)."""
    candidates: int
    """Candidates considered (pruned families counted in full)."""
    feasible: int
    """Candidates that fit (each is priced, or dominated by a faster one that fits)."""
    seconds: float
    """Wall time of the search."""
    all_feasible: tuple[Estimate, ...] = field(default=(), repr=False)
    """Every estimate priced, fastest first (every undominated feasible plan when searched exhaustively)."""
    misfit_plans: tuple[Plan, ...] = field(default=(), repr=False)
    """The lightest variant of every family that did not fit (for plots)."""

    @property
    def best(self) -> Estimate:
        """The chosen plan."""
        return self.plans[0]

    def to_dict(self) -> dict[str, object]:
        """The JSON object of ``fleet plan --json``."""
        return {
            "plans": [e.to_dict() for e in self.plans],
            "rejected": [r.to_dict() for r in self.rejected],
            "search": {"candidates": self.candidates, "feasible": self.feasible, "seconds": self.seconds},
        }


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _offloads(zero: int, cons: Constraints, has_host: bool) -> list[Offload]:
    """Offload modes to try for a ZeRO stage, lightest first (empty when offload is required but impossible)."""
    if not ((cons.allow_offload or cons.require_offload) and has_host) or zero == 0:
        return [] if cons.require_offload else [Offload.NONE]
    modes = [Offload.NONE, Offload.OPTIMIZER] + ([Offload.OPTIMIZER_PARAMS] if zero == 3 else [])
    return modes[1:] if cons.require_offload else modes


@dataclass(frozen=True, slots=True)
class _Layout:
    dp: int
    tp: int
    pp: int


def _layouts(model: ModelSpec, world: int, cons: Constraints, rejected: list[tuple[float, Rejection]]) -> list[_Layout]:
    out = []
    for tp in divisors(world):
        if model.num_heads % tp or (cons.max_tp and tp > cons.max_tp):
            continue
        for pp in divisors(world // tp):
            if model.num_layers % pp or (cons.max_pp and pp > cons.max_pp):
                continue
            dp = world // (tp * pp)
            if tp > 1 and pp > 1 and not cons.tp_with_pp:
                continue
            if model.global_batch_size % dp:
                reason = f"dp({dp}) does not divide the global batch size {model.global_batch_size}"
                rejected.append((float("inf"), Rejection(plan=f"dp={dp},tp={tp},pp={pp}", reason=reason)))
                continue
            out.append(_Layout(dp, tp, pp))
    return out


def _variants(layout: _Layout, model: ModelSpec, cons: Constraints) -> list[tuple[int, bool, int]]:
    """(vpp, sp, zero) combinations for a layout."""
    vpps = [1]
    if layout.pp > 1:
        vpps = [v for v in divisors(model.num_layers // layout.pp) if cons.max_vpp is None or v <= cons.max_vpp]
    sps = [False, True] if layout.tp > 1 and cons.allow_sp else [False]
    top_zero = cons.max_zero_with_pp if layout.pp > 1 else 3
    zeros = [z for z in cons.zero_stages if z <= top_zero]
    return list(itertools.product(vpps, sps, zeros))


def _alternative_orders(plan: Plan, hw: Hardware) -> list[tuple[Axis, ...]]:
    """Other placements worth pricing: only when the default crosses nodes, and only distinct ones."""
    sized = [a for a in Axis if getattr(plan, a.value) > 1]
    if len(sized) < 2 or all(axis_level(plan, a, hw.devices_per_node) is LinkLevel.INTRA for a in sized):
        return []
    seen = {tuple(a for a in DEFAULT_ORDER if a in sized)}
    out = []
    for order in itertools.permutations(Axis):
        key = tuple(a for a in order if a in sized)
        if key not in seen:
            seen.add(key)
            out.append(order)
    return out


def _best_placement(model: ModelSpec, hw: Hardware, default: Estimate) -> Estimate:
    best = default
    for order in _alternative_orders(default.plan, hw):
        other = estimate_with(model, hw, default.plan.replace(order=order), default.memory)  # placement moves no bytes
        if other.time.step_s < best.time.step_s:
            best = other
    return best


def _refine_placements(model: ModelSpec, hw: Hardware, ranked: list[Estimate], top: int) -> list[Estimate]:
    """Price other placements for the plans that could still enter the top ``top``.

    A plan's time with every collective on the faster link is a lower bound over all placements;
    plans whose bound is no better than the current top-th time keep the default placement.
    """
    fastest = hw.with_fastest_links()
    threshold = ranked[min(top, len(ranked)) - 1].time.step_s
    out = []
    for candidate in ranked:
        if compute_bound_s(model, hw, candidate.plan) < threshold and _alternative_orders(candidate.plan, hw):
            if time_estimate(model, fastest, candidate.plan).step_s < threshold:
                candidate = _best_placement(model, hw, candidate)
        out.append(candidate)
    return sorted(out, key=_rank_key)


def _rank_key(e: Estimate) -> tuple[float, float]:
    """Fastest first; equal times prefer less memory."""
    return (e.time.step_s, e.memory.total_bytes)


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def explain_misfit(memory: MemoryEstimate) -> str:
    """One line: what the plan needs, what there is, and the largest term."""
    if memory.host_bytes > memory.host_limit_bytes and memory.total_bytes <= memory.limit_bytes:
        return (
            f"host memory: needs {_gib(memory.host_bytes)} per device > {_gib(memory.host_limit_bytes)} "
            f"(short {_gib(memory.host_bytes - memory.host_limit_bytes)})"
        )
    term, nbytes = memory.largest_term()
    return (
        f"needs {_gib(memory.total_bytes)} > {_gib(memory.limit_bytes)} on stage {memory.stage} "
        f"(short {_gib(memory.total_bytes - memory.limit_bytes)}; largest term {term} {_gib(nbytes)})"
    )


def _explain_slower(candidate: Estimate, best: Estimate) -> str:
    ratio = candidate.time.step_s / best.time.step_s
    term, seconds = candidate.time.largest_term()
    return (
        f"slower: {candidate.time.step_s:.4g} s/step vs {best.time.step_s:.4g} s ({ratio:.2f}x); "
        f"largest term {term} {seconds:.4g} s"
    )


def _undominated(
    fitting: list[tuple[Recompute, Offload]], recomputes: tuple[Recompute, ...], offloads: list[Offload]
) -> list[tuple[Recompute, Offload]]:
    """Fitting variants with no lighter-weight fitting variant: less recomputation and less offload are never slower."""
    rank = {v: (recomputes.index(v[0]), offloads.index(v[1])) for v in fitting}
    return [
        v
        for v in fitting
        if not any(w != v and rank[w][0] <= rank[v][0] and rank[w][1] <= rank[v][1] for w in fitting)
    ]


class _Search:
    """One run of the planner (mutable bookkeeping kept out of the pure functions)."""

    def __init__(self, model: ModelSpec, cluster: ClusterSpec, cons: Constraints, *, top: int, exhaustive: bool) -> None:
        self.model, self.cons, self.top, self.exhaustive = model, cons, top, exhaustive
        self._top_times: list[float] = []  # negated step times of the best `top` priced so far (a max-heap)
        self.hw = Hardware.of(cluster, model)
        self.has_host = cluster.host is not None
        self.candidates = 0
        self.feasible_count = 0
        self.feasible: list[Estimate] = []
        self.misfits: list[tuple[float, Rejection]] = []
        self.misfit_plans: list[Plan] = []
        self.closest: tuple[float, MemoryEstimate, Plan] | None = None
        self._states: dict[tuple[int, int, int, int, Offload], list[tuple[float, ...]]] = {}

    def _worst(self, acts: list[float], state: list[tuple[float, ...]], loads) -> MemoryEstimate:
        """The worst stage's MemoryEstimate, built from the sums the search already has."""
        stages = [
            MemoryEstimate(
                params_bytes=params,
                grads_bytes=grads,
                optimizer_bytes=optimizer,
                activations_bytes=a,
                other_bytes=other,
                limit_bytes=self.hw.memory_bytes,
                host_bytes=host,
                host_limit_bytes=self.hw.host_bytes_per_device,
                stage=load.index,
            )
            for a, (params, grads, optimizer, other, host), load in zip(acts, state, loads)
        ]
        return max(stages, key=MemoryEstimate.shortfall_bytes)

    def _cannot_enter_top(self, base: Plan) -> bool:
        """Branch and bound: skip pricing when even free communication would not beat the top-th time so far."""
        if self.exhaustive or len(self._top_times) < self.top:
            return False
        return compute_bound_s(self.model, self.hw, base) >= -self._top_times[0]

    def _state(self, base: Plan, offload: Offload) -> list[tuple[float, ...]]:
        """Per-stage non-activation bytes; they do not depend on mbs, gas, sp or vpp, so they are kept."""
        key = (base.dp, base.tp, base.pp, base.zero, offload)
        if key not in self._states:
            self._states[key] = [
                stage_state_bytes(self.model, self.hw, load, tp=base.tp, dp=base.dp, zero=base.zero, offload=offload)
                for load in stage_loads(self.model, base.pp)
            ]
        return self._states[key]

    def run(self) -> None:
        for layout in _layouts(self.model, self.hw.world_size, self.cons, self.misfits):
            batch = self.model.global_batch_size // layout.dp
            mbs_values = [m for m in divisors(batch) if self.cons.mbs is None or m in self.cons.mbs]
            for vpp, sp, zero in _variants(layout, self.model, self.cons):
                self._micro_batches(layout, vpp, sp, zero, batch, mbs_values)

    def _micro_batches(self, layout: _Layout, vpp: int, sp: bool, zero: int, batch: int, mbs_values: list[int]) -> None:
        offloads = _offloads(zero, self.cons, self.has_host)
        if layout.pp > 1 and not self.cons.offload_with_pp:
            offloads = [o for o in offloads if o is Offload.NONE]
        if not offloads:
            return
        family = len(self.cons.recompute) * len(offloads)
        for i, mbs in enumerate(mbs_values):
            base = Plan(dp=layout.dp, tp=layout.tp, pp=layout.pp, zero=zero, mbs=mbs, gas=batch // mbs, sp=sp, vpp=vpp)
            if not self._first_fit(base, offloads):
                self.candidates += family * (len(mbs_values) - i)
                return
            self.candidates += family

    def _first_fit(self, base: Plan, offloads: list[Offload]) -> bool:
        """Price the first (recompute, offload) variant that fits; record the lightest misfit otherwise.

        Activations depend only on recompute and the other terms only on offload, so each is summed
        once per stage and the variants are compared on those sums.
        """
        loads = stage_loads(self.model, base.pp)
        hw = self.hw
        acts = {r: [stage_activation_bytes(load, base, r) for load in loads] for r in self.cons.recompute}
        state = {o: self._state(base, o) for o in offloads}
        fitting = [
            (recompute, offload)
            for recompute, offload in itertools.product(self.cons.recompute, offloads)
            if all(
                a + sum(s[:4]) <= hw.memory_bytes and s[4] <= hw.host_bytes_per_device
                for a, s in zip(acts[recompute], state[offload])
            )
        ]
        if fitting:
            self.feasible_count += len(fitting)
            if self._cannot_enter_top(base):
                return True
            for recompute, offload in _undominated(fitting, self.cons.recompute, offloads):
                memory = self._worst(acts[recompute], state[offload], loads)
                priced = estimate_with(self.model, hw, base.replace(recompute=recompute, offload=offload), memory)
                self.feasible.append(priced)
                heapq.heappush(self._top_times, -priced.time.step_s)
                if len(self._top_times) > self.top:
                    heapq.heappop(self._top_times)
            return True
        plan = base.replace(recompute=self.cons.recompute[-1], offload=offloads[-1])
        memory = memory_estimate(self.model, hw, plan)
        short = memory.shortfall_bytes()
        if self.closest is None or short < self.closest[0]:
            self.closest = (short, memory, plan)
        self.misfits.append((short, Rejection(plan=str(plan), reason=explain_misfit(memory) + " (and every larger mbs)")))
        self.misfit_plans.append(plan)
        return False


def plan(
    model: ModelSpec,
    cluster: ClusterSpec,
    *,
    top: int = 5,
    max_rejected: int = 20,
    exhaustive: bool = False,
    constraints: Constraints | None = None,
    **constraint_fields: object,
) -> PlanResult:
    """Rank every plan for ``model`` on ``cluster``; the keyword arguments are :class:`Constraints` fields.

    The top ``top`` plans are exact. Plans that provably cannot enter them (their step time with all
    communication free is already slower) are counted but not priced, unless ``exhaustive`` (for
    plots and benchmarks that want every candidate's estimate in ``all_feasible``).

    Raises NoFeasiblePlanError (naming the closest plan, its shortfall and what would help) when no
    candidate fits.
    """
    if top < 1:
        raise PlanError(f"top must be >= 1, got {top}")
    cons = constraints if constraints is not None else Constraints(**constraint_fields)  # type: ignore[arg-type]
    started = _clock.perf_counter()
    search = _Search(model, cluster, cons, top=top, exhaustive=exhaustive)
    search.run()
    if not search.feasible:
        raise _nothing_fits(model, cluster, search)
    ranked = sorted(search.feasible, key=_rank_key)
    if cons.search_placement:
        ranked = _refine_placements(model, search.hw, ranked, top)
    best = ranked[0]
    slower = [Rejection(plan=str(e.plan), reason=_explain_slower(e, best)) for e in ranked[top : top + max_rejected]]
    misfits = [r for _, r in sorted(search.misfits, key=lambda x: x[0])[:max_rejected]]
    return PlanResult(
        plans=tuple(ranked[:top]),
        rejected=tuple(slower + misfits),
        candidates=search.candidates,
        feasible=search.feasible_count,
        seconds=_clock.perf_counter() - started,
        all_feasible=tuple(ranked),
        misfit_plans=tuple(search.misfit_plans),
    )


def _nothing_fits(model: ModelSpec, cluster: ClusterSpec, search: _Search) -> NoFeasiblePlanError:
    if search.closest is None:
        return NoFeasiblePlanError(
            f"no plan for {model.name!r} on {cluster.world_size} devices: no layout divides the heads "
            f"({model.num_heads}), layers ({model.num_layers}) and global batch ({model.global_batch_size}) "
            f"within the constraints; change the device count or the global batch size"
        )
    _, memory, closest = search.closest
    cons = search.cons
    helps = ["add devices or use devices with more memory"]
    if not cons.allow_offload or cluster.host is None:
        helps.append("allow offload" + ("" if cluster.host is not None else " (give the cluster a host section)"))
    if Recompute.FULL not in cons.recompute:
        helps.append("allow recompute=full")
    if cons.max_tp is not None or cons.max_pp is not None:
        helps.append("raise max_tp / max_pp")
    if memory.host_bytes > memory.host_limit_bytes and memory.total_bytes <= memory.limit_bytes:
        needed, limit, what = memory.host_bytes, memory.host_limit_bytes, "host memory per device"
    else:
        needed, limit, what = memory.total_bytes, memory.limit_bytes, "memory per device"
    term, nbytes = memory.largest_term()
    return NoFeasiblePlanError(
        f"model {model.name!r} needs {_gib(needed)} {what} with the best plan ({closest}); "
        f"devices have {_gib(limit)} (largest term: {term} {_gib(nbytes)}): {', '.join(helps)}"
    )
