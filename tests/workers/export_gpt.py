"""Worker for tests/test_export.py: train the example GPT under several plans and check what comes out.

One Trainer.fit per plan (same processes). After each fit, every rank: gathers the live full weights
(lightning_fleet.runtime.deepspeed.weights.full_state_dict), saves ``trainer.save_checkpoint(DIR/<index>/before)``,
hands the module back (weights.restore_module), checks it is the plain original module (types, keys, dtypes, no DeepSpeed
attributes or hooks, the user's own hook kept, same weights on every rank), runs it on a fixed batch,
and saves again (``DIR/<index>/after``, written by the engine's mirror of the tree). A FleetCheckpoint
step directory is written under ``DIR/<index>/fleet`` at the last step. Rank 0 writes the results to --out.
Under a mixed precision (``bf16-mixed@PLAN``) it also records, straight from DeepSpeed's optimizer (not through
lightning_fleet's weights module), the fp32 master weights and the low-precision weights the module trained with.

    python tests/workers/export_gpt.py --plans "dp=2,zero=3;tied:dp=1,tp=2,zero=0;bf16-mixed@dp=2,zero=0" \
        --save-to /tmp/x --out /tmp/r.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch import Trainer, seed_everything  # noqa: E402

from examples.gpt.data import StdlibText  # noqa: E402
from examples.gpt.model import GPT  # noqa: E402
from lightning_fleet.runtime.deepspeed.weights import (  # noqa: E402
    full_state_dict,
    pipeline_layer_keys,
    record_module,
    restore_module,
)
from lightning_fleet.strategy import FleetStrategy  # noqa: E402
from tests.multiprocess import QUIET_TRAINER  # noqa: E402
from tests.workers.tied_gpt import PathGPT, TiedGPT  # noqa: E402
from tests.workers.train_gpt import DATA, SIZES, eval_batch  # noqa: E402


class RecordingStrategy(FleetStrategy):
    """FleetStrategy that records the module before deepspeed.initialize (what the strategy itself does once wired)."""

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):  # type: ignore[no-untyped-def]
        self._module_record = record_module(self.lightning_module)
        self.export_record = self._module_record
        return super()._setup_model_and_optimizer(model, optimizer, lr_scheduler)


def module_report(model: GPT, record, hook_calls: list[int]) -> dict:  # type: ignore[no-untyped-def]
    """What the restored module looks like: plain types, the original keys/shapes/dtypes, nothing of DeepSpeed."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    types = sorted({type(m).__module__.split(".")[0] for m in model.modules()})
    ds_attributes = sorted(
        f"{path}.{name}" for path, m in model.named_modules() for name, value in vars(m).items() if _from_deepspeed(name, value)
    )
    # a plain Parameter or buffer has no attributes; DeepSpeed's carry ds_*, _hp_mapping, ...
    tensor_attributes = sorted(f"{k}.{a}" for k, t in model.state_dict(keep_vars=True).items() for a in vars(t))
    hooks = sum(len(getattr(m, attr)) for m in model.modules() for attr in HOOK_DICTS)
    before = hook_calls[0]
    x, _ = eval_batch(StdlibText(**DATA))
    was_training = model.training
    with torch.no_grad():
        logits = model.eval()(x)
    model.train(was_training)
    return {
        "keys": [(k, tuple(v.shape), str(v.dtype)) for k, v in state.items()],
        "recorded": [(i.key, i.shape, f"torch.{i.dtype}") for i in record.tensors],
        "module_packages": types,
        "ds_attributes": ds_attributes,
        "tensor_attributes": tensor_attributes,
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
        "hooks": hooks,
        "user_hook_ran": hook_calls[0] > before,
        "logits": logits,
        "state": state,
        "ranks_max_diff": ranks_max_diff(logits),
        "state_ranks_max_diff": ranks_max_diff(torch.cat([v.detach().float().flatten() for v in state.values()])),
        "tied": isinstance(model, TiedGPT) and model.head.weight is model.tok.weight,
    }


HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks")


def _from_deepspeed(name: str, value: object) -> bool:
    """An attribute DeepSpeed set: a ds_* name, or a value of a DeepSpeed type (a bound method of one included)."""
    owner = getattr(value, "__self__", value)
    return name.startswith(("ds_", "_ds_")) or type(owner).__module__.startswith("deepspeed") or name == "_original_parameters"


def ranks_max_diff(tensor: torch.Tensor) -> float:
    """Largest difference between this tensor and rank 0's, over all ranks."""
    reference = tensor.detach().clone()
    dist.broadcast(reference, src=0)
    diff = (tensor.detach() - reference).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def engine_masters(strategy, model: GPT) -> tuple[dict, dict]:  # type: ignore[no-untyped-def]
    """(fp32 masters, low-precision weights as fp32) of every trainable parameter, by the module's key, on every rank.

    Read from DeepSpeed's own objects: ZeRO 1-3 and the bf16 optimizer through ``safe_get_full_fp32_param``;
    ZeRO-0's fp16/bf16 wrappers (FP16_Optimizer: ``fp32_groups_flat``, FP16_UnfusedOptimizer: ``fp32_groups``)
    by position in their groups. Pipeline stages hold their own layers, tensor-parallel ranks their shards (split
    along DeepSpeed's recorded ``partition_dim``; only with dp=1, where the world is one tp group): all gathered."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.utils import safe_get_full_fp32_param

    engine = strategy.model
    keys = module_keys(engine, model)
    optimizer, by_id = engine.optimizer, {}
    if isinstance(optimizer, FP16_Optimizer):
        for flat, group in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups):
            offset = 0
            for param in group:
                by_id[id(param)] = flat.narrow(0, offset, param.numel()).view_as(param)
                offset += param.numel()
    elif isinstance(optimizer, FP16_UnfusedOptimizer):
        for masters, group in zip(optimizer.fp32_groups, optimizer.fp16_groups):
            by_id.update({id(param): master for param, master in zip(group, masters)})
    mine = {}
    for name, param in engine.module.named_parameters():
        if not param.requires_grad or name not in keys:
            continue
        master = by_id.get(id(param))
        master = safe_get_full_fp32_param(param) if master is None else master
        meta = getattr(param, DS_AUTOTP_UC_META, None) or {}
        dim = None if meta.get("replicated") else meta.get("partition_dim")
        # (ZeRO 0-2: the parameter itself is whole on this rank)
        mine[keys[name]] = (master.detach().float().cpu().clone(), param.detach().float().cpu().clone(), dim)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    masters, low = {}, {}
    for key in dict.fromkeys(k for entries in everyone for k in entries):
        held = [entries[key] for entries in everyone if key in entries]
        dim = held[0][2]
        assert dim is None or strategy.plan.dp == 1, "tensor-parallel shards are gathered over the whole world"
        masters[key] = held[0][0] if dim is None else torch.cat([h[0] for h in held], dim=dim)
        low[key] = held[0][1] if dim is None else torch.cat([h[1] for h in held], dim=dim)
    return masters, low


def module_keys(engine, model: GPT) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The engine's parameter names -> the module's keys (after fit the engine trains a mirror of the tree; a pipeline
    stage names its parameters ``<layer index>.<name in the layer>``)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    if not isinstance(engine, PipelineEngine):
        return {name: name for name, _ in engine.module.named_parameters()}
    layers = pipeline_layer_keys(model)
    return {f"{index}.{local}": key for index, mapping in enumerate(layers) for local, key in mapping.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--plans",
        required=True,
        help="';'-separated plans; 'tied:PLAN' trains TiedGPT (tied head, buffers), 'path:PLAN' PathGPT (a Path "
        "hyper-parameter); 'PRECISION@PLAN' another precision",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--cluster", default="cpu", help="cluster preset or YAML matching --devices")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--save-to", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = []
    for index, entry in enumerate(args.plans.split(";")):
        precision, _, entry = entry.rpartition("@")
        kind, _, plan = entry.rpartition(":")
        seed_everything(0)
        model = {"tied": TiedGPT, "path": PathGPT}.get(kind, GPT)(**SIZES)
        hook_calls = [0]
        model.blocks[0].mlp.register_forward_hook(lambda *_: hook_calls.__setitem__(0, hook_calls[0] + 1))
        dm = StdlibText(**DATA)
        where = Path(args.save_to) / str(index)
        strategy = RecordingStrategy(
            runtime="deepspeed",  # what it records and restores is DeepSpeed's engine
            plan=plan,
            global_batch_size=args.gbs,
            cluster=args.cluster,
            checkpoint_dir=where / "fleet",
            checkpoint_every_n_steps=args.steps,
        )
        trainer = Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=strategy,
            max_steps=args.steps,
            precision=precision or args.precision,
            **QUIET_TRAINER,
            limit_val_batches=0,
            num_sanity_val_steps=0,
        )
        trainer.fit(model, dm)
        masters, low = engine_masters(strategy, model) if precision else ({}, {})
        live = full_state_dict(strategy.core, strategy.export_record)
        trainer.save_checkpoint(where / "before")
        restore_module(strategy.core, strategy.export_record)
        restore_module(strategy.core, strategy.export_record)  # a second call changes nothing
        report = module_report(model, strategy.export_record, hook_calls)
        trainer.save_checkpoint(where / "after")
        facts = {"plan": str(strategy.plan), "model": type(model).__name__, "global_step": trainer.global_step, "live": live}
        facts |= {"precision": precision or args.precision, "masters": masters, "low_precision": low}
        results.append(facts | report)
    if dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
