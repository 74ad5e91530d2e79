"""Planning on a cluster whose devices differ (issue 14): which device each rank and replica has, the min-max split of a
micro-step's samples over replicas (balance_micro_batches), the per-replica estimate, and the planner choosing an
uneven split and saying how much it gains over planning on the slowest device.

Every expected value is a literal, a visible arithmetic expression, or the estimate of a homogeneous view it names.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from lightning_fleet.cli import main
from lightning_fleet.planning import FleetError, Plan, estimate, load_cluster, load_model, parse_plan, plan
from lightning_fleet.planning.cluster import DeviceSpec, PeakTflops, cluster_from_dict, slowest_device
from lightning_fleet.planning.estimate import replica_devices
from lightning_fleet.planning.search import balance_micro_batches

pytestmark = pytest.mark.pure

MIXED = load_cluster("mixed-h100-a100")  # 2 nodes x 8 H100, then 2 nodes x 8 A100
H100, A100 = MIXED.groups[0].device, MIXED.groups[1].device


def test_ranks_fill_the_groups_in_order_node_by_node() -> None:
    assert [MIXED.rank_device(r).name for r in (0, 15, 16, 31)] == [H100.name, H100.name, A100.name, A100.name]
    with pytest.raises(FleetError, match="rank 32 is not one of its ranks 0..31"):
        MIXED.rank_device(32)
    assert MIXED.with_device(A100).is_homogeneous and MIXED.with_device(A100).world_size == 32


def test_the_slowest_device_takes_the_least_of_each_figure() -> None:
    small_fast = DeviceSpec(name="a", memory_gib=40, peak_tflops=PeakTflops(bf16=300, fp16=300, fp32=20), memory_GBps=3000)
    big_slow = DeviceSpec(name="b", memory_gib=80, peak_tflops=PeakTflops(bf16=100, fp16=200, fp32=10), memory_GBps=1000)
    worst = slowest_device([small_fast, big_slow])
    assert (worst.memory_gib, worst.peak_tflops, worst.memory_GBps) == (40, PeakTflops(bf16=100, fp16=200, fp32=10), 1000)
    assert slowest_device([big_slow, big_slow]) is big_slow


def test_a_replica_runs_on_the_slowest_of_its_ranks() -> None:
    assert replica_devices(MIXED, parse_plan("dp=32,mbs=1,gas=1")) == (H100,) * 16 + (A100,) * 16
    assert replica_devices(MIXED, parse_plan("dp=4,tp=8,mbs=1,gas=1")) == (H100, H100, A100, A100)
    # a pipeline of 2 stages placed outside dp: replica r's stages are ranks r and r + 16, an H100 and an A100
    assert replica_devices(MIXED, parse_plan("dp=16,pp=2,mbs=1,gas=1")) == (slowest_device([H100, A100]),) * 16


def test_min_max_split_by_hand() -> None:
    """Replica 0 takes m seconds for m samples, replica 1 three times as long: 8 samples go 6/2 (both 6 s)."""
    def step_s(replica: int, mbs: int) -> float:
        return float(mbs) * (1 if replica == 0 else 3)

    assert balance_micro_batches(step_s, 2, 8) == (6, 2)
    capped = lambda replica, mbs: None if replica == 0 and mbs > 4 else step_s(replica, mbs)  # noqa: E731
    assert balance_micro_batches(capped, 2, 8) == (4, 4)  # replica 0 holds at most 4
    assert balance_micro_batches(lambda replica, mbs: None if mbs > 3 else 1.0, 2, 8) is None  # 2 x 3 < 8
    assert balance_micro_batches(step_s, 3, 2) is None  # fewer samples than replicas
    assert balance_micro_batches(step_s, 2, 2) == (1, 1)


def test_a_forced_uneven_plan_on_mixed_devices_is_paced_by_its_slowest_replica() -> None:
    model = load_model("gpt-1.7b")
    text = "dp=32,gas=2," + "dp_mbs=" + "/".join(["12"] * 16 + ["4"] * 16)
    uneven = estimate(model, MIXED, parse_plan(text, global_batch_size=512))
    per_device = {}
    for device, mbs in ((H100, 12), (A100, 4)):
        alike = dataclasses.replace(model, global_batch_size=32 * mbs * 2)
        per_device[device.name] = estimate(alike, MIXED.with_device(device), parse_plan(f"dp=32,mbs={mbs},gas=2"))
    assert uneven.time == max((e.time for e in per_device.values()), key=lambda t: t.step_s)
    assert uneven.memory == max((e.memory for e in per_device.values()), key=lambda m: m.shortfall_bytes())
    assert uneven.samples_per_s == pytest.approx(512 / uneven.time.step_s)


def test_the_planner_splits_unevenly_and_says_what_it_gains_over_the_slowest_device() -> None:
    model = load_model("gpt-1.7b")
    result = plan(model, MIXED, top=3)
    best, even = result.best, result.even_best
    assert best.plan.dp_mbs is not None and even is not None and even.plan.dp_mbs is None
    assert result.speedup_over_even == even.time.step_s / best.time.step_s > 1.3
    sizes = best.plan.dp_mbs
    devices = replica_devices(MIXED, best.plan)
    assert min(s for s, d in zip(sizes, devices) if d == H100) > max(s for s, d in zip(sizes, devices) if d == A100)
    assert best.fits and best.plan.global_batch_size == 512
    slowest = plan(model, MIXED, top=1, search_dp_mbs=False, uneven_stages=False)  # planning on the slowest device
    assert slowest.best == even and slowest.even_best is None
    homogeneous = plan(model, MIXED.with_device(slowest_device([H100, A100])), top=1)
    assert homogeneous.best.time == even.time


def test_fleet_plan_prints_the_split_per_device_and_the_json_carries_it(capsys) -> None:
    assert main(["plan", "--model", "gpt-1.7b", "--cluster", "mixed-a100-v100", "--top", "1"]) == 0
    out = capsys.readouterr().out
    line = " ".join(out[out.index("split by device:"):].split())
    assert "replicas on A100-SXM4-80GB at mbs" in line and "replicas on V100-SXM2-32GB at mbs" in line
    assert "x the throughput of the best plan for the slowest device" in line
    assert main(["plan", "--model", "gpt-1.7b", "--cluster", "mixed-a100-v100", "--top", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["speedup_over_even"] > 1 and len(data["plans"][0]["plan"]["dp_mbs"]) == data["plans"][0]["plan"]["dp"]
    assert "dp_mbs" not in data["even_best"]["plan"]
    assert main(["plan", "--model", "gpt-1.7b", "--cluster", "dgx-a100-80gb", "--top", "1", "--json"]) == 0
    assert "speedup_over_even" not in json.loads(capsys.readouterr().out)  # one device type: nothing to balance


@pytest.mark.parametrize(("key", "value", "message"), [
    ("devices_per_node", 0, r"cluster.groups\[1\]: a device group needs at least one node and one device per node, got nodes=2, devices_per_node=0"),
    ("nodes", 0, r"cluster.groups\[1\]: a device group needs at least one node .* got nodes=0"),
    ("bogus", 1, r"unknown key 'bogus' in cluster.groups\[1\]"),
])
def test_a_bad_group_is_one_line_naming_it(key: str, value: object, message: str) -> None:
    from lightning_fleet.planning.cluster import cluster_from_dict

    data = MIXED.to_dict()
    data["groups"][1][key] = value
    with pytest.raises(FleetError, match=message) as err:
        cluster_from_dict(data)
    assert "\n" not in str(err.value) and str(err.value).count("cluster.groups[1]") == 1


def test_rank_devices_must_be_one_per_rank_and_round_trip() -> None:
    from lightning_fleet.planning.cluster import cluster_from_dict

    cpu = load_cluster("cpu")
    slow = dataclasses.replace(cpu.groups[0].device, name="slow", peak_tflops=PeakTflops(bf16=0.01, fp16=0.01, fp32=0.02))
    measured = dataclasses.replace(cpu, rank_devices=(cpu.groups[0].device, slow))
    assert cluster_from_dict(measured.to_dict()) == measured and not measured.is_homogeneous
    assert measured.rank_device(1) == slow and measured.planning_device().peak_tflops.fp32 == 0.02
    with pytest.raises(FleetError, match="rank_devices lists 1 devices for 2 ranks: give one per rank"):
        dataclasses.replace(cpu, rank_devices=(slow,))
    with pytest.raises(FleetError, match="a device measured per rank; only a homogeneous cluster can be resized"):
        measured.with_nodes(2)


def test_devices_by_speed_scale_the_fastest_device() -> None:
    from lightning_fleet.planning.cluster import devices_by_speed

    fast = dataclasses.replace(H100, name="gpu rank 3")
    slow_fast = devices_by_speed(fast, [2.0, 4.0])
    assert [d.name for d in slow_fast] == ["gpu rank 0", "gpu rank 1"]
    assert slow_fast[1].peak_tflops == H100.peak_tflops
    assert slow_fast[0].peak_tflops == PeakTflops(bf16=989 / 2, fp16=989 / 2, fp32=67 / 2)
    assert slow_fast[0].memory_gib == H100.memory_gib and slow_fast[0].memory_GBps == H100.memory_GBps / 2
    assert (slow_fast[0].slowdown, slow_fast[1].slowdown) == (2.0, 1.0)
    assert slow_fast[0].host_slowdown == slow_fast[1].host_slowdown == 1.0


def test_devices_by_speed_take_each_ranks_host_and_memory() -> None:
    """A rank's host measured at a third of the fastest host's speed takes 3x its framework time; memory is its own."""
    from lightning_fleet.planning.cluster import devices_by_speed

    devices = devices_by_speed(H100, [4.0, 4.0, 1.0], host_speeds=[3.0, 1.0, 3.0], memory_gib=[80, 40, 80])
    assert [d.host_slowdown for d in devices] == [1.0, 3.0, 1.0]
    assert [d.slowdown for d in devices] == [1.0, 1.0, 4.0]
    assert [d.memory_gib for d in devices] == [80, 40, 80]
    with pytest.raises(FleetError, match="each rank needs one positive speed, host speed and memory"):
        devices_by_speed(H100, [1.0, 0.0])
    with pytest.raises(FleetError, match="each rank needs one positive speed"):
        devices_by_speed(H100, [1.0, 2.0], host_speeds=[1.0])


def test_calibration_on_a_slower_device_and_host_by_hand() -> None:
    """Calibration.on: per-element and device Adam work scale by the device's slowdown, every host time and CPU Adam by
    its host's; a device at the calibration's speed gets the calibration itself."""
    from lightning_fleet.planning.cluster import Calibration

    c = Calibration(op_overhead_s=1e-5, microbatch_overhead_s=2e-3, step_overhead_s=0.1, elementwise_s=1e-9,
                    zero_step_overhead_s=(0.0, 0.01, 0.02, 0.03), zero_tensor_overhead_s=(1e-5, 1e-5, 2e-5, 3e-5),
                    offload_tensor_overhead_s=(1e-4, 2e-4), adam_params_per_s=1e9, cpu_adam_params_per_s=1e8)
    slow = dataclasses.replace(H100, slowdown=2.0, host_slowdown=3.0)
    on = c.on(slow)
    assert c.on(H100) is c
    assert on.elementwise_s == pytest.approx(2e-9) and on.adam_params_per_s == pytest.approx(5e8)
    assert (on.op_overhead_s, on.microbatch_overhead_s, on.step_overhead_s) == pytest.approx((3e-5, 6e-3, 0.3))
    assert on.zero_step_overhead_s == pytest.approx((0.0, 0.03, 0.06, 0.09))
    assert on.zero_tensor_overhead_s == pytest.approx((3e-5, 3e-5, 6e-5, 9e-5))
    assert on.offload_tensor_overhead_s == pytest.approx((3e-4, 6e-4)) and on.cpu_adam_params_per_s == pytest.approx(1e8 / 3)
    assert on.matmul_efficiency == c.matmul_efficiency and on.overlap == c.overlap


def test_a_slower_host_slows_its_replica_in_the_estimate() -> None:
    """Two CPU ranks of equal GEMM speed, rank 1's host at half speed: its replica's per-operator time doubles, so the
    planner gives it fewer samples than rank 0 (the GEMMs alone would split evenly), and the estimate of an even split
    is paced by it."""
    from lightning_fleet.planning.cluster import devices_by_speed
    from lightning_fleet.planning.search import split_by_speed

    base = load_cluster("cpu")
    cpu = base.with_calibration(dataclasses.replace(base.calibration, op_overhead_s=1e-4))
    model = dataclasses.replace(load_model("gpt-tiny"), forward_ops=200)  # 0.06 s of host time a micro-batch
    hosts = dataclasses.replace(cpu, rank_devices=devices_by_speed(cpu.groups[0].device, [1.0, 1.0], host_speeds=[2.0, 1.0]))
    same = dataclasses.replace(cpu, rank_devices=devices_by_speed(cpu.groups[0].device, [1.0, 1.0]))
    even = Plan(dp=2, tp=1, pp=1, zero=1, mbs=model.global_batch_size // 2, gas=1)
    assert estimate(model, hosts, even).time.step_s > estimate(model, same, even).time.step_s
    split = split_by_speed(model, hosts, even)
    assert split is not None and split.dp_mbs is not None and split.dp_mbs[0] > split.dp_mbs[1]
    assert split_by_speed(model, same, even) == even  # alike: the even split


def test_device_slowdowns_read_back_and_bad_ones_are_one_line() -> None:
    cpu = load_cluster("cpu")
    slow = dataclasses.replace(cpu.groups[0].device, slowdown=2.0, host_slowdown=1.5)
    measured = dataclasses.replace(cpu, rank_devices=(cpu.groups[0].device, slow))
    assert cluster_from_dict(measured.to_dict()) == measured
    assert "slowdown" not in measured.to_dict()["rank_devices"][0]
    with pytest.raises(FleetError, match=r"device.slowdown must be a number >= 1 .* got 0.5"):
        dataclasses.replace(slow, slowdown=0.5)


def test_stage_capacity_moves_layers_to_the_faster_stage_by_hand() -> None:
    """8 equal layers on 2 stages: alike 4/4; the second at half speed, its load counts double, the busiest stage then
    carries 6 average layers' worth at best (6/2 or 5/3), the other way round 3/5 or 2/6."""
    from lightning_fleet.planning.stages import balanced_stage_layers
    from tests.test_uneven_stages import _blocks_model

    model = _blocks_model(8, pre=False)
    assert balanced_stage_layers(model, 2, ((1.0, 1.0), (1.0, 1.0))) == balanced_stage_layers(model, 2) == (4, 4)
    slow_last = balanced_stage_layers(model, 2, ((1.0, 1.0), (0.5, 1.0)))
    assert slow_last in ((6, 2), (5, 3)) and max(slow_last[0] / 1.0, slow_last[1] / 0.5) == 6
    slow_first = balanced_stage_layers(model, 2, ((0.5, 1.0), (1.0, 1.0)))
    assert slow_first in ((2, 6), (3, 5)) and max(slow_first[0] / 0.5, slow_first[1] / 1.0) == 6
    with pytest.raises(FleetError, match=r"capacity must give pp\(2\) positive \(speed, memory\) pairs"):
        balanced_stage_layers(model, 2, ((1.0, 1.0),))


def test_a_pipeline_over_mixed_devices_gives_the_faster_stages_more_layers() -> None:
    """gpt3-175b with pp=4 fixed on 2 H100 + 2 A100 nodes: stages 0-1 on H100s, 2-3 on A100s; the planner re-splits the
    layers by the stages' speeds, prices each stage on its own device, and gains over the plan for the slowest device."""
    from lightning_fleet.planning.estimate import stage_devices

    model = load_model("gpt3-175b")
    result = plan(model, MIXED, top=1, pp=4, vpp=1, tp=8, zero_stages=(1,))
    best = result.best
    assert stage_devices(MIXED, best.plan) == (H100, H100, A100, A100)
    layers = best.plan.stage_layers
    assert layers is not None and min(layers[:2]) > max(layers[2:]) and sum(layers) == model.num_layers
    assert result.even_best is not None and result.speedup_over_even > 1.2
    slowest = estimate(model, MIXED.with_device(slowest_device([H100, A100])), best.plan)
    assert best.time.step_s < slowest.time.step_s  # the H100 stages priced at their own rate


def test_a_stage_whose_end_block_alone_outweighs_the_bound_is_not_a_split() -> None:
    """A last stage 20x slower than the first (a V100's bf16 against an A100's) cannot hold even the head within a tight
    bound; the layer split must say so rather than return it (the bisection then never ended): all layers but none go
    to the fast stage, and the busiest stage's load is the one reported."""
    from lightning_fleet.planning.stages import _LayerCosts, balanced_stage_layers

    model = load_model("llama-3-8b")
    capacity = ((1.0, 1.0), (15.7 / 312, 32 / 80))
    costs = _LayerCosts(model, 2, capacity)
    head_alone = costs.cost(0, model.num_layers, model.num_layers, 1) / costs.unit[0] / capacity[1][0]
    assert costs.fill(costs.bounds(head_alone * 0.99)) is None
    assert balanced_stage_layers(model, 2, capacity) == (model.num_layers, 0)


def _one_a100_one_v100_node(inter_GBps: float = 25.0):
    data = load_cluster("mixed-a100-v100").to_dict()
    data["groups"][0]["nodes"] = data["groups"][1]["nodes"] = 1
    data["inter_node"] = {"bandwidth_GBps": inter_GBps, "latency_us": 10}
    return cluster_from_dict(data)


def test_without_devices_keeps_each_nodes_other_ranks() -> None:
    from lightning_fleet.planning.cluster import devices_by_speed

    mixed = _one_a100_one_v100_node()
    a100, v100 = mixed.groups[0].device, mixed.groups[1].device
    rest = mixed.without_devices({v100})
    assert rest.world_size == 8 and rest.is_homogeneous and rest.groups[0].device == a100 and rest.rank_devices == ()
    with pytest.raises(FleetError, match="leaves no rank"):
        mixed.without_devices({a100, v100})
    cpu = load_cluster("cpu")
    measured = dataclasses.replace(cpu, rank_devices=devices_by_speed(cpu.groups[0].device, [1.0, 0.1]))
    host_heavy = measured.with_calibration(dataclasses.replace(cpu.calibration, cpu_adam_params_per_s=2e9, adam_params_per_s=1.5e9))
    alone = host_heavy.without_devices({measured.rank_devices[1]})
    assert alone.world_size == 1 and alone.groups[0].devices_per_node == 1 and alone.rank_device(0) == measured.rank_devices[0]
    assert alone.calibration.cpu_adam_params_per_s == 1.5e9  # one device on the host now: CPU Adam no faster than it


def test_the_planner_leaves_out_devices_that_slow_the_job_down() -> None:
    """tinyllama-1.1b trains in bf16; a V100 has no bf16 (its bf16 figure is its fp32 rate, 15.7 against the A100's
    312 TFLOP/s): its replicas take one sample each and still pace the step, so the 8 A100s alone are faster; the
    leave-out plan is the planner's best for them, and the line says which ranks and by how much. Where the V100s help
    (gpt-1.7b in fp16 on the shipped preset) nothing is left out."""
    mixed = _one_a100_one_v100_node()
    model = load_model("tinyllama-1.1b")
    result = plan(model, mixed)
    leave = result.leave_out
    assert leave is not None and leave.ranks == tuple(range(8, 16)) and leave.devices == ("V100-SXM2-32GB",)
    alone = plan(model, mixed.without_devices({mixed.groups[1].device}), consider_leaving_out=False).best
    assert leave.best.plan == alone.plan and leave.best.time.step_s == alone.time.step_s
    assert leave.speedup(result.best) == result.best.time.step_s / alone.time.step_s >= 1.05
    line = leave.line(result.best)
    assert line.startswith("leave out: the 8 V100-SXM2-32GB devices (ranks 8-15) slow this job down: the other 8 run ")
    assert f"{leave.speedup(result.best):.2f}x the throughput with them" in line
    assert result.to_dict()["leave_out"]["ranks"] == list(range(8, 16))
    assert plan(model, mixed, consider_leaving_out=False).leave_out is None
    assert plan(load_model("gpt-1.7b"), load_cluster("mixed-a100-v100")).leave_out is None


def test_fleet_plan_prints_the_leave_out_line(capsys, tmp_path) -> None:
    path = tmp_path / "mixed.yaml"
    path.write_text(_one_a100_one_v100_node().to_yaml())
    assert main(["plan", "--model", "tinyllama-1.1b", "--cluster", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "leave out: the 8 V100-SXM2-32GB devices (ranks 8-15) slow this job down" in out
    assert main(["plan", "--model", "tinyllama-1.1b", "--cluster", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["leave_out"]["world_size"] == 8
