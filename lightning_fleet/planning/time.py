"""Step time, one small pure function per term.

A step runs ``gas`` micro-batches through ``pp`` stages. Per micro-batch a stage computes
forward, backward (2x forward, Narayanan 2021) and any recomputation, runs its tensor-parallel
collectives and its pipeline sends; the slowest stage sets the pace, the pipeline adds a bubble,
data-parallel / ZeRO communication follows, and offload adds PCIe transfers and the CPU optimizer step.
Which communications hide behind compute is the runtime's (:class:`~lightning_fleet.planning.overlap.Overlaps`);
what fraction of an overlapped one really hides is calibrated (``calibration.overlap``).

Pure; imported by estimate.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fleet.planning.cluster import Calibration, LinkSpec
from lightning_fleet.planning.comm import allgather_s, allreduce_s, p2p_s, reduce_scatter_s
from lightning_fleet.planning.memory import sparse_index_bytes
from lightning_fleet.planning.model import Precision, TouchedRows
from lightning_fleet.planning.overlap import Overlaps
from lightning_fleet.planning.plan import Offload, Recompute
from lightning_fleet.planning.stages import StageLoad


def gemm_dim(*, mbs: int, seq_length: int, hidden_size: int, tp: int) -> float:
    """Edge of the cube with the volume of one device's typical layer GEMM, [tokens x h] @ [h x h/tp]: the size
    `fleet calibrate` fits the efficiency curve against (it times GEMMs of that shape; all three dimensions matter,
    most on small GEMMs)."""
    return (mbs * seq_length * hidden_size * hidden_size / tp) ** (1.0 / 3.0)


def achieved_flops_per_s(peak_flops_per_s: float, dim: float, calibration: Calibration) -> float:
    """Achieved matmul rate: peak * efficiency * d / (d + d_half) -- a saturating fit of GEMM efficiency vs size (calibrated by `fleet calibrate`)."""
    return peak_flops_per_s * calibration.matmul_efficiency * dim / (dim + calibration.matmul_half_dim)


MEMORY_BOUND_ACCESSES = 2
"""Element accesses of device memory per output element of a memory-bound operator: its input read once and its output
written once (an element-wise map; a fused kernel reads several inputs, an unfused chain of them re-reads each
intermediate: two is the fused single-input case). Norms, activations, dropout, softmax and residual adds do O(1)
arithmetic per element and run at the memory's rate, not the matmul units' (Ivanov et al., "Data Movement Is All You
Need: A Case Study on Optimizing Transformers", MLSys 2021, arXiv 2007.00072, Sec. 3)."""


def memory_bound_element_s(memory_GBps: float, element_bytes: int) -> float:
    """Device seconds per output element of a memory-bound operator: :data:`MEMORY_BOUND_ACCESSES` accesses of
    ``element_bytes`` each at the memory's data-sheet bandwidth (an A100 80GB's 2,039 GB/s, bf16: 4 bytes in 1.96 ps)."""
    return MEMORY_BOUND_ACCESSES * element_bytes / (memory_GBps * 1e9)


FUSED_ATTENTION_BACKWARD = 2.5
"""A fused attention kernel's backward over its forward: five matmuls (QK^T recomputed, dV, dP, dQ, dK) against two
(FlashAttention, Dao 2022, Sec. 3.1: the scores are recomputed in the backward pass; the FlashAttention repository counts
backward FLOPs as ``2.5 * f``, benchmarks/benchmark_flash_attention.py)."""


def fused_attention_s(kernel_flops: float, *, mbs: int, tp: int, flops_per_s: float, efficiency: float) -> float:
    """Forward seconds of the fused attention kernels of one micro-batch on one device: the FLOPs they execute
    (:attr:`StageLoad.attention_kernel_flops`, split by tp with the heads) at ``efficiency`` times the GEMMs' achieved rate
    (``calibration.attention_efficiency``)."""
    return kernel_flops * mbs / tp / (flops_per_s * efficiency)


def _forward_work_s(
    flops: float, attention_flops: float, kernel_flops: float, elementwise: float, *, mbs: int, tp: int, flops_per_s: float,
    elementwise_s: float, attention_efficiency: float,
) -> float:
    """Seconds of forward work on one device: the matmul FLOPs at the achieved rate, but those of fused attention kernels
    (``attention_flops``, of which they execute ``kernel_flops``) at ``attention_efficiency`` times it, and the
    memory-bound operators' output elements at ``elementwise_s`` seconds each; per sample, times mbs, split by tp."""
    attention_s = kernel_flops / (flops_per_s * attention_efficiency)
    matmul_s = (flops - attention_flops) / flops_per_s + attention_s
    return (matmul_s + elementwise * elementwise_s) * mbs / tp


def forward_s(
    load: StageLoad, *, mbs: int, tp: int, flops_per_s: float, elementwise_s: float = 0.0, attention_efficiency: float = 1.0
) -> float:
    """Forward compute of one micro-batch on one device of the stage: all its blocks' work (:func:`_forward_work_s`)."""
    return _forward_work_s(
        load.flops, load.attention_flops, load.attention_kernel_flops, load.elementwise, mbs=mbs, tp=tp,
        flops_per_s=flops_per_s, elementwise_s=elementwise_s, attention_efficiency=attention_efficiency,
    )


def backward_s(forward_time_s: float, attention_s: float = 0.0) -> float:
    """Backward is twice the forward: input and weight gradients (Narayanan 2021, Sec. 5.1); a fused attention kernel's
    part of it (``attention_s``, :func:`fused_attention_s`) FUSED_ATTENTION_BACKWARD times its forward."""
    return 2.0 * forward_time_s + (FUSED_ATTENTION_BACKWARD - 2.0) * attention_s


def recompute_s(
    load: StageLoad,
    *,
    mbs: int,
    tp: int,
    recompute: Recompute,
    flops_per_s: float,
    elementwise_s: float = 0.0,
    attention_efficiency: float = 1.0,
) -> float:
    """Recomputation is hardware FLOPs (Narayanan 2021): full redoes the layers' forward (its memory-bound operators
    too, its fused attention at the kernel's rate, as :func:`forward_s`), selective the attention core (Korthikanti 2022),
    op-level the matmuls and memory-bound operators its policy does not keep
    (:class:`~lightning_fleet.planning.model.OpRecompute`: never a fused attention kernel, whose output it keeps)."""
    if recompute is Recompute.NONE:
        return 0.0
    if recompute is Recompute.FULL:
        return _forward_work_s(
            load.layer_flops, load.layer_attention_flops, load.layer_attention_kernel_flops, load.layer_elementwise, mbs=mbs,
            tp=tp, flops_per_s=flops_per_s, elementwise_s=elementwise_s, attention_efficiency=attention_efficiency,
        )
    if recompute is Recompute.OP:
        # the selective term's expression first, so op (which redoes at least those FLOPs) is never the faster, bit for bit
        return load.op_recompute_flops * mbs / tp / flops_per_s + load.op_recompute_elementwise * elementwise_s * mbs / tp
    return load.recompute_flops * mbs / tp / flops_per_s


def tp_comm_s(
    load: StageLoad, *, mbs: int, tp: int, recompute: Recompute, link: LinkSpec, sp: bool = False, sp_traffic: float = 1.0
) -> float:
    """Tensor-parallel all-reduces of one micro-batch (sp's all-gather + reduce-scatter pairs cost the same); full
    recompute repeats the layers' forward ones, and so does op-level recompute without sp; with sp it repeats only their
    all-gathers, as torchtitan's op policy keeps the reduce-scatters' outputs (``_c10d_functional.reduce_scatter_tensor``
    in its save list, torchtitan/parallelisms/parallelize_llama.py @9dec370a). With sp, ``sp_traffic`` times that: the
    runtime's layout over Megatron's (:attr:`Overlaps.sp_traffic`)."""
    if sp and sp_traffic != 1:
        return sp_traffic * tp_comm_s(load, mbs=mbs, tp=tp, recompute=recompute, link=link, sp=True)
    if recompute is Recompute.OP and sp:
        base, repeated = _tp_allreduces_s(load, mbs=mbs, tp=tp, repeat_forward=False, link=link), load.layer_tp_allreduces_fwd
        if tp == 1 or repeated == 0:
            return base
        return base + repeated * allgather_s(load.layer_tp_allreduce_fwd_bytes * mbs / repeated, tp, link)
    repeat = recompute is Recompute.FULL or recompute is Recompute.OP
    return _tp_allreduces_s(load, mbs=mbs, tp=tp, repeat_forward=repeat, link=link)


def _tp_allreduces_s(load: StageLoad, *, mbs: int, tp: int, repeat_forward: bool, link: LinkSpec) -> float:
    """The stage's tp all-reduces of one micro-batch, with the layers' forward ones a second time when ``repeat_forward``."""
    messages = load.tp_allreduces
    nbytes = load.tp_allreduce_bytes
    if repeat_forward:
        messages += load.layer_tp_allreduces_fwd
        nbytes += load.layer_tp_allreduce_fwd_bytes
    if tp == 1 or messages == 0:
        return 0.0
    return messages * allreduce_s(nbytes * mbs / messages, tp, link)


def pp_comm_s(
    load: StageLoad, *, mbs: int, tp: int, sp: bool, pp: int, vpp: int, link: LinkSpec, split_over_tp: bool = False
) -> float:
    """Pipeline sends of one micro-batch: activation forward, gradient backward, per virtual stage; sp sends a 1/tp slice,
    and so does ``split_over_tp`` (Megatron-LM's scatter-gather, Narayanan 2021 Sec. 4.1: :func:`pp_split_gather_s`)."""
    if pp == 1:
        return 0.0
    nbytes = load.boundary_bytes * mbs / (tp if sp or split_over_tp else 1)
    return 2 * vpp * p2p_s(nbytes, link)


def pp_split_gather_s(load: StageLoad, *, mbs: int, tp: int, pp: int, vpp: int, link: LinkSpec) -> float:
    """The receivers' all-gathers over tp of the 1/tp slices :func:`pp_comm_s` sends with ``split_over_tp``: one per
    send, the whole boundary tensor (Narayanan 2021 Sec. 4.1; Megatron-LM's ``gather_split_1d_tensor`` after the
    receive, megatron/p2p_communication.py before the move to megatron/core, March 2023)."""
    if pp == 1:
        return 0.0
    return 2 * vpp * allgather_s(load.boundary_bytes * mbs, tp, link)


def pp_exposed_s(sends_s: float, gathers_s: float, compute_s: float, overlap: float) -> float:
    """Pipeline communication of one micro-batch left on the critical path: the sends hide behind the micro-batch's
    compute up to ``overlap`` (Megatron-LM's ``overlap_p2p_comm`` in its interleaved schedule; 0 when not overlapped),
    the all-gathers of split sends do not (``gather_split_1d_tensor`` waits for them)."""
    sends = exposed_s(sends_s, compute_s, overlap) if overlap else sends_s
    return sends + gathers_s if gathers_s else sends


def tp_exposed_s(comm_s: float, compute_s: float, overlap: float) -> float:
    """Tensor-parallel communication of one micro-batch left on the critical path: it hides behind the micro-batch's
    GEMMs (its compute) up to ``overlap`` (Megatron-LM's ``--tp-comm-overlap``: "overlapping of Linear layer execution
    with tensor parallel communication collectives like AllGather/ReduceScatter", model_parallel_config.py; 0 when not)."""
    return exposed_s(comm_s, compute_s, overlap) if overlap else comm_s


def bubble_s(microbatch_s: float, *, pp: int, vpp: int) -> float:
    """Pipeline fill and drain: (pp - 1) / vpp micro-batch times, i.e. (p-1)/(m*v) of the ideal (Narayanan 2021, Sec. 2.2)."""
    return (pp - 1) / vpp * microbatch_s


def microbatch_overhead_s(
    forward_ops: float,
    calibration: Calibration,
    zero: int = 0,
    param_tensors: float = 0,
    recomputed: float = 0.0,
    offload: Offload = Offload.NONE,
) -> float:
    """Framework time of one micro-batch on one device: a fixed part, ZeRO's per-parameter-tensor hooks, and every
    operator's dispatch, forward and backward (~2x the forward's operators).

    ``recomputed`` is the share of the forward that recomputation runs again: its operators are
    dispatched once more and, under ZeRO-3, its parameters gathered and released once more (half
    again the forward + backward hooks). Offload adds its per-tensor host copies and bookkeeping.
    """
    hooked = param_tensors * (1 + recomputed / 2) if zero == 3 else param_tensors
    level = (Offload.NONE, Offload.OPTIMIZER, Offload.OPTIMIZER_PARAMS).index(offload)
    return calibration.microbatch_overhead(zero, hooked, level) + (3 + recomputed) * forward_ops * calibration.op_overhead_s


def optimizer_step_s(n: float, *, tp: int, dp: int, zero: int, offload: Offload, adam_params_per_s: float) -> float:
    """The device's Adam step over the parameters it updates: all of its tp shard at ZeRO-0, its 1/dp partition from ZeRO-1 on; none when offloaded (the host steps: :func:`offload_s`)."""
    if offload is not Offload.NONE:
        return 0.0
    return n / tp / (dp if zero >= 1 else 1) / adam_params_per_s


def sparse_optimizer_step_s(touched: TouchedRows, *, dp: int, adam_params_per_s: float) -> float:
    """The optimizer step over sparse gradients: the gathered rows of every replica (dp times one replica's touched
    elements, uncoalesced as DeepSpeed's ``SparseTensor.to_coo_tensor`` leaves them), at the Adam rate. Every torch
    optimizer that takes sparse gradients (SGD, Adagrad, SparseAdam) updates only the rows a gradient holds; Adam and
    AdamW refuse them ("does not support sparse gradients"). Not priced: SGD's weight_decay, which makes the gradient
    dense (``grad.add(param, alpha=weight_decay)``)."""
    return dp * touched.elements / adam_params_per_s


# DeepSpeed 0.19.8 runtime/engine.py sparse_allreduce -> sparse_all_gather (called for the indices, then the values):
# all_gather_scalar of the local row count, then dist.all_gather of the tensor padded to the largest rank's. torch DDP
# on gloo reduces sparse gradients the same way (ProcessGroupGloo AsyncSparseAllreduceWork: all-gathers of metadata,
# indices and values).
def sparse_grad_allgather_s(touched: TouchedRows, *, tensors: int, dp: int, precision: Precision, link: LinkSpec) -> float:
    """The data-parallel reduction of ``tensors`` sparse gradients holding ``touched`` rows per replica in all: per
    tensor two all-gathers of a row count (8 bytes a rank), one of its indices and one of its values (every replica's
    rows: dp times one replica's bytes in all, :func:`comm.allgather_s`); none without data parallelism."""
    if dp == 1 or tensors == 0:
        return 0.0
    counts = 2 * allgather_s(8.0 * dp, dp, link)
    indices = allgather_s(dp * touched.rows * sparse_index_bytes(precision) / tensors, dp, link)
    values = allgather_s(dp * touched.elements * precision.element_bytes / tensors, dp, link)
    return tensors * (counts + indices + values)


def exposed_s(comm_s: float, window_s: float, overlap: float) -> float:
    """Communication left on the critical path when a fraction ``overlap`` of it can hide behind ``window_s`` of compute."""
    return comm_s - overlap * min(comm_s, window_s)


def hidden_fraction(overlapped: bool, overlap: float) -> float:
    """The fraction of a communication that hides behind compute: the calibrated ``overlap`` when the runtime runs it
    beside compute (:class:`Overlaps`), else 0 (:func:`exposed_s` then leaves all of it exposed, exactly)."""
    return overlap if overlapped else 0.0


def shared_window_exposed_s(total_s: float, hideable_s: float, window_s: float, overlap: float) -> float:
    """Of ``total_s`` of communication on one link, ``hideable_s`` runs beside ``window_s`` of compute and hides up to
    ``overlap`` of it; the rest is exposed. With everything hideable this is :func:`exposed_s` (ZeRO-3's backward:
    the weight gathers and the gradient reduce-scatters share the link and the backward)."""
    return total_s - overlap * min(hideable_s, window_s)


def dp_comm_s(
    n: float,
    *,
    tp: int,
    dp: int,
    zero: int,
    gas: int,
    precision: Precision,
    link: LinkSpec,
    forward_time_s: float,
    backward_time_s: float,
    overlap: float,
    trainable: float | None = None,
    overlaps: Overlaps = Overlaps.DEFAULT,
    pp: int = 1,
    sparse_s: float = 0.0,
    shard: int | None = None,
    replica_link: LinkSpec | None = None,
) -> float:
    """Exposed data-parallel communication per step of a stage holding ``n`` parameters, ``trainable`` of them with
    gradients (default all), in a ``pp``-stage pipeline (ZeRO paper Sec. 7; DeepSpeed's overlap_comm).

    zero 0: one gradient all-reduce at the accumulation boundary, behind the last backward.
    zero 1: reduce-scatter there, all-gather of the updated weights after the step, behind the next step's first forward.
    zero 2: a reduce-scatter every micro-batch (each behind its backward) and the weight all-gather.
    At zero 1/2 the reduction is a full all-reduce where the runtime runs one (:attr:`Overlaps.dp_grad_allreduce`).
    zero 3: every micro-batch gathers the weights for forward and again for backward, and reduce-scatters gradients.
    "Behind" hides up to ``overlap`` of it where ``overlaps`` says the runtime runs it beside compute
    (:meth:`Overlaps.hides_grad_reduce`, :meth:`Overlaps.hides_param_gather`); the rest is exposed.
    Gradients and updated weights are the trainable parameters' (DeepSpeed 0.19's ZeRO-1/2 optimizer flattens only the
    parameters that require grad, ``is_optimized_parameter`` in stage_1_and_2.py); ZeRO-3 gathers every parameter.
    ``sparse_s`` is the zero-0 reduction of the sparse gradients (:func:`sparse_grad_allgather_s`; ``trainable`` then
    counts the dense ones only): it runs beside the dense all-reduce, after the same backward.
    Hybrid sharding (``shard`` replicas per shard group, fewer than dp; ``link`` is then the shard group's link and
    ``replica_link`` the one across groups): the gathers and reduce-scatters run within the group, and each reduction
    adds an all-reduce of the group's 1/shard of the gradients across the dp / shard groups
    (:func:`hybrid_reduce_s`).
    """
    if dp == 1:
        return 0.0
    grads = hidden_fraction(overlaps.hides_grad_reduce(zero, pp), overlap)
    gathers = hidden_fraction(overlaps.hides_param_gather(zero, pp), overlap)
    nbytes = precision.element_bytes * (n if trainable is None else trainable) / tp
    if zero == 0:
        return exposed_s(allreduce_s(nbytes, dp, link) + sparse_s, backward_time_s, grads)
    group = dp if shard is None else shard
    across = hybrid_reduce_s(nbytes, dp=dp, shard=group, link=link if replica_link is None else replica_link)
    gather = allgather_s(nbytes, group, link)
    scatter = reduce_scatter_s(nbytes, group, link) + across
    if zero in (1, 2):
        updated = exposed_s(gather, forward_time_s, gathers) if gathers else gather
        reduce = allreduce_s(nbytes, group, link) + across if overlaps.reduces_grads_by_allreduce(zero) else scatter
        return (gas if zero == 2 else 1) * exposed_s(reduce, backward_time_s, grads) + updated
    gather = gather if trainable is None else allgather_s(precision.element_bytes * n / tp, group, link)
    return gas * zero3_microbatch_s(gather, scatter, forward_time_s, backward_time_s, gathers=gathers, grads=grads)


# torch 2.13 torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py foreach_reduce: the reduce-scatter over the shard
# group, then "if all_reduce_group is not None:  # HSDP" dist.all_reduce(reduce_output, group=all_reduce_group) of the
# shard it left; on the same stream, behind the same backward.
def hybrid_reduce_s(nbytes: float, *, dp: int, shard: int, link: LinkSpec) -> float:
    """Hybrid sharding's reduction across shard groups: a ring all-reduce of one group member's 1/``shard`` of the
    ``nbytes`` gradients over the dp / ``shard`` members that hold the same shard; none without hybrid sharding
    (``shard`` = dp)."""
    return allreduce_s(nbytes / shard, dp // shard, link)


def zero3_microbatch_s(gather_s: float, scatter_s: float, forward_time_s: float, backward_time_s: float, *, gathers: float,
                       grads: float) -> float:
    """ZeRO-3's exposed communication of one micro-batch: the weight gather before forward hides behind the forward
    (a fraction ``gathers``: DeepSpeed's prefetch, partitioned_param_coordinator.py); backward's gather and the gradient
    reduce-scatter share the link and hide behind the backward together, each as far as it is overlapped (``gathers``,
    ``grads``: the calibrated overlap or 0, :func:`hidden_fraction`)."""
    forward = exposed_s(gather_s, forward_time_s, gathers)
    if gathers == grads:
        return forward + exposed_s(gather_s + scatter_s, backward_time_s, gathers)
    hideable = gather_s if gathers else scatter_s
    return forward + shared_window_exposed_s(gather_s + scatter_s, hideable, backward_time_s, max(gathers, grads))


def offload_s(
    n: float,
    *,
    tp: int,
    dp: int,
    gas: int,
    offload: Offload,
    precision: Precision,
    pcie_GBps: float,
    cpu_adam_params_per_s: float,
    devices_per_node: int,
    trainable: float | None = None,
) -> float:
    """Offload per step (ZeRO-Offload, Ren 2021): gradients to host each micro-batch, updated weights back once, CPU Adam
    on the partition (the host's rate shared by its devices), all for the ``trainable`` parameters (default all ``n``);
    ZeRO-Infinity also fetches all ``n`` weights for every forward and backward."""
    if offload is Offload.NONE:
        return 0.0
    t = n if trainable is None else trainable
    moved = (gas + 1) * precision.element_bytes * t / (tp * dp)
    if offload is Offload.OPTIMIZER_PARAMS:
        moved += 2 * gas * precision.element_bytes * n / (tp * dp)
    adam_s = t / (tp * dp) * devices_per_node / cpu_adam_params_per_s
    return moved / (pcie_GBps * 1e9) + adam_s


@dataclass(frozen=True, slots=True, kw_only=True)
class TimeEstimate:
    """Seconds per optimizer step, by term; they add up to ``step_s``."""

    compute_s: float
    """Forward, backward and recomputation of the slowest stage, all micro-batches."""
    tp_comm_s: float
    """Tensor-parallel collectives of the slowest stage, less what hides behind its compute."""
    pp_comm_s: float
    """Pipeline sends and receives of the slowest stage, less what hides behind its compute."""
    dp_comm_s: float
    """Data-parallel / ZeRO communication not hidden behind compute."""
    bubble_s: float
    """Pipeline fill and drain."""
    offload_s: float
    """Host transfers and CPU optimizer step."""
    optimizer_s: float = 0.0
    """The device's own optimizer step (not offloaded)."""
    overhead_s: float
    """Fixed framework time per step and per micro-batch (calibrated)."""

    @property
    def step_s(self) -> float:
        """Predicted time of one optimizer step."""
        return (
            self.compute_s + self.tp_comm_s + self.pp_comm_s + self.dp_comm_s + self.bubble_s + self.offload_s + self.optimizer_s
            + self.overhead_s
        )

    def terms(self) -> dict[str, float]:
        """The terms by readable name."""
        return {
            "compute": self.compute_s,
            "tp communication": self.tp_comm_s,
            "pipeline communication": self.pp_comm_s,
            "dp communication": self.dp_comm_s,
            "pipeline bubble": self.bubble_s,
            "offload": self.offload_s,
            "optimizer step": self.optimizer_s,
            "framework overhead": self.overhead_s,
        }

    def largest_term(self) -> tuple[str, float]:
        """Name and seconds of the largest term, for explanations."""
        return max(self.terms().items(), key=lambda item: item[1])

    def to_dict(self) -> dict[str, float]:
        """The JSON ``time`` object."""
        return {
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "tp_comm_s": self.tp_comm_s,
            "pp_comm_s": self.pp_comm_s,
            "dp_comm_s": self.dp_comm_s,
            "bubble_s": self.bubble_s,
            "offload_s": self.offload_s,
            "optimizer_s": self.optimizer_s,
            "overhead_s": self.overhead_s,
        }
