"""The activation dtype per machine (nodes/engine/dtype_choice.py): the choice as a table, its cache per machine, the
probes' exactness here, and what an AVX2 machine's flags say."""

import json
import os
import platform

import pytest

from nodes.engine import dtype_choice
from nodes.engine.dtype_choice import (
    MAX_ERROR,
    MAX_ROUNDS,
    ROUNDS,
    ROWS,
    STABLE,
    Probe,
    choose,
    compute_dtype,
    machine_choice,
    probe_format,
    timed_rounds,
)
from tests.subprocesses import run_python

FAST, SLOW = 0.001, 0.02
EXACT, ROUNDED = 1e-6, 0.004


@pytest.mark.parametrize("probes, expected", [
    ({"float32": Probe(SLOW, EXACT, 2), "bfloat16": Probe(FAST, ROUNDED, 5), "float16": Probe(SLOW, EXACT, 2)},
     "bfloat16"),  # the int4 kernel here: bfloat16 20x faster
    ({"float32": Probe(FAST, EXACT, 5), "bfloat16": Probe(FAST * 0.95, ROUNDED, 5), "float16": Probe(SLOW, 0, 2)},
     "float32"),  # 5 % faster is within MARGIN: the exact one stays
    ({"float32": Probe(SLOW, EXACT, 2), "bfloat16": Probe(FAST / 2, 0.05, 5), "float16": Probe(FAST, ROUNDED, 5)},
     "float16"),  # the fastest errs by 5 %: not exact enough
    ({"float32": Probe(FAST, EXACT, 5), "bfloat16": Probe(SLOW, ROUNDED, 2), "float16": Probe(SLOW, ROUNDED, 2)},
     "float32"),  # no native bfloat16, no fast float16 (a float matmul on some CPUs)
    ({"float32": Probe(SLOW, float("inf"), 2), "bfloat16": Probe(FAST, ROUNDED, 5)}, "bfloat16"),
])
def test_the_fastest_exact_enough_dtype_is_chosen(probes, expected):
    assert choose(probes) == expected


@pytest.mark.parametrize("faster, native, expected", [
    (1.2, True, "bfloat16"),  # native bfloat16: MARGIN (1.1) is enough
    (1.2, False, "float32"),  # without: a near-tie keeps float32
    (1.4, False, "bfloat16"),  # measured clearly faster: bfloat16 even without
])
def test_without_native_bfloat16_a_near_tie_keeps_float32(faster, native, expected):
    probes = {"float32": Probe(FAST, EXACT, 5), "bfloat16": Probe(FAST / faster, ROUNDED, 5)}
    assert choose(probes, native_bf16=native) == expected


def scripted(times: dict[str, list[float]]):
    """call(dtype, row index) -> seconds for timed_rounds: round r of a dtype takes times[dtype][r] a row (the
    last one repeats)."""
    calls = dict.fromkeys(times, 0)

    def call(d: str, i: int) -> float:
        r = calls[d] // len(ROWS)
        calls[d] += 1
        return times[d][min(r, len(times[d]) - 1)] * ROWS[i]
    return call


def probes_of(best: dict, rounds: dict, errors: dict) -> dict[str, Probe]:
    return {d: Probe(sum(t / r for r, t in best[d].items()), errors[d], rounds[d]) for d in errors}


def test_a_busy_spell_does_not_decide_the_probe():
    """float32 disturbed at first, less and less (other work on a shared box): ROUNDS rounds alone choose bfloat16;
    the rounds go on until the times settle and the choice holds, and it is float32."""
    errors = {"float32": EXACT, "bfloat16": ROUNDED}
    spell = {"float32": [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.3, 1.2, 1.0], "bfloat16": [1.4]}
    first = {d: {r: t[min(ROUNDS, len(t)) - 1] * r for r in ROWS} for d, t in spell.items()}  # best of ROUNDS
    assert choose(probes_of(first, dict.fromkeys(errors, ROUNDS), errors)) == "bfloat16"
    best, rounds = timed_rounds(scripted(spell), errors)
    assert choose(probes_of(best, rounds, errors)) == "float32" and rounds["float32"] == len(spell["float32"]) + \
        STABLE - 1


def test_a_quiet_probe_stops_after_its_rounds():
    call = scripted({"float32": [1.0], "bfloat16": [2.0], "float16": [30.0]})
    _, rounds = timed_rounds(call, {"float32": EXACT, "bfloat16": ROUNDED, "float16": ROUNDED})
    assert rounds == {"float32": ROUNDS, "bfloat16": ROUNDS, "float16": 2}  # float16 dropped as a loser


def test_times_that_never_settle_stop_at_max_rounds():
    call = scripted({"float32": [0.9 ** r for r in range(MAX_ROUNDS + 1)], "bfloat16": [0.5]})
    _, rounds = timed_rounds(call, {"float32": EXACT, "bfloat16": ROUNDED})
    assert rounds["float32"] == MAX_ROUNDS


def test_no_exact_enough_dtype_is_an_error():
    with pytest.raises(RuntimeError, match="no activation dtype"):
        choose({"float32": Probe(FAST, 1.0, 5), "bfloat16": Probe(FAST, float("nan"), 5)})


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """An empty $PRIMA_HOME, measure() counted, and no choice remembered in this process."""
    monkeypatch.setenv("PRIMA_HOME", str(tmp_path))
    calls = []

    def measured():
        calls.append(1)
        return {"choice": {"float": "float32", "int8": "float16", "int4": "bfloat16"}, "probes": {}}

    monkeypatch.setattr(dtype_choice, "measure", measured)
    machine_choice.cache_clear()
    yield tmp_path, calls
    machine_choice.cache_clear()


def test_the_choice_is_measured_once_per_machine_and_cached(fresh, monkeypatch):
    home, calls = fresh
    assert compute_dtype("int4") == "bfloat16" and compute_dtype("int8") == "float16" and calls == [1]
    machine_choice.cache_clear()  # another process on this machine reads the file
    assert compute_dtype("int4") == "bfloat16" and calls == [1]
    machine_choice.cache_clear()
    monkeypatch.setattr(dtype_choice, "machine_key", lambda: "another machine")  # e.g. ATEN_CPU_CAPABILITY set
    assert compute_dtype("int4") == "bfloat16" and calls == [1, 1]
    doc = json.loads((home / dtype_choice.CACHE_NAME).read_text())
    assert doc["format"] == dtype_choice.FORMAT and len(doc["machines"]) == 2


def test_float_stores_and_asked_dtypes_are_not_measured(fresh):
    _, calls = fresh
    assert compute_dtype("float32") == compute_dtype("bfloat16") == compute_dtype("float16") == "float32"
    assert compute_dtype("int4", "float32") == "float32"
    assert calls == []


@pytest.mark.parametrize("fmt", ["float", "int8", "int4"])
def test_the_probes_are_exact_here(fmt):
    """float32 is exact on every format (to rounding; int4 and small int8 matrices through our kernel, where it
    builds, to its activation mode's bound, tests/test_kernels.py: ~14 bits exact, ggml's Q8_0 q8 ~0.5 %); every row
    count is timed; the quantized formats' choice is within MAX_ERROR."""
    from nodes.engine.kernels import q4

    probes = probe_format(fmt)
    ours = fmt != "float" and q4.available()  # int8's probe matrix is below oneDNN's size: q4.c's int8 path
    assert probes["float32"].error < ({"exact": 3e-4, "q8": MAX_ERROR}[q4.mode()] if ours else 1e-5)
    assert all(p.seconds > 0 and p.rounds >= 2 and set(p.by_rows) == set(dtype_choice.ROWS) for p in probes.values())
    if fmt != "float":
        assert probes[choose(probes)].error <= MAX_ERROR


@pytest.mark.slow  # compiles and times the kernels
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="AVX2 emulation is x86's")
def test_an_avx2_machine_has_no_native_bfloat16():
    """Under ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (what an AVX2 CPU's kernels are) native bfloat16 says
    no, whatever this CPU's flags, and the machine key differs from this one's, so its choice is its own."""
    code = "from nodes.engine.dtype_choice import machine_key, native_bfloat16; print(native_bfloat16(), machine_key())"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    native, key = run_python(code, env=env, timeout=120).split(" ", 1)
    assert native == "False" and " AVX2 " in key and "onednn-int8-exact=False" in key
