"""Step time, one small pure function per term.

A step runs ``gas`` micro-batches through ``pp`` stages. Per micro-batch a stage computes
forward, backward (2x forward, Narayanan 2021) and any recomputation, runs its tensor-parallel
collectives (not overlapped, as in Megatron-LM) and its pipeline sends; the slowest stage sets
the pace, the pipeline adds a bubble, data-parallel / ZeRO communication hides partly behind
backward, and offload adds PCIe transfers and the CPU optimizer step.

Pure; imported by estimate.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fleet.planning.cluster import Calibration, LinkSpec
from lightning_fleet.planning.comm import allgather_s, allreduce_s, p2p_s, reduce_scatter_s
from lightning_fleet.planning.model import Precision
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


def forward_s(load: StageLoad, *, mbs: int, tp: int, flops_per_s: float, elementwise_s: float = 0.0) -> float:
    """Forward compute of one micro-batch on one device of the stage: its matmul FLOPs at the achieved rate and its
    memory-bound operators' output elements at ``elementwise_s`` seconds each."""
    return (load.flops / flops_per_s + load.elementwise * elementwise_s) * mbs / tp


def backward_s(forward_time_s: float) -> float:
    """Backward is twice the forward: input and weight gradients (Narayanan 2021, Sec. 5.1)."""
    return 2.0 * forward_time_s


def recompute_s(load: StageLoad, *, mbs: int, tp: int, recompute: Recompute, flops_per_s: float, elementwise_s: float = 0.0) -> float:
    """Recomputation is hardware FLOPs (Narayanan 2021): full redoes the layers' forward (its memory-bound operators
    too), selective the attention core (Korthikanti 2022)."""
    if recompute is Recompute.NONE:
        return 0.0
    if recompute is Recompute.FULL:
        return (load.layer_flops / flops_per_s + load.layer_elementwise * elementwise_s) * mbs / tp
    return load.recompute_flops * mbs / tp / flops_per_s


def tp_comm_s(load: StageLoad, *, mbs: int, tp: int, recompute: Recompute, link: LinkSpec) -> float:
    """Tensor-parallel all-reduces of one micro-batch (sp's all-gather + reduce-scatter pairs cost the same); full recompute repeats the layers' forward ones."""
    messages = load.tp_allreduces
    nbytes = load.tp_allreduce_bytes
    if recompute is Recompute.FULL:
        messages += load.layer_tp_allreduces_fwd
        nbytes += load.layer_tp_allreduce_fwd_bytes
    if tp == 1 or messages == 0:
        return 0.0
    return messages * allreduce_s(nbytes * mbs / messages, tp, link)


def pp_comm_s(load: StageLoad, *, mbs: int, tp: int, sp: bool, pp: int, vpp: int, link: LinkSpec) -> float:
    """Pipeline sends of one micro-batch: activation forward, gradient backward, per virtual stage; sp sends a 1/tp slice."""
    if pp == 1:
        return 0.0
    nbytes = load.boundary_bytes * mbs / (tp if sp else 1)
    return 2 * vpp * p2p_s(nbytes, link)


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


def exposed_s(comm_s: float, window_s: float, overlap: float) -> float:
    """Communication left on the critical path when a fraction ``overlap`` of it can hide behind ``window_s`` of compute."""
    return comm_s - overlap * min(comm_s, window_s)


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
) -> float:
    """Exposed data-parallel communication per step of a stage holding ``n`` parameters, ``trainable`` of them with
    gradients (default all) (ZeRO paper Sec. 7; DeepSpeed's overlap_comm).

    zero 0: one gradient all-reduce at the accumulation boundary, hidden behind the last backward.
    zero 1: reduce-scatter there, all-gather of the updated weights after the step (not hidden).
    zero 2: a reduce-scatter every micro-batch (each behind its backward) and the weight all-gather.
    zero 3: every micro-batch gathers the weights for forward and again for backward, and reduce-scatters gradients.
    Gradients and updated weights are the trainable parameters' (DeepSpeed 0.19's ZeRO-1/2 optimizer flattens only the
    parameters that require grad, ``is_optimized_parameter`` in stage_1_and_2.py); ZeRO-3 gathers every parameter.
    """
    if dp == 1:
        return 0.0
    nbytes = precision.element_bytes * (n if trainable is None else trainable) / tp
    if zero == 0:
        return exposed_s(allreduce_s(nbytes, dp, link), backward_time_s, overlap)
    gather = allgather_s(nbytes, dp, link)
    scatter = reduce_scatter_s(nbytes, dp, link)
    if zero == 1:
        return exposed_s(scatter, backward_time_s, overlap) + gather
    if zero == 2:
        return gas * exposed_s(scatter, backward_time_s, overlap) + gather
    gather = gather if trainable is None else allgather_s(precision.element_bytes * n / tp, dp, link)
    # backward's gather and the gradient scatter share the link, so they hide behind backward together
    per_microbatch = exposed_s(gather, forward_time_s, overlap) + exposed_s(gather + scatter, backward_time_s, overlap)
    return gas * per_microbatch


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
    """Tensor-parallel collectives of the slowest stage."""
    pp_comm_s: float
    """Pipeline sends and receives of the slowest stage."""
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
