"""Issue 22 items 10 and 11: the restricted loader is a property of each load (threads, subprocesses and the user's own
torch settings are untouched), and what admitted types can carry is checked against what DeepSpeed expects.

Single process, torch (and DeepSpeed's loss-scaler and fragment classes); each hostile payload is built as an attacker
would write it and refused in one line.
"""

from __future__ import annotations

import argparse
import fractions
import pathlib
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lightning_fleet.elastic.safe_load import load_file
from lightning_fleet.planning import FleetError
from tests.test_safe_load import zip_torch_file

pytestmark = pytest.mark.unit

_RELEASE = threading.Event()
_ENTERED = threading.Event()


class Slow:
    """A class a user trusts (add_safe_globals): unpickling it waits until the test releases it, so a library load
    is in progress for as long as the test needs."""

    def __init__(self) -> None:
        self.value = 1  # a state, so that unpickling calls __setstate__

    def __setstate__(self, state):
        _ENTERED.set()
        assert _RELEASE.wait(60)
        self.__dict__.update(state)


@pytest.fixture
def user_safe_globals():
    """The user's own safe globals, restored after the test whatever it did."""
    before = torch.serialization.get_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)


def test_a_library_load_in_one_thread_changes_nothing_for_the_others(tmp_path, user_safe_globals):
    """While a load of ours is in progress in one thread: a payload loaded by another library load is refused, during
    and after the first; the user's own torch.load(weights_only=False) and a subprocess the user starts load what
    weights_only would refuse; the user's add_safe_globals entries (one of them also on our allowlist) survive. Before:
    restricted() set TORCH_FORCE_WEIGHTS_ONLY_LOAD for the process, so the user's load and subprocess were refused,
    and its safe_globals exit removed the user's PosixPath entry."""
    from lightning_fleet.runtime.deepspeed.checked_engine import checked_loads

    torch.serialization.add_safe_globals([Slow, pathlib.PosixPath])
    slow = tmp_path / "slow.ckpt"
    torch.save({"hyper_parameters": {"x": Slow()}}, slow)
    payload, marker = tmp_path / "mp_rank_00_model_states.pt", tmp_path / "ran"
    payload.write_bytes(zip_torch_file(marker))
    mine = tmp_path / "user.pt"
    torch.save({"ratio": fractions.Fraction(1, 3)}, mine)  # weights_only refuses Fraction; the user chose to trust it
    _RELEASE.clear(), _ENTERED.clear()
    loaded: list = []
    first = threading.Thread(target=lambda: loaded.append(load_file(slow, kind="lightning")), daemon=True)
    first.start()
    assert _ENTERED.wait(30)  # the first load is inside its unpickler now
    engine = SimpleNamespace(checkpoint_engine=None, optimizer=None, module=None)
    with checked_loads(engine, None):  # a DeepSpeed load of ours in this thread, overlapping the first
        with pytest.raises(FleetError, match="restricted unpickler refuses"):
            engine.checkpoint_engine.load(str(payload))
        assert torch.load(mine, weights_only=False)["ratio"] == fractions.Fraction(1, 3)
        code = f"import torch, fractions; assert torch.load({str(mine)!r}, weights_only=False)['ratio'] == fractions.Fraction(1, 3)"
        assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0
        _RELEASE.set()
        first.join(30)
        assert not first.is_alive() and loaded and isinstance(loaded[0]["hyper_parameters"]["x"], Slow)
        with pytest.raises(FleetError, match="restricted unpickler refuses"):  # after the first load has left
            engine.checkpoint_engine.load(str(payload))
    assert not marker.exists()
    assert {Slow, pathlib.PosixPath} <= set(torch.serialization.get_safe_globals())


def test_a_user_thread_loads_unrestricted_while_the_library_loads(tmp_path, user_safe_globals):
    """The user's own thread calls torch.load(weights_only=False) while our load is in progress: it succeeds."""
    torch.serialization.add_safe_globals([Slow])
    slow = tmp_path / "slow.ckpt"
    torch.save({"x": Slow()}, slow)
    mine = tmp_path / "user.pt"
    torch.save({"ratio": fractions.Fraction(2, 3)}, mine)
    _RELEASE.clear(), _ENTERED.clear()
    library = threading.Thread(target=lambda: load_file(slow, kind="lightning"), daemon=True)
    library.start()
    assert _ENTERED.wait(30)
    got: list = []
    user = threading.Thread(target=lambda: got.append(torch.load(mine, weights_only=False)), daemon=True)
    user.start()
    user.join(30)
    _RELEASE.set()
    library.join(30)
    assert got and got[0]["ratio"] == fractions.Fraction(2, 3)


# --- admitted types, attacker-chosen state ----------------------------------------------------------------------------


def _scaler(**fields):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1.0, delayed_shift=2, consecutive_hysteresis=False)
    scaler.__dict__.update(fields)
    return scaler


def _optim_states(loss_scaler) -> dict:
    return {"optimizer_state_dict": {"loss_scaler": loss_scaler, "single_partition_of_fp32_groups": [torch.ones(4)]}}


class _Reduced:
    """Pickles as ``func(*args)`` followed by ``BUILD state`` (what an attacker writes by hand)."""

    def __init__(self, func, args, state=None):
        self.spec = (func, args) if state is None else (func, args, state)

    def __reduce__(self):
        return self.spec


def _parameter_with_attributes():
    """``_rebuild_from_type_v2(_rebuild_tensor_v2, Parameter, <tensor args>, {ds_tensor, ds_status})``: torch's
    weights_only unpickler builds a Parameter with those attributes set."""
    args = torch.ones(4).__reduce_ex__(2)[1]
    return _Reduced(torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_tensor_v2, torch.nn.Parameter, args,
                                                          {"ds_status": "AVAILABLE", "ds_numel": 10**12}))


def _shadowing_state_dict():
    sd = OrderedDict(w=torch.ones(2))
    sd.keys = OrderedDict  # sd.keys() -> an empty mapping: a strict load would see no keys at all
    return sd


HOSTILE = {
    "Namespace posing as DynamicLossScaler (optim states)": (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        lambda: _optim_states(argparse.Namespace(**vars(_scaler(cur_scale=0)))),
        "it would import argparse.Namespace when loaded"),
    "Namespace posing as the loss scaler (ZeRO-0 model states)": (
        "mp_rank_00_model_states.pt",
        lambda: {"optimizer": {"loss_scaler": argparse.Namespace(**vars(_scaler(cur_scale=0)))}},
        "/optimizer/loss_scaler is a argparse.Namespace; DeepSpeed's loss scaler must be its LossScaler or DynamicLossScaler"),
    "DynamicLossScaler with cur_scale=0": (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda: _optim_states(_scaler(cur_scale=0)),
        "loss scaler /optimizer_state_dict/loss_scaler.cur_scale is 0, expected a finite number > 0"),
    "DynamicLossScaler with a NaN scale": (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda: _optim_states(_scaler(cur_scale=float("nan"))),
        "cur_scale is nan, expected a finite number > 0"),
    "DynamicLossScaler with an attribute of its own": (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda: _optim_states(_scaler(has_overflow_serial=0)),
        "given attributes ['has_overflow_serial']"),
    "OrderedDict whose keys attribute shadows its contents": (
        "mp_rank_00_model_states.pt", lambda: {"module": _shadowing_state_dict()},
        "given attributes ['keys']; it has only ['_metadata']"),
    "PosixPath whose str is not its parts": (
        "mp_rank_00_model_states.pt",
        lambda: {"hyper_parameters": {"data": _Reduced(pathlib.PosixPath, ("data",), (None, {"_str": "/etc/shadow"}))}},
        "attributes set on a pathlib.PosixPath"),
    "Parameter rebuilt with arbitrary attributes": (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda: {"optimizer_state_dict": {"fp32_flat_groups": [_parameter_with_attributes()]}},
        "it would import torch.nn.parameter.Parameter when loaded"),
    "tensor with attributes beyond ZeRO-3's ds_id": (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        lambda: {"fp32_flat_groups": [_Reduced(torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_tensor_v2, torch.Tensor,
                                                                                       torch.ones(2).__reduce_ex__(2)[1], {"ds_id": "0", "ds_tensor": "x"}))]},
        "a tensor carries attributes ['ds_id', 'ds_tensor']"),
    "slice mapping with a negative start": (
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda: {"param_slice_mappings": [OrderedDict(w=_fragment(4, -8))]},
        "slice mapping /param_slice_mappings[0]/w is {'numel': 4, 'start': -8}"),
    "loss scaler in an RNG file": ("rank-00000.pt", lambda: {"s": _scaler()}, "it would import deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
}


def _fragment(numel, start):
    from deepspeed.utils.tensor_fragment import fragment_address

    return fragment_address(numel=numel, start=start)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_attacker_chosen_state_in_admitted_types_is_refused_in_one_line(tmp_path, case):
    name, build, words = HOSTILE[case]
    path = tmp_path / name
    torch.save(build(), path)
    with pytest.raises(FleetError) as refused:
        load_file(path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and words in message, message


def test_the_old_loader_admitted_these_payloads(tmp_path):
    """The proof the payloads mean something: torch's weights_only unpickler with the old allowlist builds each (a
    Namespace with cur_scale=0, a state_dict whose keys() hide its tensors, a path reading /etc/shadow, a Parameter
    with DeepSpeed's attributes)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    old = [argparse.Namespace, pathlib.PosixPath, DynamicLossScaler]
    path = tmp_path / "x.pt"
    cases = {
        "scaler": (lambda: {"s": argparse.Namespace(**vars(_scaler(cur_scale=0)))}, lambda v: v["s"].cur_scale == 0),
        "keys": (lambda: {"m": _shadowing_state_dict()}, lambda v: len(v["m"].keys()) == 0 and len(v["m"]) == 1),
        "path": (lambda: {"p": _Reduced(pathlib.PosixPath, ("data",), (None, {"_str": "/etc/shadow"}))}, lambda v: str(v["p"]) == "/etc/shadow"),
        "param": (lambda: {"p": _parameter_with_attributes()}, lambda v: v["p"].ds_numel == 10**12),
    }
    for name, (build, holds) in cases.items():
        torch.save(build(), path)
        with torch.serialization.safe_globals(old):
            assert holds(torch.load(path, weights_only=True)), name
