"""The predicted column of the many-users benchmark on a live loopback ring (tools/bench/batch_prediction.py)."""

import pytest

from prima_rpc.app.applied_plan import predict
from tests.rings import local_ring
from tools.bench.batch_prediction import predict_live


@pytest.mark.slow
def test_prediction_for_a_live_ring(tiny_store, tmp_path, monkeypatch):
    monkeypatch.setenv("PRIMA_HOME", str(tmp_path))  # the nodes' profile caches: measured here, fresh
    with local_ring(tiny_store, 3, tmp_path / "logs", [4, 2, 2], timeout=120) as local:
        head = local.addresses[0]
        rows = predict_live(head, None, [1, 2, 4, 8])
        # one request: the prediction the ring's plan already shows (the web page's, status's)
        assert rows[0]["tpot_ms_per_request"] == pytest.approx(predict(head, None)["predicted_tpot_ms"])
        assert [r["concurrency"] for r in rows] == [1, 2, 4, 8]
        for r in rows:  # three nodes on one machine: their compute is one resource, one batch of all is best
            assert r["bottleneck"].startswith("shared host CPU (") and r["micro_batches"] == 1
            assert r["max_batch"] == r["concurrency"] and r["mode"] == "async"
        tps = [r["aggregate_tps"] for r in rows]
        assert tps == sorted(tps)  # a batch of b never costs more than b requests one at a time
        fixed = predict_live(head, None, [8], max_batch=2, micro_batches=4)[0]
        assert (fixed["max_batch"], fixed["micro_batches"]) == (2, 4)
        assert fixed["aggregate_tps"] <= tps[-1] * 1.01  # the plan's batching is within NEAR of the best
