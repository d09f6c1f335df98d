"""The whole context planned (issue 50): Halda prices each device's KV cache in its KV dtype at the requested
context, a long context takes layers off a device, and devices at auto get the most precise KV dtype that holds it."""

import dataclasses
from pathlib import Path

import pytest
import torch

from nodes.engine.kv_dtype import kv_dtype
from prima_rpc.spec.profiles import DeviceProfile, load_profiles
from solver.cost_model import Instance
from solver.kv_term import kv_bytes_per_token_layer, row_bytes
from solver.model_profile import ModelProfile
from solver.presets import preset
from solver.strategies import plan_for, plan_offline

TESTBED = Path(__file__).resolve().parents[1] / "solver" / "testbeds" / "prima_d1_d4.json"
MANIFEST = preset("llama3-8b").to_manifest()  # 8 KV heads of 128, planned with 16-bit float KV


@pytest.mark.parametrize("name", ["float", "int8", "int4"])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_the_solver_counts_a_rows_bytes_as_the_cache_stores_it(name, head_dim):
    for dtype in (torch.float32, torch.bfloat16):
        assert row_bytes(head_dim, dtype.itemsize, name) == kv_dtype(name).row_bytes(head_dim, dtype)


def windows(result: dict) -> dict[str, int]:
    return {d["name"]: d["window"] * result["k"] for d in result["devices"]}


def test_a_long_context_takes_layers_off_a_device_and_plan_shows_its_kv_bytes():
    short, long = (plan_offline(TESTBED, MANIFEST, n_ctx=n) for n in (4096, 65536))
    assert windows(short)["D3"] == 32 and windows(long)["D3"] < 32  # D3's memory now holds KV as well
    model = ModelProfile.from_json(MANIFEST)
    for result in (short, long):
        for d in result["devices"]:
            assert d["kv_dtype"] == "float"
            assert d["kv_bytes"] == kv_bytes_per_token_layer(model, "float") * result["ctx"] * d["window"] * result["k"]


def test_auto_takes_int8_where_float_kv_would_read_layers_from_disk():
    ctx = 300_000  # the testbed's memory holds the 8B's weights and this context only in 8-bit KV
    fixed = plan_offline(TESTBED, MANIFEST, n_ctx=ctx)
    chosen = plan_offline(TESTBED, MANIFEST, n_ctx=ctx, choose_kv=True)
    assert any(d["disk_ms"] > 0 for d in fixed["devices"])
    assert {d["kv_dtype"] for d in chosen["devices"]} == {"int8"}
    assert all(d["disk_ms"] == 0 for d in chosen["devices"])
    assert chosen["predicted_tpot_ms"] < fixed["predicted_tpot_ms"] / 10
    # where float holds the context, auto stays float
    assert {d["kv_dtype"] for d in plan_offline(TESTBED, MANIFEST, n_ctx=65536, choose_kv=True)["devices"]} == {"float"}


def test_a_devices_own_kv_dtype_is_priced_whatever_the_choice():
    devices = tuple(dataclasses.replace(d, kv_dtype="int4") if d.name == "D3" else d
                    for d in load_profiles(TESTBED))
    result = plan_for(devices, MANIFEST, n_ctx=65536)
    by_name = {d["name"]: d for d in result["devices"]}
    assert by_name["D3"]["kv_dtype"] == "int4" and by_name["D2"]["kv_dtype"] == "float"
    assert windows(result)["D3"] == 32  # 4-bit KV: its memory holds every layer again
    assert Instance(devices, ModelProfile.from_json(MANIFEST)).priced_kv == ("float", "float", "int4", "float")


def test_a_bad_kv_dtype_is_refused():
    d = load_profiles(TESTBED)[0]
    with pytest.raises(ValueError, match="kv_dtype"):
        DeviceProfile.from_json({**d.to_json(), "kv_dtype": "int3"})
    with pytest.raises(ValueError, match="kv_dtypes"):
        Instance(load_profiles(TESTBED), ModelProfile.from_json(MANIFEST), kv_dtypes=("float",))
