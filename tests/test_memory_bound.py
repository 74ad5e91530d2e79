"""Tier-1 tests of memory-bound operators priced at the device memory's bandwidth (DeviceSpec.memory_GBps,
time.memory_bound_element_s, Hardware.elementwise_s).

Every expected value is a literal or a visible arithmetic expression with the formula named.
"""

from __future__ import annotations

import dataclasses

import pytest

from lightning_fleet.planning import FleetError, estimate, load_cluster, parse_plan
from lightning_fleet.planning.cluster import Calibration, DeviceGroup, cluster_from_dict
from lightning_fleet.planning.estimate import Hardware
from lightning_fleet.planning.model import Precision
from lightning_fleet.planning.time import MEMORY_BOUND_ACCESSES, memory_bound_element_s
from tests.conftest import make_cluster, make_model

pytestmark = pytest.mark.pure


def test_one_read_and_one_write_at_the_data_sheet_bandwidth() -> None:
    assert MEMORY_BOUND_ACCESSES == 2
    assert memory_bound_element_s(2039, 2) == pytest.approx(4 / 2039e9, rel=1e-15)  # A100 80GB, bf16: 1.96 ps
    assert memory_bound_element_s(3350, 4) == pytest.approx(8 / 3350e9, rel=1e-15)  # H100 SXM, fp32


def _with_bandwidth(cluster, memory_GBps):
    group = cluster.groups[0]
    device = dataclasses.replace(group.device, memory_GBps=memory_GBps)
    return dataclasses.replace(cluster, groups=(dataclasses.replace(group, device=device),))


@pytest.mark.parametrize(("precision", "element_bytes"), [("bf16-mixed", 2), ("fp16-mixed", 2), ("fp32", 4)])
def test_the_hardware_takes_the_device_rate_in_the_model_precision(precision: str, element_bytes: int) -> None:
    model = make_model(precision=precision)
    assert Precision(precision).element_bytes == element_bytes
    hw = Hardware.of(_with_bandwidth(make_cluster(), 2000), model)
    assert hw.elementwise_s == 2 * element_bytes / 2000e9


def test_a_stated_calibration_wins_and_no_bandwidth_folds_them_into_the_matmul_rate() -> None:
    model = make_model()
    assert Hardware.of(make_cluster(), model).elementwise_s == 0.0  # no bandwidth stated: as before this term existed
    assert Hardware.of(_with_bandwidth(make_cluster(elementwise_s=3e-9), 2000), model).elementwise_s == 3e-9
    assert Hardware.of(_with_bandwidth(make_cluster(elementwise_s=0.0), 2000), model).elementwise_s == 0.0


def test_the_estimate_adds_exactly_the_memory_bound_seconds() -> None:
    """Forward: elements x t; backward 2x forward; so compute grows by 3 x elements x mbs x gas x t (one stage, tp 1)."""
    model = make_model(layers=2, hidden=256, heads=4, seq=128, vocab=1000, gbs=8)
    plan = parse_plan("dp=8,mbs=1", global_batch_size=8)
    folded = estimate(model, make_cluster(), plan)
    priced = estimate(model, _with_bandwidth(make_cluster(), 2000), plan)
    elements = sum(b.elementwise * b.count for b in model.blocks)
    assert priced.time.compute_s - folded.time.compute_s == pytest.approx(3 * elements * 4 / 2000e9, rel=1e-9)
    assert priced.memory == folded.memory


def test_mixed_groups_plan_on_the_slowest_memory_and_an_unknown_one_folds() -> None:
    a100 = load_cluster("dgx-a100-80gb")
    v100 = load_cluster("dgx1-v100")
    both = dataclasses.replace(a100, groups=(a100.groups[0], v100.groups[0]))
    assert both.planning_device().memory_GBps == 900
    unknown = dataclasses.replace(v100.groups[0].device, memory_GBps=None)
    partly = dataclasses.replace(a100, groups=(a100.groups[0], DeviceGroup(nodes=1, devices_per_node=8, device=unknown)))
    assert partly.planning_device().memory_GBps is None


def test_every_gpu_preset_states_its_bandwidth_and_the_yaml_round_trips() -> None:
    expected = {"dgx-a100-40gb": 1555, "dgx-a100-80gb": 2039, "dgx-a100-80gb-x128": 2039, "dgx-a100-80gb-x384": 2039,
                "jean-zay-a100-80gb": 2039, "dgx-h100": 3350, "grand-teton-h100-96gb": 2400, "hgx-h200": 4800,
                "dgx1-v100": 900}
    for name, bandwidth in expected.items():
        cluster = load_cluster(name)
        assert cluster.groups[0].device.memory_GBps == bandwidth, name
        assert cluster_from_dict(cluster.to_dict()) == cluster
    cpu = load_cluster("cpu")
    assert cpu.groups[0].device.memory_GBps is None
    assert "memory_GBps" not in cpu.to_dict()["device"]
    assert "elementwise_s" not in load_cluster("dgx-h100").with_calibration(Calibration(overlap=0.5)).to_dict()["calibration"]


@pytest.mark.parametrize(("value", "message"), [
    (0, "device.memory_GBps must be > 0, got 0"),
    (-5, "device.memory_GBps must be > 0, got -5"),
    ("fast", "memory_GBps must be a number, got 'fast'"),
])
def test_a_bad_bandwidth_is_one_clear_error(value, message: str) -> None:
    data = load_cluster("dgx-h100").to_dict()
    data["device"]["memory_GBps"] = value
    with pytest.raises(FleetError, match=message) as err:
        cluster_from_dict(data)
    assert "\n" not in str(err.value)
