"""ModelSpec: what a model costs, per block and per sample.

A ModelSpec is a sequence of blocks. Each block says, for ONE sample at the model's sequence
length: its parameters, forward FLOPs, and the bytes autograd saves for backward, split by how
tensor parallelism and recomputation treat them. Blocks with role ``pre`` live on the first
pipeline stage, ``layer`` blocks are split evenly across stages, ``post`` blocks live on the last.

Two ways to build one: :func:`transformer_model` from the decoder-only YAML of a GPT- or Llama-class
model (closed forms below, one small function per term) and, in :mod:`lightning_fleet.profiling`, by measuring a real ``nn.Module`` on the meta device.

Pure (stdlib + yaml); imported across the planning core and by profiling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Mapping

from lightning_fleet.planning.cluster import _resolve, _preset_dir
from lightning_fleet.planning.errors import SpecError
from lightning_fleet.planning.yamlspec import (
    check_keys,
    dump_yaml,
    from_mapping,
    read_yaml,
    require_at_most,
    require_name,
    require_non_negative,
    require_positive,
    shown,
    to_mapping,
)

MAX_LAYERS = 2**14
"""Most transformer layers a model may have (16,384; published models have up to a few hundred): stage splits walk
them one by one."""
MAX_GLOBAL_BATCH_SIZE = 2**32
"""Largest global batch size, in samples, the planner searches (:func:`lightning_fleet.planning.search.plan`): it walks
the divisors of the batch per data-parallel degree. Estimates of one plan take any size."""


class Precision(StrEnum):
    """Training number format, as Lightning spells it."""

    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    FP32 = "fp32"

    @classmethod
    def from_lightning(cls, name: str) -> "Precision":
        """The precision a Lightning ``Trainer(precision=...)`` string trains in (the "-true" half precisions priced as
        their mixed kind: 16-bit activations and weights); SpecError naming the supported ones otherwise."""
        if str(name) not in LIGHTNING_PRECISIONS:
            raise SpecError(f"strategy 'fleet' supports precision 32-true, bf16-mixed, bf16-true, 16-mixed; got {str(name)!r}")
        return LIGHTNING_PRECISIONS[str(name)]

    @property
    def compute_dtype(self) -> str:
        """Key into PeakTflops for the matmuls."""
        return {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp32": "fp32"}[self.value]

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation / working parameter / gradient element."""
        return 4 if self is Precision.FP32 else 2


class GradAccumDtype(StrEnum):
    """Which gradient copies training keeps per trainable parameter (priced by :func:`memory.grad_bytes_per_param`)."""

    WORKING = "working"
    """One gradient in the working precision (2 bytes in bf16/fp16 mixed precision, 4 in fp32): DeepSpeed ZeRO's
    default (``data_types.grad_accum_dtype`` unset), PyTorch DDP."""
    FP32 = "fp32"
    """One fp32 gradient; the working-precision gradient is freed as it is added in: Megatron-LM's ``main_grad``
    buffer (``--accumulate-allreduce-grads-in-fp32``; ``param.grad = None`` after ``main_grad.add_``), FSDP with
    ``reduce_dtype=float32`` (fp32 sharded gradients)."""
    FP32_AND_WORKING = "fp32+working"
    """An fp32 accumulation buffer beside the working-precision gradient it accumulates from: DeepSpeed's
    BF16_Optimizer (``bf16`` with ``grad_accum_dtype: fp32``; BLOOM's "bf16 with fp32 gradient accumulation")."""


def _grad_accum_dtype(value: Any, precision: Precision, where: str) -> GradAccumDtype:
    """``value`` as a GradAccumDtype, or one SpecError; an fp32 buffer beside an fp32 gradient is refused."""
    try:
        dtype = GradAccumDtype(value)
    except ValueError:
        raise SpecError(f"{where}grad_accum_dtype must be one of {', '.join(GradAccumDtype)}, got {shown(value)}") from None
    if dtype is GradAccumDtype.FP32_AND_WORKING and precision is Precision.FP32:
        raise SpecError(
            f"{where}grad_accum_dtype 'fp32+working' needs bf16-mixed or fp16-mixed precision; "
            "in fp32 the working gradient is the fp32 one: use 'working'"
        )
    return dtype


LIGHTNING_PRECISIONS: dict[str, Precision] = {
    "32-true": Precision.FP32,
    "32": Precision.FP32,
    "bf16-mixed": Precision.BF16_MIXED,
    "bf16-true": Precision.BF16_MIXED,
    "16-mixed": Precision.FP16_MIXED,
    "16-true": Precision.FP16_MIXED,
}
"""Lightning's ``Trainer(precision=...)`` spellings strategy 'fleet' trains, as the cost model prices them (the one table:
the strategy, ``fleet plan --module`` and :meth:`Precision.from_lightning` read it)."""


class Role(StrEnum):
    """Where a block goes in a pipeline."""

    PRE = "pre"
    LAYER = "layer"
    POST = "post"


@dataclass(frozen=True, slots=True, kw_only=True)
class OpRecompute:
    """What op-level selective recomputation (``recompute=op``) does to one layer block, per sample, before tp.

    The policy is torchtitan's ``selective_ac_option = 'op'`` (torchtitan/parallelisms/parallelize_llama.py @9dec370a,
    ``_custom_policy``: "Saves output of all compute ops, except every second mm", with a fresh matmul counter for each
    checkpointed block's forward): the outputs of the 1st, 3rd, ... weight matmul and of a fused attention kernel
    (its output and fp32 logsumexp) are kept; every other operator of the block is recomputed in backward from those
    and the block's input, which the checkpoint keeps (the ``output_bytes`` full recomputation keeps). A block runs at
    most the work full recomputation redoes and at least what selective recomputation redoes, and keeps no more than
    autograd would save without recomputation (checked here, so the search's order of modes holds for every spec)."""

    flops: float
    """Forward FLOPs it redoes: the even-numbered matmuls, and the attention core when it runs as separate operators
    (the math kernel: its batched matmuls are not the counted ``mm``, so nothing of it is kept)."""
    elementwise: float
    """Output elements of the memory-bound operators it redoes (all of the block's but a fused attention kernel's own)."""
    saved_replicated_bytes: float
    """Kept matmul outputs that every tp rank holds whole unless sp splits them: the row-parallel ones (attention output
    projection, MLP down projection), counted as the h-wide activation after their reduction."""
    saved_sharded_bytes: float
    """Kept outputs split by tp: the column-parallel matmuls' (Q/K/V, MLP up / gate) and the fused attention kernel's."""

    def __post_init__(self) -> None:
        require_non_negative(
            "op_recompute.",
            flops=self.flops,
            elementwise=self.elementwise,
            saved_replicated_bytes=self.saved_replicated_bytes,
            saved_sharded_bytes=self.saved_sharded_bytes,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockSpec:
    """Costs of one block for one sample; ``count`` identical blocks in a row share one entry."""

    name: str
    """Block name (module path when profiled)."""
    role: Role = Role.LAYER
    """pre: first pipeline stage; layer: split across stages; post: last stage."""
    count: int = 1
    """How many identical blocks follow each other."""
    params: int
    """Parameters of one block; tensor parallelism divides them by tp."""
    flops: float
    """Forward FLOPs for one sample (multiply-add = 2 FLOPs); tensor parallelism divides them by tp."""
    elementwise: float = 0.0
    """Output elements per sample of the forward's operators that do no matmul (norms, activations, softmax, residual
    adds, copies: memory-bound work priced by ``Hardware.elementwise_s``: the calibration's or the device memory's rate); tensor parallelism divides them by tp."""
    act_replicated_bytes: float = 0.0
    """Saved bytes per sample that every tp rank keeps whole, unless sequence parallelism splits them."""
    act_sharded_bytes: float = 0.0
    """Saved bytes per sample that tensor parallelism splits by tp."""
    act_attention_bytes: float = 0.0
    """Saved bytes per sample of attention scores (split by tp); selective recomputation drops them."""
    recompute_flops: float = 0.0
    """Forward FLOPs per sample that selective recomputation redoes (attention core)."""
    attention_flops: float = 0.0
    """The part of ``flops`` a fused attention kernel runs (its QK^T and scores x V, counted over every score as ``flops``
    counts them): the time model prices it at the kernel's own rate and its backward at 2.5x (the kernel recomputes the
    scores; :func:`time.fused_attention_s`). 0 when attention runs as separate matmuls (priced with the GEMMs)."""
    attention_kernel_flops: float = 0.0
    """Forward FLOPs per sample that fused kernel executes: ``attention_flops``, or half of it under a causal mask (the
    kernel skips the score blocks above the diagonal; :func:`attention_kernel_flops`)."""
    output_bytes: float = 0.0
    """Bytes per sample of the block's output: a pipeline send, a tp all-reduce, the full-recompute checkpoint."""
    tp_allreduces_fwd: int = 0
    """Tensor-parallel all-reduces of ``output_bytes`` in the forward pass."""
    tp_allreduces_bwd: int = 0
    """Tensor-parallel all-reduces of ``output_bytes`` in the backward pass."""
    trainable_params: int | None = None
    """Parameters of one block that train (``requires_grad``); None: all of them. Gradients, optimizer states and
    their communication scale with these, the working weights with ``params``."""
    op_recompute: OpRecompute | None = None
    """What op-level selective recomputation redoes and keeps in this block (layer blocks only); None: unknown (the
    profiler does not derive it from a measured module), and ``recompute=op`` is not offered for the model."""
    sparse_params: int = 0
    """Trainable parameters of one block whose gradient is sparse (embedding tables looked up with ``sparse=True``): a
    step's gradient holds only the rows the step looked up (:func:`touched_sparse`). Part of the trainable parameters."""
    sparse_tensors: int = 0
    """Parameter tensors of one block with sparse gradients (each is reduced by collectives of its own)."""
    sparse_rows_per_sample: float = 0.0
    """Rows of those tables one sample looks up, every lookup counted (an upper bound on the distinct rows it touches)."""
    sparse_elements_per_sample: float = 0.0
    """Gradient elements of those rows per sample: the looked-up rows' widths, summed."""

    def __post_init__(self) -> None:
        where = f"block {self.name!r}: "
        if self.trainable_params is not None:
            require_non_negative(where, trainable_params=self.trainable_params)
            if self.trainable_params > self.params:
                raise SpecError(f"{where}trainable_params ({self.trainable_params}) must be <= params ({self.params})")
        require_positive(where, count=self.count)
        require_non_negative(
            where,
            params=self.params,
            flops=self.flops,
            elementwise=self.elementwise,
            act_replicated_bytes=self.act_replicated_bytes,
            act_sharded_bytes=self.act_sharded_bytes,
            act_attention_bytes=self.act_attention_bytes,
            recompute_flops=self.recompute_flops,
            attention_flops=self.attention_flops,
            attention_kernel_flops=self.attention_kernel_flops,
            output_bytes=self.output_bytes,
            tp_allreduces_fwd=self.tp_allreduces_fwd,
            tp_allreduces_bwd=self.tp_allreduces_bwd,
        )
        object.__setattr__(self, "role", Role(self.role))
        if self.attention_flops > self.flops:
            raise SpecError(
                f"{where}attention_flops ({self.attention_flops:g}) must be <= flops ({self.flops:g}): they are part of them"
            )
        if self.attention_kernel_flops > self.attention_flops:
            raise SpecError(
                f"{where}attention_kernel_flops ({self.attention_kernel_flops:g}) must be <= attention_flops "
                f"({self.attention_flops:g}): a fused kernel executes at most the scores it is given"
            )
        if self.op_recompute is not None:
            _check_op_recompute(self, self.op_recompute, where)
        _check_sparse(self, where)

    @property
    def act_split_bytes(self) -> float:
        """Saved bytes per sample that tensor parallelism splits: sharded and attention-score bytes."""
        return self.act_sharded_bytes + self.act_attention_bytes

    @property
    def act_bytes(self) -> float:
        """All saved bytes per sample without parallelism or recomputation."""
        return self.act_replicated_bytes + self.act_sharded_bytes + self.act_attention_bytes

    @property
    def trainable(self) -> int:
        """Parameters of one block that train."""
        return self.params if self.trainable_params is None else self.trainable_params


def _check_sparse(block: BlockSpec, where: str) -> None:
    """SpecError unless the sparse fields are non-negative, the sparse parameters train, and lookups come with tables."""
    require_non_negative(
        where,
        sparse_params=block.sparse_params,
        sparse_tensors=block.sparse_tensors,
        sparse_rows_per_sample=block.sparse_rows_per_sample,
        sparse_elements_per_sample=block.sparse_elements_per_sample,
    )
    if block.sparse_params > block.trainable:
        raise SpecError(f"{where}sparse_params ({block.sparse_params}) must be <= its trainable parameters ({block.trainable})")
    if (block.sparse_params > 0) != (block.sparse_tensors > 0):
        raise SpecError(f"{where}sparse_params ({block.sparse_params}) and sparse_tensors ({block.sparse_tensors}) must be both 0 or both > 0")
    if block.sparse_rows_per_sample > block.sparse_elements_per_sample:
        raise SpecError(
            f"{where}sparse_rows_per_sample ({block.sparse_rows_per_sample:g}) must be <= sparse_elements_per_sample "
            f"({block.sparse_elements_per_sample:g}): a row has at least one element"
        )
    if block.sparse_elements_per_sample and not block.sparse_params:
        raise SpecError(f"{where}sparse lookups ({block.sparse_elements_per_sample:g} elements per sample) need sparse_params > 0")


@dataclass(frozen=True, slots=True)
class TouchedRows:
    """What one replica's sparse gradient holds after a step: rows and their elements (:func:`touched_sparse`)."""

    rows: float
    """Distinct rows (an upper bound: every lookup a distinct row, at most every row of the tables)."""
    elements: float
    """Their gradient elements."""


def touched_sparse(
    sparse_params: float, rows_per_sample: float, elements_per_sample: float, samples: float
) -> TouchedRows:
    """The rows a step of ``samples`` samples touches in tables of ``sparse_params`` elements: every lookup a distinct
    row, at most the whole tables (their rows at the average looked-up width). An upper bound: repeated ids touch
    fewer rows, and it bounds each table by its own size only through the sum (sum of min <= min of sums)."""
    elements = min(float(sparse_params), elements_per_sample * samples)
    rows = elements * rows_per_sample / elements_per_sample if elements_per_sample else 0.0
    return TouchedRows(rows=rows, elements=elements)


def _check_op_recompute(block: BlockSpec, op: OpRecompute, where: str) -> None:
    """SpecError unless ``op`` lies between selective and full recomputation of ``block``: it redoes at least the
    selective FLOPs and at most the forward outside a fused attention kernel (which it keeps), at most the block's
    memory-bound operators, and keeps at most what the block saves without recomputation, in each tp split."""
    bounds = (
        ("flops", op.flops, block.recompute_flops, block.flops - block.attention_flops,
         "recompute_flops (selective) <= op_recompute.flops <= flops - attention_flops"),
        ("elementwise", op.elementwise, 0.0, block.elementwise, "op_recompute.elementwise <= elementwise"),
        ("saved_replicated_bytes", op.saved_replicated_bytes, 0.0, block.act_replicated_bytes,
         "op_recompute.saved_replicated_bytes <= act_replicated_bytes"),
        ("saved_sharded_bytes", op.saved_sharded_bytes, 0.0, block.act_split_bytes,
         "op_recompute.saved_sharded_bytes <= act_sharded_bytes + act_attention_bytes"),
    )
    for name, value, low, high, rule in bounds:
        if not low <= value <= high:
            raise SpecError(f"{where}op_recompute.{name} ({value:g}) is out of range: {rule} ({low:g} .. {high:g})")


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """A model as the planner sees it: blocks plus the shape facts that constrain tp and batch."""

    name: str
    """Model name, for reports."""
    blocks: tuple[BlockSpec, ...]
    """Blocks in execution order."""
    hidden_size: int
    """Width of the residual stream; sets the smallest per-device GEMM dimension under tp."""
    num_heads: int
    """Attention heads; tp must divide them."""
    seq_length: int
    """Tokens per sample."""
    precision: Precision = Precision.BF16_MIXED
    """Training number format."""
    global_batch_size: int
    """Samples per optimizer step, over all data-parallel replicas."""
    num_kv_heads: int | None = None
    """Key/value heads under grouped-query attention (None: num_heads); tp must divide them too, as Megatron-LM requires
    of its query groups (``num_query_groups % tensor_model_parallel_size == 0``, megatron/core/transformer config)."""
    tied_params: int = 0
    """Parameters shared by the first pre block and the last post block (tied embeddings): stored once when both sit on one stage."""
    forward_ops: int = 0
    """Operators one forward pass of a micro-batch dispatches (measured by profiling; 0 when unknown)."""
    param_tensors: int = 0
    """Parameter tensors of the whole model (ZeRO's per-parameter hooks cost time per tensor; 0 when unknown)."""
    tied_trainable_params: int | None = None
    """How many of ``tied_params`` train; None: all of them."""
    grad_accum_dtype: GradAccumDtype = GradAccumDtype.WORKING
    """Gradient copies per trainable parameter: working | fp32 | fp32+working (see :class:`GradAccumDtype`)."""

    def __post_init__(self) -> None:
        require_name("model.", self.name)
        require_non_negative("model.", forward_ops=self.forward_ops, param_tensors=self.param_tensors)
        if self.tied_trainable_params is not None:
            require_non_negative("model.", tied_trainable_params=self.tied_trainable_params)
            if self.tied_trainable_params > self.tied_params:
                raise SpecError(
                    f"model.tied_trainable_params ({self.tied_trainable_params}) must be <= tied_params ({self.tied_params})"
                )
        require_positive(
            "model.",
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            seq_length=self.seq_length,
            global_batch_size=self.global_batch_size,
        )
        require_non_negative("model.", tied_params=self.tied_params)
        if self.num_kv_heads is not None:
            require_positive("model.", num_kv_heads=self.num_kv_heads)
            if self.num_heads % self.num_kv_heads:
                raise SpecError(f"model.num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        object.__setattr__(self, "precision", Precision(self.precision))
        object.__setattr__(self, "grad_accum_dtype", _grad_accum_dtype(self.grad_accum_dtype, self.precision, "model."))
        if self.num_layers == 0:
            raise SpecError(f"model {self.name!r} has no block with role 'layer'; pipeline stages need layers")
        require_at_most("model.", MAX_LAYERS, "the planner's bound", num_layers=self.num_layers)
        roles = [b.role for b in self.blocks]
        order = sorted(roles, key=[Role.PRE, Role.LAYER, Role.POST].index)
        if roles != order:
            raise SpecError(f"model {self.name!r}: blocks must be ordered pre..., layer..., post...; got {', '.join(roles)}")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads without grouped-query attention (tp must divide them)."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def op_recompute_known(self) -> bool:
        """Every layer block says what op-level recomputation does to it (:attr:`BlockSpec.op_recompute`): only then
        can ``recompute=op`` be priced (the planner offers it, ``fleet estimate`` accepts it)."""
        return all(b.op_recompute is not None for b in self.blocks if b.role is Role.LAYER)

    @property
    def num_layers(self) -> int:
        """Number of pipeline-splittable layer blocks."""
        return sum(b.count for b in self.blocks if b.role is Role.LAYER)

    @property
    def params(self) -> int:
        """Total distinct parameters."""
        return sum(b.params * b.count for b in self.blocks) - self.tied_params

    @property
    def tied_trainable(self) -> int:
        """Tied parameters that train."""
        return self.tied_params if self.tied_trainable_params is None else self.tied_trainable_params

    @property
    def trainable_params(self) -> int:
        """Total distinct parameters that train."""
        return sum(b.trainable * b.count for b in self.blocks) - self.tied_trainable

    @property
    def flops_per_sample(self) -> float:
        """Forward FLOPs of one sample."""
        return sum(b.flops * b.count for b in self.blocks)

    @property
    def sparse_params(self) -> int:
        """Trainable parameters whose gradients are sparse (:attr:`BlockSpec.sparse_params`, all blocks)."""
        return sum(b.sparse_params * b.count for b in self.blocks)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping in the per-block YAML layout (unset trainable counts left out: all parameters train; unset
        num_kv_heads, the default grad_accum_dtype, blocks' zero fused-attention FLOPs, unknown op_recompute and zero sparse
        fields left out)."""
        out = to_mapping(self)
        if self.tied_trainable_params is None:
            del out["tied_trainable_params"]
        if self.num_kv_heads is None:
            del out["num_kv_heads"]
        if self.grad_accum_dtype is GradAccumDtype.WORKING:
            del out["grad_accum_dtype"]
        for block in out["blocks"]:
            if block["trainable_params"] is None:
                del block["trainable_params"]
            for key in ("attention_flops", "attention_kernel_flops"):
                if not block[key]:
                    del block[key]
            if block["op_recompute"] is None:
                del block["op_recompute"]
            for key in ("sparse_params", "sparse_tensors", "sparse_rows_per_sample", "sparse_elements_per_sample"):
                if not block[key]:
                    del block[key]
        return out

    def to_yaml(self) -> str:
        """YAML text that :func:`load_model` reads back to an equal spec."""
        return dump_yaml(self.to_dict())


class FfnKind(StrEnum):
    """The MLP of a transformer layer."""

    GELU = "gelu"
    """Two matrices, h x f and f x h, with a GeLU between them (GPT-2/3, Megatron-LM)."""
    SWIGLU = "swiglu"
    """Three matrices, gate and up h x f and down f x h: down(silu(gate(x)) * up(x)) (Shazeer 2020; Llama)."""

    @property
    def matrices(self) -> int:
        """Weight matrices of the MLP, h x f each."""
        return 2 if self is FfnKind.GELU else 3


class PositionEmbedding(StrEnum):
    """How a transformer tells positions apart."""

    LEARNED = "learned"
    """A learned s x h table added to the token embedding (GPT-2/3)."""
    ROPE = "rope"
    """Rotary embeddings applied to Q and K in every layer, no parameters (Su et al. 2021; Llama)."""


class NormKind(StrEnum):
    """The normalisation before attention, before the MLP and before the output projection."""

    LAYERNORM = "layernorm"
    """LayerNorm with a weight and a bias, 2h parameters (Ba et al. 2016; GPT)."""
    RMSNORM = "rmsnorm"
    """RMSNorm with a weight and no bias, h parameters (Zhang & Sennrich 2019; Llama)."""


class AttentionKernel(StrEnum):
    """How the attention core (softmax(QK^T) V) runs, which decides what it saves for backward (the transformer YAML's
    ``attention_kernel``, and how profiling prices ``torch.nn.functional.scaled_dot_product_attention``)."""

    MATH = "math"
    """Separate matmul and softmax operators (the composite path the meta device runs, and a CPU with dropout on): the
    a x s x s softmax output (and dropout mask) are saved (Korthikanti 2022)."""
    FLASH = "flash"
    """A fused kernel (FlashAttention, Dao et al. 2022; PyTorch SDPA's flash/memory-efficient/cuDNN kernels, as
    ``select_sdp_backend`` picks them on a GPU): no s x s tensor is saved, only Q, K, V, the output and an fp32
    logsumexp per head and token."""


_KINDS: dict[str, type[StrEnum]] = {
    "ffn_kind": FfnKind,
    "position_embedding": PositionEmbedding,
    "norm": NormKind,
    "attention_kernel": AttentionKernel,
}
"""The transformer YAML keys whose values are one of a few kinds."""


def _kind(enum: type[StrEnum], value: Any, where: str) -> Any:
    """``value`` as a member of ``enum``, or one SpecError naming ``where`` and the allowed values."""
    try:
        return enum(value)
    except ValueError:
        raise SpecError(f"{where} must be one of {', '.join(enum)}, got {shown(value)}") from None


_ARCHITECTURE_KEYS = ("num_kv_heads", "tie_embeddings", "bias", "dropout", "causal", "fused_qkv", *_KINDS)
"""Transformer YAML keys added for Llama-class models; left out of a dump when they keep the GPT default."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerSpec:
    """The decoder-only transformer YAML: the shape of a GPT- or Llama-class model and its batch; the defaults describe GPT."""

    name: str
    """Model name."""
    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Hidden size h."""
    num_heads: int
    """Attention heads a."""
    seq_length: int
    """Sequence length s."""
    vocab_size: int
    """Vocabulary size V."""
    ffn_hidden_size: int | None = None
    """MLP inner size f; defaults to 4h."""
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention, Ainslie et al. 2023); None: num_heads. Must divide num_heads; the K and V
    projections are h x (num_kv_heads * h / num_heads) each."""
    ffn_kind: FfnKind = FfnKind.GELU
    """gelu: two MLP matrices h x f (GPT); swiglu: three, gate, up and down (Shazeer 2020; Llama)."""
    tie_embeddings: bool = True
    """true: the output projection is the token embedding (GPT); false: a separate V x h output matrix (Llama)."""
    position_embedding: PositionEmbedding = PositionEmbedding.LEARNED
    """learned: an s x h position table (GPT); rope: rotary embeddings, no parameters (Llama)."""
    norm: NormKind = NormKind.LAYERNORM
    """layernorm: weight and bias, 2h per norm (GPT); rmsnorm: a weight, h per norm (Llama)."""
    bias: bool = True
    """Biases in the linear layers (Q, K, V, output projection, MLP); Llama has none. The vocabulary projection has none."""
    dropout: bool = True
    """Dropout after the embedding, on the attention probabilities and after attention and MLP, whose masks are saved for
    backward (Korthikanti 2022); Llama-class pretraining uses none."""
    attention_kernel: AttentionKernel = AttentionKernel.MATH
    """math: the s x s attention scores are saved (Korthikanti 2022); flash: a fused kernel (FlashAttention / SDPA) keeps an
    fp32 logsumexp per head and token instead, and selective recomputation has nothing left to drop."""
    causal: bool = True
    """A causal attention mask (a decoder-only language model). The flash kernel skips the score blocks above the diagonal,
    half of its QK^T and scores x V work (FlashAttention-2, Dao 2023, Sec. 3.1); the math kernel computes every score and
    masks them, so it changes nothing there. false: every score is computed (bidirectional attention, or an explicit mask
    passed to the kernel)."""
    fused_qkv: bool = True
    """Q, K and V come out of one matmul (GPT-2's ``c_attn``, Megatron-LM's ``linear_qkv``); false: three, in the order
    Q, K, V (Llama's ``wq``, ``wk``, ``wv``: Meta's reference model, torchtitan, Hugging Face). Parameters, FLOPs and
    saved bytes are the same either way; it decides which matmuls op-level recomputation (``recompute=op``) keeps, as
    that policy counts them (:func:`layer_matmuls`)."""
    precision: Precision = Precision.BF16_MIXED
    """bf16-mixed | fp16-mixed | fp32."""
    grad_accum_dtype: GradAccumDtype = GradAccumDtype.WORKING
    """Gradient copies per trainable parameter: working | fp32 | fp32+working (see :class:`GradAccumDtype`)."""
    global_batch_size: int
    """Samples per optimizer step."""

    def __post_init__(self) -> None:
        require_name("model.", self.name)
        require_positive(
            "model.",
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_heads=self.num_heads,
            seq_length=self.seq_length,
            vocab_size=self.vocab_size,
            global_batch_size=self.global_batch_size,
        )
        if self.ffn_hidden_size is not None:
            require_positive("model.", ffn_hidden_size=self.ffn_hidden_size)
        try:
            object.__setattr__(self, "precision", Precision(self.precision))
        except ValueError:
            raise SpecError(f"model.precision must be one of {', '.join(Precision)}, got {shown(self.precision)}") from None
        object.__setattr__(self, "grad_accum_dtype", _grad_accum_dtype(self.grad_accum_dtype, self.precision, "model."))
        if self.hidden_size % self.num_heads:
            raise SpecError(f"model.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_kv_heads is not None:
            require_positive("model.", num_kv_heads=self.num_kv_heads)
            if self.num_heads % self.num_kv_heads:
                raise SpecError(f"model.num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        for key, enum in _KINDS.items():
            object.__setattr__(self, key, _kind(enum, getattr(self, key), f"model.{key}"))

    @property
    def ffn(self) -> int:
        """MLP inner size f."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        """Key/value heads: num_kv_heads, or num_heads without grouped-query attention."""
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of K (and of V): kv_heads times the head size h / a."""
        return self.kv_heads * (self.hidden_size // self.num_heads)

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping in the transformer YAML layout (unset ffn_hidden_size, the default grad_accum_dtype and architecture
        keys at their GPT defaults left out)."""
        out = to_mapping(self)  # leaves out the optional keys at None (ffn_hidden_size, num_kv_heads unset)
        for field in dataclasses.fields(self):
            if field.name in _ARCHITECTURE_KEYS and getattr(self, field.name) == field.default:
                out.pop(field.name, None)
        if self.grad_accum_dtype is GradAccumDtype.WORKING:
            del out["grad_accum_dtype"]
        return out

    def to_yaml(self) -> str:
        """YAML text that :func:`load_transformer` reads back to an equal spec."""
        return dump_yaml(self.to_dict())


# --- closed forms of a decoder layer --------------------------------------------------------------------------------
# GPT defaults: Narayanan et al. 2021 (parameters, FLOPs) and Korthikanti et al. 2022, Sec. 4 (saved activations). Llama
# features: grouped-query attention (Ainslie et al. 2023), SwiGLU (Shazeer 2020), RMSNorm (Zhang & Sennrich 2019), rotary
# positions (Su et al. 2021), fused attention (Dao et al. 2022). s: sequence, h: hidden, a: heads, f: MLP inner size,
# kv_dim: width of K (and of V), h under multi-head attention; e: bytes per activation element. FLOPs count 2 per
# multiply-add. Defaults everywhere give the GPT layer.


def attention_params(h: int, kv_dim: int, *, bias: bool = True) -> int:
    """Q and output projections h x h, K and V h x kv_dim each (GQA), biases h + kv_dim + kv_dim + h (Megatron-LM)."""
    return 2 * h * h + 2 * h * kv_dim + ((2 * h + 2 * kv_dim) if bias else 0)


def mlp_params(h: int, f: int, *, ffn_kind: FfnKind = FfnKind.GELU, bias: bool = True) -> int:
    """gelu: fc1 h x f + f, fc2 f x h + h; swiglu: gate and up h x f (+ f each), down f x h (+ h) (Shazeer 2020)."""
    biases = (ffn_kind.matrices - 1) * f + h
    return ffn_kind.matrices * h * f + (biases if bias else 0)


def norm_params(h: int, norm: NormKind = NormKind.LAYERNORM) -> int:
    """One norm: LayerNorm weight and bias 2h (Ba 2016); RMSNorm weight h (Zhang & Sennrich 2019)."""
    return 2 * h if norm is NormKind.LAYERNORM else h


def position_params(s: int, h: int, position: PositionEmbedding = PositionEmbedding.LEARNED) -> int:
    """A learned s x h position table (GPT-2/3); rotary embeddings have none (Su 2021)."""
    return s * h if position is PositionEmbedding.LEARNED else 0


def layer_params(
    h: int,
    f: int,
    *,
    kv_dim: int | None = None,
    ffn_kind: FfnKind = FfnKind.GELU,
    norm: NormKind = NormKind.LAYERNORM,
    bias: bool = True,
) -> int:
    """Parameters of one layer: attention, MLP, two norms; the GPT defaults give 12h^2 + 13h at f = 4h (Narayanan 2021)."""
    kv = h if kv_dim is None else kv_dim
    return attention_params(h, kv, bias=bias) + mlp_params(h, f, ffn_kind=ffn_kind, bias=bias) + 2 * norm_params(h, norm)


def attention_gemm_flops(s: int, h: int, kv_dim: int) -> float:
    """Forward FLOPs of the Q, K, V and output projections for one sample: 2*s*h*(2h + 2*kv_dim); 8sh^2 without GQA."""
    return 2.0 * s * h * (2 * h + 2 * kv_dim)


def mlp_flops(s: int, h: int, f: int, ffn_kind: FfnKind = FfnKind.GELU) -> float:
    """Forward FLOPs of the MLP for one sample: 2*s*h*f per matrix, two (gelu) or three (swiglu)."""
    return 2.0 * s * h * f * ffn_kind.matrices


def layer_attention_flops(s: int, h: int) -> float:
    """Forward FLOPs of QK^T and scores*V for one sample, 4*s^2*h whatever the K/V heads (GQA shares K and V between
    query heads, every query head still attends; Korthikanti 2022, Sec. 5: what selective recomputation redoes)."""
    return 4.0 * s * s * h


CAUSAL_ATTENTION_SHARE = 0.5
"""Share of the s x s scores a fused kernel computes under a causal mask: the blocks on and below the diagonal, "about
half" (FlashAttention-2, Dao 2023, Sec. 3.1); counted as exactly half, as the FlashAttention repository counts causal
attention FLOPs (benchmarks/benchmark_flash_attention.py: ``4 * batch * seqlen**2 * nheads * headdim // (2 if causal else
1)``)."""


def fused_attention_flops(s: int, h: int, kernel: AttentionKernel = AttentionKernel.MATH) -> float:
    """The part of a layer's forward FLOPs a fused attention kernel runs: the attention core 4*s^2*h under flash (counted
    over every score, as :func:`layer_flops` counts it); none under math, whose matmuls are priced with the GEMMs."""
    return layer_attention_flops(s, h) if kernel is AttentionKernel.FLASH else 0.0


def attention_kernel_flops(s: int, h: int, *, kernel: AttentionKernel = AttentionKernel.MATH, causal: bool = True) -> float:
    """Forward FLOPs the fused kernel executes per sample: :func:`fused_attention_flops`, times CAUSAL_ATTENTION_SHARE under
    a causal mask (2*s^2*h)."""
    return fused_attention_flops(s, h, kernel) * (CAUSAL_ATTENTION_SHARE if causal else 1.0)


def layer_flops(s: int, h: int, f: int, *, kv_dim: int | None = None, ffn_kind: FfnKind = FfnKind.GELU) -> float:
    """Forward FLOPs of one layer for one sample: projections, MLP, attention core (Narayanan 2021: 24sh^2(1 + s/6h) for
    GPT at f = 4h)."""
    kv = h if kv_dim is None else kv_dim
    return attention_gemm_flops(s, h, kv) + mlp_flops(s, h, f, ffn_kind) + layer_attention_flops(s, h)


def attention_elementwise(
    s: int, h: int, a: int, *, kv_dim: int | None = None, kernel: AttentionKernel = AttentionKernel.MATH
) -> float:
    """Output elements of the attention core's operators that do no matmul. math: Q and K scaling (s*h + s*kv_dim), K and V
    repeated to all a heads under GQA (2*s*h, Megatron-LM DotProductAttention's repeat_interleave), causal mask and softmax
    over the scores (2*a*s^2). flash: none: the fused kernel scales, repeats and computes the softmax of every score
    inside (FlashAttention-2, Dao 2023, Sec. 3.1), and its whole time is priced at the kernel's own rate
    (``calibration.attention_efficiency``, measured by ``fleet calibrate`` with the softmax in it), as profiling prices
    a fused scaled_dot_product_attention."""
    if kernel is AttentionKernel.FLASH:
        return 0.0
    kv = h if kv_dim is None else kv_dim
    repeat = 2.0 * s * h if kv < h else 0.0
    return s * h + s * kv + repeat + 2.0 * a * s * s


def rope_elementwise(s: int, h: int, kv_dim: int) -> float:
    """Rotary embedding outputs of one layer: Q and K rotated, s*h + s*kv_dim (Su 2021; a fused kernel writes each once)."""
    return float(s * h + s * kv_dim)


def mlp_elementwise(s: int, f: int, ffn_kind: FfnKind = FfnKind.GELU) -> float:
    """The MLP's activation outputs: the GeLU, s*f; swiglu: silu(gate) and its product with up, 2*s*f."""
    return float(s * f) if ffn_kind is FfnKind.GELU else 2.0 * s * f


def layer_elementwise(
    s: int,
    h: int,
    f: int,
    a: int,
    *,
    kv_dim: int | None = None,
    ffn_kind: FfnKind = FfnKind.GELU,
    kernel: AttentionKernel = AttentionKernel.MATH,
    position: PositionEmbedding = PositionEmbedding.LEARNED,
) -> float:
    """Output elements of one layer's operators that do no matmul, one sample: two norms, two residual adds and the
    attention output's re-layout (5*s*h), the attention core, rotary embeddings, the MLP activation. The GPT defaults give
    7sh + sf + 2as^2, what profiling the example GPT counts, less its mask construction."""
    kv = h if kv_dim is None else kv_dim
    rope = rope_elementwise(s, h, kv) if position is PositionEmbedding.ROPE else 0.0
    core = attention_elementwise(s, h, a, kv_dim=kv, kernel=kernel)
    return 5.0 * s * h + core + rope + mlp_elementwise(s, f, ffn_kind)


def layer_act_replicated_bytes(s: int, h: int, e: int, *, dropout: bool = True) -> float:
    """Saved bytes not split by tp: two norm inputs 2e, QKV input e, MLP input e, and with dropout two masks 1+1 (per s*h;
    Korthikanti 2022 eq. 2: 10sbh at e=2)."""
    return (4 * e + (2 if dropout else 0)) * s * h


def flash_logsumexp_bytes(s: int, a: int) -> float:
    """The fp32 logsumexp a fused attention kernel saves for backward: 4*a*s bytes per sample (FlashAttention-2 Alg. 1
    stores L = m + log(l); flash-attn's FlashAttnFunc saves q, k, v, out, softmax_lse of shape (batch, heads, seqlen) fp32)."""
    return 4.0 * a * s


def attention_act_sharded_bytes(
    s: int, h: int, e: int, *, a: int | None = None, kv_dim: int | None = None, kernel: AttentionKernel = AttentionKernel.MATH
) -> float:
    """Saved attention bytes split by tp, per sample. math: Q, K and V as the score and context matmuls read them (K and V
    repeated to all heads under GQA, Megatron-LM DotProductAttention) and the output projection's input, 4e*s*h
    (Korthikanti 2022). flash: Q e*s*h, K and V e*s*kv_dim each, the kernel output that is the projection's input e*s*h,
    and the logsumexp (flash-attn FlashAttnFunc.forward: save_for_backward(q, k, v, out, softmax_lse, rng_state))."""
    if kernel is AttentionKernel.MATH:
        return 4.0 * e * s * h
    if a is None:
        raise ValueError("attention_act_sharded_bytes: the flash kernel's logsumexp needs the head count a")
    kv = h if kv_dim is None else kv_dim
    return 2.0 * e * s * h + 2.0 * e * s * kv + flash_logsumexp_bytes(s, a)


def mlp_act_sharded_bytes(s: int, f: int, e: int, ffn_kind: FfnKind = FfnKind.GELU) -> float:
    """Saved MLP bytes split by tp, per sample. gelu: GeLU input and fc2 input, 2e*s*f (Korthikanti 2022). swiglu: gate and
    up outputs (what Megatron-LM's fused SwiGLUFunction saves) and their product, the down projection's input, 3e*s*f."""
    return (2 if ffn_kind is FfnKind.GELU else 3) * e * s * f


def layer_act_sharded_bytes(
    s: int,
    h: int,
    f: int,
    e: int,
    *,
    a: int | None = None,
    kv_dim: int | None = None,
    ffn_kind: FfnKind = FfnKind.GELU,
    kernel: AttentionKernel = AttentionKernel.MATH,
) -> float:
    """Saved bytes split by tp: attention (Q, K, V, projection input) and MLP (Korthikanti 2022: 24sbh/t at e=2, f=4h)."""
    return attention_act_sharded_bytes(s, h, e, a=a, kv_dim=kv_dim, kernel=kernel) + mlp_act_sharded_bytes(s, f, e, ffn_kind)


def layer_act_attention_bytes(
    s: int, a: int, e: int, *, dropout: bool = True, kernel: AttentionKernel = AttentionKernel.MATH
) -> float:
    """Saved attention-score bytes, what selective recomputation drops: softmax output e, with dropout its mask 1 and output e
    (per a*s^2; Korthikanti 2022: 5as^2b at e=2). A fused kernel saves none (its dropout mask is regenerated from the seed)."""
    if kernel is AttentionKernel.FLASH:
        return 0.0
    return (e + ((e + 1) if dropout else 0)) * a * s * s


def layer_recompute_flops(s: int, h: int, kernel: AttentionKernel = AttentionKernel.MATH) -> float:
    """Forward FLOPs selective recomputation redoes: the attention core under the math kernel; none under flash, which saves
    no scores to drop."""
    return layer_attention_flops(s, h) if kernel is AttentionKernel.MATH else 0.0


@dataclass(frozen=True, slots=True)
class Matmul:
    """One weight matmul of a decoder layer, [s x inputs] @ [inputs x outputs] per sample."""

    name: str
    """What it computes (qkv, q, k, v, out; fc1, fc2; gate, up, down)."""
    inputs: int
    """Its input width."""
    outputs: int
    """Its output width."""
    row_parallel: bool
    """Tensor parallelism splits its input dimension, so its output is h wide on every rank (Megatron-LM's
    RowParallelLinear: attention output and MLP down projection); else its output dimension (ColumnParallelLinear)."""


def layer_matmuls(
    h: int, f: int, *, kv_dim: int | None = None, ffn_kind: FfnKind = FfnKind.GELU, fused_qkv: bool = True
) -> tuple[Matmul, ...]:
    """The layer's weight matmuls in forward order: attention's Q/K/V (one fused h x (h + 2 kv_dim) matmul, or Q, K, V),
    its output projection, then the MLP: gelu fc1, fc2; swiglu gate, up, down (torchtitan's FeedForward
    ``self.w2(F.silu(self.w1(x)) * self.w3(x))``, Attention ``xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)`` then
    ``self.wo(output)``, torchtitan/models/llama/model.py @9dec370a). Their FLOPs, 2 s x inputs x outputs each, add up to
    :func:`attention_gemm_flops` + :func:`mlp_flops`."""
    kv = h if kv_dim is None else kv_dim
    if fused_qkv:
        qkv = (Matmul("qkv", h, h + 2 * kv, False),)
    else:
        qkv = (Matmul("q", h, h, False), Matmul("k", h, kv, False), Matmul("v", h, kv, False))
    if ffn_kind is FfnKind.GELU:
        mlp = (Matmul("fc1", h, f, False), Matmul("fc2", f, h, True))
    else:
        mlp = (Matmul("gate", h, f, False), Matmul("up", h, f, False), Matmul("down", f, h, True))
    return (*qkv, Matmul("out", h, h, True), *mlp)


def op_kept_matmuls(matmuls: tuple[Matmul, ...]) -> tuple[Matmul, ...]:
    """The matmuls whose outputs op-level recomputation keeps: the 1st, 3rd, ... in forward order (torchtitan's policy
    counts ``aten.mm`` calls per checkpointed block and saves those where the count is odd)."""
    return matmuls[0::2]


def op_recomputed_matmuls(matmuls: tuple[Matmul, ...]) -> tuple[Matmul, ...]:
    """The matmuls op-level recomputation runs again in backward: the 2nd, 4th, ... in forward order."""
    return matmuls[1::2]


def op_recompute_flops(s: int, h: int, matmuls: tuple[Matmul, ...], kernel: AttentionKernel = AttentionKernel.MATH) -> float:
    """Forward FLOPs op-level recomputation redoes per sample: the even-numbered matmuls, 2 s x inputs x outputs each, and
    under the math kernel the attention core 4 s^2 h (its batched matmuls and softmax are not in the policy's save list;
    a fused kernel's output is, so under flash it is not redone)."""
    core = layer_attention_flops(s, h) if kernel is AttentionKernel.MATH else 0.0
    return sum(2.0 * s * m.inputs * m.outputs for m in op_recomputed_matmuls(matmuls)) + core


def op_recompute_elementwise(
    layer_elementwise: float, s: int, h: int, a: int, kernel: AttentionKernel = AttentionKernel.MATH
) -> float:
    """Output elements of the memory-bound operators op-level recomputation redoes: every one of the layer's (norms,
    rotary embeddings, activations, residual adds, copies; the softmax too under math), less the fused kernel's own
    softmax under flash (:func:`attention_elementwise`), which is kept with the kernel's output."""
    if kernel is AttentionKernel.FLASH:
        return layer_elementwise - attention_elementwise(s, h, a, kernel=kernel)
    return layer_elementwise


def op_saved_replicated_bytes(s: int, e: int, matmuls: tuple[Matmul, ...]) -> float:
    """Kept bytes per sample that tp does not split: the kept row-parallel matmuls' outputs, e*s*outputs each."""
    return float(sum(e * s * m.outputs for m in op_kept_matmuls(matmuls) if m.row_parallel))


def op_saved_sharded_bytes(
    s: int, h: int, a: int, e: int, matmuls: tuple[Matmul, ...], kernel: AttentionKernel = AttentionKernel.MATH
) -> float:
    """Kept bytes per sample split by tp: the kept column-parallel matmuls' outputs, e*s*outputs each, and under flash the
    fused kernel's outputs, e*s*h and the fp32 logsumexp (:func:`flash_logsumexp_bytes`; the policy keeps every output
    of ``aten._scaled_dot_product_flash_attention``). Under math nothing of the core is kept."""
    kept = sum(e * s * m.outputs for m in op_kept_matmuls(matmuls) if not m.row_parallel)
    fused = e * s * h + flash_logsumexp_bytes(s, a) if kernel is AttentionKernel.FLASH else 0.0
    return float(kept) + fused


def layer_op_recompute(spec: "TransformerSpec") -> OpRecompute:
    """What op-level recomputation redoes and keeps in one decoder layer of ``spec``, per sample."""
    s, h, a, f, kv = spec.seq_length, spec.hidden_size, spec.num_heads, spec.ffn, spec.kv_dim
    e, kernel = spec.precision.element_bytes, spec.attention_kernel
    matmuls = layer_matmuls(h, f, kv_dim=kv, ffn_kind=spec.ffn_kind, fused_qkv=spec.fused_qkv)
    elementwise = layer_elementwise(
        s, h, f, a, kv_dim=kv, ffn_kind=spec.ffn_kind, kernel=kernel, position=spec.position_embedding
    )
    return OpRecompute(
        flops=op_recompute_flops(s, h, matmuls, kernel),
        elementwise=op_recompute_elementwise(elementwise, s, h, a, kernel),
        saved_replicated_bytes=op_saved_replicated_bytes(s, e, matmuls),
        saved_sharded_bytes=op_saved_sharded_bytes(s, h, a, e, matmuls, kernel),
    )


def embedding_elementwise(s: int, h: int, position: PositionEmbedding = PositionEmbedding.LEARNED) -> float:
    """Output elements of the embedding that do no matmul: learned, the lookups and their sum (2*s*h, as before); rope, the
    token lookup (s*h)."""
    return 2.0 * s * h if position is PositionEmbedding.LEARNED else float(s * h)


def embedding_act_bytes(s: int, h: int, *, dropout: bool = True) -> float:
    """Saved bytes of the embedding: its dropout mask, s*h bytes (Korthikanti 2022, Sec. 4.3); nothing without dropout."""
    return float(s * h) if dropout else 0.0


def _embedding_block(spec: TransformerSpec) -> BlockSpec:
    """Token embedding (and the learned position table): the first pipeline stage."""
    s, h = spec.seq_length, spec.hidden_size
    return BlockSpec(
        name="embedding",
        role=Role.PRE,
        params=spec.vocab_size * h + position_params(s, h, spec.position_embedding),
        flops=0.0,
        elementwise=embedding_elementwise(s, h, spec.position_embedding),
        act_replicated_bytes=embedding_act_bytes(s, h, dropout=spec.dropout),
        output_bytes=float(spec.precision.element_bytes * s * h),
        tp_allreduces_fwd=1,  # vocab-parallel lookup sums partial embeddings
    )


def _layer_block(spec: TransformerSpec) -> BlockSpec:
    """The num_layers identical decoder layers."""
    s, h, a, f, kv = spec.seq_length, spec.hidden_size, spec.num_heads, spec.ffn, spec.kv_dim
    e, kind, kernel = spec.precision.element_bytes, spec.ffn_kind, spec.attention_kernel
    return BlockSpec(
        name="layer",
        role=Role.LAYER,
        count=spec.num_layers,
        params=layer_params(h, f, kv_dim=kv, ffn_kind=kind, norm=spec.norm, bias=spec.bias),
        flops=layer_flops(s, h, f, kv_dim=kv, ffn_kind=kind),
        elementwise=layer_elementwise(s, h, f, a, kv_dim=kv, ffn_kind=kind, kernel=kernel, position=spec.position_embedding),
        act_replicated_bytes=layer_act_replicated_bytes(s, h, e, dropout=spec.dropout),
        act_sharded_bytes=layer_act_sharded_bytes(s, h, f, e, a=a, kv_dim=kv, ffn_kind=kind, kernel=kernel),
        act_attention_bytes=layer_act_attention_bytes(s, a, e, dropout=spec.dropout, kernel=kernel),
        recompute_flops=layer_recompute_flops(s, h, kernel),
        attention_flops=fused_attention_flops(s, h, kernel),
        attention_kernel_flops=attention_kernel_flops(s, h, kernel=kernel, causal=spec.causal),
        output_bytes=float(e * s * h),
        op_recompute=layer_op_recompute(spec),
        tp_allreduces_fwd=2,  # after attention and after the MLP (Megatron g operators)
        tp_allreduces_bwd=2,  # at their inputs (Megatron f operators)
    )


def _head_block(spec: TransformerSpec) -> BlockSpec:
    """Final norm, vocabulary projection (tied or not) and the loss: the last pipeline stage."""
    s, h, v, e = spec.seq_length, spec.hidden_size, spec.vocab_size, spec.precision.element_bytes
    return BlockSpec(
        name="head",
        role=Role.POST,
        params=v * h + norm_params(h, spec.norm),
        flops=2.0 * s * h * v,
        elementwise=s * h + 2.0 * s * v,  # final norm, log-softmax and loss over the logits
        # Korthikanti 2022 Sec. 4.3: final norm input and projection input (e*s*h each),
        # fp32 logits for the cross entropy (4*s*V), the latter vocab-parallel.
        act_replicated_bytes=float(2 * e * s * h),
        act_sharded_bytes=float(4 * s * v),
        output_bytes=float(e * s * h),
        tp_allreduces_bwd=1,  # input gradient of the vocab-parallel projection
    )


def transformer_model(spec: TransformerSpec) -> ModelSpec:
    """The ModelSpec of a decoder-only transformer: embedding (pre), num_layers layers, head (post); with tied embeddings the
    head's V x h projection is the embedding's table (``tied_params``)."""
    return ModelSpec(
        name=spec.name,
        blocks=(_embedding_block(spec), _layer_block(spec), _head_block(spec)),
        hidden_size=spec.hidden_size,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        seq_length=spec.seq_length,
        precision=spec.precision,
        global_batch_size=spec.global_batch_size,
        tied_params=spec.vocab_size * spec.hidden_size if spec.tie_embeddings else 0,
        grad_accum_dtype=spec.grad_accum_dtype,
    )


def model_presets() -> list[str]:
    """Names of the shipped model presets."""
    return sorted(p.name.removesuffix(".yaml") for p in _preset_dir("models").iterdir() if p.name.endswith(".yaml"))


def transformer_from_dict(data: Mapping[str, Any], where: str = "model") -> TransformerSpec:
    """Build a TransformerSpec from the YAML mapping; errors name the key."""
    if "precision" in data and data["precision"] not in list(Precision):
        raise SpecError(f"{where}.precision must be one of {', '.join(Precision)}, got {shown(data['precision'])}")
    for key, enum in _KINDS.items():
        if key in data:
            _kind(enum, data[key], f"{where}.{key}")
    return from_mapping(TransformerSpec, data, where)


def model_from_dict(data: Mapping[str, Any], where: str = "model") -> ModelSpec:
    """Build a ModelSpec from either YAML layout: the transformer shape, or explicit ``blocks``."""
    if "blocks" not in data:
        return transformer_model(transformer_from_dict(data, where))
    fields = [f for f in ModelSpec.__dataclass_fields__]
    check_keys(data, fields, ("name", "blocks", "hidden_size", "num_heads", "seq_length", "global_batch_size"), where)
    if not isinstance(data["blocks"], list) or not data["blocks"]:
        raise SpecError(f"{where}.blocks must be a non-empty list of blocks")
    for i, block in enumerate(data["blocks"]):
        if isinstance(block, Mapping) and "role" in block and block["role"] not in list(Role):
            raise SpecError(f"{where}.blocks[{i}].role must be one of {', '.join(Role)}, got {shown(block['role'])}")
    if "precision" in data and data["precision"] not in list(Precision):
        raise SpecError(f"{where}.precision must be one of {', '.join(Precision)}, got {shown(data['precision'])}")
    return from_mapping(ModelSpec, data, where)


def load_model(source: str | Path) -> ModelSpec:
    """Load a model from a YAML file path or a preset name (see :func:`model_presets`)."""
    path = _resolve(source, "models", model_presets)
    return model_from_dict(read_yaml(path, "model"), where=f"model file {Path(path).name!r}")


def load_transformer(source: str | Path) -> TransformerSpec:
    """Load the transformer-shape YAML (not the per-block layout) from a path or preset name."""
    path = _resolve(source, "models", model_presets)
    return transformer_from_dict(read_yaml(path, "model"), where=f"model file {Path(path).name!r}")


__all__ = [
    "AttentionKernel",
    "BlockSpec",
    "FfnKind",
    "GradAccumDtype",
    "Matmul",
    "ModelSpec",
    "NormKind",
    "OpRecompute",
    "PositionEmbedding",
    "Precision",
    "Role",
    "TouchedRows",
    "TransformerSpec",
    "load_model",
    "load_transformer",
    "model_from_dict",
    "model_presets",
    "touched_sparse",
    "transformer_model",
]
