"""The fixed CLI contract of `prima-ctl import | run | synth`, and bad input to every command: one line
`error: ...` on stderr, a non-zero exit, no traceback, no hang. Argument errors run in this process (CliRunner);
click's own usage errors, argv bytes and the contract's commands run as real processes, where the console
script's exit status and stderr are the point."""

import json
import subprocess
import sys

import pytest

from nodes.generation.reference import ReferenceModel
from nodes.generation.state import GenerateParams
from prima_rpc.app.local_ring import free_ports
from tests.ctl import assert_one_line_error, ctl, ctl_here
from tests.gguf_files import small_gguf


@pytest.mark.slow  # SmolLM2 in a process of its own
def test_run_json_equals_the_reference(smol_store):
    res = ctl("run", "--model", str(smol_store), "--max-tokens", "12", "--temperature", "0", "--json", "Name a color.",
              timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    ref = ReferenceModel(smol_store)
    expected = list(ref.generate("Name a color.", GenerateParams(max_tokens=12)))
    assert out["tokens"] == [t.token_id for t in expected]
    assert out["text"] == "".join(t.text for t in expected)
    assert out["ttft_ms"] > 0 and out["tpot_ms"] > 0


@pytest.mark.slow  # prima-ctl processes that import torch
def test_run_raw_and_seeded_sampling_is_reproducible(tiny_store):
    args = ("run", "--model", str(tiny_store), "--raw", "--max-tokens", "8", "--temperature", "0.9",
            "--seed", "7", "--json", "hello")
    first, second = ctl(*args), ctl(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["tokens"] == json.loads(second.stdout)["tokens"]
    assert len(json.loads(first.stdout)["tokens"]) == 8


def test_run_says_an_answer_was_cut(tiny_store):
    args = ("run", "--model", str(tiny_store), "--raw", "--max-tokens", "3", "--temperature", "0", "hello")
    said = ctl(*args)
    assert said.returncode == 0 and "[cut: the answer reached --max-tokens 3 (finish_reason: length)" in said.stderr
    assert json.loads(ctl(*args, "--json").stdout)["finish_reason"] == "length"


@pytest.mark.slow
def test_import_default_creates_the_store_once(tmp_path):
    env = {"PRIMA_HOME": str(tmp_path)}
    first = ctl("import", "--default", env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    store = tmp_path / "models" / "SmolLM2-135M-Instruct-int4"  # --default alone: int4 (tools/default_model.py)
    assert first.stdout.strip().splitlines()[-1] == str(store)
    assert (store / "manifest.json").is_file() and not list(tmp_path.glob("models/.*partial*"))
    stamp = (store / "manifest.json").stat().st_mtime_ns
    again = ctl("import", "--default", env=env, timeout=300)
    assert again.stdout.strip().splitlines()[-1] == str(store)
    assert (store / "manifest.json").stat().st_mtime_ns == stamp


@pytest.mark.slow  # prima-ctl processes that import torch
def test_synth_presets_and_manifest_only(tmp_path):
    res = ctl("synth", str(tmp_path / "m"), "--preset", "qwen2.5-72b", "--manifest-only", "--bits-per-weight", "4.5")
    assert res.returncode == 0, res.stderr
    manifest = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert manifest["dims"]["n_layers"] == 80 and manifest["bits_per_weight"] == 4.5


@pytest.mark.parametrize("args, message", [
    (("run", "--model", "/nonexistent", "hi"), "not a layer store"),
    (("import", "/nonexistent.gguf", "/tmp/x"), "does not exist"),
    (("synth", "/tmp/never", "--preset", "gpt-9"), "unknown preset"),
    (("synth", "/tmp/never", "--preset", "tiny", "--dtype", "foo"), "unknown dtype"),
    (("synth", "/tmp/never", "--preset", "tiny", "--bits-per-weight", "4.5"), "needs --manifest-only"),
    (("run", "--max-tokens", "0", "--model", "{tiny}", "hi"), "max_tokens must be in [1, 2147483647], got 0"),
    (("run", "--model", "{tiny}", b"caf\xe9"), "the prompt is not valid UTF-8 text (byte 0xe9"),
    (("run", "--model", "{tiny}", "--temperature", "3", "hi"), "temperature must be in [0, 2]"),
    (("run", "--model", "{tiny}", "--top-p", "1.5", "hi"), "top_p must be in [0, 1]"),
    (("run", "--model", "{tiny}", "--seed", "-1", "hi"), "seed must be in [0, 2**64 - 1]"),
    (("run", "--model", "{tiny}", "--stop", b"\xff", "hi"), "a stop string is not valid UTF-8"),
    (("run", "--model", b"/tmp/\xff", "hi"), "the model path is not valid UTF-8"),
    (("run", "--model", "{tiny}", ""), "prompt is empty"),
])
def test_bad_input_gives_one_line_error_without_traceback(tiny_store, args, message):
    res = ctl_here(*(a.format(tiny=tiny_store) if isinstance(a, str) else a for a in args))
    assert res.returncode == 2
    assert_one_line_error(res, message)


@pytest.mark.slow  # prima-ctl processes that import torch
@pytest.mark.parametrize("args, message", [
    (("run", "--model", "{tiny}", "--max-tokens", "many", "hi"), "Invalid value for '--max-tokens'"),
    (("run", "--bogus", "hi"), "No such option: --bogus"),
    (("run",), "Missing argument"),
    (("frobnicate",), "No such command"),
    (("generate", "--bogus", "hi"), "No such option: --bogus (see prima-ctl generate --help)"),
    (("run", "--model", "{tiny}", b"caf\xe9"), "the prompt is not valid UTF-8 text (byte 0xe9"),
])
def test_the_console_script_gives_usage_errors_and_argv_bytes_one_line(tiny_store, tmp_path, args, message):
    """Click's own usage errors are made one line by the app's __call__, which only a real process runs; argv
    bytes become text in the interpreter's start-up."""
    res = ctl(*(a.format(tiny=tiny_store) if isinstance(a, str) else a for a in args),
              env={"PRIMA_HOME": str(tmp_path)}, timeout=60)
    assert res.returncode == 2
    assert_one_line_error(res, message)
    assert not (tmp_path / "run").exists()  # no ring was started, no log written


def test_not_a_gguf_file_is_a_clean_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 40)
    res = ctl_here("import", str(bad), str(tmp_path / "out"))
    assert res.returncode == 2 and "Traceback" not in res.stderr and res.stderr.startswith("error:")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep", [1000, 9_000_000], ids=["in-the-header", "in-the-tensors"])
def test_a_gguf_cut_short_says_truncated(tmp_path, keep):
    whole = small_gguf(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:keep])
    res = ctl_here("import", str(tmp_path / "cut.gguf"), str(tmp_path / "out"))
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert f"the file is truncated: it ends at byte {keep:,}" in res.stderr and "download it again" in res.stderr
    assert not (tmp_path / "out").exists()


DEAD = f"127.0.0.1:{free_ports(1)[0]}"  # nothing listens there


@pytest.mark.parametrize("args, message", [
    (("--node", "127.0.0.1", "generate", "hi"), "--node must be HOST:PORT"),  # gRPC would dial port 443
    (("--node", "127.0.0.1:99999", "generate", "hi"), "--node must be HOST:PORT with a port in 1-65535"),
    (("--node", "::1:7000", "down"), "--node must be HOST:PORT"),
    (("--node", DEAD, "generate", "hi"), f"cannot reach node {DEAD}"),
    (("--node", DEAD, "generate", b"caf\xe9"), "the prompt is not valid UTF-8"),  # before dialling
    (("--node", DEAD, "generate", "--temperature", "2.5", "hi"), "temperature must be in [0, 2]"),
    (("--node", DEAD, "generate", "--top-k", "-1", "hi"), "top_k must be in [0,"),
    (("--node", DEAD, "generate", "--stop", "", "hi"), "non-empty strings"),
    (("--node", DEAD, "generate", "--speculate", "magic", "hi"), "speculate must be one of off, ngram, draft"),
    (("--node", DEAD, "generate", "--draft-tokens", "17", "hi"), "draft_tokens must be in [1, 16]"),
    (("--node", DEAD, "generate", "--depth", "17", "hi"), "depth must be in [1, 16]"),
    (("--node", DEAD, "chat"), f"cannot reach node {DEAD}"),
    (("--node", DEAD, "chat", "--max-tokens", "0"), "max_tokens must be in [1,"),
    (("--node", DEAD, "start", "--windows", "10,x"), "--windows must be comma-separated integers"),
    (("--node", DEAD, "start", "--windows", "10,10"), f"cannot reach node {DEAD}"),
    (("--node", DEAD, "start", "--plan", "/nonexistent.json"), f"cannot reach node {DEAD}"),
    (("--node", DEAD, "down"), f"cannot reach node {DEAD}"),
    (("--node", DEAD, "serve", "--port", "0"), f"cannot reach node {DEAD}"),
    (("--node", DEAD, "serve", "--port", "70000"), "--port must be in 0-65535"),
    (("--node", DEAD, "serve", "--max-tokens", "0"), "--max-tokens must be in [1,"),
    (("--token-file", "/nonexistent/token", "generate", "hi"), "cannot read the token file /nonexistent/token"),
    (("up", "--local", "0"), "--local takes 1 to 64 nodes"),
    (("up", "--base-port", "65535"), "--base-port must leave room for 3 ports"),
    (("up", "--serve", "70000"), "--serve takes a port in 1-65535"),
    (("up", "--windows", "10,10"), "--windows gives 2 windows for 3 nodes"),
    (("up", "--model", "/bogus"), "not a layer store"),
    (("up", "--prompt", b"\xe9t\xe9"), "--prompt is not valid UTF-8"),
    (("plan", "--profiles", "/nonexistent.json", "--model", "/bogus"), "not a layer store"),
    (("plan", "--profiles", "solver/testbeds/prima_d1_d4.json"), "--profiles needs --model"),
    (("plan", "--concurrency", "0"), "--concurrency must be >= 1, got 0"),
])
def test_bad_input_to_ring_commands_is_one_line_before_anything_starts(tmp_path, args, message):
    res = ctl_here(*args, env={"PRIMA_HOME": str(tmp_path)})
    assert_one_line_error(res, message)
    assert not (tmp_path / "run").exists()  # no ring was started, no log written


def test_token_file_that_is_empty_or_not_a_token(tmp_path):
    empty, accented = tmp_path / "empty", tmp_path / "spaced"
    empty.write_text("\n")
    accented.write_text("s3cr\u00e9t\n")
    assert_one_line_error(ctl_here("--token-file", str(empty), "--node", DEAD, "generate", "hi"), "is empty")
    assert_one_line_error(ctl_here("--token-file", str(accented), "--node", DEAD, "generate", "hi"),
                          "the token must be printable ASCII")


def test_down_local_without_a_ring_says_so(tmp_path):
    res = ctl_here("down", "--local", env={"PRIMA_HOME": str(tmp_path)})
    assert res.returncode == 0 and "no local ring is running" in res.stdout, res.stderr


def test_status_help_imports_neither_mip_nor_torch():
    code = ("import sys; sys.argv = ['prima-ctl', 'status', '--help']\n"
            "from prima_rpc.app.cli import app\n"
            "try:\n    app()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('mip', 'torch', 'numpy') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "status" in res.stdout and res.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("text, expected", [
    ("127.0.0.1:7000", "127.0.0.1:7000"), ("desktop:7000", "desktop:7000"), ("[::1]:7000", "[::1]:7000"),
    (" node:08 ", "node:8"), ("127.0.0.1", None), ("127.0.0.1:", None), (":7000", None), ("host:0", None),
    ("host:65536", None), ("host:x", None), ("::1:7000", None), ("[zz]:7000", None), ("", None),
])
def test_addresses_need_a_host_and_a_port(text, expected):
    import typer

    from prima_rpc.app.cli_args import address

    if expected is None:
        with pytest.raises(typer.Exit):
            address(text, "--node")
    else:
        assert address(text, "--node") == expected


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be in [1, 2147483647]"),
    (dict(temperature=2.01), "temperature must be in [0, 2]"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=-1), "top_k must be in [0,"), (dict(top_p=-0.1), "top_p must be in [0, 1]"),
    (dict(seed=2**64), "seed must be in [0, 2**64 - 1]"), (dict(stop=("a",) * 17), "up to 16"),
    (dict(stop=("",)), "non-empty"), (dict(stop=("\udce9",)), "a stop string is not valid UTF-8"),
])
def test_the_client_refuses_what_the_head_would_before_sending(kwargs, message):
    import asyncio

    import grpc

    from prima_rpc.client import PrimaClient, PrimaError

    async def call():
        async with PrimaClient(DEAD) as client:  # nothing listens: a refusal must come before any dialling
            async for _ in client.generate("hi", **kwargs):
                pass

    with pytest.raises(PrimaError) as err:
        asyncio.run(call())
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.message


def test_token_from_the_environment_or_a_file(tmp_path, monkeypatch):
    from prima_rpc.channel import read_token

    monkeypatch.setenv("PRIMA_TOKEN", " from env \n")
    assert read_token() == "from env"
    (tmp_path / "t").write_text("from file\n")
    assert read_token(tmp_path / "t") == "from file"  # the file wins
    monkeypatch.setenv("PRIMA_TOKEN", "")
    assert read_token() is None


@pytest.mark.slow  # SmolLM2 in a process of its own
def test_import_default_int4_prints_its_own_store_and_runs(smol_store):
    res = ctl("import", "--default", "--dtype", "int4", timeout=300)
    assert res.returncode == 0, res.stderr
    store = res.stdout.strip().splitlines()[-1]
    assert store.endswith("SmolLM2-135M-Instruct-int4") and store != str(smol_store)
    assert json.loads(open(f"{store}/manifest.json").read())["dtype"] == "int4"
    out = ctl("run", "--model", store, "--max-tokens", "12", "--temperature", "0", "--json",
              "What is the capital of France?", timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in json.loads(out.stdout)["text"]


@pytest.mark.slow  # prima-ctl processes that import torch
def test_synth_int4_writes_real_weights(tmp_path):
    res = ctl("synth", str(tmp_path / "s"), "--preset", "tiny", "--dtype", "int4")
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert m["dtype"] == "int4" and m["quant"]["group"] == 32 and not m["manifest_only"]
    assert all(f["format"] == "int4" and f["sha256"] for f in m["files"]["layers"])
    from tools.default_model import default_gguf

    bad = ctl_here("import", str(default_gguf()), str(tmp_path / "o"), "--dtype", "int3")
    assert bad.returncode != 0 and "unknown dtype 'int3'" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow  # prima-ctl processes that import torch
def test_plan_concurrency_prints_the_throughput(tmp_path):
    store = tmp_path / "l8"
    res = ctl("synth", str(store), "--preset", "llama3-8b", "--manifest-only", "--bits-per-weight", "4.5")
    assert res.returncode == 0, res.stderr
    args = ("plan", "--profiles", "solver/testbeds/prima_d1_d4.json", "--model", str(store), "--concurrency", "4")
    res = ctl(*args, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "4 requests at once: " in res.stdout and "tokens/s in all" in res.stdout and "bottleneck: " in res.stdout
    out = json.loads(ctl(*args, "--json", timeout=120).stdout)
    assert out["concurrency"] == 4 and out["tpot_ms_per_request"] > 0 and out["mode"] == "async"
    assert out["max_batch"] * out["micro_batches"] >= 4
