"""The ring benchmarks' helpers: prima.cpp found (or said missing) and timed by its own eval line, and the token
budget's span names read into its lines. A real prima.cpp ring runs where a build is in the cache."""

import os
import stat

import pytest

from tools.bench import prima_cpp, token_budget
from tools.default_model import default_gguf


def test_no_build_anywhere_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PRIMA_HOME", str(tmp_path))
    with pytest.raises(prima_cpp.PrimaCppMissing, match="no prima.cpp build in"):
        prima_cpp.find_llama_cli(None)
    with pytest.raises(prima_cpp.PrimaCppMissing, match="neither a prima.cpp build"):
        prima_cpp.find_llama_cli(tmp_path)


def test_a_build_directory_is_used_as_it_is(tmp_path):
    cli = tmp_path / "llama-cli"
    cli.write_text("#!/bin/sh\n")
    cli.chmod(cli.stat().st_mode | stat.S_IEXEC)
    assert prima_cpp.find_llama_cli(tmp_path) == cli


def test_the_ring_script_starts_every_rank_on_loopback_with_the_windows_at_rank_0():
    script = prima_cpp.ring_script(prima_cpp.Path("/b/llama-cli"), prima_cpp.Path("/m.gguf"), [7, 3, 5], 16, 1)
    lines = script.splitlines()
    assert lines[0] == "ip link set lo up" and lines[-1] == "wait"
    assert [f"--rank {r}" in lines[r] for r in (1, 2)] == [True, True] and lines[1].endswith("&")
    assert "--rank 0 -lw 7,3,5" in lines[3] and "--world 3" in lines[3] and "-n 16" in lines[3]
    line = "llama_perf_context_print:        eval time =     850.01 ms /    58 runs   (   14.66 ms per token"
    m = prima_cpp.EVAL.search(line)
    assert float(m.group(1)) / int(m.group(2)) == pytest.approx(14.655, abs=1e-3)


@pytest.mark.parametrize("span,line", [
    ("Shard.compute_batch.run", "layers"), ("Shard.compute_batch.inline", "layers"),
    ("Shard.compute_batch.wait", "hand-off to compute thread"), ("Shard.logits.back", "hand-off back to loop"),
    ("Shard.last_logits.inline", "logits"), ("receive", "receive + decode"), ("send", "send"),
    ("Node.dtype.run", None), ("other", None)])
def test_token_budget_lines(span, line):
    assert token_budget.budget_line(span) == line


@pytest.mark.slow
def test_prima_cpp_ring_runs_where_a_build_is_cached():
    try:
        cli = prima_cpp.find_llama_cli(None)
    except prima_cpp.PrimaCppMissing as exc:
        pytest.skip(str(exc))
    if os.geteuid() != 0 and not os.path.exists("/proc/sys/kernel/unprivileged_userns_clone"):
        pytest.skip("unshare -rn needs user namespaces")
    assert prima_cpp.ring_tpot(cli, default_gguf(), [10, 10, 10], 8) > 0
