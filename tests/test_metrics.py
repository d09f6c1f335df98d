"""Prometheus metrics: the node collector in-process, the bearer check, and a real ring scraped around a request."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nodes.ring import metrics
from nodes.ring.spans import Spans
from prima_rpc.app.local_ring import free_ports
from prima_rpc.client import PrimaError
from prima_rpc.v1 import prima_pb2 as pb
from tests.ctl import ctl
from tests.rings import collect, local_ring


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


class FakeNode:
    def __init__(self):
        self.stats = pb.NodeStats(compute_s=2.0, stall_s=0.5, link_s=0.25, frames=7, disk_read_bytes=1024,
                                  resident_bytes=4096, rss_bytes=8192, active_requests=1, last_token_ms=40.0,
                                  batches=3, batched_frames=7, max_batch_seen=4, queue_depth=2, queue_wait_s=0.5,
                                  max_batch=8)
        self.spans = Spans()
        self.spans.add("Shard.compute_batch.run", 0.25)

    def info(self) -> pb.NodeInfo:
        return pb.NodeInfo(name="n0", role="head", model_name="tiny", windows=[pb.LayerRange(start=0, stop=4)],
                           epoch=3, stats=self.stats)


def test_collector_reads_node_info_at_scrape_time_and_counters_never_go_back():
    node = FakeNode()
    registry = metrics.registry_for(node)
    first = samples(generate_latest(registry).decode())
    assert first[("prima_frames_total", ())] == 7
    assert first[("prima_compute_seconds_total", ())] == 2.0
    assert first[("prima_disk_read_bytes_total", ())] == 1024
    assert first[("prima_resident_bytes", ())] == 4096 and first[("prima_active_requests", ())] == 1
    assert first[("prima_last_token_seconds", ())] == pytest.approx(0.04)
    assert first[("prima_batches_total", ())] == 3 and first[("prima_batched_frames_total", ())] == 7
    assert first[("prima_queue_depth", ())] == 2 and first[("prima_queue_wait_seconds_total", ())] == 0.5
    assert first[("prima_max_batch_seen", ())] == 4 and first[("prima_max_batch", ())] == 8
    assert first[("prima_span_seconds_total", (("span", "Shard.compute_batch.run"),))] == 0.25
    assert first[("prima_spans_total", (("span", "Shard.compute_batch.run"),))] == 1
    info = next(k for k in first if k[0] == "prima_node_info")
    assert dict(info[1]) == {"name": "n0", "role": "head", "model": "tiny", "windows": "[0,4)"}
    node.stats.frames, node.stats.compute_s = 9, 1.5  # net compute dipped mid-frame
    second = samples(generate_latest(registry).decode())
    assert second[("prima_frames_total", ())] == 9 and second[("prima_compute_seconds_total", ())] == 2.0


def test_metrics_need_the_cluster_token_when_the_ring_has_one():
    async def scrape(headers: dict) -> tuple[int, str]:
        async with TestClient(TestServer(metrics.make_app(metrics.registry_for(FakeNode()), "s3cret"))) as client:
            resp = await client.get("/metrics", headers=headers)
            return resp.status, await resp.text()

    assert asyncio.run(scrape({}))[0] == 401
    assert asyncio.run(scrape({"Authorization": "Bearer wrong"}))[0] == 401
    status, text = asyncio.run(scrape({"Authorization": "Bearer s3cret"}))
    assert status == 200 and "prima_frames_total 7.0" in text


@pytest.fixture(scope="module")
def metered_ring(smol_store, tmp_path_factory):
    ports = free_ports(2)
    with local_ring(smol_store, 2, tmp_path_factory.mktemp("metrics"), [20, 10],
                    extra_args=[["--metrics-port", str(p)] for p in ports]) as local:
        yield local, [f"http://127.0.0.1:{p}/metrics" for p in ports]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/plain")
        return samples(resp.read().decode())


REPEATING = [{"role": "user", "content": "Say 'one two three' four times: one two three one two three"}]


@pytest.mark.slow
def test_counters_move_after_a_request(metered_ring):
    local, urls = metered_ring
    before = [scrape(u) for u in urls]
    collect(local.addresses[0], "Name a color.", 8, speculate="off")  # a frame per token
    with pytest.raises(PrimaError):  # a prompt beyond the model's context: only the head can refuse it
        collect(local.addresses[0], "Name a color.", 8, messages=[{"role": "user", "content": "hi " * 9000}])
    after = [scrape(u) for u in urls]

    def grew(i: int, name: str, labels: tuple = ()) -> float:
        return after[i].get((name, labels), 0.0) - before[i].get((name, labels), 0.0)

    assert grew(0, "prima_generated_tokens_total") == 8
    assert grew(0, "prima_ttft_seconds_count") == 1 and grew(0, "prima_tpot_seconds_count") == 1
    assert grew(0, "prima_ttft_seconds_sum") > 0
    assert grew(0, "prima_requests_total", (("finish_reason", "length"),)) == 1
    assert grew(0, "prima_request_errors_total", (("code", "INVALID_ARGUMENT"),)) == 1
    assert grew(0, "prima_prompt_tokens_total") > 0
    for i in (0, 1):  # both nodes computed every token's frame
        assert grew(i, "prima_frames_total") >= 8
        assert grew(i, "prima_compute_seconds_total") > 0
        assert after[i][("prima_resident_bytes", ())] > 0 and after[i][("prima_rss_bytes", ())] > 0
        assert after[i][("prima_active_requests", ())] == 0
    assert grew(0, "prima_link_seconds_total") > 0
    for span in ("receive", "send", "inbox"):  # the per-token budget's parts (tools/bench/token_budget.py)
        assert grew(1, "prima_spans_total", (("span", span),)) >= 8
    computed = [grew(1, "prima_spans_total", (("span", f"Shard.compute_batch.{part}"),)) for part in ("run", "inline")]
    assert sum(computed) >= 8
    assert after[0][("prima_last_token_seconds", ())] > 0
    assert after[1].get(("prima_generated_tokens_total", ()), 0.0) == 0  # only the head serves requests
    _, done = collect(local.addresses[0], "", 8, speculate="ngram", messages=REPEATING)
    spec = scrape(urls[0])
    assert done.drafted > 0
    for name, count in (("prima_drafted_tokens_total", done.drafted), ("prima_accepted_tokens_total", done.accepted)):
        assert spec[(name, ())] - after[0].get((name, ()), 0) == count
    roles = {dict(k[1])["role"] for s in after for k in s if k[0] == "prima_node_info"}
    assert roles == {"head", "worker"}


@pytest.mark.slow
def test_status_watch_refreshes_until_interrupted(metered_ring):
    local, _ = metered_ring
    cmd = [sys.executable, "-m", "prima_rpc.app.cli", "--node", local.addresses[0],
           "status", "--watch", "0.2", "--json"]
    # faulthandler: a watch that outlives its Ctrl-C is aborted below and shows where each thread was
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    try:
        snapshots = [json.loads(proc.stdout.readline()) for _ in range(2)]
        proc.send_signal(signal.SIGINT)
        try:
            assert proc.wait(timeout=10) == 0, proc.stderr.read()
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            threads = proc.communicate(timeout=10)[1][-4000:]
            pytest.fail(f"status --watch did not stop on Ctrl-C; its threads:\n{threads}")
    finally:
        proc.kill()
    for snap in snapshots:
        assert [n["role"] for n in snap["nodes"]] == ["head", "worker"]
    assert snapshots[1]["time"] > snapshots[0]["time"]
    table = ctl("--node", local.addresses[0], "status", env={"COLUMNS": "100"}, timeout=60)
    assert table.returncode == 0 and local.addresses[0] in table.stdout and "[10,30)" in table.stdout
