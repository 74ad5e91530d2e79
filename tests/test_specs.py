"""Cluster and model specs: YAML round-trips, presets, and one clear error per bad input."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
import yaml

from lightning_fleet.planning import (
    SpecError,
    cluster_from_dict,
    cluster_presets,
    load_cluster,
    load_model,
    load_transformer,
    model_from_dict,
    model_presets,
)

pytestmark = pytest.mark.pure

ISSUE_CLUSTER = """\
name: dgx-a100-80gb
nodes: 4
devices_per_node: 8
device:
  name: A100-SXM4-80GB
  memory_gib: 80
  peak_tflops: {bf16: 312, fp16: 312, fp32: 19.5}
intra_node: {bandwidth_GBps: 300, latency_us: 5}   # per device, one direction
inter_node: {bandwidth_GBps: 25, latency_us: 10}   # per device, one direction
host: {memory_gib: 1024, pcie_GBps: 25}            # optional; needed for offload
"""

ISSUE_MODEL = """\
name: gpt3-175b
num_layers: 96
hidden_size: 12288
num_heads: 96
seq_length: 2048
vocab_size: 51200
ffn_hidden_size: 49152       # optional, default 4 * hidden_size
precision: bf16-mixed        # bf16-mixed | fp16-mixed | fp32
global_batch_size: 1536
"""


def write(tmp_path, text, name="spec.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_issue_cluster_file_loads_with_exactly_these_names(tmp_path):
    """The cluster YAML of the issue loads; every field lands where it should."""
    c = load_cluster(write(tmp_path, ISSUE_CLUSTER))
    assert (c.name, c.world_size, c.num_nodes, c.devices_per_node) == ("dgx-a100-80gb", 32, 4, 8)
    d = c.groups[0].device
    assert (d.name, d.memory_gib, d.peak_tflops.bf16, d.peak_tflops.fp32) == ("A100-SXM4-80GB", 80, 312, 19.5)
    assert (c.intra_node.bandwidth_GBps, c.inter_node.latency_us, c.host.pcie_GBps) == (300, 10, 25)


@pytest.mark.parametrize("name", cluster_presets())
def test_cluster_presets_round_trip(name):
    """load -> dump -> load is identity for every shipped cluster."""
    c = load_cluster(name)
    again = cluster_from_dict(yaml.safe_load(c.to_yaml()))
    assert again == c
    assert yaml.safe_load(again.to_yaml()) == yaml.safe_load(c.to_yaml())


def test_required_presets_exist():
    """Presets for common machines and the CPU box ship with the package."""
    names = set(cluster_presets())
    assert {"dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "hgx-h200", "dgx1-v100", "cpu", "grand-teton-h100-96gb", "jean-zay-a100-80gb"} <= names
    assert {"gpt3-175b", "megatron-1t", "gpt-tiny"} <= set(model_presets())


def test_issue_model_file_round_trips(tmp_path):
    """The transformer YAML of the issue: load -> dump -> load is identity, both as shape and as blocks."""
    path = write(tmp_path, ISSUE_MODEL)
    shape = load_transformer(path)
    assert load_transformer(write(tmp_path, shape.to_yaml(), "again.yaml")) == shape
    model = load_model(path)
    assert model_from_dict(yaml.safe_load(model.to_yaml())) == model
    assert model.num_layers == 96 and model.global_batch_size == 1536
    assert 174e9 < model.params < 176e9


@pytest.mark.parametrize("name", model_presets())
def test_model_presets_round_trip_as_blocks(name):
    """Every model preset dumps to the per-block layout and reads back equal."""
    model = load_model(name)
    assert model_from_dict(yaml.safe_load(model.to_yaml())) == model


def test_heterogeneous_cluster_round_trips(tmp_path):
    """groups: [...] replaces nodes/devices_per_node/device and survives a round-trip."""
    text = ISSUE_CLUSTER.replace("nodes: 4\ndevices_per_node: 8\ndevice:\n  name: A100-SXM4-80GB\n  memory_gib: 80\n  peak_tflops: {bf16: 312, fp16: 312, fp32: 19.5}\n", "")
    text += textwrap.dedent(
        """\
        groups:
          - {nodes: 2, devices_per_node: 8, device: {name: A100, memory_gib: 80, peak_tflops: {bf16: 312, fp16: 312, fp32: 19.5}}}
          - {nodes: 1, devices_per_node: 4, device: {name: V100, memory_gib: 32, peak_tflops: {bf16: 15.7, fp16: 125, fp32: 15.7}}}
        """
    )
    c = load_cluster(write(tmp_path, text))
    assert c.world_size == 20 and not c.is_homogeneous and c.devices_per_node == 4
    assert cluster_from_dict(yaml.safe_load(c.to_yaml())) == c


BAD_CLUSTERS = [
    ("nodes: 4", "nodes: 0", "needs at least one node and one device per node, got nodes=0"),
    ("nodes: 4", "nodes: -2", "needs at least one node and one device per node, got nodes=-2"),
    ("nodes: 4", 'nodes: "4"', "nodes must be an integer, got '4'"),
    ("memory_gib: 80", "memory_gib: -80", "memory_gib must be > 0"),
    ("devices_per_node: 8", "devices_per_node: 8\ndevices_per_nod: 8", "unknown key 'devices_per_nod'"),
    ("  memory_gib: 80", "  memory_gib: 80\n  hbm: 3", "unknown key 'hbm' in cluster file 'spec.yaml'.device"),
    ("intra_node: {bandwidth_GBps: 300, latency_us: 5}", "intra_node: {bandwidth_GBps: 0, latency_us: 5}", "bandwidth_GBps must be > 0"),
    ("intra_node: {bandwidth_GBps: 300, latency_us: 5}", "", "missing key 'intra_node'"),
    ("peak_tflops: {bf16: 312, fp16: 312, fp32: 19.5}", "peak_tflops: {bf16: 312, fp32: 19.5}", "missing key 'fp16'"),
]


@pytest.mark.parametrize("old,new,message", BAD_CLUSTERS)
def test_bad_cluster_files_give_one_line_naming_the_key(tmp_path, old, new, message):
    """Each malformed cluster file raises SpecError with one line that names what is wrong."""
    assert old in ISSUE_CLUSTER
    with pytest.raises(SpecError) as err:
        load_cluster(write(tmp_path, ISSUE_CLUSTER.replace(old, new, 1)))
    assert message in str(err.value) and "\n" not in str(err.value)


BAD_MODELS = [
    ("num_layers: 96", "num_layers: 0", "num_layers must be > 0, got 0"),
    ("hidden_size: 12288", "hidden_size: -1", "hidden_size must be > 0"),
    ("num_heads: 96", "num_heads: 100", "hidden_size (12288) must be divisible by num_heads (100)"),
    ("precision: bf16-mixed", "precision: int8", "precision must be one of bf16-mixed, fp16-mixed, fp32, got 'int8'"),
    ("vocab_size: 51200", "vocab_size: 51200\nvocab: 3", "unknown key 'vocab'"),
    ("global_batch_size: 1536", "", "missing key 'global_batch_size'"),
    ("seq_length: 2048", "seq_length: 2048.5", "seq_length must be an integer"),
]


@pytest.mark.parametrize("old,new,message", BAD_MODELS)
def test_bad_model_files_give_one_line_naming_the_key(tmp_path, old, new, message):
    """Each malformed model file raises SpecError with one line that names what is wrong."""
    with pytest.raises(SpecError) as err:
        load_model(write(tmp_path, ISSUE_MODEL.replace(old, new, 1)))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_yaml_that_is_not_yaml_or_not_a_mapping(tmp_path):
    """Broken YAML and a YAML list are one-line errors with the position."""
    with pytest.raises(SpecError, match=r"is not valid YAML at line 3, column 1"):
        load_cluster(write(tmp_path, "name: x\nnodes: [1,\n"))
    with pytest.raises(SpecError, match="must hold a mapping"):
        load_model(write(tmp_path, "- 1\n- 2\n"))


def test_yaml_python_tags_are_refused_and_never_run(tmp_path):
    """safe_load only: a !!python/object/apply tag is an error and its payload does not execute."""
    marker = tmp_path / "pwned"
    text = f"name: !!python/object/apply:os.system ['touch {marker}']\n" + ISSUE_CLUSTER.split("\n", 1)[1]
    with pytest.raises(SpecError, match="not valid YAML"):
        load_cluster(write(tmp_path, text))
    assert not marker.exists()


def test_unknown_preset_lists_the_presets():
    """A name that is neither a file nor a preset says which presets exist."""
    with pytest.raises(SpecError, match="no cluster file or preset named 'dgx-z100'; presets: .*dgx-a100-80gb"):
        load_cluster("dgx-z100")
    with pytest.raises(SpecError, match="no model file or preset named"):
        load_model("gpt-99")


def test_block_layout_errors(tmp_path):
    """Per-block models: unknown role, missing layers and bad order are named."""
    model = load_model("gpt-tiny").to_dict()
    model["blocks"][1]["role"] = "middle"
    with pytest.raises(SpecError, match="role must be one of pre, layer, post, got 'middle'"):
        model_from_dict(model)
    model = load_model("gpt-tiny").to_dict()
    model["blocks"] = [model["blocks"][0], model["blocks"][2]]
    with pytest.raises(SpecError, match="has no block with role 'layer'"):
        model_from_dict(model)
    model = load_model("gpt-tiny").to_dict()
    model["blocks"] = list(reversed(model["blocks"]))
    with pytest.raises(SpecError, match="blocks must be ordered pre..., layer..., post..."):
        model_from_dict(model)


def test_trainable_counts_round_trip_and_default_to_all():
    """Frozen parameters: trainable_params per block and tied_trainable_params survive load -> dump -> load; unset,
    they are left out of the YAML and mean 'all of them train'."""
    model = load_model("gpt-tiny").to_dict()
    assert all("trainable_params" not in block for block in model["blocks"]) and "tied_trainable_params" not in model
    model["blocks"][0]["trainable_params"] = 0  # frozen embedding, tied to the head
    model["tied_trainable_params"] = 0
    spec = model_from_dict(model)
    again = model_from_dict(yaml.safe_load(spec.to_yaml()))
    assert again == spec and again.blocks[0].trainable_params == 0 and again.blocks[1].trainable_params is None
    embedding, layer, head = again.blocks
    assert again.trainable_params == layer.params * layer.count + head.params  # the tied head weight trains in no block
    assert again.params == embedding.params + layer.params * layer.count + head.params - again.tied_params


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("block", -1, "block 'embedding': trainable_params must be >= 0, got -1"),
        ("block", 10**12, "block 'embedding': trainable_params (1000000000000) must be <= params"),
        ("block", True, "trainable_params must be an integer, got True"),
        ("model", 10**12, "model.tied_trainable_params (1000000000000) must be <= tied_params"),
    ],
)
def test_bad_trainable_counts_are_one_line_errors(where, value, message):
    model = load_model("gpt-tiny").to_dict()
    target = model["blocks"][0] if where == "block" else model
    target["trainable_params" if where == "block" else "tied_trainable_params"] = value
    with pytest.raises(SpecError) as err:
        model_from_dict(model)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_runtimes_measured_overheads_replace_the_defaults_at_its_shard_levels_and_round_trip():
    """calibration.runtimes: each runtime's own per-shard-level framework time, read from YAML, written back the same,
    scaled with a slower host like the other framework constants, and refused in one line when malformed."""
    from lightning_fleet.planning import RuntimeOverheads, SpecError, cluster_from_dict, load_cluster

    data = load_cluster("cpu").to_dict()
    data["calibration"] = {**data.get("calibration", {}), "zero_step_overhead_s": [0.001, 0.002, 0.003, 0.004],
                           "zero_tensor_overhead_s": [0, 1e-6, 2e-6, 3e-6],
                           "runtimes": [{"runtime": "torch", "zero_stages": [0, 2, 3], "step_overhead_s": [0.0, 0.02, 0.03],
                                         "tensor_overhead_s": [0, 5e-6, 7e-6]}]}
    cluster = cluster_from_dict(data)
    assert cluster_from_dict(cluster.to_dict()) == cluster
    torch_view = cluster.for_runtime("torch").calibration
    assert torch_view.zero_step_overhead_s == (0.0, 0.002, 0.02, 0.03)  # zero=1, which torch does not run, keeps the default
    assert torch_view.zero_tensor_overhead_s == (0, 1e-6, 5e-6, 7e-6)
    assert cluster.for_runtime("deepspeed") is cluster  # no entry: the defaults
    slow = dataclasses.replace(cluster.groups[0].device, host_slowdown=2.0)
    assert cluster.calibration.on(slow).runtimes[0].step_overhead_s == (0.0, 0.04, 0.06)
    for bad, says in (
        ({"zero_stages": [0, 2], "step_overhead_s": [0.0, 0.02, 0.03], "tensor_overhead_s": [0, 0]}, "must be 2 non-negative"),
        ({"zero_stages": [0, 5], "step_overhead_s": [0, 0], "tensor_overhead_s": [0, 0]}, "distinct shard levels 0-3"),
    ):
        broken = {**data, "calibration": {**data["calibration"], "runtimes": [{"runtime": "torch", **bad}]}}
        with pytest.raises(SpecError, match=says):
            cluster_from_dict(broken)
    twice = [RuntimeOverheads(runtime="torch", zero_stages=(0,), step_overhead_s=(0.0,), tensor_overhead_s=(0.0,))] * 2
    with pytest.raises(SpecError, match="names a runtime twice"):
        dataclasses.replace(cluster.calibration, runtimes=tuple(twice))
