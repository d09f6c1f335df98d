"""The fixed CLI contract of `prima-ctl import | run | synth`, as real subprocesses."""

import json
import os
import subprocess
import sys

import pytest

from nodes.generation import GenerateParams
from nodes.reference import ReferenceModel


def ctl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prima_rpc.app.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_run_json_equals_the_reference(smol_store):
    res = ctl("run", "--model", str(smol_store), "--max-tokens", "12", "--json", "Name a color.")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    ref = ReferenceModel(smol_store)
    expected = list(ref.generate("Name a color.", GenerateParams(max_tokens=12)))
    assert out["tokens"] == [t.token_id for t in expected]
    assert out["text"] == "".join(t.text for t in expected)
    assert out["ttft_ms"] > 0 and out["tpot_ms"] > 0


def test_run_raw_and_seeded_sampling_is_reproducible(tiny_store):
    args = ("run", "--model", str(tiny_store), "--raw", "--max-tokens", "8", "--temperature", "0.9",
            "--seed", "7", "--json", "hello")
    first, second = ctl(*args), ctl(*args)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["tokens"] == json.loads(second.stdout)["tokens"]
    assert len(json.loads(first.stdout)["tokens"]) == 8


@pytest.mark.slow
def test_import_default_creates_the_store_once(tmp_path):
    env = {"PRIMA_HOME": str(tmp_path)}
    first = ctl("import", "--default", env=env)
    assert first.returncode == 0, first.stderr
    store = tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert first.stdout.strip().splitlines()[-1] == str(store)
    assert (store / "manifest.json").is_file() and not list(tmp_path.glob("models/.*partial*"))
    stamp = (store / "manifest.json").stat().st_mtime_ns
    again = ctl("import", "--default", env=env)
    assert again.stdout.strip().splitlines()[-1] == str(store)
    assert (store / "manifest.json").stat().st_mtime_ns == stamp


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
    (("run", "--max-tokens", "0", "--model", "{tiny}", "hi"), "max_tokens must be positive"),
    (("run", "--model", "{tiny}", ""), "prompt is empty"),
])
def test_bad_input_gives_one_line_error_without_traceback(tiny_store, args, message):
    res = ctl(*(a.format(tiny=tiny_store) for a in args))
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr


def test_not_a_gguf_file_is_a_clean_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 40)
    res = ctl("import", str(bad), str(tmp_path / "out"))
    assert res.returncode == 2 and "Traceback" not in res.stderr and res.stderr.startswith("error:")
    assert not (tmp_path / "out").exists()


def test_import_default_int4_prints_its_own_store_and_runs(smol_store):
    res = ctl("import", "--default", "--dtype", "int4")
    assert res.returncode == 0, res.stderr
    store = res.stdout.strip().splitlines()[-1]
    assert store.endswith("SmolLM2-135M-Instruct-int4") and store != str(smol_store)
    assert json.loads(open(f"{store}/manifest.json").read())["dtype"] == "int4"
    out = ctl("run", "--model", store, "--max-tokens", "12", "--json", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert "Paris" in json.loads(out.stdout)["text"]


def test_synth_int4_writes_real_weights(tmp_path):
    res = ctl("synth", str(tmp_path / "s"), "--preset", "tiny", "--dtype", "int4")
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert m["dtype"] == "int4" and m["quant"]["group"] == 32 and not m["manifest_only"]
    assert all(f["format"] == "int4" and f["sha256"] for f in m["files"]["layers"])
    from tools.default_model import default_gguf

    bad = ctl("import", str(default_gguf()), str(tmp_path / "o"), "--dtype", "int3")
    assert bad.returncode != 0 and "unknown dtype 'int3'" in bad.stderr and "Traceback" not in bad.stderr
