"""A new user's first hour: the local ring found without --node, max_tokens capped to the context, a long
prompt's prefill progress, errors that name the option that fixes them, serve's default temperature, and a
fresh `make run` that speaks within 2 s."""

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from prima_rpc.app.local_ring import RING_FILE, free_ports
from prima_rpc.client import Finished, Prefill, PrimaClient, Token
from prima_rpc.request import GenerateRequest
from tests.ctl import assert_one_line_error, ctl, ctl_here
from tests.rings import greedy_tokens

ROOT = Path(__file__).resolve().parents[1]


def record_ring(home: Path, port: int) -> None:
    """A local ring's record as `up --local` writes it, whose one process is this live test process (alive()
    checks the pid's command line against the recorded one)."""
    run = home / "run" / str(port)
    run.mkdir(parents=True)
    (run / RING_FILE).write_text(json.dumps({"addresses": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"],
                                             "commands": {"node0": psutil.Process().cmdline()}}))
    (run / "node0.pid").write_text(f"{os.getpid()}\n")


def test_without_node_the_one_local_ring_is_dialled(tmp_path):
    port = free_ports(1)[0]  # nothing listens there: the error names the address that was chosen
    record_ring(tmp_path, port)
    res = ctl_here("status", env={"PRIMA_HOME": str(tmp_path)})
    assert_one_line_error(res, f"127.0.0.1:{port}")
    assert "7000" not in res.stderr


def test_without_node_several_local_rings_are_named(tmp_path):
    first, second = free_ports(2)
    record_ring(tmp_path, first)
    record_ring(tmp_path, second)
    res = ctl_here("generate", "hi", env={"PRIMA_HOME": str(tmp_path)})
    assert_one_line_error(res, "2 local rings are up")
    assert f"127.0.0.1:{first}" in res.stderr and f"127.0.0.1:{second}" in res.stderr and "--node" in res.stderr
    # commands that talk to no node are not stopped by the choice
    assert "no local ring" not in ctl_here("synth", str(tmp_path / "s"), "--preset", "tiny", "--manifest-only",
                                           env={"PRIMA_HOME": str(tmp_path)}).stderr


def test_a_recorded_ring_that_is_gone_is_not_used(tmp_path):
    port = free_ports(1)[0]
    record_ring(tmp_path, port)
    (tmp_path / "run" / str(port) / "node0.pid").write_text("1\n")  # pid 1 runs another command
    res = ctl_here("status", env={"PRIMA_HOME": str(tmp_path)})
    assert_one_line_error(res, "cannot reach node 127.0.0.1:7000")


def test_a_busy_http_port_names_the_http_port_option(tiny_store, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        http = busy.getsockname()[1]
        base = free_ports(1)[0]
        res = ctl_here("up", "--local", "1", "--model", str(tiny_store), "--base-port", str(base),
                       "--serve", str(http), "--prompt", "", env={"PRIMA_HOME": str(tmp_path)})
    assert_one_line_error(res, f"port {http} is in use")
    assert "--serve" in res.stderr and "--base-port" not in res.stderr
    assert not (tmp_path / "run").exists()  # refused before any node started


def test_serve_temperature_is_checked(tmp_path):
    res = ctl_here("--node", f"127.0.0.1:{free_ports(1)[0]}", "serve", "--temperature", "3",
                   env={"PRIMA_HOME": str(tmp_path)})
    assert_one_line_error(res, "--temperature must be in [0, 2], got 3")


@pytest.mark.slow  # make creates a virtual environment (stopped after its first line)
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_a_fresh_make_run_speaks_within_two_seconds(tmp_path):
    proc = subprocess.Popen(["make", "--no-print-directory", "run", f"VENV={tmp_path / 'venv'}",
                             f"PYTHON={sys.executable}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    started = time.monotonic()
    try:
        first = proc.stdout.readline().decode()
        took = time.monotonic() - started
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # make and the venv it was creating: this test's own group
        proc.wait(timeout=30)
    assert "[1/4] creating the virtual environment" in first, first
    assert took < 2.0, f"the first line came after {took:.1f} s"


PROMPT = "x" * 400  # raw, byte tokenizer: 400 prompt tokens, two prefill chunks of the tiny model's 512


@pytest.fixture(scope="module")
def tiny_head(tiny_rings):
    return tiny_rings(2, [4, 4]).addresses[0]


async def events(head: str, request: GenerateRequest, prefill: bool) -> list:
    async with PrimaClient(head) as client:
        return [e async for e in client.stream(request, prefill=prefill)]


@pytest.mark.slow
def test_a_long_prompt_reports_its_prefill_and_max_tokens_is_capped(tiny_head, tiny_store):
    request = GenerateRequest(PROMPT, raw=True, max_tokens=100000)
    got = asyncio.run(events(tiny_head, request, prefill=True))
    prefills = [e for e in got if isinstance(e, Prefill)]
    done = got[-1]
    assert prefills == [Prefill(256, 400)] and got[0] == prefills[0]  # before any token
    assert isinstance(done, Finished) and done.finish_reason == "length"
    assert done.max_tokens == 512 - 400 == done.completion_tokens
    tokens = [e.token_id for e in got if isinstance(e, Token)]
    assert tokens == greedy_tokens(tiny_store, PROMPT, 100000, raw=True)  # the reference caps alike
    plain = asyncio.run(events(tiny_head, request, prefill=False))
    assert not any(isinstance(e, Prefill) for e in plain)  # callers that did not ask see tokens only


@pytest.mark.slow
def test_generate_and_chat_say_an_answer_was_cut(tiny_head):
    res = ctl("--node", tiny_head, "generate", "--raw", "--max-tokens", "3", "--temperature", "0", "hello")
    assert res.returncode == 0 and "(finish_reason: length)" in res.stderr, res.stderr
    chat = ctl("--node", tiny_head, "chat", "--max-tokens", "3", "--temperature", "0", stdin=b"hello\n")
    assert chat.returncode == 0 and "[cut: the answer reached --max-tokens 3" in chat.stderr, chat.stderr


@pytest.mark.slow
def test_the_cli_says_max_tokens_was_capped(tiny_head):
    res = ctl("--node", tiny_head, "generate", "--raw", "--json", "--max-tokens", "100000", "--temperature", "0",
              PROMPT)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["finish_reason"] == "length" and out["max_tokens"] == len(out["tokens"]) == 112
    assert "max_tokens 100,000 was capped to 112" in res.stderr and "finish_reason: length" in res.stderr


@pytest.mark.slow
def test_the_http_api_caps_max_tokens_and_samples_with_the_models_settings_by_default(tiny_head):
    from tests.test_openai_api import api_server, post

    with api_server(tiny_head) as url:
        status, body = post(url + "/completions", json.dumps({"prompt": PROMPT, "max_tokens": 100000,
                                                              "temperature": 0}).encode())
        _, sampled = post(url + "/completions", json.dumps({"prompt": PROMPT, "max_tokens": 16, "seed": 5}).encode())
    assert status == 200, body
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 112
    greedy = asyncio.run(events(tiny_head, GenerateRequest(PROMPT, raw=True, max_tokens=112), prefill=False))
    assert body["choices"][0]["text"] == "".join(e.text for e in greedy if isinstance(e, Token))  # temperature 0
    model = asyncio.run(events(tiny_head, GenerateRequest(PROMPT, raw=True, max_tokens=16, temperature=None, seed=5),
                               prefill=False))  # no temperature: the model's sampling, seeded alike
    assert sampled["choices"][0]["text"] == "".join(e.text for e in model if isinstance(e, Token))
