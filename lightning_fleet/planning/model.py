"""ModelSpec: what a model costs, per block and per sample.

A ModelSpec is a sequence of blocks. Each block says, for ONE sample at the model's sequence
length: its parameters, forward FLOPs, and the bytes autograd saves for backward, split by how
tensor parallelism and recomputation treat them. Blocks with role ``pre`` live on the first
pipeline stage, ``layer`` blocks are split evenly across stages, ``post`` blocks live on the last.

Two ways to build one: :func:`transformer_model` from the decoder-only YAML (closed forms below)
and, in :mod:`lightning_fleet.profiling`, by measuring a real ``nn.Module`` on the meta device.

Pure (stdlib + yaml); imported across the planning core and by profiling.
"""

from __future__ import annotations

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
    require_non_negative,
    require_positive,
    to_mapping,
)


class Precision(StrEnum):
    """Training number format, as Lightning spells it."""

    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"
    FP32 = "fp32"

    @property
    def compute_dtype(self) -> str:
        """Key into PeakTflops for the matmuls."""
        return {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp32": "fp32"}[self.value]

    @property
    def element_bytes(self) -> int:
        """Bytes of one activation / working parameter / gradient element."""
        return 4 if self is Precision.FP32 else 2


class Role(StrEnum):
    """Where a block goes in a pipeline."""

    PRE = "pre"
    LAYER = "layer"
    POST = "post"


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
    adds, copies: memory-bound work priced by ``calibration.elementwise_s``); tensor parallelism divides them by tp."""
    act_replicated_bytes: float = 0.0
    """Saved bytes per sample that every tp rank keeps whole, unless sequence parallelism splits them."""
    act_sharded_bytes: float = 0.0
    """Saved bytes per sample that tensor parallelism splits by tp."""
    act_attention_bytes: float = 0.0
    """Saved bytes per sample of attention scores (split by tp); selective recomputation drops them."""
    recompute_flops: float = 0.0
    """Forward FLOPs per sample that selective recomputation redoes (attention core)."""
    output_bytes: float = 0.0
    """Bytes per sample of the block's output: a pipeline send, a tp all-reduce, the full-recompute checkpoint."""
    tp_allreduces_fwd: int = 0
    """Tensor-parallel all-reduces of ``output_bytes`` in the forward pass."""
    tp_allreduces_bwd: int = 0
    """Tensor-parallel all-reduces of ``output_bytes`` in the backward pass."""
    trainable_params: int | None = None
    """Parameters of one block that train (``requires_grad``); None: all of them. Gradients, optimizer states and
    their communication scale with these, the working weights with ``params``."""

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
            output_bytes=self.output_bytes,
            tp_allreduces_fwd=self.tp_allreduces_fwd,
            tp_allreduces_bwd=self.tp_allreduces_bwd,
        )
        object.__setattr__(self, "role", Role(self.role))

    @property
    def act_bytes(self) -> float:
        """All saved bytes per sample without parallelism or recomputation."""
        return self.act_replicated_bytes + self.act_sharded_bytes + self.act_attention_bytes

    @property
    def trainable(self) -> int:
        """Parameters of one block that train."""
        return self.params if self.trainable_params is None else self.trainable_params


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
    tied_params: int = 0
    """Parameters shared by the first pre block and the last post block (tied embeddings): stored once when both sit on one stage."""
    forward_ops: int = 0
    """Operators one forward pass of a micro-batch dispatches (measured by profiling; 0 when unknown)."""
    param_tensors: int = 0
    """Parameter tensors of the whole model (ZeRO's per-parameter hooks cost time per tensor; 0 when unknown)."""
    tied_trainable_params: int | None = None
    """How many of ``tied_params`` train; None: all of them."""

    def __post_init__(self) -> None:
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
        object.__setattr__(self, "precision", Precision(self.precision))
        if self.num_layers == 0:
            raise SpecError(f"model {self.name!r} has no block with role 'layer'; pipeline stages need layers")
        roles = [b.role for b in self.blocks]
        order = sorted(roles, key=[Role.PRE, Role.LAYER, Role.POST].index)
        if roles != order:
            raise SpecError(f"model {self.name!r}: blocks must be ordered pre..., layer..., post...; got {', '.join(roles)}")

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

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping in the per-block YAML layout (unset trainable counts left out: all parameters train)."""
        out = to_mapping(self)
        if self.tied_trainable_params is None:
            del out["tied_trainable_params"]
        for block in out["blocks"]:
            if block["trainable_params"] is None:
                del block["trainable_params"]
        return out

    def to_yaml(self) -> str:
        """YAML text that :func:`load_model` reads back to an equal spec."""
        return dump_yaml(self.to_dict())


@dataclass(frozen=True, slots=True, kw_only=True)
class TransformerSpec:
    """The decoder-only transformer YAML: the shape of a GPT-style model and its batch."""

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
    precision: Precision = Precision.BF16_MIXED
    """bf16-mixed | fp16-mixed | fp32."""
    global_batch_size: int
    """Samples per optimizer step."""

    def __post_init__(self) -> None:
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
            raise SpecError(f"model.precision must be one of {', '.join(Precision)}, got {self.precision!r}") from None
        if self.hidden_size % self.num_heads:
            raise SpecError(f"model.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")

    @property
    def ffn(self) -> int:
        """MLP inner size f."""
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        """Plain mapping in the transformer YAML layout (unset ffn_hidden_size left out)."""
        out = to_mapping(self)
        if self.ffn_hidden_size is None:
            del out["ffn_hidden_size"]
        return out

    def to_yaml(self) -> str:
        """YAML text that :func:`load_transformer` reads back to an equal spec."""
        return dump_yaml(self.to_dict())


# --- closed forms of a GPT layer (Narayanan et al. 2021; Korthikanti et al. 2022, Sec. 4) ---------


def layer_params(h: int, f: int) -> int:
    """Parameters of one layer: QKV 3h^2+3h, proj h^2+h, fc1 hf+f, fc2 fh+h, two LayerNorms 4h (Megatron-LM, Narayanan 2021 eq. for P)."""
    return 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h


def layer_flops(s: int, h: int, f: int) -> float:
    """Forward FLOPs of one layer for one sample: 2*s*(4h^2 + 2hf) GEMMs + 4*s^2*h attention (Narayanan 2021: 24sh^2(1+s/6h) for f=4h)."""
    return 2.0 * s * (4 * h * h + 2 * h * f) + 4.0 * s * s * h


def layer_elementwise(s: int, h: int, f: int, a: int) -> float:
    """Output elements of one layer's operators that do no matmul, one sample: two LayerNorms, two residual adds, the
    attention output's re-layout, the Q and K scaling (s*h each), the activation (s*f), the causal mask and softmax over
    the scores (2*a*s^2) -- what profiling the example GPT counts, less its mask construction."""
    return 7.0 * s * h + s * f + 2.0 * a * s * s


def layer_attention_flops(s: int, h: int) -> float:
    """Forward FLOPs of QK^T and scores*V for one sample, what selective recompute redoes (Korthikanti 2022, Sec. 5)."""
    return 4.0 * s * s * h


def layer_act_replicated_bytes(s: int, h: int, e: int) -> float:
    """Saved bytes not split by tp: two LayerNorm inputs 2e, QKV input e, MLP input e, two dropout masks 1+1 (per s*h; Korthikanti 2022 eq. 2: 10sbh at e=2)."""
    return (4 * e + 2) * s * h


def layer_act_sharded_bytes(s: int, h: int, f: int, e: int) -> float:
    """Saved bytes split by tp: Q,K 2e, V e, proj input e (per s*h), fc2 input and GeLU input 2e (per s*f) (Korthikanti 2022: 24sbh/t at e=2, f=4h)."""
    return 4 * e * s * h + 2 * e * s * f


def layer_act_attention_bytes(s: int, a: int, e: int) -> float:
    """Saved attention-score bytes: softmax output e, dropout mask 1, dropout output e (per a*s^2; Korthikanti 2022: 5as^2b at e=2)."""
    return (2 * e + 1) * a * s * s


def transformer_model(spec: TransformerSpec) -> ModelSpec:
    """The ModelSpec of a GPT-style decoder: embedding (pre), num_layers layers, head (post), tied embeddings."""
    s, h, a, v, f = spec.seq_length, spec.hidden_size, spec.num_heads, spec.vocab_size, spec.ffn
    e = spec.precision.element_bytes
    embedding = BlockSpec(
        name="embedding",
        role=Role.PRE,
        params=v * h + s * h,
        flops=0.0,
        elementwise=2.0 * s * h,  # token + position lookups and their sum
        # Korthikanti 2022 Sec. 4.3: the embedding dropout mask, s*h bytes.
        act_replicated_bytes=float(s * h),
        output_bytes=float(e * s * h),
        tp_allreduces_fwd=1,  # vocab-parallel lookup sums partial embeddings
    )
    layer = BlockSpec(
        name="layer",
        role=Role.LAYER,
        count=spec.num_layers,
        params=layer_params(h, f),
        flops=layer_flops(s, h, f),
        elementwise=layer_elementwise(s, h, f, a),
        act_replicated_bytes=layer_act_replicated_bytes(s, h, e),
        act_sharded_bytes=layer_act_sharded_bytes(s, h, f, e),
        act_attention_bytes=layer_act_attention_bytes(s, a, e),
        recompute_flops=layer_attention_flops(s, h),
        output_bytes=float(e * s * h),
        tp_allreduces_fwd=2,  # after attention and after the MLP (Megatron g operators)
        tp_allreduces_bwd=2,  # at their inputs (Megatron f operators)
    )
    head = BlockSpec(
        name="head",
        role=Role.POST,
        params=v * h + 2 * h,
        flops=2.0 * s * h * v,
        elementwise=s * h + 2.0 * s * v,  # final LayerNorm, log-softmax and loss over the logits
        # Korthikanti 2022 Sec. 4.3: final LayerNorm input and projection input (e*s*h each),
        # fp32 logits for the cross entropy (4*s*V), the latter vocab-parallel.
        act_replicated_bytes=float(2 * e * s * h),
        act_sharded_bytes=float(4 * s * v),
        output_bytes=float(e * s * h),
        tp_allreduces_bwd=1,  # input gradient of the vocab-parallel projection
    )
    return ModelSpec(
        name=spec.name,
        blocks=(embedding, layer, head),
        hidden_size=h,
        num_heads=a,
        seq_length=s,
        precision=spec.precision,
        global_batch_size=spec.global_batch_size,
        tied_params=v * h,
    )


def model_presets() -> list[str]:
    """Names of the shipped model presets."""
    return sorted(p.name.removesuffix(".yaml") for p in _preset_dir("models").iterdir() if p.name.endswith(".yaml"))


def transformer_from_dict(data: Mapping[str, Any], where: str = "model") -> TransformerSpec:
    """Build a TransformerSpec from the YAML mapping; errors name the key."""
    if "precision" in data and data["precision"] not in list(Precision):
        raise SpecError(f"{where}.precision must be one of {', '.join(Precision)}, got {data['precision']!r}")
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
            raise SpecError(f"{where}.blocks[{i}].role must be one of {', '.join(Role)}, got {block['role']!r}")
    if "precision" in data and data["precision"] not in list(Precision):
        raise SpecError(f"{where}.precision must be one of {', '.join(Precision)}, got {data['precision']!r}")
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
    "BlockSpec",
    "ModelSpec",
    "Precision",
    "Role",
    "TransformerSpec",
    "load_model",
    "load_transformer",
    "model_from_dict",
    "model_presets",
    "transformer_model",
]
