"""Step batches cut from one global sample order, so that the optimisation does not depend on the layout.

Every epoch has one global order of dataset indices: a seeded permutation, identity without
shuffle, or the indices the user's own sampler yields (``epoch_order``, see
:mod:`lightning_fleet.data`). Optimizer step ``s`` consumes global samples ``order[s*G:(s+1)*G]``;
data-parallel rank ``r`` of ``dp`` takes the contiguous ``G/dp`` slice ``r`` of them
(:func:`rank_share`; with uneven ``shares``, its own share, after those of the replicas before it) and cuts it into
``gas`` micro-batches. A plan change (dp, mbs,
gas) therefore never changes which samples form a step, and a single process with the whole batch
sees the same samples.

Imports torch only; imported by data.py and the strategy.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import Sampler


class MicroBatches(list):
    """The micro-batches of one optimizer step on one rank, each already collated."""


def rank_share(step_samples: Sequence[Any], dp_size: int, dp_rank: int, shares: Sequence[int] | None = None) -> list[Any]:
    """Data-parallel rank ``dp_rank``'s contiguous share of one step's global samples: the ``dp_rank``-th of ``dp_size``
    equal slices, or, given ``shares`` (samples per replica, first to last, adding up to the step), the slice after
    the shares of the replicas before it."""
    if shares is None:
        start = dp_rank * (len(step_samples) // dp_size)
        stop = start + len(step_samples) // dp_size
    else:
        start = sum(shares[:dp_rank])
        stop = start + shares[dp_rank]
    share = step_samples[start:stop]
    return share.tolist() if isinstance(share, torch.Tensor) else list(share)


def check_shares(shares: Sequence[int], *, global_batch_size: int, dp_size: int, gas: int) -> None:
    """ValueError (one line) unless ``shares`` has one positive count per replica, each a whole number of ``gas``
    micro-batches, adding up to the global batch."""
    if len(shares) != dp_size or any(n < 1 for n in shares):
        raise ValueError(f"shares {list(shares)} must be {dp_size} positive sample counts, one per data-parallel replica")
    if sum(shares) != global_batch_size:
        raise ValueError(f"shares {list(shares)} add up to {sum(shares)}, not the global batch {global_batch_size}")
    if any(n % gas for n in shares):
        raise ValueError(f"shares {list(shares)} do not each split into gas {gas} equal micro-batches")


class ShareSchedule:
    """The replicas' shares of each step's samples, by global optimizer step: ``None`` (equal shares) or samples per
    replica, from a step on. The sampler reads it when it cuts a step and the strategy when it weights that step's
    losses, so the two agree whichever step a rebalance starts at; a change takes effect only at a step no batch has
    been cut for yet (:meth:`set_from`'s caller keeps the prefetched steps out)."""

    def __init__(self, shares: Sequence[int] | None = None) -> None:
        self._changes: list[tuple[int, tuple[int, ...] | None]] = [(0, None if shares is None else tuple(shares))]

    @classmethod
    def of(cls, shares: "Sequence[int] | ShareSchedule | None") -> "ShareSchedule":
        """``shares`` itself when it is a schedule, else a schedule of those shares (None: equal) from step 0."""
        return shares if isinstance(shares, ShareSchedule) else cls(shares)

    def at(self, step: int) -> tuple[int, ...] | None:
        """The shares of global step ``step``."""
        for start, shares in reversed(self._changes):
            if step >= start:
                return shares
        return self._changes[0][1]

    def set_from(self, step: int, shares: Sequence[int] | None) -> None:
        """Use ``shares`` (None: equal) from global step ``step`` on; ValueError before the latest change's step."""
        if step < self._changes[-1][0]:
            raise ValueError(f"share change at step {step} comes before the one at step {self._changes[-1][0]}")
        self._changes.append((step, None if shares is None else tuple(shares)))


class GlobalBatchSampler(Sampler[list[Any]]):
    """Yields, per optimizer step, this rank's ``global_batch_size / dp_size`` dataset indices (its ``shares`` entry of
    them when given).

    The position is keyed by the global optimizer step (``first_step()`` when iteration starts):
    step ``g`` is step ``g % S`` of epoch ``g // S`` (``S`` steps per epoch). A resumed or resized
    job therefore continues exactly where the committed history stopped, whatever Lightning's own
    epoch counter says (it counts an epoch cut short by ``max_steps`` as finished).
    """

    def __init__(
        self,
        num_samples: int,
        *,
        global_batch_size: int,
        dp_size: int,
        dp_rank: int,
        shuffle: bool = True,
        seed: int = 0,
        first_step: Callable[[], int] = lambda: 0,
        epoch_order: Callable[[int], Sequence[Any]] | None = None,
        shares: Sequence[int] | ShareSchedule | None = None,
    ) -> None:
        schedule = ShareSchedule.of(shares)
        first_shares = schedule.at(0)
        if first_shares is not None:
            check_shares(first_shares, global_batch_size=global_batch_size, dp_size=dp_size, gas=1)
        elif global_batch_size % dp_size:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by dp {dp_size}")
        if num_samples < global_batch_size:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch_size}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.shuffle, self.seed = shuffle, seed
        self.first_step = first_step
        self.epoch_order = epoch_order
        self.schedule = schedule

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches in one epoch (an incomplete last one is dropped)."""
        return self.num_samples // self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this every epoch; the order follows the global step instead (see the class doc)."""

    def order(self, epoch: int) -> Sequence[Any]:
        """The global order of dataset indices in ``epoch``."""
        if self.epoch_order is not None:
            return self.epoch_order(epoch)
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def __iter__(self) -> Iterator[list[Any]]:
        epoch, first = divmod(self.first_step(), self.steps_per_epoch)
        order = self.order(epoch)
        size = self.global_batch_size
        for step in range(first, self.steps_per_epoch):
            shares = self.schedule.at(epoch * self.steps_per_epoch + step)
            yield rank_share(order[step * size : (step + 1) * size], self.dp_size, self.dp_rank, shares)

    def __len__(self) -> int:
        """Steps of a whole epoch, also when resuming mid-epoch: Lightning's batch counter continues from the resumed step."""
        return self.steps_per_epoch


class MicroBatchCollate:
    """Collates a step's samples into ``gas`` micro-batches with the user's collate function."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], gas: int) -> None:
        self.collate_fn = collate_fn
        self.gas = gas

    def __call__(self, samples: Sequence[Any]) -> MicroBatches:
        mbs = len(samples) // self.gas
        return MicroBatches(self.collate_fn(list(samples[i * mbs : (i + 1) * mbs])) for i in range(self.gas))
