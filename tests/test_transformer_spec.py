"""The transformer spec for GPT- and Llama-class models: each closed-form term against a hand-computed number, published
parameter totals, each feature changing exactly its terms, the GPT defaults unchanged, YAML round trips and one-line errors."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from lightning_fleet.planning import SpecError, load_model, load_transformer, model_presets
from lightning_fleet.planning.model import (
    AttentionKernel,
    FfnKind,
    ModelSpec,
    NormKind,
    PositionEmbedding,
    TransformerSpec,
    attention_act_sharded_bytes,
    attention_elementwise,
    attention_gemm_flops,
    attention_params,
    embedding_act_bytes,
    embedding_elementwise,
    flash_logsumexp_bytes,
    layer_act_attention_bytes,
    layer_act_replicated_bytes,
    layer_act_sharded_bytes,
    layer_attention_flops,
    layer_elementwise,
    layer_flops,
    layer_params,
    layer_recompute_flops,
    mlp_act_sharded_bytes,
    mlp_elementwise,
    mlp_flops,
    mlp_params,
    norm_params,
    position_params,
    rope_elementwise,
    transformer_from_dict,
    transformer_model,
)

pytestmark = pytest.mark.pure

FLASH, MATH = AttentionKernel.FLASH, AttentionKernel.MATH
SWIGLU, GELU = FfnKind.SWIGLU, FfnKind.GELU
ROPE, LEARNED = PositionEmbedding.ROPE, PositionEmbedding.LEARNED

# The tiny shape every term is checked on: s 16, h 64, a 4 heads of 16, kv 2 heads (kv_dim 32), f 96, e 2 bytes.
S, H, A, KV, F, E = 16, 64, 4, 32, 96, 2


# --- published totals ------------------------------------------------------------------------------------------------


def test_llama_2_7b_by_hand() -> None:
    """Llama-2-7B (Touvron et al. 2023; meta-llama/Llama-2-7b-hf config: 32 layers, h 4096, 32 heads, f 11008, V 32000,
    untied, rope, rmsnorm, no bias) has 6,738,415,616 parameters: keras-team/keras-hub
    keras_hub/src/models/llama/llama_presets.py, "llama2_7b_en": "params": 6738415616 (Hugging Face's safetensors.total,
    6,738,417,664, adds the 32 x 64 rotary inv_freq buffers that checkpoint stores)."""
    h, f, v = 4096, 11008, 32000
    attention = 4 * h * h  # q, k, v, o: 67,108,864
    mlp = 3 * h * f  # gate, up, down: 135,266,304
    norms = 2 * h  # two RMSNorm weights
    assert layer_params(h, f, ffn_kind=SWIGLU, norm=NormKind.RMSNORM, bias=False) == attention + mlp + norms == 202_383_360
    total = 32 * 202_383_360 + v * h + (v * h + h)  # layers, embedding, untied output + final norm
    assert total == 6_738_415_616
    spec = TransformerSpec(
        name="llama-2-7b", num_layers=32, hidden_size=h, num_heads=32, seq_length=4096, vocab_size=v, ffn_hidden_size=f,
        ffn_kind="swiglu", tie_embeddings=False, position_embedding="rope", norm="rmsnorm", bias=False, global_batch_size=1,
    )  # fmt: skip
    assert transformer_model(spec).params == total


PUBLISHED = [
    # preset, parameters, source
    ("llama-2-7b", 6_738_415_616, "keras-hub llama2_7b_en preset 'params': 6738415616"),
    ("llama-2-70b", 68_976_648_192, "HF safetensors.total of meta-llama/Llama-2-70b-hf, 68,976,653,312, less 80 x 64 inv_freq"),
    ("llama-3-8b", 8_030_261_248, "HF API safetensors.total of meta-llama/Llama-3.1-8B (index total_size 16,060,522,496 B)"),
    ("llama-3-70b", 70_553_706_496, "HF API safetensors.total of meta-llama/Llama-3.1-70B"),
    ("llama-3.1-405b", 405_853_388_800, "HF API safetensors.total of meta-llama/Llama-3.1-405B"),
    ("tinyllama-1.1b", 1_100_048_384, "HF safetensors {'F32': 1100048384} of TinyLlama-1.1B-intermediate-step-1431k-3T"),
]


@pytest.mark.parametrize("preset,params,source", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_presets_match_published_parameter_totals(preset: str, params: int, source: str) -> None:
    """Each Llama-class preset (shapes: Llama 3 paper Table 3, Llama 2 paper + HF configs, TinyLlama README) gives the
    published total exactly; the source of each total is quoted in PUBLISHED."""
    assert load_model(preset).params == params, source


def test_llama_3_8b_by_hand() -> None:
    """Llama 3 8B (Llama 3 paper Table 3: 32 layers, h 4096, 32 heads, 8 KV heads, f 14336; V 128256, untied): 8,030,261,248."""
    h, kv_dim, f, v = 4096, 8 * 128, 14336, 128256
    layer = 2 * h * h + 2 * h * kv_dim + 3 * h * f + 2 * h  # 33,554,432 + 8,388,608 + 176,160,768 + 8,192
    assert layer == 218_112_000
    assert 32 * layer + 2 * v * h + h == 8_030_261_248 == load_model("llama-3-8b").params


# --- each term on the tiny shape ----------------------------------------------------------------------------------


def test_parameter_terms_by_hand() -> None:
    """Q, O h x h and K, V h x kv_dim (+ biases h, kv, kv, h); 2 or 3 MLP matrices (+ biases); norms; position table."""
    assert attention_params(H, KV) == 2 * 4096 + 2 * 2048 + 192 == 12480
    assert attention_params(H, KV, bias=False) == 12288
    assert mlp_params(H, F) == 2 * 6144 + 96 + 64 == 12448
    assert mlp_params(H, F, ffn_kind=SWIGLU) == 3 * 6144 + 2 * 96 + 64 == 18688
    assert mlp_params(H, F, ffn_kind=SWIGLU, bias=False) == 18432
    assert (norm_params(H), norm_params(H, NormKind.RMSNORM)) == (128, 64)
    assert (position_params(S, H), position_params(S, H, ROPE)) == (1024, 0)
    assert layer_params(H, F, kv_dim=KV, ffn_kind=SWIGLU, norm=NormKind.RMSNORM, bias=False) == 12288 + 18432 + 128 == 30848
    assert layer_params(H, F) == 4 * H * H + 4 * H + 2 * H * F + F + H + 4 * H == 29344  # the GPT closed form (Megatron-LM)


def test_flop_terms_by_hand() -> None:
    """2 FLOPs per multiply-add: projections 2*s*h*(2h + 2kv_dim), MLP 2*s*h*f per matrix, attention core 4*s^2*h."""
    assert attention_gemm_flops(S, H, KV) == 2 * 16 * 64 * (128 + 64) == 393216
    assert attention_gemm_flops(S, H, H) == 8 * 16 * 64 * 64 == 524288
    assert (mlp_flops(S, H, F), mlp_flops(S, H, F, SWIGLU)) == (393216, 589824)
    assert layer_attention_flops(S, H) == 4 * 256 * 64 == 65536
    assert layer_flops(S, H, F, kv_dim=KV, ffn_kind=SWIGLU) == 393216 + 589824 + 65536 == 1048576
    assert (layer_recompute_flops(S, H, MATH), layer_recompute_flops(S, H, FLASH)) == (65536, 0)


def test_elementwise_terms_by_hand() -> None:
    """math attention: Q and K scaling, the K/V repeat under GQA, mask and softmax over a*s^2; flash: none (the kernel
    scales, repeats and computes its softmax inside, priced at its own rate); rope on Q and K."""
    assert attention_elementwise(S, H, A, kv_dim=KV) == 1024 + 512 + 2048 + 2 * 4 * 256 == 5632
    assert attention_elementwise(S, H, A) == 1024 + 1024 + 2048 == 4096
    assert attention_elementwise(S, H, A, kv_dim=KV, kernel=FLASH) == 0
    assert rope_elementwise(S, H, KV) == 1024 + 512
    assert (mlp_elementwise(S, F), mlp_elementwise(S, F, SWIGLU)) == (1536, 3072)
    assert layer_elementwise(S, H, F, A, kv_dim=KV, ffn_kind=SWIGLU, kernel=FLASH, position=ROPE) == 5 * 1024 + 1536 + 3072
    assert (embedding_elementwise(S, H), embedding_elementwise(S, H, ROPE)) == (2048, 1024)


def test_activation_terms_by_hand() -> None:
    """Saved bytes per sample: dropout masks, GQA's smaller K/V under flash, flash's fp32 logsumexp, swiglu's three s x f."""
    assert (layer_act_replicated_bytes(S, H, E), layer_act_replicated_bytes(S, H, E, dropout=False)) == (10240, 8192)
    assert flash_logsumexp_bytes(S, A) == 4 * 4 * 16 == 256
    assert attention_act_sharded_bytes(S, H, E, a=A, kv_dim=KV, kernel=FLASH) == 2 * 2 * 1024 + 2 * 2 * 512 + 256 == 6400
    assert attention_act_sharded_bytes(S, H, E, a=A, kv_dim=KV) == 4 * 2 * 1024  # math: K, V repeated to all heads
    assert (mlp_act_sharded_bytes(S, F, E), mlp_act_sharded_bytes(S, F, E, SWIGLU)) == (2 * 2 * 1536, 3 * 2 * 1536)
    assert layer_act_sharded_bytes(S, H, F, E, a=A, kv_dim=KV, ffn_kind=SWIGLU, kernel=FLASH) == 6400 + 9216
    assert layer_act_attention_bytes(S, A, E) == 5 * 4 * 256 == 5120
    assert layer_act_attention_bytes(S, A, E, dropout=False) == 2 * 4 * 256
    assert layer_act_attention_bytes(S, A, E, kernel=FLASH) == 0
    assert (embedding_act_bytes(S, H), embedding_act_bytes(S, H, dropout=False)) == (1024, 0)
    with pytest.raises(ValueError, match="needs the head count"):
        attention_act_sharded_bytes(S, H, E, kernel=FLASH)


# --- each feature changes exactly its terms --------------------------------------------------------------------------


def _spec(**features: object) -> TransformerSpec:
    shape = dict(num_layers=3, hidden_size=H, num_heads=A, seq_length=S, vocab_size=100, ffn_hidden_size=F)
    return TransformerSpec(name="t", global_batch_size=4, **shape, **features)


def _changed(before: ModelSpec, after: ModelSpec) -> set[str]:
    """Names of the block fields (``block.field``) and model fields that differ."""
    pairs = zip(before.blocks, after.blocks)
    out = {f"{b.name}.{field}" for b, c in pairs for field in b.__dataclass_fields__ if getattr(b, field) != getattr(c, field)}
    model_fields = ("tied_params", "num_heads", "hidden_size", "seq_length", "precision")
    return out | {field for field in model_fields if getattr(before, field) != getattr(after, field)}


FLASH_TERMS = {"layer.elementwise", "layer.act_sharded_bytes", "layer.act_attention_bytes", "layer.recompute_flops",
               "layer.attention_flops", "layer.attention_kernel_flops", "layer.op_recompute"}
OP = "layer.op_recompute"  # what recompute=op redoes and keeps (tests/test_op_recompute.py has its numbers)
FEATURES = [
    # feature switched on, the features already on, the terms that must move
    ({"num_kv_heads": 2}, {}, {"layer.params", "layer.flops", "layer.elementwise", OP}),
    ({"num_kv_heads": 2}, {"attention_kernel": "flash"}, {"layer.params", "layer.flops", "layer.act_sharded_bytes", OP}),
    ({"ffn_kind": "swiglu"}, {}, {"layer.params", "layer.flops", "layer.elementwise", "layer.act_sharded_bytes", OP}),
    ({"attention_kernel": "flash"}, {}, FLASH_TERMS),
    ({"tie_embeddings": False}, {}, {"tied_params"}),
    ({"position_embedding": "rope"}, {}, {"embedding.params", "embedding.elementwise", "layer.elementwise", OP}),
    ({"norm": "rmsnorm"}, {}, {"layer.params", "head.params"}),
    ({"bias": False}, {}, {"layer.params"}),
    ({"dropout": False}, {}, {"embedding.act_replicated_bytes", "layer.act_replicated_bytes", "layer.act_attention_bytes"}),
]


@pytest.mark.parametrize("feature,base,terms", FEATURES, ids=[",".join(f) for f, _, _ in FEATURES])
def test_each_feature_changes_exactly_its_terms(feature: dict, base: dict, terms: set[str]) -> None:
    """Switching one feature on (from the GPT defaults, or from ``base``) moves exactly the listed terms."""
    assert _changed(transformer_model(_spec(**base)), transformer_model(_spec(**base, **feature))) == terms


def test_feature_deltas_by_hand() -> None:
    """The size of each change on the tiny shape (3 layers, V 100)."""
    gpt = transformer_model(_spec())
    untied = transformer_model(_spec(tie_embeddings=False))
    assert untied.params - gpt.params == 100 * H  # the output matrix is no longer the embedding's
    rope = transformer_model(_spec(position_embedding="rope"))
    assert gpt.params - rope.params == S * H  # no position table
    assert rope.blocks[1].elementwise - gpt.blocks[1].elementwise == S * H + S * H  # rotary on Q and K (kv = a)
    rms = transformer_model(_spec(norm="rmsnorm"))
    assert gpt.params - rms.params == 3 * 2 * H + H  # two norm biases per layer and the final norm's
    nobias = transformer_model(_spec(bias=False))
    assert gpt.params - nobias.params == 3 * (4 * H + F + H)  # q, k, v, o biases, fc1 and fc2 biases
    flash = transformer_model(_spec(attention_kernel="flash")).blocks[1]
    # kv = a: Q, K, V and the output as before, plus the logsumexp
    assert flash.act_sharded_bytes - gpt.blocks[1].act_sharded_bytes == flash_logsumexp_bytes(S, A)
    assert (flash.act_attention_bytes, flash.recompute_flops) == (0, 0)
    gqa = transformer_model(_spec(num_kv_heads=2)).blocks[1]
    assert gpt.blocks[1].params - gqa.params == 2 * (H * H - H * KV) + 2 * (H - KV)  # K and V shrink to h x kv_dim
    assert gpt.blocks[1].flops - gqa.flops == 2 * S * H * 2 * (H - KV)


# --- the GPT defaults are today's model --------------------------------------------------------------------------


# Per block (embedding, layer, head), then tied_params, as transformer_model computed them at commit bf22526, before the
# new keys existed (computed by that code, not by hand).
BLOCK_FIELDS = ("count", "params", "flops", "elementwise", "act_replicated_bytes", "act_sharded_bytes", "act_attention_bytes",
                "recompute_flops", "output_bytes", "tp_allreduces_fwd", "tp_allreduces_bwd")  # fmt: skip
GPT_BEFORE = {
    "gpt-tiny": (
        dict(num_layers=4, hidden_size=128, num_heads=4, seq_length=128, vocab_size=256, precision="fp32"),
        (1, 49152, 0, 32768, 16384, 0, 0, 0, 65536, 1, 0),
        (4, 198272, 58720256, 311296, 294912, 786432, 589824, 8388608, 65536, 2, 2),
        (1, 33024, 8388608, 81920, 131072, 131072, 0, 0, 65536, 0, 1),
        32768,
    ),
    "gpt3-175b": (
        dict(num_layers=96, hidden_size=12288, num_heads=96, seq_length=2048, vocab_size=51200, ffn_hidden_size=49152),
        (1, 654311424, 0, 50331648, 25165824, 0, 0, 0, 50331648, 1, 0),
        (96, 1812099072, 7627861917696, 1082130432, 251658240, 603979776, 2013265920, 206158430208, 50331648, 2, 2),
        (1, 629170176, 2576980377600, 234881024, 100663296, 419430400, 0, 0, 50331648, 0, 1),
        629145600,
    ),
    "t3x96": (
        dict(num_layers=3, hidden_size=96, num_heads=6, seq_length=32, vocab_size=50, ffn_hidden_size=200, precision="fp32"),
        (1, 7872, 0, 6144, 3072, 0, 0, 0, 12288, 1, 0),
        (3, 76328, 5210112, 40192, 55296, 100352, 55296, 393216, 12288, 2, 2),
        (1, 4992, 307200, 6272, 24576, 6400, 0, 0, 12288, 0, 1),
        4800,
    ),
    "t1x8": (
        dict(num_layers=1, hidden_size=8, num_heads=2, seq_length=4, vocab_size=10, ffn_hidden_size=12, precision="fp16-mixed"),
        (1, 112, 0, 64, 32, 0, 0, 0, 64, 1, 0),
        (1, 532, 4096, 336, 320, 448, 160, 512, 64, 2, 2),
        (1, 96, 640, 112, 128, 160, 0, 0, 64, 0, 1),
        80,
    ),
}


@pytest.mark.parametrize("name", sorted(GPT_BEFORE))
def test_gpt_defaults_give_todays_model(name: str) -> None:
    """A spec without the new keys gives exactly the ModelSpec the code gave before they existed."""
    shape, *blocks, tied = GPT_BEFORE[name]
    model = transformer_model(TransformerSpec(name=name, global_batch_size=8, **shape))
    assert [tuple(getattr(b, f) for f in BLOCK_FIELDS) for b in model.blocks] == blocks
    assert [b.role for b in model.blocks] == ["pre", "layer", "post"] and model.tied_params == tied
    sizes = (model.hidden_size, model.num_heads, model.seq_length)
    assert sizes == (shape["hidden_size"], shape["num_heads"], shape["seq_length"])


# --- YAML ----------------------------------------------------------------------------------------------------------


LLAMA_YAML = """\
name: tiny-llama
num_layers: 2
hidden_size: 64
num_heads: 4
num_kv_heads: 2
seq_length: 16
vocab_size: 100
ffn_hidden_size: 96
ffn_kind: swiglu
tie_embeddings: false
position_embedding: rope
norm: rmsnorm
bias: false
dropout: false
attention_kernel: flash
precision: bf16-mixed
global_batch_size: 4
"""


def _write(tmp_path, text: str, name: str = "model.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_new_keys_round_trip(tmp_path) -> None:
    """load -> dump -> load is identity with every new key set; the kinds come back as their enums."""
    spec = load_transformer(_write(tmp_path, LLAMA_YAML))
    assert (spec.ffn_kind, spec.norm, spec.position_embedding, spec.attention_kernel) == (SWIGLU, NormKind.RMSNORM, ROPE, FLASH)
    assert (spec.kv_heads, spec.kv_dim, spec.tie_embeddings, spec.bias, spec.dropout) == (2, 32, False, False, False)
    assert yaml.safe_load(spec.to_yaml()) == yaml.safe_load(LLAMA_YAML)
    assert load_transformer(_write(tmp_path, spec.to_yaml(), "again.yaml")) == spec
    model = load_model(_write(tmp_path, LLAMA_YAML, "blocks.yaml"))
    assert load_model(_write(tmp_path, model.to_yaml(), "blocks-again.yaml")) == model


def test_gpt_dump_has_no_new_keys() -> None:
    """A GPT spec dumps exactly the keys it had before (the new keys at their defaults are left out)."""
    text = load_transformer("gpt3-175b").to_yaml()
    shape = {"name", "num_layers", "hidden_size", "num_heads", "seq_length", "vocab_size", "ffn_hidden_size"}
    assert set(yaml.safe_load(text)) == shape | {"precision", "global_batch_size"}


@pytest.mark.parametrize("name", ["llama-2-7b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-405b", "tinyllama-1.1b"])
def test_llama_presets_ship_and_round_trip(name: str) -> None:
    """The Llama-class presets are listed and dump back to themselves."""
    assert name in model_presets()
    spec = load_transformer(name)
    assert (spec.ffn_kind, spec.tie_embeddings, spec.dropout, spec.attention_kernel) == (SWIGLU, False, False, FLASH)
    assert transformer_from_dict(yaml.safe_load(spec.to_yaml())) == spec


BAD = [
    ("ffn_kind: swiglu", "ffn_kind: relu", "ffn_kind must be one of gelu, swiglu, got 'relu'"),
    ("norm: rmsnorm", "norm: batchnorm", "norm must be one of layernorm, rmsnorm, got 'batchnorm'"),
    ("position_embedding: rope", "position_embedding: alibi", "position_embedding must be one of learned, rope, got 'alibi'"),
    ("attention_kernel: flash", "attention_kernel: sdpa", "attention_kernel must be one of math, flash, got 'sdpa'"),
    ("num_kv_heads: 2", "num_kv_heads: 3", "num_kv_heads (3) must divide num_heads (4)"),
    ("num_kv_heads: 2", "num_kv_heads: 0", "num_kv_heads must be > 0, got 0"),
    ("tie_embeddings: false", "tie_embeddings: no-thanks", "tie_embeddings must be true or false"),
    ("dropout: false", "dropout: 0", "dropout must be true or false, got 0"),
    ("bias: false", "biases: false", "unknown key 'biases'"),
]


@pytest.mark.parametrize("old,new,message", BAD, ids=[b[1] for b in BAD])
def test_bad_values_are_one_line_errors(tmp_path, old: str, new: str, message: str) -> None:
    """Each bad value of a new key is one SpecError line naming the key (and the allowed values)."""
    assert old in LLAMA_YAML
    with pytest.raises(SpecError) as err:
        load_model(_write(tmp_path, LLAMA_YAML.replace(old, new, 1)))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_kind_in_python_is_a_spec_error() -> None:
    """Built in Python, a bad kind is the same one-line SpecError."""
    with pytest.raises(SpecError, match=r"^model\.attention_kernel must be one of math, flash, got 'fused'$"):
        _spec(attention_kernel="fused")


# --- grouped-query attention bounds tensor parallelism ----------------------------------------------


def test_tp_must_divide_the_key_value_heads():
    """Llama-3 70B has 64 heads but 8 key/value heads: tp=16 splits the heads but not the K/V groups (Megatron-LM requires
    num_query_groups % tp == 0), so the planner never proposes it and a fixed tp=16 is refused naming the rule."""
    from lightning_fleet.planning import Constraints, PlanError, estimate, narrow, parse_partial_plan, parse_plan, plan
    from tests.conftest import make_cluster

    model = load_model("llama-3-70b")
    assert (model.num_heads, model.num_kv_heads, model.kv_heads) == (64, 8, 8)
    cluster = make_cluster(nodes=4, devices_per_node=8)
    result = plan(model, cluster, top=50, exhaustive=True)
    assert result.plans and all(e.plan.tp <= 8 for e in result.plans)
    with pytest.raises(PlanError, match=r"tp\(16\) does not divide num_kv_heads\(8\)"):
        estimate(model, cluster, parse_plan("dp=2,tp=16,pp=1,zero=1,mbs=1", global_batch_size=model.global_batch_size))
    with pytest.raises(Exception, match=r"tp must divide num_kv_heads \(8\) and so num_heads \(64\)"):
        plan(model, cluster, constraints=narrow(Constraints(), parse_partial_plan("tp=16")))
    gpt = load_model("gpt-1.7b")
    assert gpt.num_kv_heads is None and gpt.kv_heads == gpt.num_heads


def test_num_kv_heads_round_trips_in_the_per_block_layout_and_is_validated():
    from lightning_fleet.planning import model_from_dict

    model = load_model("llama-3-8b")
    again = model_from_dict(yaml.safe_load(model.to_yaml()))
    assert again == model and again.num_kv_heads == 8
    assert "num_kv_heads" not in load_model("gpt-1.7b").to_yaml()
    with pytest.raises(SpecError, match=r"model.num_kv_heads \(5\) must divide num_heads \(32\)"):
        model_from_dict({**yaml.safe_load(model.to_yaml()), "num_kv_heads": 5})
