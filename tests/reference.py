"""The single-process reference every multi-process run is held against: plain PyTorch, whole global batch per step."""

from __future__ import annotations

import torch

from examples.gpt.data import StdlibText
from examples.gpt.model import GPT
from lightning_fleet.elastic.sampler import GlobalBatchSampler
from tests.workers.train_gpt import DATA, SIZES, eval_batch


def reference_run(steps: int, global_batch_size: int, seed: int = 0, clip: float = 0.0) -> tuple[float, dict[str, torch.Tensor]]:
    """Eval loss and weights after ``steps`` AdamW steps of the example GPT, one process, no Lightning, no DeepSpeed
    (``clip`` > 0: the gradient's norm clipped to it first, as ``Trainer(gradient_clip_val=clip)``)."""
    torch.manual_seed(seed)
    model = GPT(**SIZES)
    dm = StdlibText(**DATA)
    dm.setup("fit")
    sampler = GlobalBatchSampler(len(dm.train_set), global_batch_size=global_batch_size, dp_size=1, dp_rank=0, shuffle=True, seed=seed)
    optimizer = model.configure_optimizers()
    step = 0
    while step < steps:  # one epoch after another, as the sampler's global step advances
        sampler.first_step = lambda: step
        indices = next(iter(sampler))
        xs, ys = zip(*(dm.train_set[i] for i in indices))
        loss = model.loss((torch.stack(xs), torch.stack(ys)))
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
        step += 1
    with torch.no_grad():
        return float(model.loss(eval_batch(dm))), {k: v.detach().clone() for k, v in model.state_dict().items()}
