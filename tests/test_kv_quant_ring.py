"""Real prima-node processes with quantized KV caches (--kv-dtype): every ring shape gives the greedy tokens of the
single-process reference with the same KV dtype, and status reports each node's KV dtype and bytes a position."""

import grpc
import pytest
import torch

from nodes.engine.kv_dtype import INT4, INT8
from nodes.generation.reference import ReferenceModel
from nodes.generation.state import GenerateParams
from prima_rpc.app import ring
from prima_rpc.app.status_rows import status_row
from prima_rpc.control import Control, assign_request
from tests.rings import collect, local_ring

pytestmark = pytest.mark.slow
PROMPTS = ["What is the capital of France?", "Write a haiku about autumn."]
TOKENS = 12


@pytest.fixture(scope="module")
def int8_reference(smol_store):
    model = ReferenceModel(smol_store, kv_dtype=INT8)
    return {p: [t.token_id for t in model.generate(p, GenerateParams(max_tokens=TOKENS))] for p in PROMPTS}


def test_every_ring_shape_with_int8_kv_equals_the_int8_reference(smol_store, int8_reference, tmp_path):
    with local_ring(smol_store, 3, tmp_path, extra_args=[["--kv-dtype", "int8"]] * 3) as local:
        for windows in ([10, 10, 10], [7, 3, 5], [2, 2, 1]):  # k = 1, 2 and 6
            ring.start(local.addresses[0], windows)
            for prompt in PROMPTS:
                tokens, done = collect(local.addresses[0], prompt, TOKENS)
                assert tokens == int8_reference[prompt], f"windows {windows}, prompt {prompt!r}"
        rows = [status_row(a, "up", info) for a, info in ring.walk(local.addresses[0])]
    assert [r["kv_dtype"] for r in rows] == ["int8"] * 3
    per_layer = 2 * 3 * INT8.row_bytes(64, torch.float32)  # SmolLM2: 3 KV heads of 64
    assert [r["kv_bytes_per_token"] for r in rows] == [per_layer * n for n in (12, 12, 6)]  # 6 rounds of [2, 2, 1]


def test_auto_takes_the_plans_kv_dtype_and_a_bad_one_is_refused(smol_store, tmp_path):
    """A node at --kv-dtype auto loads the assignment's KV dtype; one with its own keeps it."""
    with local_ring(smol_store, 2, tmp_path, extra_args=[["--kv-dtype", "float"], []]) as local:
        ring.start(local.addresses[0], [20, 10], kv_dtypes=["int4", "int4"])
        rows = [status_row(a, "up", info) for a, info in ring.walk(local.addresses[0])]
        assert [r["kv_dtype"] for r in rows] == ["float", "int4"]
        assert rows[1]["kv_bytes_per_token"] == 2 * 3 * INT4.row_bytes(64, torch.float32) * 10
        assert rows[0]["kv_bytes_per_token"] == 2 * 3 * 64 * 4 * 20  # float32 SmolLM2
        tokens, _ = collect(local.addresses[0], PROMPTS[0], 4)
        assert len(tokens) == 4
        with Control(local.addresses[1]) as peer:
            info = peer.info()
            with pytest.raises(grpc.RpcError) as err:
                for _ in peer.assign(assign_request([(0, 10)], info.n_layers, info.model_id, 0, kv_dtype="int3")):
                    pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_dtype" in err.value.details()


def test_the_plans_kv_dtype_survives_the_heads_replan(tiny_store, tmp_path):
    """A worker lost: the head re-plans the survivors, which keep the KV dtype and context the plan gave them."""
    with local_ring(tiny_store, 3, tmp_path) as local:
        head, _, worker = local.addresses
        ring.start(head, [3, 3, 2], kv_dtypes=["int8"] * 3, ctx=300)
        local.processes[1].kill()
        local.processes[1].wait()
        tokens, _ = collect(head, "hello", 4, raw=True)  # on the survivors, replayed if it raced the re-plan
        assert len(tokens) == 4
        infos = {a: info for a, info in ring.walk(head)}
        assert set(infos) == {head, worker}
        assert all(info.kv_dtype == "int8" and info.kv_positions for info in infos.values())
