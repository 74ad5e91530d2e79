"""What tensor parallelism can split, read off the module before the first step (lightning_fleet/hooks.py
``tensor_parallel_limits``), refused in one line naming the layer (runtime/base.py ``Capabilities.refusal``) and kept
out of the automatic plan (planning/search.py ``Constraints.tp_divides``).

Hugging Face models are built from tiny configs, as users bring them: GPT-2's fused ``c_attn`` is a transformers
``Conv1D`` (weight stored in x out), Llama with one key/value head cannot give each of 2 ranks whole heads; both crashed
inside DeepSpeed after the plan was accepted. Unit tier: modules built in this process, nothing started; the decision
test is pure (no torch); the last test is one real 2-process job that trains a splittable Llama and meets the refusal.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fleet.decide import JobOptions, ModuleFacts, Resume, ResumeKind, decide
from lightning_fleet.planning import FleetError, parse_partial_plan
from lightning_fleet.runtime.base import ModuleHooks, TensorParallelLimit
from lightning_fleet.runtime.deepspeed.capabilities import DEEPSPEED
from tests.conftest import make_cluster, make_model

ROOT = Path(__file__).resolve().parents[1]
LLAMA_TP = {"column": [r".*\.self_attn\.[qkv]_proj\.weight$", r".*\.mlp\.(up|gate)_proj\.weight$"],
            "row": [r".*\.self_attn\.o_proj\.weight$", r".*\.mlp\.down_proj\.weight$"]}
GPT2_TP = {"column": [r".*\.attn\.c_attn\.weight$", r".*\.mlp\.c_fc\.weight$"],
           "row": [r".*\.attn\.c_proj\.weight$", r".*\.mlp\.c_proj\.weight$"]}


def wrapped(model, patterns: dict, heads: int = 4):  # type: ignore[no-untyped-def]
    """A LightningModule-like holder of a Hugging Face model with the hook a user writes for it."""
    from torch import nn

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def fleet_tensor_parallel(self) -> dict:
            return {"num_heads": heads, **patterns}

    return Holder()


def llama(kv_heads: int):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=kv_heads, vocab_size=128, max_position_embeddings=16)
    return wrapped(transformers.LlamaForCausalLM(config), LLAMA_TP)


def refusal(module, plan: str) -> str | None:  # type: ignore[no-untyped-def]
    from lightning_fleet.hooks import module_hooks

    return DEEPSPEED.refusal(parse_partial_plan(plan), module_hooks(module))


@pytest.mark.unit
def test_gpt2_conv1d_is_refused_naming_the_layer() -> None:
    """HF GPT-2 at tp=2 crashed inside DeepSpeed ("split_with_sizes expects split_sizes to sum exactly to 192"): its
    Conv1D weights are (in, out), which AutoTP's training path splits as if they were nn.Linear (out, in)."""
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=16))
    assert refusal(wrapped(gpt2, GPT2_TP), "tp=2") == (
        "plan tp=2: tp=2 cannot split model.transformer.h.0.attn.c_attn: it is a Conv1D (weight (64, 192), stored "
        "transposed: in x out), and tensor parallelism splits nn.Linear (out x in) and nn.Embedding weights only; use "
        "tp=1, or a model built from nn.Linear layers"
    )
    assert refusal(wrapped(gpt2, GPT2_TP), "tp=1") is None


@pytest.mark.unit
def test_a_single_key_value_head_is_refused_naming_the_projection() -> None:
    """Llama with num_key_value_heads=1 at tp=2 crashed in its attention ("shape '[8, 16, -1, 16]' is invalid"): k_proj's
    one head was cut in halves. The head counts come from the model's config, the layer from the hook's patterns."""
    module = llama(kv_heads=1)
    assert refusal(module, "dp=1,tp=2") == (
        "plan dp=1,tp=2: tp=2 cannot split model.model.layers.0.self_attn.k_proj: its 1 key/value head is not divisible "
        "by tp=2; use tp=1"
    )
    from lightning_fleet.hooks import module_hooks

    assert DEEPSPEED.constraints(module_hooks(module)).tp_divides == 1


@pytest.mark.unit
def test_grouped_query_attention_splits_by_whole_key_value_heads() -> None:
    """Two key/value heads split over tp=2 (one each); tp=4 would cut them. Query heads and MLP features allow more."""
    from lightning_fleet.hooks import tensor_parallel_limits

    module = llama(kv_heads=2)
    assert refusal(module, "tp=2") is None
    assert refusal(module, "tp=4") == (
        "plan tp=4: tp=4 cannot split model.model.layers.0.self_attn.k_proj: its 2 key/value heads are not divisible "
        "by tp=4; use a tp that divides 2"
    )
    parts = {limit.layer.split(".", 4)[-1]: limit.parts for limit in tensor_parallel_limits(module) if ".layers.0." in limit.layer}
    assert parts == {"self_attn.q_proj": 4, "self_attn.k_proj": 2, "self_attn.v_proj": 2, "self_attn.o_proj": 4,
                     "mlp.gate_proj": 128, "mlp.up_proj": 128, "mlp.down_proj": 128}


@pytest.mark.unit
def test_a_fused_query_key_value_linear_is_refused() -> None:
    """nanoGPT's c_attn = nn.Linear(h, 3h): an even column split gives rank 0 all queries and half the keys."""
    from torch import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(32, 96), nn.Linear(32, 32)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.ModuleDict({"attn": Attention()}) for _ in range(2))

        def fleet_tensor_parallel(self) -> dict:
            return {"num_heads": 4, "column": [r".*c_attn\.weight$"], "row": [r".*c_proj\.weight$"]}

    assert refusal(Net(), "tp=2") == (
        "plan tp=2: tp=2 cannot split blocks.0.attn.c_attn: its 96 outputs hold the query, key and value projections side "
        "by side (4 + 2 x 4 heads of 8), and an even split gives a rank the queries of some heads and the keys of others; "
        "use tp=1, or separate query, key and value nn.Linear layers"
    )


@pytest.mark.unit
def test_the_hook_gives_key_value_heads_where_no_config_does() -> None:
    """A module of its own (no Hugging Face config): the hook's num_kv_heads decides; a count that cannot be is one line."""
    from torch import nn

    class Net(nn.Module):
        def __init__(self, kv_heads: int | None) -> None:
            super().__init__()
            self.kv_heads = kv_heads
            self.attn = nn.ModuleDict({"q": nn.Linear(32, 32), "k": nn.Linear(32, 16), "v": nn.Linear(32, 16), "o": nn.Linear(32, 32)})

        def fleet_tensor_parallel(self) -> dict:
            return {"num_heads": 4, "num_kv_heads": self.kv_heads, "column": [r"attn\.[qkv]\.weight$"], "row": [r"attn\.o\.weight$"]}

    assert refusal(Net(2), "tp=2") is None
    assert refusal(Net(2), "tp=4") == (
        "plan tp=4: tp=4 cannot split attn.k: its 2 key/value heads are not divisible by tp=4; use a tp that divides 2"
    )
    with pytest.raises(FleetError) as err:
        refusal(Net(3), "tp=2")
    assert str(err.value) == ("Net.fleet_tensor_parallel(): num_heads, num_kv_heads and head_dim must be positive, and "
                              "num_kv_heads must divide num_heads")


@pytest.mark.unit
def test_separate_projections_keep_their_tensor_parallel_degrees() -> None:
    """The example GPT (q, k, v, proj, fc of 4 heads x 8): tp=2 and 4 split it, tp=3 is refused by its heads."""
    from examples.gpt.model import GPT
    from lightning_fleet.hooks import module_hooks

    hooks = module_hooks(GPT(num_layers=2, hidden_size=32, num_heads=4, seq_length=8))
    assert hooks.tp_divides == 4
    assert DEEPSPEED.refusal(parse_partial_plan("tp=2"), hooks) is None
    assert DEEPSPEED.refusal(parse_partial_plan("tp=3"), hooks) == (
        "plan tp=3: tp=3 cannot split blocks.0.attn.q: its 4 attention heads are not divisible by tp=3; use a tp that "
        "divides 4"
    )


@pytest.mark.pure
def test_the_automatic_plan_never_chooses_a_degree_the_module_cannot_split() -> None:
    """On 8 devices without ZeRO this model's best plan is tp=2; with one layer that no tp > 1 splits the decision
    takes tp=1, and fixing tp=2 is refused in the layer's line before any search."""
    limit = TensorParallelLimit(layer="model.layers.0.self_attn.k_proj", parts=1, reason="its 1 key/value head is not divisible by tp={tp}; use tp=1")

    def decision(limits: tuple[TensorParallelLimit, ...], plan: str | None = None):  # type: ignore[no-untyped-def]
        hooks = ModuleHooks(name="M", tensor_parallel=True, pipeline=False, layers=True, automatic_optimization=True, tp_limits=limits)
        facts = ModuleFacts(spec=make_model(layers=8, hidden=4096, heads=32, seq=2048, gbs=16), hooks=hooks, loader_batch_size=2)
        return decide(facts, make_cluster(devices_per_node=8), world_size=8, options=JobOptions(plan=plan, zero_stages=(0,)),
                      runtimes=(DEEPSPEED,), resume=Resume(kind=ResumeKind.FRESH))

    assert decision(()).plan.tp == 2
    assert decision((limit,)).plan.tp == 1
    with pytest.raises(FleetError) as err:
        decision((limit,), plan="tp=2")
    assert str(err.value) == ("plan tp=2: tp=2 cannot split model.layers.0.self_attn.k_proj: its 1 key/value head is not "
                              "divisible by tp=2; use tp=1")


@pytest.mark.multiprocess
def test_hugging_face_llama_at_tp2_trains_with_two_key_value_heads_and_is_refused_with_one(tmp_path) -> None:
    """One 2-process job (Lightning's launcher), two fits at tp=2 on each runtime (DeepSpeed's AutoTP, DTensor's
    parallelize_module, and that with sequence parallelism: the decoder layers on sequence shards, their norms as
    SequenceParallel, attention and MLP gathering their input): with 2 key/value heads every projection splits and the
    weights after 3 steps equal a one-process run; with 1 the fit ends in the k_proj line before either runtime builds
    anything."""
    pytest.importorskip("transformers")
    import torch

    from tests.multiprocess import run_worker
    from tests.workers.hf_tp import reference_state

    runtimes = ("deepspeed", "torch", "torch-sp")
    results, _ = run_worker(tmp_path, "--kv-heads", "2,1", "--runtimes", ",".join(runtimes), worker=ROOT / "tests" / "workers" / "hf_tp.py")
    reference = reference_state(2)
    for index, runtime in enumerate(runtimes):
        trained, refused = results[2 * index: 2 * index + 2]
        for name, tensor in reference.items():
            torch.testing.assert_close(trained["state"][name], tensor, atol=2e-5, rtol=0, msg=f"{runtime}: {name}")
        assert trained["local_params"] < 0.8 * sum(t.numel() for t in reference.values())  # the projections really split
        sp = ",sp=true" if runtime == "torch-sp" else ""
        assert refused == (f"plan dp=1,tp=2,zero=0,mbs=8,gas=1{sp}: tp=2 cannot split "
                           "model.model.layers.0.self_attn.k_proj: its 1 key/value head is not divisible by tp=2; use tp=1")


@pytest.mark.pure
def test_sequence_parallelism_lays_out_each_layer_by_its_regions_and_norms() -> None:
    """The example GPT: each block takes sequence shards, its attention and MLP gather their input, ln1 and ln2 run on
    the shards; module_hooks says sp may be planned."""
    from examples.gpt.model import GPT
    from lightning_fleet.hooks import module_hooks, sequence_parallel_layout

    layout, why = sequence_parallel_layout(GPT(num_layers=2, hidden_size=32, num_heads=4, seq_length=16))
    assert why == "" and layout is not None
    assert layout.layers == ["blocks.0", "blocks.1"]
    assert layout.regions == ["blocks.0.attn", "blocks.0.mlp", "blocks.1.attn", "blocks.1.mlp"]
    assert layout.norms == ["blocks.0.ln1", "blocks.0.ln2", "blocks.1.ln1", "blocks.1.ln2"]
    assert module_hooks(GPT(num_layers=2, hidden_size=32, num_heads=4, seq_length=16)).sequence_parallel


@pytest.mark.pure
def test_a_module_sequence_parallelism_cannot_lay_out_says_why_in_one_line() -> None:
    """No 'sequence' modules, a norm left out of them (its gradient would be one shard's), a layer whose split layers
    have no attention or MLP module around them: each refused naming what to add or change."""
    from torch import nn

    from examples.gpt.model import GPT
    from lightning_fleet.hooks import module_hooks
    from lightning_fleet.runtime.torch.capabilities import TORCH

    class Partly(GPT):
        def fleet_tensor_parallel(self) -> dict:
            return {**super().fleet_tensor_parallel(), "sequence": [r".*\.ln1\.weight$"]}

    class Unnamed(GPT):
        def fleet_tensor_parallel(self) -> dict:
            return {key: value for key, value in super().fleet_tensor_parallel().items() if key != "sequence"}

    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.ModuleDict({"up": nn.Linear(8, 16), "down": nn.Linear(16, 8)}) for _ in range(2))

        def fleet_tensor_parallel(self) -> dict:
            return {"num_heads": 2, "column": [r".*\.up\.weight$"], "row": [r".*\.down\.weight$"], "sequence": [r"none"]}

    sizes = dict(num_layers=2, hidden_size=32, num_heads=4, seq_length=16)
    cases = [
        (Partly(**sizes), "plan tp=2,sp=true has sp=true, but Partly holds blocks.0.ln2.weight in its layer blocks.0, which is "
         "neither split (column/row) nor a 'sequence' module: name it in fleet_tensor_parallel()'s 'sequence' (a norm) or "
         "use sp=false"),
        (Unnamed(**sizes), "plan tp=2,sp=true has sp=true, but Unnamed names no 'sequence' modules (its norms) in "
         "fleet_tensor_parallel(): add them or use sp=false"),
        (Flat(), "plan tp=2,sp=true has sp=true, but Flat splits layers.0.up with no submodule of layers.0 around it that "
         "holds both column- and row-split layers (an attention or MLP module): sequence parallelism gathers such a "
         "module's input; use sp=false"),
    ]
    for module, message in cases:
        hooks = module_hooks(module)
        assert not hooks.sequence_parallel
        assert TORCH.refusal(parse_partial_plan("tp=2,sp=true"), hooks) == message
        assert not TORCH.constraints(hooks).allow_sp


@pytest.mark.pure
def test_per_rank_counts_are_limits_and_a_pattern_that_names_nothing_is_one_line() -> None:
    """The zoo's Llama reshapes by ``self.heads`` / ``self.kv_heads`` and names them 'per_rank': each is a limit (tp must
    divide 4 and 2), a tp=8 plan is refused on such a count; tp=2 with and without sequence parallelism may run; a
    misspelt pattern is refused before anything runs."""
    from torch import nn

    from lightning_fleet.hooks import module_hooks, per_rank_attributes, tensor_parallel_limits
    from lightning_fleet.runtime.torch.capabilities import TORCH
    from tests.zoo import Llama

    module = Llama()
    counts = {(path, value) for path, _, _, value in per_rank_attributes(module)}
    assert counts == {("layers.0.attn.heads", 4), ("layers.0.attn.kv_heads", 2), ("layers.1.attn.heads", 4), ("layers.1.attn.kv_heads", 2)}
    limits = {limit.layer: limit for limit in tensor_parallel_limits(module)}
    assert limits["layers.0.attn.kv_heads"].parts == 2 and limits["layers.0.attn.heads"].parts == 4
    assert limits["layers.1.attn.heads"].refusal(8) == (
        "tp=8 cannot split layers.1.attn.heads: the module reads it as a count of what tensor parallelism splits "
        "(fleet_tensor_parallel()'s 'per_rank'), and its 4 is not divisible by tp=8; use a tp that divides 4")
    hooks = module_hooks(module)
    assert TORCH.refusal(parse_partial_plan("tp=2"), hooks) is None and TORCH.refusal(parse_partial_plan("tp=2,sp=true"), hooks) is None

    class Misspelt(Llama):
        def fleet_tensor_parallel(self) -> dict:
            return {**super().fleet_tensor_parallel(), "per_rank": [r".*\.n_heads$"]}

    with pytest.raises(FleetError) as err:
        tensor_parallel_limits(Misspelt())
    assert str(err.value) == (
        "Misspelt.fleet_tensor_parallel(): 'per_rank' pattern '.*\\\\.n_heads$' names no positive integer attribute of the "
        "module or its submodules (matched against '<module path>.<attribute>', e.g. 'layers.0.attn.n_heads'); fix the "
        "pattern or drop it")
    assert per_rank_attributes(nn.Linear(2, 2)) == []
