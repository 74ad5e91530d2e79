"""Step batches cut from one global sample order, so that the optimisation does not depend on the layout.

Every epoch has one order of the whole dataset (a seeded permutation, or identity without
shuffle). Optimizer step ``s`` consumes global samples ``order[s*G:(s+1)*G]``; data-parallel rank
``r`` of ``dp`` takes the contiguous ``G/dp`` slice ``r`` of them and cuts it into ``gas``
micro-batches of ``mbs``. A plan change (dp, mbs, gas) therefore never changes which samples form
a step, and a single process with the whole batch sees the same samples.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import Sampler


class MicroBatches(list):
    """The micro-batches of one optimizer step on one rank, each already collated."""


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields, per optimizer step, this rank's ``global_batch_size / dp_size`` dataset indices.

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
    ) -> None:
        if global_batch_size % dp_size:
            raise ValueError(f"global batch size {global_batch_size} is not divisible by dp {dp_size}")
        if num_samples < global_batch_size:
            raise ValueError(f"the dataset has {num_samples} samples, fewer than one global batch of {global_batch_size}")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.shuffle, self.seed = shuffle, seed
        self.first_step = first_step

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches in one epoch (an incomplete last one is dropped)."""
        return self.num_samples // self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Lightning calls this every epoch; the order follows the global step instead (see the class doc)."""

    def order(self, epoch: int) -> torch.Tensor:
        """The global order of dataset indices in ``epoch``."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + epoch))

    def __iter__(self) -> Iterator[list[int]]:
        epoch, first = divmod(self.first_step(), self.steps_per_epoch)
        order = self.order(epoch)
        per_rank = self.global_batch_size // self.dp_size
        for step in range(first, self.steps_per_epoch):
            start = step * self.global_batch_size + self.dp_rank * per_rank
            yield order[start : start + per_rank].tolist()

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
