"""Whether a job's ranks run on different devices: the rule that judges the ranks' probe rounds, and the line that says why.

A job's ranks probe their speed together in RANK_PROBE_ROUNDS rounds (:func:`~.measure.measure_ranks`); a rank is judged
slower than the fastest only when it is slower by RANK_SPEED_SPREAD or more in *every* round (:class:`RankMeasures`): on
a shared machine one round's figures move by 1.5-12x (another process' time slice landing on one rank), a CPU quota or
a slower device never lets a rank catch up. Ranks that report the same device identity (host, device model, cores or
memory) hold the same memory; where a rank's device is its host (a CPU), its GEMMs and its operator dispatch time the
same cores, so it is judged slower only where both say so.

What a rebalance does with a probe (:func:`rebalance_by`): the split by the judged speeds, back to the even split where
a split's cause has gone, and the line that says so.

Pure (stdlib and the planning core): imported by :mod:`lightning_fleet.calibrate.measure` (which probes), the strategy
(rebalancing, the start-up report) and ``fleet calibrate``'s summary.
"""

from __future__ import annotations

import statistics
import zlib
from dataclasses import dataclass

from lightning_fleet.planning.cluster import ClusterSpec
from lightning_fleet.planning.errors import SpecError
from lightning_fleet.planning.estimate import Estimate
from lightning_fleet.planning.model import ModelSpec
from lightning_fleet.planning.overlap import Overlaps
from lightning_fleet.planning.plan import Plan, field_text
from lightning_fleet.planning.search import rebalance

RANK_PROBE_ROUNDS = 4
"""Rounds of the ranks' speed probe; a rank is judged slower only where it is slower in each of them."""
RANK_SPEED_SPREAD = 1.2
"""A rank slower than the round's fastest by this factor or more in every probe round is described on its own
(``ClusterSpec.rank_devices``), so the planner can give the faster ones more of the batch; a smaller or passing
difference is noise (one round on a shared VM: 1.5-12x on the host figure, ~10-40 % on the GEMMs)."""
RANK_MEMORY_SPREAD = 1.1
"""Ranks whose devices differ (another identity) and whose memory differs by this factor or more are described one by
one (a GPU node of 40 GB cards beside one of 80 GB). Ranks of one identity hold the least of their memories: a CPU
rank's available RAM moves by a few percent between ranks of one host."""


def device_identity(text: str) -> int:
    """A number naming a device (its host, model and cores or memory as text) that every rank can all-gather as a float:
    equal numbers, the same device."""
    return zlib.crc32(text.encode())


def _ratio_text(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMeasures:
    """What every rank measured, rank 0 first, round by round (the same on every rank)."""

    flops_rounds: tuple[tuple[float, ...], ...]
    """Each probe round's GEMM rates, one per rank."""
    ops_rounds: tuple[tuple[float, ...], ...]
    """Each probe round's host dispatch rates (operators per second), one per rank."""
    memory_gib: tuple[float, ...]
    """Each rank's device memory, in GiB."""
    identity: tuple[int, ...]
    """Each rank's device identity (:func:`device_identity`): ranks of equal identity have the same kind of device."""
    host_is_device: bool = False
    """The device is the host's CPU: a rank's GEMMs and dispatch time the same cores."""

    def __post_init__(self) -> None:
        ranks = len(self.memory_gib)
        rounds = (*self.flops_rounds, *self.ops_rounds)
        if not self.flops_rounds or len(self.flops_rounds) != len(self.ops_rounds) or len(self.identity) != ranks \
                or any(len(r) != ranks for r in rounds) or any(v <= 0 for r in rounds for v in r):
            raise SpecError(f"rank measures need the same ranks in each round and positive rates; got {self}")

    @property
    def world_size(self) -> int:
        """Ranks measured."""
        return len(self.memory_gib)

    @property
    def flops_per_s(self) -> tuple[float, ...]:
        """Each rank's GEMM rate: its median over the rounds."""
        return tuple(statistics.median(r[rank] for r in self.flops_rounds) for rank in range(self.world_size))

    @property
    def ops_per_s(self) -> tuple[float, ...]:
        """Each rank's host dispatch rate: its median over the rounds."""
        return tuple(statistics.median(r[rank] for r in self.ops_rounds) for rank in range(self.world_size))

    @property
    def fastest(self) -> int:
        """The rank with the fastest device (the first of equals, by median GEMM rate)."""
        rates = self.flops_per_s
        return rates.index(max(rates))

    @staticmethod
    def _slowdowns(rounds: tuple[tuple[float, ...], ...]) -> list[list[float]]:
        """Per rank, per round: the round's fastest rate over the rank's."""
        return [[max(r) / r[rank] for r in rounds] for rank in range(len(rounds[0]))]

    def judged(self) -> "RankJudgement":
        """The persistence rule: each rank's device and host speed relative to the fastest (1: alike), where it was
        slower by RANK_SPEED_SPREAD or more in every round (both figures on a CPU), else 1; the speed is the inverse of
        its median slowdown. Memory: the least of each identity's ranks."""
        device, host = self._slowdowns(self.flops_rounds), self._slowdowns(self.ops_rounds)
        slow_device = [min(s) >= RANK_SPEED_SPREAD for s in device]
        slow_host = [min(s) >= RANK_SPEED_SPREAD for s in host]
        if self.host_is_device:  # one set of cores: a real slowdown shows in both figures
            slow_device = slow_host = [d and h for d, h in zip(slow_device, slow_host)]
        memory = tuple(min(m for m, i in zip(self.memory_gib, self.identity) if i == own) for own in self.identity)
        return RankJudgement(
            measures=self,
            speeds=tuple(1 / statistics.median(s) if slow else 1.0 for s, slow in zip(device, slow_device)),
            host_speeds=tuple(1 / statistics.median(s) if slow else 1.0 for s, slow in zip(host, slow_host)),
            memory_gib=memory,
        )

    def differ(self) -> bool:
        """Whether the ranks are described one by one (:meth:`judged`)."""
        return self.judged().differ


@dataclass(frozen=True, slots=True, kw_only=True)
class RankJudgement:
    """What the persistence rule made of a probe (:meth:`RankMeasures.judged`)."""

    measures: RankMeasures
    """The probe judged."""
    speeds: tuple[float, ...]
    """Each rank's device speed over the fastest's (1: alike, also where a difference did not persist)."""
    host_speeds: tuple[float, ...]
    """Each rank's host speed over the fastest's, likewise."""
    memory_gib: tuple[float, ...]
    """Each rank's memory, the least of its identity's ranks."""

    @property
    def slower(self) -> tuple[int, ...]:
        """The ranks judged slower (device or host)."""
        return tuple(r for r, (s, h) in enumerate(zip(self.speeds, self.host_speeds)) if s < 1 or h < 1)

    @property
    def differ(self) -> bool:
        """Whether the ranks differ: a rank judged slower, or memories RANK_MEMORY_SPREAD apart (across identities)."""
        return bool(self.slower) or max(self.memory_gib) >= RANK_MEMORY_SPREAD * min(self.memory_gib)

    def line(self) -> str:
        """Why the ranks were judged alike or different, with the figures behind it: each rank's GEMM and host rate
        over the round's fastest, round by round, and which ranks report one device."""
        m = self.measures
        if m.world_size == 1:
            return "ranks    one process: no other rank to compare, not probed"
        rounds = len(m.flops_rounds)
        groups: dict[int, list[int]] = {}
        for rank, ident in enumerate(m.identity):
            groups.setdefault(ident, []).append(rank)
        same = ("all report one device (host, model, cores)" if len(groups) == 1 else
                f"{len(groups)} device identities (ranks {'; '.join(','.join(map(str, g)) for g in groups.values())})")
        figures = "; ".join(
            f"rank {r} GEMMs {_ratio_text([x[r] / max(x) for x in m.flops_rounds])}, "
            f"host {_ratio_text([x[r] / max(x) for x in m.ops_rounds])}"
            for r in range(m.world_size)
        )
        if self.slower:
            kinds = "GEMMs and host" if m.host_is_device else "GEMMs or host"
            verdict = (f"differ: rank(s) {','.join(map(str, self.slower))} slower by {RANK_SPEED_SPREAD:g}x or more "
                       f"in each of {rounds} probe rounds ({kinds}); speeds {_ratio_text(list(self.speeds))}, "
                       f"host {_ratio_text(list(self.host_speeds))}")
        elif self.differ:
            verdict = f"differ in memory: {'/'.join(f'{v:.3g}' for v in self.memory_gib)} GiB"
        else:
            verdict = (f"alike: no rank slower by {RANK_SPEED_SPREAD:g}x in each of {rounds} probe rounds "
                       f"(a passing difference is noise)")
        return f"ranks    {verdict}; {same}; per round, of the fastest: {figures}"


def rebalance_by(
    measures: RankMeasures, model: ModelSpec, cluster: ClusterSpec, plan: Plan, *, overlaps: Overlaps, step: int, start: int,
) -> tuple[Estimate, str] | None:
    """What a rebalance at ``step`` does after a probe: the estimate of ``plan`` split by the ranks' judged speeds
    (:meth:`RankMeasures.judged`: 1 wherever a difference did not persist over the rounds) and the line that says so,
    where :func:`~lightning_fleet.planning.search.rebalance` finds that split another and REBALANCE_GAIN faster -- also
    back to the even split when a split's cause has gone (the ranks measure alike again); else None."""
    judged = measures.judged()
    change = rebalance(model, cluster, plan, list(judged.speeds), host_speeds=list(judged.host_speeds), overlaps=overlaps)
    if change is None:
        return None
    now, new = change
    split = new.plan
    sizes = (field_text(split.dp_mbs) if split.dp_mbs is not None else
             f"{split.mbs} on every replica (the even split: the ranks measure alike again)")
    line = (f"lightning_fleet: rank speeds {_ratio_text(list(judged.speeds))} at step {step}: micro-batches {sizes} "
            f"from step {start} (predicted {now.time.step_s:.3g} -> {new.time.step_s:.3g} s/step); "
            f"{judged.line().removeprefix('ranks    ')}")
    return new, line
