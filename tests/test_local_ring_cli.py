"""`prima-ctl up --local / down / down --local`, tokens and chat on real node processes on loopback: rings
recorded by pid files, a second ring refused, ports reused right after `down`, dead and hung nodes."""

import json
import os
import random
import signal
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from prima_rpc.app.local_ring import LaunchError, free_ports, launch
from tests.ctl import assert_one_line_error, ctl
from tests.rings import SECRET

pytestmark = pytest.mark.slow


def consecutive_ports(n: int) -> int:
    """A base port with n free ports from it."""
    for _ in range(200):
        base = random.randrange(20000, 60000)
        try:
            free_ports(n, base)
            return base
        except LaunchError:
            continue
    raise RuntimeError("no free port range")


def pids(run: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in run.glob("*.pid")}


def gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_up_records_refuses_a_second_ring_and_down_stops_the_survivors(tiny_store, tmp_path):
    env = {"PRIMA_HOME": str(tmp_path)}
    base = consecutive_ports(3)
    up = ("up", "--local", "3", "--model", str(tiny_store), "--base-port", str(base), "--prompt", "")
    first = ctl(*up, env=env, timeout=180)
    assert first.returncode == 0, first.stderr
    run = tmp_path / "run" / str(base)
    assert f"logs in {run}" in first.stdout
    started = pids(run)
    assert set(started) == {"node0", "node1", "node2"}
    assert first.stdout.count("down --local") == 1 and "-m prima_rpc.app.cli chat" in first.stdout  # as it runs
    found = ctl("status", "--json", env=env)  # no --node: the one local ring under $PRIMA_HOME/run
    assert found.returncode == 0, found.stderr
    assert [n["address"] for n in json.loads(found.stdout)["nodes"]] == [f"127.0.0.1:{base + i}" for i in range(3)]
    assert json.loads((run / "ring.json").read_text())["addresses"] == [f"127.0.0.1:{base + i}" for i in range(3)]

    second = ctl(*up, env=env, timeout=60)
    assert_one_line_error(second, f"a local ring is already up on 127.0.0.1:{base}")
    assert "prima-ctl down --local" in second.stderr and pids(run) == started
    reuse = ctl(*up, "--reuse", env=env, timeout=60)
    assert reuse.returncode == 0 and "reusing the local ring" in reuse.stdout, reuse.stderr

    os.kill(started["node1"], signal.SIGKILL)  # the head's successor: the walk from the head stops there
    assert gone(started["node1"])
    down = ctl("--node", f"127.0.0.1:{base}", "down", env=env, timeout=60)
    assert down.returncode == 0, down.stderr
    assert all(gone(pid) for pid in started.values()), "a surviving node still runs after down"
    assert not pids(run)

    # Right away on the same ports (those in TIME_WAIT included), in a fresh log directory of the same name.
    again = ctl(*up, env=env, timeout=180)
    assert again.returncode == 0, again.stderr
    assert json.loads((run / "ring.json").read_text())["addresses"][0] == f"127.0.0.1:{base}"
    assert b"exited" not in (run / "node0.log").read_bytes()
    assert ctl("--node", f"127.0.0.1:{base}", "down", env=env, timeout=60).returncode == 0
    assert all(gone(pid) for pid in pids(run).values())


def test_down_local_stops_hung_nodes_and_the_http_server_by_their_pid_files(tiny_store, tmp_path):
    env = {"PRIMA_HOME": str(tmp_path)}
    base, (http,) = consecutive_ports(2), free_ports(1)
    up = ctl("up", "--local", "2", "--model", str(tiny_store), "--base-port", str(base), "--prompt", "",
             "--serve", str(http), env=env, timeout=180)
    assert up.returncode == 0, up.stderr
    assert f"http://127.0.0.1:{http}/" in up.stdout
    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models/prima", timeout=30) as res:
        assert json.loads(res.read())["id"] == "prima"  # any model name is the ring's model
    started = pids(tmp_path / "run" / str(base))
    assert set(started) == {"node0", "node1", "serve"}
    for name in ("node0", "node1"):
        os.kill(started[name], signal.SIGSTOP)  # hung: alive, answering nothing
    try:
        down = ctl("down", "--local", env=env, timeout=60)
        assert down.returncode == 0, down.stderr
        assert "stopped the local ring" in down.stdout
        assert all(gone(pid) for pid in started.values())
    finally:
        for pid in started.values():
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_node_that_cannot_start_names_its_log(tmp_path):
    bogus = tmp_path / "not-a-store"
    bogus.mkdir()
    with pytest.raises(LaunchError) as err:
        launch(bogus, 1, log_dir=tmp_path / "logs", detach=False)
    assert f"log: {tmp_path / 'logs' / 'node0.log'}" in str(err.value) and "exited with status 2" in str(err.value)
    assert "not a layer store" in str(err.value)  # the node's own last line
    assert not list((tmp_path / "logs").glob("*.pid"))


@pytest.fixture(scope="module")
def secured(secured_rings):
    return secured_rings(2, [4, 4])


def test_the_token_never_appears_on_a_command_line(secured):
    for proc in secured.processes:
        assert SECRET not in " ".join(psutil.Process(proc.pid).cmdline())


@pytest.mark.parametrize("token", [None, "wrong"], ids=["missing", "wrong"])
def test_a_refused_token_says_so(secured, token, tmp_path):
    env = {"PRIMA_TOKEN": token} if token else {"PRIMA_TOKEN": ""}
    head = secured.addresses[0]
    for args in (("generate", "hi"), ("down",), ("chat",), ("start", "--windows", "4,4"), ("plan",),
                 ("serve", "--port", "0")):
        res = ctl("--node", head, *args, env=env, timeout=60)
        assert_one_line_error(res, f"{head} refused the token")
        assert "PRIMA_TOKEN or --token-file" in res.stderr and "cannot reach" not in res.stderr
    assert all(p.poll() is None for p in secured.processes)


def test_token_file_and_chat_that_survives_errors(secured, tmp_path):
    token = tmp_path / "token"
    token.write_text(SECRET + "\n")
    head = secured.addresses[0]
    ok = ctl("--token-file", str(token), "--node", head, "generate", "--max-tokens", "3", "--raw", "--json",
             "--temperature", "0", "hi", env={"PRIMA_TOKEN": ""}, timeout=60)
    assert ok.returncode == 0 and len(json.loads(ok.stdout)["tokens"]) == 3, ok.stderr
    spec = ctl("--token-file", str(token), "--node", head, "generate", "--max-tokens", "12", "--raw", "--json",
               "--temperature", "0", "--speculate", "ngram", "--draft-tokens", "3", "--depth", "3", "a b a b a b a b",
               env={"PRIMA_TOKEN": ""}, timeout=60)
    out = json.loads(spec.stdout)
    assert len(out["tokens"]) == 12 and 0 <= out["accepted"] <= out["drafted"] and "tpot_ms" in out, spec.stderr
    assert out["depth"] == 3 and 0 < out["trips"] <= 12
    chat = ctl("--token-file", str(token), "--node", head, "chat", "--max-tokens", "3",
               stdin=b"caf\xe9\nhello\n", timeout=60)
    chat.stderr = "".join(line for line in chat.stderr.splitlines(keepends=True)  # the answer's cut notice aside
                          if line.strip() and not line.startswith("[cut: "))
    assert_one_line_error(chat, "your message is not valid UTF-8 text (byte 0xe9")
    assert chat.returncode == 1 and chat.stdout.count("model> ") == 1  # the second line was answered
