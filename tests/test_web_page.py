"""The web page of `prima-ctl serve` over HTTP: its files and their types, the token, /api/ring and /api/plan
on real tiny rings (the browser itself: test_web_browser.py)."""

import asyncio
import base64
import json
import re

import pytest
from aiohttp.test_utils import TestClient, TestServer

from prima_rpc.app.applied_plan import NOT_ASSIGNED, NoPlan, assignment
from prima_rpc.app.local_ring import free_ports
from prima_rpc.app.openai_api import ApiConfig, make_app
from prima_rpc.app.web_page import STATIC
from prima_rpc.v1 import prima_pb2 as pb
from tests.rings import local_ring

SECRET = "page-s3cret"
AUTH = {"Authorization": f"Bearer {SECRET}"}


def fetch(head: str, requests: list[tuple[str, str, dict]], token: str | None = None) -> list[tuple[int, str, bytes]]:
    """(status, content type, body) of each (method, path, headers), from the API's app on a loopback port."""

    async def main():
        async with TestClient(TestServer(make_app(ApiConfig(head, token)))) as client:
            out = []
            for method, path, headers in requests:
                if ".." in path:  # sent as written: a client would resolve it first
                    out.append(await raw_get(client.port, path))
                    continue
                res = await client.request(method, path, headers=headers)
                out.append((res.status, res.content_type, await res.read()))
            return out

    return asyncio.run(main())


async def raw_get(port: int, path: str) -> tuple[int, str, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    answer = await reader.read()
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    kind = re.search(rb"Content-Type: ([^;\r]+)", head)
    return int(head.split()[1]), kind[1].decode() if kind else "", body


def referenced_files() -> list[str]:
    """Every file index.html loads (src= and href=)."""
    return re.findall(r'(?:src|href)="([^"]+)"', (STATIC / "index.html").read_text())


# ---------------------------------------------------------------- the files, no ring


def test_page_loads_only_its_own_files():
    refs = referenced_files()
    assert {"/static/app.js", "/static/style.css", "/static/favicon.svg"} <= set(refs)
    assert all(r.startswith("/static/") for r in refs), refs  # no CDN: nothing from another host
    for js in STATIC.glob("*.js"):
        assert "http://" not in js.read_text() and "https://" not in js.read_text(), js


@pytest.mark.parametrize("token", [None, SECRET], ids=["open", "token"])
def test_page_and_files_are_served_with_their_types_without_a_token(token):
    (dead,) = free_ports(1)  # no ring: the page and its files need none
    paths = ["/"] + referenced_files()
    answers = fetch(f"127.0.0.1:{dead}", [("GET", p, {}) for p in paths], token)
    types = dict(zip(paths, ((status, kind) for status, kind, _ in answers)))
    assert types["/"] == (200, "text/html")
    assert types["/static/style.css"] == (200, "text/css")
    assert types["/static/app.js"][0] == 200 and types["/static/app.js"][1] in ("application/javascript",
                                                                                 "text/javascript")
    assert types["/static/favicon.svg"] == (200, "image/svg+xml")
    assert b"<title>prima-rpc</title>" in answers[0][2]
    assert (STATIC / "app.js").read_bytes() == answers[paths.index("/static/app.js")][2]


def test_data_endpoints_need_the_token_and_files_outside_static_are_not_served():
    (dead,) = free_ports(1)
    answers = fetch(f"127.0.0.1:{dead}", [("GET", "/api/ring", {}), ("GET", "/api/plan", {}),
                                          ("POST", "/api/plan", {}), ("GET", "/static/nothing.js", {}),
                                          ("GET", "/static/../web_page.py", {}), ("GET", "/static/../api/ring", {}),
                                          ("GET", "/static/%2e%2e/web_page.py", {})], SECRET)
    assert [status for status, _, _ in answers[:6]] == [401, 401, 401, 404, 404, 404] and answers[6][0] in (401, 404)
    assert b"invalid_api_key" in answers[0][2]
    assert not any(b"import" in body or b"nodes" in body for _, _, body in answers)  # no way out of static/


@pytest.mark.parametrize("held, expected", [
    ([[(6, 8)], [(0, 4)], [(4, 6)]], (1, [2, 4, 2])),  # one round: ranks 1..M-1, then the head
    ([[(3, 4), (7, 8)], [(0, 3), (4, 7)]], (2, [1, 3])),  # k = 2
    ([[(4, 8)], [], [(0, 4)]], (1, [4, 0, 4])),  # a relay
    ([[], [], []], NoPlan),  # nothing assigned
    ([[(0, 4)], [(4, 8)]], NoPlan),  # the head first: not how a plan lays windows out
])
def test_the_applied_assignment_is_read_from_the_nodes_windows(held, expected):
    nodes = [(f"n{i}", pb.NodeInfo(role="head" if i == 0 else "worker" if w else "relay", n_layers=8,
                                   windows=[pb.LayerRange(start=a, stop=b) for a, b in w]))
             for i, w in enumerate(held)]
    if expected is NoPlan:
        with pytest.raises(NoPlan):
            assignment(nodes)
    else:
        assert assignment(nodes) == expected


# ---------------------------------------------------------------- real tiny rings


@pytest.fixture(scope="module")
def tiny_ring(tiny_store, tmp_path_factory):
    with local_ring(tiny_store, 3, tmp_path_factory.mktemp("web"), [4, 2, 2], token=SECRET) as local:
        yield local


@pytest.mark.slow
def test_api_ring_lists_the_members_in_ring_order(tiny_ring):
    (status, kind, body), = fetch(tiny_ring.addresses[0], [("GET", "/api/ring", AUTH)], SECRET)
    answer = json.loads(body)
    assert status == 200 and kind == "application/json" and answer["error"] is None
    assert [n["address"] for n in answer["nodes"]] == tiny_ring.addresses
    assert [n["role"] for n in answer["nodes"]] == ["head", "worker", "worker"]
    assert [n["windows"] for n in answer["nodes"]] == [[[4, 8]], [[0, 2]], [[2, 4]]]
    assert all(n["resident_bytes"] > 0 for n in answer["nodes"])


@pytest.mark.slow  # profiles three nodes (cached after the first time)
def test_api_plan_prices_the_windows_the_ring_holds(tiny_ring):
    before, predicted, after = (json.loads(body) for _, _, body in fetch(
        tiny_ring.addresses[0], [("GET", "/api/plan", AUTH), ("POST", "/api/plan", AUTH), ("GET", "/api/plan", AUTH)],
        SECRET))
    assert before["plan"] is None and before["timeline_png"] is None and before["predicted_tpot_ms"] is None
    plan = predicted["plan"]
    assert plan is not None, predicted["reason"]
    assert [d["name"] for d in plan["devices"]] == tiny_ring.addresses
    assert [d["window"] for d in plan["devices"]] == [4, 2, 2] and plan["k"] == 1
    assert predicted["predicted_tpot_ms"] == plan["predicted_tpot_ms"] > 0
    assert base64.b64decode(predicted["timeline_png"])[:8] == b"\x89PNG\r\n\x1a\n"
    assert after["plan"] == plan  # kept while the ring holds the same windows


@pytest.mark.slow
def test_no_plan_is_said_and_a_node_down_still_gets_an_answer(tiny_store, tmp_path):
    with local_ring(tiny_store, 2, tmp_path) as local:  # no windows: the head watches nobody
        (status, _, body), = fetch(local.addresses[0], [("GET", "/api/plan", {})])
        assert status == 200 and json.loads(body) == {"plan": None, "timeline_png": None, "predicted_tpot_ms": None,
                                                       "measured_tpot_ms": None, "reason": NOT_ASSIGNED}
        local.processes[1].kill()
        local.processes[1].wait()
        (status, _, body), = fetch(local.addresses[0], [("GET", "/api/ring", {})])
    answer = json.loads(body)
    assert status == 200 and answer["error"] is None
    assert [(n["address"], n["state"]) for n in answer["nodes"]] == [(local.addresses[0], "up"),
                                                                    (local.addresses[1], "lost")]
    assert answer["nodes"][1]["error"] == "does not answer"
