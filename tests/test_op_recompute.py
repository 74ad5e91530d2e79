"""Op-level selective recomputation (``recompute=op``, torchtitan's ``selective_ac_option = 'op'``): what it keeps and
redoes in a Llama-style and a GPT-style layer by hand, the stage memory and time terms it moves, the plan text, which
runtime runs it, the search's exactness with it, and that it changes nothing for the other modes.

Pure tier: nothing started, no torch.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from tests.conftest import make_cluster, make_model
from tests.test_search import brute_force, check_against_brute_force
from lightning_fleet.cli import main
from lightning_fleet.planning import (
    Constraints,
    ModelSpec,
    PartialPlan,
    PlanError,
    Recompute,
    SpecError,
    TransformerSpec,
    estimate,
    parse_partial_plan,
    parse_plan,
    plan,
    transformer_model,
)
from lightning_fleet.planning.cluster import LinkSpec
from lightning_fleet.planning.estimate import hardware_flops_per_sample
from lightning_fleet.planning.memory import activation_bytes_per_sample, activations_bytes, recompute_transient_bytes
from lightning_fleet.planning.model import (
    BlockSpec,
    OpRecompute,
    attention_gemm_flops,
    layer_matmuls,
    load_transformer,
    mlp_flops,
    model_from_dict,
    op_kept_matmuls,
    op_recomputed_matmuls,
)
from lightning_fleet.planning.stages import stage_loads
from lightning_fleet.planning.time import recompute_s, tp_comm_s
from lightning_fleet.runtime.base import ANY, ModuleHooks
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED

pytestmark = pytest.mark.pure

OP = Recompute.OP
S, H, A, KV_HEADS, F_LLAMA, V = 8, 32, 4, 2, 64, 50  # head size 8, so K and V are 2 x 8 = 16 wide
KV = 16


def llama(**changes: object) -> TransformerSpec:
    """A tiny Llama: GQA, SwiGLU, rope, RMSNorm, no bias, no dropout, flash, separate wq/wk/wv (torchtitan's Attention)."""
    fields = dict(name="llama-tiny", num_layers=2, hidden_size=H, num_heads=A, num_kv_heads=KV_HEADS, seq_length=S,
                  vocab_size=V, ffn_hidden_size=F_LLAMA, ffn_kind="swiglu", tie_embeddings=False, position_embedding="rope",
                  norm="rmsnorm", bias=False, dropout=False, attention_kernel="flash", fused_qkv=False, global_batch_size=4)
    return TransformerSpec(**{**fields, **changes})  # type: ignore[arg-type]


def gpt(**changes: object) -> TransformerSpec:
    """A tiny GPT with the defaults: fused c_attn, GeLU MLP (f = 4h = 128), math attention, dropout."""
    fields = dict(name="gpt-tiny-op", num_layers=2, hidden_size=H, num_heads=A, seq_length=S, vocab_size=V, global_batch_size=4)
    return TransformerSpec(**{**fields, **changes})  # type: ignore[arg-type]


def layer(spec: TransformerSpec) -> BlockSpec:
    return next(b for b in transformer_model(spec).blocks if b.name == "layer")


# --- the matmul order and what the policy keeps ------------------------------------------------------------------------


def test_matmul_order_of_each_style() -> None:
    """torchtitan's Llama: wq, wk, wv, wo, w1, w3, w2 (keeps wq, wv, w1, w2); GPT: c_attn, c_proj, fc1, fc2 (keeps c_attn,
    fc1); their FLOPs add up to the layer's projection and MLP FLOPs."""
    separate = layer_matmuls(H, F_LLAMA, kv_dim=KV, ffn_kind=llama().ffn_kind, fused_qkv=False)
    assert [m.name for m in separate] == ["q", "k", "v", "out", "gate", "up", "down"]
    assert [m.name for m in op_kept_matmuls(separate)] == ["q", "v", "gate", "down"]
    assert [m.name for m in op_recomputed_matmuls(separate)] == ["k", "out", "up"]
    fused = layer_matmuls(H, 4 * H)
    assert [(m.name, m.inputs, m.outputs, m.row_parallel) for m in fused] == [
        ("qkv", 32, 96, False), ("out", 32, 32, True), ("fc1", 32, 128, False), ("fc2", 128, 32, True)]
    assert [m.name for m in op_kept_matmuls(fused)] == ["qkv", "fc1"]
    for matmuls, kv, kind in ((separate, KV, llama().ffn_kind), (fused, H, gpt().ffn_kind)):
        f = matmuls[-1].inputs
        assert sum(2 * S * m.inputs * m.outputs for m in matmuls) == attention_gemm_flops(S, H, kv) + mlp_flops(S, H, f, kind)


def test_llama_layer_by_hand() -> None:
    """Recomputed: wk 32x16, wo 32x32, w3 32x64 (flash keeps the attention core). Kept: w2's output (row-parallel, 2*8*32),
    and split by tp wq 32 + wv 16 + w1 64 wide, the kernel output 2*8*32 and its fp32 logsumexp 4*4*8."""
    op = layer(llama()).op_recompute
    assert op.flops == 2 * 8 * (32 * 16 + 32 * 32 + 32 * 64) == 57344
    # layer elementwise: 5sh 1280 + rope s(h + kv) 384 + swiglu 2sf 1024 (the fused kernel's softmax is inside its own
    # time, priced at attention_efficiency); op redoes all of them
    assert layer(llama()).elementwise == 1280 + 384 + 1024
    assert op.elementwise == 1280 + 384 + 1024 == 2688
    assert op.saved_replicated_bytes == 2 * 8 * 32 == 512
    assert op.saved_sharded_bytes == 2 * 8 * (32 + 16 + 64) + 2 * 8 * 32 + 4 * 4 * 8 == 2432


def test_llama_with_fused_qkv_keeps_k_too() -> None:
    """Fused QKV: qkv (1st), wo, w1 (3rd), w3, w2 (5th): recomputes wo and w3, keeps the whole 64-wide QKV output."""
    op = layer(llama(fused_qkv=True)).op_recompute
    assert op.flops == 2 * 8 * (32 * 32 + 32 * 64) == 49152
    assert op.saved_replicated_bytes == 512
    assert op.saved_sharded_bytes == 2 * 8 * (64 + 64) + 512 + 128 == 2688


def test_gpt_layer_by_hand() -> None:
    """GPT (math kernel): recomputes c_proj 32x32 and fc2 128x32 and the attention core 4 s^2 h (its batched matmuls are
    not the policy's mm), every memory-bound operator; keeps the c_attn (96 wide) and fc1 (128 wide) outputs."""
    op = layer(gpt()).op_recompute
    assert op.flops == 2 * 8 * (32 * 32 + 128 * 32) + 4 * 8 * 8 * 32 == 90112
    # 5sh 1280 + math core (Q, K scaling s*h + s*h, mask and softmax 2as^2) 1024 + GeLU s*f 1024
    assert op.elementwise == layer(gpt()).elementwise == 1280 + 1024 + 1024
    assert op.saved_replicated_bytes == 0
    assert op.saved_sharded_bytes == 2 * 8 * (96 + 128) == 3584
    separate = layer(gpt(fused_qkv=False)).op_recompute  # q, k, v, c_proj, fc1, fc2: k, c_proj, fc2 recomputed
    assert separate.flops == 2 * 8 * (32 * 32 + 32 * 32 + 128 * 32) + 8192 == 106496
    assert separate.saved_sharded_bytes == 2 * 8 * (32 + 32 + 128) == 3072


def test_gqa_and_fp32_by_hand() -> None:
    """GQA narrows the kept V; fp32 doubles every kept byte but the logsumexp (fp32 either way)."""
    op = layer(llama(precision="fp32")).op_recompute
    assert op.saved_sharded_bytes == 4 * 8 * (32 + 16 + 64) + 4 * 8 * 32 + 128 == 4736
    mha = layer(llama(num_kv_heads=None)).op_recompute  # K is 32 wide: wk recomputed 32x32, V kept 32 wide
    assert mha.flops == 2 * 8 * (32 * 32 + 32 * 32 + 32 * 64) == 65536
    assert mha.saved_sharded_bytes == 2 * 8 * (32 + 32 + 64) + 512 + 128 == 2688


# --- stage memory and time ---------------------------------------------------------------------------------------------


def test_stage_memory_of_the_tiny_llama_by_hand() -> None:
    """One stage, two layers. Stored per sample: the head's norm and projection inputs 2*2*8*32 (replicated) and fp32
    logits 4*8*50 (split), each layer's input 512 and what the policy keeps (512 + 2432). Re-materialised in one layer's
    backward: its saved bytes without recomputation (replicated 4*2*8*32 = 2048; split Q 512 + K, V 2*256 + logsumexp 128
    + SwiGLU 3*2*8*64 = 4736) less what is kept."""
    (load,) = stage_loads(transformer_model(llama()), 1)
    assert activation_bytes_per_sample(load, tp=1, sp=False, recompute=OP) == 1024 + 1600 + 2 * 512 + 2 * (512 + 2432) == 9536
    assert recompute_transient_bytes(load, tp=1, sp=False, recompute=OP, mbs=1) == (2048 - 512) + (4736 - 2432) == 3840
    assert activations_bytes(load, tp=1, sp=False, recompute=OP, mbs=2, in_flight=1) == 2 * 9536 + 2 * 3840
    # tp = 2 without sp splits only the tp-split parts; with sp the replicated ones too
    assert activation_bytes_per_sample(load, tp=2, sp=False, recompute=OP) == 1024 + 1600 / 2 + 1024 + 2 * 512 + 2 * 2432 / 2
    assert activation_bytes_per_sample(load, tp=2, sp=True, recompute=OP) == 9536 / 2
    # between full (inputs only) and none
    none, full = (activation_bytes_per_sample(load, tp=1, sp=False, recompute=r) for r in (Recompute.NONE, Recompute.FULL))
    assert full == 1024 + 1600 + 2 * 512 < 9536 < none == 1024 + 1600 + 2 * (2048 + 4736)


def test_recompute_time_of_the_tiny_llama_by_hand() -> None:
    """Two layers' recomputed FLOPs at the matmul rate plus their memory-bound outputs at elementwise_s, split by tp."""
    (load,) = stage_loads(transformer_model(llama()), 1)
    got = recompute_s(load, mbs=2, tp=2, recompute=OP, flops_per_s=1e9, elementwise_s=1e-9)
    assert got == pytest.approx(2 * 57344 * 2 / 2 / 1e9 + 2 * 2688 * 1e-9 * 2 / 2, rel=1e-12)
    model = transformer_model(llama())
    assert hardware_flops_per_sample(model, OP) == 3 * model.flops_per_sample + 2 * 57344


def test_tp_communication_under_op() -> None:
    """Without sp op repeats the layers' forward all-reduces, as full does; with sp only their all-gathers (torchtitan
    keeps the reduce-scatter outputs). The tiny Llama: 10 all-reduces of 512 B per micro-batch (embedding 1, 2 layers x
    4, head 1), 4 of them the layers' forward ones."""
    (load,) = stage_loads(transformer_model(llama()), 1)
    link = LinkSpec(bandwidth_GBps=100, latency_us=5)
    a, b = 5e-6, 1e-11
    none = 10 * (2 * a + 512 * b)  # ring all-reduce over 2: 2(n-1) alpha + 2(n-1)/n bytes beta
    assert tp_comm_s(load, mbs=1, tp=2, recompute=Recompute.NONE, link=link) == pytest.approx(none, rel=1e-12)
    assert tp_comm_s(load, mbs=1, tp=2, recompute=OP, link=link) == pytest.approx(14 * (2 * a + 512 * b), rel=1e-12)
    full = tp_comm_s(load, mbs=1, tp=2, recompute=Recompute.FULL, link=link)
    assert tp_comm_s(load, mbs=1, tp=2, recompute=OP, link=link) == full
    with_sp = none + 4 * (a + 512 / 2 * b)  # four all-gathers: (n-1) alpha + (n-1)/n bytes beta
    assert tp_comm_s(load, mbs=1, tp=2, recompute=OP, link=link, sp=True) == pytest.approx(with_sp, rel=1e-12)


@pytest.mark.parametrize("spec", [llama(), gpt(), llama(fused_qkv=True), gpt(fused_qkv=False, ffn_kind="swiglu")],
                         ids=["llama", "gpt", "llama-fused", "gpt-separate-swiglu"])
def test_op_lies_between_selective_and_full(spec: TransformerSpec) -> None:
    """Time: selective <= op <= full in every term; memory: full <= op, and op < none where a stage holds both layers
    (with one layer and one micro-batch in flight, op and full keep the layer's input beside the re-materialised layer,
    more than none keeps)."""
    model = transformer_model(spec)
    cluster = make_cluster(nodes=1, devices_per_node=4)
    for text in ("dp=4", "dp=2,tp=2", "dp=1,tp=2,sp=true,pp=2,mbs=2", "dp=2,pp=2,mbs=2"):
        p = parse_plan(text, global_batch_size=4)
        by = {r: estimate(model, cluster, p.replace(recompute=r)) for r in Recompute}
        sel, op, full = by[Recompute.SELECTIVE], by[OP], by[Recompute.FULL]
        for term in ("compute_s", "tp_comm_s", "overhead_s"):
            assert getattr(sel.time, term) <= getattr(op.time, term) <= getattr(full.time, term), (text, term)
        assert full.memory.activations_bytes <= op.memory.activations_bytes
        if p.pp == 1:
            assert op.memory.activations_bytes < by[Recompute.NONE].memory.activations_bytes


# --- spec, YAML, defaults ----------------------------------------------------------------------------------------------


def test_fused_qkv_defaults_to_gpt_and_round_trips() -> None:
    """Left out of the YAML it is true (GPT's c_attn) and a dump leaves it out; false is kept."""
    assert gpt().fused_qkv is True and "fused_qkv" not in gpt().to_dict()
    assert llama().to_dict()["fused_qkv"] is False
    assert load_transformer("gpt-tiny").fused_qkv is True


def test_per_block_yaml_round_trip_keeps_op_recompute() -> None:
    """The per-block layout writes op_recompute for layer blocks and reads it back; blocks without it leave it out."""
    model = transformer_model(llama())
    text = model.to_yaml()
    assert "op_recompute:" in text and text.count("op_recompute:") == 1
    assert model_from_dict(yaml.safe_load(text)) == model


def _without_op(model: ModelSpec) -> ModelSpec:
    """The model as the profiler describes it: no block knows what op-level recomputation does."""
    return dataclasses.replace(model, blocks=tuple(dataclasses.replace(b, op_recompute=None) for b in model.blocks))


@pytest.mark.parametrize("recompute", [Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL])
def test_op_facts_change_nothing_for_the_other_modes(recompute: Recompute) -> None:
    """The same model with and without op_recompute prices every other mode bit for bit the same."""
    cluster = make_cluster(nodes=1, devices_per_node=4)
    for spec in (llama(), gpt()):
        model = transformer_model(spec)
        for text in ("dp=4", "dp=1,tp=2,sp=true,pp=2,mbs=2"):
            p = parse_plan(text, global_batch_size=4).replace(recompute=recompute)
            assert estimate(model, cluster, p) == dataclasses.replace(estimate(_without_op(model), cluster, p), model=model)


def test_block_facts_outside_selective_and_full_are_refused() -> None:
    """op_recompute must redo at least selective's FLOPs and at most the forward outside a fused kernel, and keep no more
    than the block saves (so the search's order of modes holds for any spec)."""
    base = layer(gpt())
    for change, message in (
        (dict(flops=base.flops + 1), "op_recompute.flops .* out of range"),
        (dict(flops=base.recompute_flops - 1), "op_recompute.flops .* out of range"),
        (dict(elementwise=base.elementwise + 1), "op_recompute.elementwise .* <= elementwise"),
        (dict(saved_sharded_bytes=base.act_split_bytes + 1), "saved_sharded_bytes .* act_sharded_bytes \\+ act_attention_bytes"),
        (dict(saved_replicated_bytes=base.act_replicated_bytes + 1), "saved_replicated_bytes .* <= act_replicated_bytes"),
    ):
        with pytest.raises(SpecError, match=message):
            dataclasses.replace(base, op_recompute=dataclasses.replace(base.op_recompute, **change))
    with pytest.raises(SpecError, match="op_recompute.flops must be >= 0"):
        OpRecompute(flops=-1.0, elementwise=0.0, saved_replicated_bytes=0.0, saved_sharded_bytes=0.0)


# --- plan text, runtimes, search --------------------------------------------------------------------------------------


def test_plan_text_round_trip() -> None:
    p = parse_plan("dp=2,recompute=op", global_batch_size=4)
    assert p.recompute is OP and "recompute=op" in str(p)
    assert parse_plan(str(p)) == p
    assert parse_partial_plan("recompute=op") == PartialPlan(recompute=OP)
    assert list(Recompute) == [Recompute.NONE, Recompute.SELECTIVE, OP, Recompute.FULL]  # the search's order


def test_deepspeed_refuses_op_in_one_line_and_any_runs_it() -> None:
    assumed = ModuleHooks.assumed("Net")
    why = DEEPSPEED.refusal(parse_partial_plan("recompute=op"), assumed)
    assert why == "plan recompute=op: DeepSpeed runs no op-level recomputation; use recompute none or full"
    assert OP not in DEEPSPEED.constraints(assumed).recompute
    assert ANY.refusal(parse_partial_plan("recompute=op"), assumed) is None
    assert ANY.constraints(assumed).recompute == tuple(Recompute)


def _tight() -> tuple[ModelSpec, object]:
    """A 4-layer flash Llama on two 1.2 GiB devices: none (= selective under flash) does not fit at tp=2, op does."""
    spec = llama(num_layers=4, hidden_size=1024, num_heads=8, seq_length=2048, vocab_size=32000, ffn_hidden_size=2816,
                 global_batch_size=8)
    return transformer_model(spec), make_cluster(nodes=1, devices_per_node=2, memory_gib=1.2, memory_reserve_gib=0.1, host=False)


def test_any_plans_op_and_deepspeed_never_does() -> None:
    model, cluster = _tight()
    best = plan(model, cluster, top=1, constraints=ANY.constraints(ModuleHooks.assumed()))
    assert best.best.plan.recompute is OP
    deepspeed = plan(model, cluster, top=50, exhaustive=True, constraints=DEEPSPEED.constraints(ModuleHooks.assumed()))
    assert all(e.plan.recompute is not OP for e in deepspeed.all_feasible)
    assert deepspeed.best.time.step_s > best.best.time.step_s


def test_search_with_op_matches_brute_force() -> None:
    """Counts, every returned plan and the best time equal an exhaustive enumeration's where op wins."""
    model, cluster = _tight()
    every = brute_force(model, cluster)
    truth = [e for e in every if e.fits]
    result = plan(model, cluster, top=3, exhaustive=True)
    assert min(truth, key=lambda e: e.time.step_s).plan.recompute is OP
    assert result.best.time.step_s == pytest.approx(min(e.time.step_s for e in truth), rel=1e-12)
    default_order = [e for e in every if e.plan.order == result.best.plan.order]
    assert result.candidates == len(default_order) and result.feasible == sum(e.fits for e in default_order)


@pytest.mark.parametrize("text", ["recompute=op", "tp=2,sp=true,recompute=op"])
def test_fixed_op_matches_brute_force(text: str) -> None:
    check_against_brute_force("offload-2x4", parse_partial_plan(text))


def test_a_model_without_op_facts_is_not_offered_op() -> None:
    """A profiled module's blocks say nothing of op: the planner leaves op out, and asking for it is one PlanError line."""
    model = _without_op(make_model(layers=4, hidden=512, heads=8, seq=512, gbs=8))
    cluster = make_cluster(nodes=1, devices_per_node=2)
    result = plan(model, cluster, top=50, exhaustive=True)
    assert all(e.plan.recompute is not OP for e in result.all_feasible)
    chosen = plan(model, cluster, top=1, constraints=Constraints(recompute=(Recompute.NONE, OP))).best.plan
    assert chosen.recompute is Recompute.NONE
    message = "recompute=op needs what op-level recomputation keeps and redoes in each layer block"
    with pytest.raises(PlanError, match=message):
        plan(model, cluster, recompute=(OP,))
    with pytest.raises(PlanError, match=message) as err:
        estimate(model, cluster, parse_plan("dp=2,recompute=op", global_batch_size=8))
    assert "\n" not in str(err.value) and "block 'layer'" in str(err.value)


def test_fleet_estimate_refuses_op_for_such_a_model_in_one_line(tmp_path, capsys) -> None:
    path = tmp_path / "profiled.yaml"
    path.write_text(_without_op(make_model(layers=4, hidden=512, heads=8, seq=512, gbs=8)).to_yaml())
    code = main(["estimate", "--model", str(path), "--cluster", "cpu", "--plan", "dp=2,recompute=op"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "recompute=op needs" in err
    code = main(["estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=2,recompute=op", "--runtime", "deepspeed"])
    out, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1 and "DeepSpeed runs no op-level recomputation" in err
    assert main(["estimate", "--model", "gpt-tiny", "--cluster", "cpu", "--plan", "dp=2,recompute=op"]) == 0
    assert "recompute=op" in capsys.readouterr().out
