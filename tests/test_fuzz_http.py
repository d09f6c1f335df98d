"""Generated hostile requests (hypothesis, bounded) to every HTTP dialect in front of a real 2-node ring: OpenAI
chat and completions, Anthropic messages, Ollama chat and generate. Never a 5xx nor a dropped connection, and the
ring answers a reference request with the single-process reference's tokens afterwards. The benchmark sends
10,000 (`python -m tools.bench.fuzz_http`); each finding is a case here."""

import json

import pytest

from prima_rpc.app.openai_api import ApiConfig
from tests.rings import collect, greedy_tokens, local_ring
from tools.bench.fuzz_bodies import PATHS, VALID
from tools.bench.fuzz_http import Tally, fuzz
from tools.bench.http_harness import api_in_thread, post

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(tiny_store, tmp_path_factory):
    with local_ring(tiny_store, 2, tmp_path_factory.mktemp("fuzz-http"), [4, 4]) as local:
        with api_in_thread(ApiConfig(local.addresses[0])) as root:
            yield local, root


def test_generated_requests_to_every_dialect_get_no_5xx(api, tiny_store):
    local, root = api
    expected = greedy_tokens(tiny_store, "hello", 8, raw=True)
    tally = Tally()
    fuzz(root, 400, tally, at_seed=3)
    assert tally.findings == []
    assert {d for d, _ in tally.statuses} == set(PATHS)  # every dialect was reached
    assert sum(c for (_, s), c in tally.statuses.items() if s == 200) >= 20  # and generated, not only refused
    assert all(p.poll() is None for p in local.processes)
    assert collect(local.addresses[0], "hello", 8, raw=True)[0] == expected


@pytest.mark.parametrize("dialect", sorted(PATHS))
@pytest.mark.parametrize("nested", [b"[" * 5000 + b"]" * 5000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
                                    b'{"messages": ' + b"[" * 70 + b"]" * 70 + b"}"])  # parses, yet too deep
def test_a_body_nested_past_the_limit_is_a_400_not_a_500(api, dialect, nested):
    # found by the fuzzer: json.loads raised RecursionError at ~1,000 levels, which the server answered with a 500
    _, root = api
    status, text = post(root, PATHS[dialect], nested)
    assert status == 400 and b"nests arrays and objects more than 64 deep" in text, text[:300]


@pytest.mark.parametrize("dialect", sorted(PATHS))
def test_the_valid_request_of_each_dialect_is_answered(api, dialect):
    _, root = api
    status, text = post(root, PATHS[dialect], json.dumps(VALID[dialect]).encode())
    assert status == 200, text[:300]


RECURSIVE = {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}  # no finite JSON satisfies it
FORMATTED = {"openai-chat": {"response_format": {"type": "json_schema",
                                                 "json_schema": {"name": "r", "schema": RECURSIVE}}},
             "ollama-chat": {"format": RECURSIVE}, "ollama-generate": {"format": RECURSIVE}}


@pytest.mark.parametrize("dialect", sorted(FORMATTED))
def test_a_schema_that_recurses_forever_is_a_400_not_a_500(api, dialect):
    # found by the fuzzer (10,000 requests): llguidance gave up mid-answer ("Too many items") and the head's
    # RuntimeError became a 500
    _, root = api
    status, text = post(root, PATHS[dialect], json.dumps({**VALID[dialect], **FORMATTED[dialect]}).encode())
    assert status == 400 and b"the output format cannot be followed" in text, text[:300]
