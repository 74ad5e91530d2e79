"""Bytes per device, one small pure function per term.

``n`` is the number of parameters a pipeline stage holds before tensor parallelism (for gradients and
optimizer states: the trainable ones, the caller passes those); every function returns bytes on ONE
device of that stage.

Pure; imported by estimate.py and search.py, and by the DeepSpeed config (its bucket size).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fleet.planning.cluster import GIB, Calibration
from lightning_fleet.planning.model import GradAccumDtype, Precision, TouchedRows
from lightning_fleet.planning.plan import Offload, Recompute
from lightning_fleet.planning.stages import StageLoad

BUCKET_ELEMENTS = 50_000_000
"""Elements of one DeepSpeed reduce / all-gather bucket; the runtime sets the same size in its config."""


def optimizer_bytes_per_param(precision: Precision) -> int:
    """Adam state per parameter. ZeRO paper (Rajbhandari 2020, Sec. 3.1): K=12 for mixed precision (fp32 master, momentum, variance); 8 in fp32 (momentum, variance)."""
    return 8 if precision is Precision.FP32 else 12


def params_bytes(n: float, *, tp: int, dp: int, zero: int, offload: Offload, precision: Precision) -> float:
    """Working (fp16/bf16 or fp32) weights: 2 or 4 bytes per parameter, split by tp; ZeRO-3 splits by dp (ZeRO paper P_os+g+p); ZeRO-Infinity moves them to host."""
    if offload is Offload.OPTIMIZER_PARAMS:
        return 0.0
    shard = dp if zero >= 3 else 1
    return precision.element_bytes * n / (tp * shard)


# Megatron-LM docs/user-guide/features/dist_optimizer.md: "bf16 parameters, fp32 gradients" 18 = 2 + 4 + 12 B/param;
# DeepSpeed runtime/bf16_optimizer.py: fp32_groups_gradients_flat = zeros_like(bf16 flat, fp32) beside the bf16 .grad.
def grad_bytes_per_param(precision: Precision, grad_accum: GradAccumDtype = GradAccumDtype.WORKING) -> int:
    """Gradient bytes per trainable parameter: the working precision's 2 or 4; an fp32 buffer instead, 4 (Megatron-LM
    ``main_grad``, FSDP ``reduce_dtype=float32``); an fp32 buffer beside the working gradient, 4 + 2 (DeepSpeed
    BF16_Optimizer: it accumulates each bf16 ``.grad`` into the fp32 buffer and keeps the ``.grad``)."""
    if grad_accum is GradAccumDtype.FP32:
        return 4
    if grad_accum is GradAccumDtype.FP32_AND_WORKING:
        return 4 + precision.element_bytes
    return precision.element_bytes


def grads_bytes(
    n: float, *, tp: int, dp: int, zero: int, precision: Precision, grad_accum: GradAccumDtype = GradAccumDtype.WORKING
) -> float:
    """Gradients: :func:`grad_bytes_per_param` bytes per parameter, split by tp; ZeRO-2/3 keep only their dp partition
    (ZeRO paper P_os+g; DeepSpeed stage 3 allocates its gradient partitions in ``gradient_accumulation_dtype``). Below
    ZeRO-2 every copy is whole: Megatron's distributed optimizer is "6 + 12/d" bytes (bf16 weights and fp32 gradients
    unsharded), and BF16_Optimizer "doesn't shard the static fp32 buffer" (bigscience tr11-176B-ml README)."""
    shard = dp if zero >= 2 else 1
    return grad_bytes_per_param(precision, grad_accum) * n / (tp * shard)


def sparse_gradients_priced(zero: int) -> bool:
    """Whether parameters with sparse gradients are priced by the rows a step touches: at the replicated level (ZeRO-0),
    where the gradient stays a sparse tensor and is reduced by gathering its rows (DeepSpeed's ``sparse_allreduce``,
    torch DDP's sparse all-reduce). A shard level keeps every gradient in dense flat partitions (DeepSpeed ZeRO-1/2's
    ``averaged_gradients`` buckets, ZeRO-3's partitions; FSDP's flat parameters), so there they are priced dense (which
    runtime runs them at all is its own: ``Capabilities.sparse_grad_zero_stages``)."""
    return zero == 0


# DeepSpeed 0.19.8 runtime/engine.py sparse_allreduce: "indices = sparse.indices.to(torch.int32)" when the communication
# dtype is fp16/bf16, else the int64 indices of the coalesced gradient.
def sparse_index_bytes(precision: Precision) -> int:
    """Bytes of one row index of a sparse gradient as it is reduced: 4 (int32) in 16-bit precision, else 8 (int64)."""
    return 4 if precision.element_bytes == 2 else 8


def sparse_grads_bytes(touched: TouchedRows, *, dp: int, precision: Precision) -> float:
    """A sparse gradient on one device after its reduction: every replica's touched rows, gathered and concatenated
    (DeepSpeed's ``sparse_allreduce`` sets the gradient to the all-gathered indices and values, runtime/engine.py), each
    row's values in the working precision and its index (:func:`sparse_index_bytes`)."""
    return dp * (touched.elements * precision.element_bytes + touched.rows * sparse_index_bytes(precision))


def optimizer_bytes(n: float, *, tp: int, dp: int, zero: int, offload: Offload, precision: Precision) -> float:
    """Optimizer states on the device: K bytes per parameter, split by tp; ZeRO-1+ by dp (ZeRO paper P_os); zero when offloaded."""
    if offload is not Offload.NONE:
        return 0.0
    shard = dp if zero >= 1 else 1
    return optimizer_bytes_per_param(precision) * n / (tp * shard)


def host_bytes(n: float, *, tp: int, dp: int, offload: Offload, precision: Precision, trainable: float | None = None) -> float:
    """Host memory per device: ZeRO-Offload (Ren 2021, Sec. 4) keeps the fp32 master/momentum/variance and fp32 gradient
    partition (16 B per trainable parameter, ``trainable`` of the ``n``, default all); ZeRO-Infinity adds the working
    weights of all ``n``."""
    if offload is Offload.NONE:
        return 0.0
    t = n if trainable is None else trainable
    weights = precision.element_bytes * n if offload is Offload.OPTIMIZER_PARAMS else 0.0
    return (16.0 * t + weights) / (tp * dp)


def in_flight_microbatches(*, stage: int, pp: int, vpp: int, gas: int) -> float:
    """Micro-batches whose activations a stage holds at once, in whole-stage units.

    1F1B (Narayanan 2021): stage i holds pp - i. Interleaved: ((pp - i - 1) * 2 + (vpp - 1) * pp + 1) / vpp,
    which for stage 0 is pp * (1 + (pp - 1) / (pp * vpp)) (Korthikanti 2022, Sec. 4.2.3). Never more than gas.
    """
    if vpp == 1:
        held = float(pp - stage)
    else:
        held = ((pp - stage - 1) * 2 + (vpp - 1) * pp + 1) / vpp
    return min(held, float(gas))


def activation_bytes_per_sample(load: StageLoad, *, tp: int, sp: bool, recompute: Recompute) -> float:
    """Saved bytes per sample on one device (Korthikanti 2022 eqs. 2-4): replicated parts split only by sp, sharded parts
    by tp; selective recompute drops attention scores; full recompute keeps each layer's input; op-level recompute keeps
    that and the outputs its policy saves (:class:`~lightning_fleet.planning.model.OpRecompute`)."""
    rep_div = tp if sp else 1
    if recompute is Recompute.FULL or recompute is Recompute.OP:
        kept_rep = load.act_replicated_bytes - load.layer_act_replicated_bytes
        kept_split = load.act_sharded_bytes - load.layer_act_sharded_bytes
        kept_split += load.act_attention_bytes - load.layer_act_attention_bytes
        full = kept_rep / rep_div + kept_split / tp + load.checkpoint_bytes / rep_div
        if recompute is Recompute.FULL:
            return full
        return full + load.layer_op_saved_replicated_bytes / rep_div + load.layer_op_saved_sharded_bytes / tp
    attention = 0.0 if recompute is Recompute.SELECTIVE else load.act_attention_bytes
    return load.act_replicated_bytes / rep_div + (load.act_sharded_bytes + attention) / tp


def recompute_transient_bytes(load: StageLoad, *, tp: int, sp: bool, recompute: Recompute, mbs: int) -> float:
    """Under full recompute one layer's activations are re-materialised during its backward (Korthikanti 2022, Sec. 5);
    under op-level recompute the part of them its policy does not keep."""
    rep_div = tp if sp else 1
    if recompute is Recompute.FULL:
        return mbs * (load.largest_layer_replicated_bytes / rep_div + load.largest_layer_split_bytes / tp)
    if recompute is Recompute.OP:
        return mbs * (load.largest_op_rematerialised_replicated_bytes / rep_div + load.largest_op_rematerialised_split_bytes / tp)
    return 0.0


def activations_bytes(load: StageLoad, *, tp: int, sp: bool, recompute: Recompute, mbs: int, in_flight: float) -> float:
    """All activation memory of a stage: per-sample bytes times mbs times the micro-batches in flight, plus the recompute transient."""
    stored = activation_bytes_per_sample(load, tp=tp, sp=sp, recompute=recompute) * mbs * in_flight
    return stored + recompute_transient_bytes(load, tp=tp, sp=sp, recompute=recompute, mbs=mbs)


def comm_buffer_bytes(n: float, *, tp: int, dp: int, zero: int, precision: Precision) -> float:
    """DeepSpeed's reduce and all-gather buckets (BUCKET_ELEMENTS each, never more than the shard); none without data parallelism."""
    if dp == 1:
        return 0.0
    buckets = 1 if zero == 0 else 2
    return buckets * precision.element_bytes * min(n / tp, BUCKET_ELEMENTS)


def zero3_gather_bytes(largest_block_params: float, *, tp: int, zero: int, precision: Precision) -> float:
    """ZeRO-3 gathers whole blocks before use: the current block and one prefetched (DeepSpeed stage-3 prefetch)."""
    if zero < 3:
        return 0.0
    return 2 * precision.element_bytes * largest_block_params / tp


def reserve_bytes(device_memory_bytes: float, calibration: Calibration) -> float:
    """Memory kept free: a fixed runtime share (context, communicators) plus a fraction for fragmentation."""
    return calibration.memory_reserve_gib * GIB + fragmentation_bytes(device_memory_bytes, calibration)


def fragmentation_bytes(device_memory_bytes: float, calibration: Calibration) -> float:
    """The part of the reserve kept for allocator fragmentation: ``memory_reserve_fraction`` of the device memory."""
    return calibration.memory_reserve_fraction * device_memory_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    """Bytes on the worst device of a plan, by term."""

    params_bytes: float
    """Working weights."""
    grads_bytes: float
    """Gradients."""
    optimizer_bytes: float
    """Optimizer states."""
    activations_bytes: float
    """Saved activations of the micro-batches in flight."""
    other_bytes: float
    """Communication buckets, ZeRO-3 gather buffers and the reserve."""
    limit_bytes: float
    """Device memory."""
    host_bytes: float
    """Host memory per device taken by offload."""
    host_limit_bytes: float
    """Host memory per device (node memory / devices per node); 0 without a host spec."""
    stage: int
    """Pipeline stage of the worst device."""
    fragmentation_bytes: float = 0.0
    """The allocator-fragmentation allowance inside ``other_bytes`` (:func:`fragmentation_bytes`)."""

    @property
    def total_bytes(self) -> float:
        """Device bytes of all terms."""
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes + self.other_bytes

    @property
    def fits(self) -> bool:
        """Device and host both hold what the plan needs."""
        return self.total_bytes <= self.limit_bytes and self.host_bytes <= self.host_limit_bytes

    @property
    def tight(self) -> bool:
        """It does not fit with the fragmentation allowance but does without it: the device holds every byte the plan
        needs, with nothing to spare for a fragmented allocator. A layout tuned by hand may run so (published ones did);
        the planner never chooses one."""
        return (
            not self.fits
            and self.total_bytes - self.fragmentation_bytes <= self.limit_bytes
            and self.host_bytes <= self.host_limit_bytes
        )

    def terms(self) -> dict[str, float]:
        """The device terms by readable name."""
        return {
            "parameters": self.params_bytes,
            "gradients": self.grads_bytes,
            "optimizer states": self.optimizer_bytes,
            "activations": self.activations_bytes,
            "buffers and reserve": self.other_bytes,
        }

    def largest_term(self) -> tuple[str, float]:
        """Name and bytes of the largest device term, for explanations."""
        return max(self.terms().items(), key=lambda item: item[1])

    def shortfall_bytes(self) -> float:
        """How many bytes are missing on the device (or on the host, whichever is worse); <= 0 when it fits."""
        return max(self.total_bytes - self.limit_bytes, self.host_bytes - self.host_limit_bytes)

    def to_dict(self) -> dict[str, float]:
        """The JSON ``memory`` object."""
        return {
            "params_bytes": self.params_bytes,
            "grads_bytes": self.grads_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "activations_bytes": self.activations_bytes,
            "other_bytes": self.other_bytes,
            "total_bytes": self.total_bytes,
            "limit_bytes": self.limit_bytes,
            "host_bytes": self.host_bytes,
        }
