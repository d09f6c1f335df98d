"""The activation dtype each weight format computes in on this machine: its kernels timed here once with every
candidate dtype, the fastest exact enough kept, cached per machine in $PRIMA_HOME/compute-dtypes.json.

Why measure: the same kernel is 10-30x faster in one dtype than another, and which one depends on the CPU and the
torch build (ARM's kernels have float16 paths x86's lack). On this AVX-512 box with native bfloat16, and under
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2, the int4 and int8 kernels are vectorised for bfloat16 activations
only (float32 and float16 take scalar loops, 20-30x slower); int4's and int8's float32 candidates are our own kernel
wherever it builds (nodes/engine/kernels/q4.c), faster than torch's bfloat16 one under AVX2 (docs/quantization.md).
Float stores always compute in float32: their weights stay exactly as stored, and the single-process reference on
them is the oracle every ring is checked against (their probe is timed for the record only).

What is timed is a decoder layer's step, not its matmuls alone: the steps between them (norms, RoPE, attention,
dtype conversions) run as one C call each in float32 (nodes/engine/kernels/ops.c) and as ~50 small torch ops in the
other dtypes, each split across the threads. On a 2-core AVX-512 + bfloat16 Xeon torch's bfloat16 int4 matmul alone
was 1.3x faster than q4.c's float32 one, and a matmul-only probe chose it; a SmolLM2 decode step then ran at 24
tokens/s in bfloat16 against 56 in float32 (2 threads; bench_decode).
"""

from __future__ import annotations

import json
import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import torch

from nodes.engine.kernels import q4
from nodes.engine.model import Layer, Segment, layer_forward
from nodes.engine.quant import (
    QUANTIZED,
    Int4,
    Int8,
    linear,
    machine_layout,
    onednn_int8_exact,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from nodes.engine.rope import Rope
from prima_rpc.spec.home import prima_home
from prima_rpc.spec.manifest import ModelConfig

try:
    import fcntl
except ImportError:  # Windows: nodes measuring at once each write their own result (the same file, atomically)
    fcntl = None

CANDIDATES = ("float32", "bfloat16", "float16")
FORMATS = ("float", "int8", "int4")  # float: a float32 store's matrices (reported; float stores use float32)
# The probe's decoder layer: a small model's (8.7M weights: each matrix below ONEDNN_MIN_WEIGHTS, in the int8pack
# kernel, whose speed depends on the activation dtype; oneDNN's quantizes them), its rows attending to POSITION keys
LAYER = ModelConfig("llama", hidden=1024, intermediate=2048, n_layers=1, n_heads=16, n_kv_heads=4, head_dim=64,
                    vocab=1, max_seq_len=128)
POSITION = 64
SHAPE = (2 * LAYER.intermediate, LAYER.hidden)  # [N, K] of w_gate_up, whose matmul the exactness is checked on
# activation rows per call: a decode step, a verify frame, a prefill chunk. A candidate's time is the sum of each
# call's time per row (t1 + t4 / 4 + t16 / 16): what a token costs in each, so decode counts most without prefill
# being ignored (q4.c lost to torch's bfloat16 kernel at 16 rows). One dtype serves every row count: choosing per
# row count would hold each int4 matrix twice (torch's packed layout and q4.c's rows); each count's time is kept in
# the probe ("by_rows") so what that would win is on record.
ROWS = (1, 4, 16)
# Candidates are timed in turn, round after round, each keeping its fastest time (the least disturbed by other
# work), until those times have settled (none got more than SETTLE faster over the last STABLE rounds) and the
# choice they make has held for those rounds, at least ROUNDS and at most MAX_ROUNDS rounds: five rounds in one
# busy spell decided and stuck in the cache before (a real AVX2 box under load chose bfloat16 by 0.3 % past MARGIN).
ROUNDS = 5
STABLE = 4
SETTLE = 0.05
MAX_ROUNDS = 16
LOSER = 3.0  # a candidate this much slower than the best after two rounds is timed no more (it cannot win)
MAX_ERROR = 0.01  # the most |result - exact product| may reach, over the exact product's largest magnitude
# (bfloat16 activations and scales: ~0.3-0.5 %; a broken or overflowing path: far more)
MARGIN = 1.1  # a dtype less exact than float32 must be this much faster: a tie, or noise, keeps float32
# ... and bfloat16 this much where the CPU has no bfloat16 instructions: its kernels there widen every value by
# shifts, so a near-tie is noise, and float32 (q4.c where it builds) is the more exact
EMULATED_MARGIN = 1.25
CACHE_NAME = "compute-dtypes.json"
# /3: a decoder layer's step timed, not a matmul alone; an older file (/2 chose by the matmul, /1 by one busy
# round) is measured again
FORMAT = "prima-dtypes/3"


@dataclass(frozen=True)
class Probe:
    seconds: float  # the sum over ROWS of the fastest round's time per row
    error: float  # against the exact product of the weights as stored, relative to its largest magnitude
    rounds: int  # fewer than ROUNDS: dropped as too slow to win
    by_rows: dict | None = None  # {rows: fastest seconds of that call}


def compute_dtype(store_dtype: str, requested: str | None = None) -> str:
    """The activation dtype of a store of weight dtype `store_dtype`: the one asked for, else float32 for float
    stores and this machine's measured choice for quantized ones (measured at first use, on the calling thread:
    call it from the thread that will compute)."""
    if requested:
        return requested
    return machine_choice()["choice"][store_dtype] if store_dtype in QUANTIZED else "float32"


def choose(probes: dict[str, Probe], native_bf16: bool = True) -> str:
    """The fastest candidate within MAX_ERROR; float32 unless another is MARGIN faster (bfloat16 on a CPU without
    native bfloat16: EMULATED_MARGIN)."""
    exact = {d: p for d, p in probes.items() if p.error <= MAX_ERROR}
    if not exact:
        raise RuntimeError(f"no activation dtype computes within {MAX_ERROR:.0%} here: {probes}")
    best = min(exact, key=lambda d: (exact[d].seconds, d != "float32"))
    margin = EMULATED_MARGIN if best == "bfloat16" and not native_bf16 else MARGIN
    if "float32" in exact and exact[best].seconds * margin > exact["float32"].seconds:
        return "float32"
    return best


def native_bfloat16() -> bool:
    """Whether torch's kernels and oneDNN's may use bfloat16 instructions here (avx512_bf16 or AMX, allowed by
    ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA). Reported beside the choice; the choice itself is timed."""
    cpu = torch.cpu
    has = any(getattr(cpu, f, lambda: False)() for f in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return has and torch.backends.cpu.get_cpu_capability() == "AVX512" and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def machine_key() -> str:
    """What the choice depends on: torch, the kernels' instruction sets (as limited by the environment), our int4
    kernel's build and activation mode (nodes/engine/kernels). Not the thread count: every process of a machine
    computes in one dtype, so a ring of 1-thread nodes gives the tokens of a 2-thread single process (with the
    count in the key, under AVX2 they chose float32 and bfloat16 on a near-tie and differed)."""
    return (f"torch {torch.__version__} {platform.machine()} {torch.backends.cpu.get_cpu_capability()}"
            f" bf16={native_bfloat16()} onednn-int8-exact={onednn_int8_exact()} q4={q4.build()}")


@cache
def machine_choice() -> dict:
    """{"choice": {format: dtype}, "probes": {format: {dtype: Probe as a dict}}, "native_bfloat16", "measured_at",
    "measure_s"} of this machine: from the cache file, else measured (one process at a time) and cached."""
    path = prima_home() / CACHE_NAME
    key = machine_key()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{CACHE_NAME}.lock"), "w") as lock:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait, then read what the first measured
        doc = _read(path)
        if key not in doc["machines"]:
            doc["machines"][key] = measure()
            _write(path, doc)
    return doc["machines"][key]


def measure() -> dict:
    """Every format's candidates timed and checked here, and the choice they make."""
    start = time.perf_counter()
    native = native_bfloat16()
    probes = {fmt: probe_format(fmt, native) for fmt in FORMATS}
    choice = {fmt: "float32" if fmt == "float" else choose(probes[fmt], native) for fmt in FORMATS}
    return {"choice": choice, "probes": {f: {d: _json(p) for d, p in ps.items()} for f, ps in probes.items()},
            "native_bfloat16": native, "measured_at": time.time(), "measure_s": time.perf_counter() - start}


@torch.inference_mode()
def probe_format(fmt: str, native_bf16: bool = True) -> dict[str, Probe]:
    """Each candidate's time for a decoder layer's step (LAYER) with weights of format `fmt`, and its error on
    the layer's w_gate_up matmul."""
    gen = torch.Generator().manual_seed(0)
    stored = {name: _stored(fmt, torch.randn(shape, generator=gen) * 0.02) for name, shape in _matrices(LAYER)}
    xs = [torch.randn(r, LAYER.hidden, generator=gen) for r in ROWS]
    exact = [x.double() @ _dequantized(fmt, stored["w_gate_up"]).double().t() for x in xs]
    steps, errors = {}, {}
    for d in CANDIDATES:  # the first call warms each up
        dtype = getattr(torch, d)
        weights = {n: _weight(fmt, s, dtype) for n, s in stored.items()}
        steps[d] = LayerStep(LAYER, weights, [x.to(dtype) for x in xs])
        errors[d] = max(_error(linear(x, weights["w_gate_up"]), e) for x, e in zip(steps[d].inputs, exact))
        for i in range(len(ROWS)):
            steps[d](i)

    def call(d: str, i: int) -> float:
        began = time.perf_counter()
        steps[d](i)
        return time.perf_counter() - began

    best, rounds = timed_rounds(call, errors, native_bf16)
    return {d: Probe(_score(best[d]), errors[d], rounds[d], best[d]) for d in CANDIDATES}


def _matrices(cfg: ModelConfig) -> list[tuple[str, tuple[int, int]]]:
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return [("wqkv", (q + 2 * kv, cfg.hidden)), ("wo", (cfg.hidden, q)),
            ("w_gate_up", (2 * cfg.intermediate, cfg.hidden)), ("w_down", (cfg.hidden, cfg.intermediate))]


class LayerStep:
    """step(i): a layer's step over inputs[i] (a decode step, a verify frame, a prefill chunk) at POSITION, the
    calls a node makes, in the inputs' dtype."""

    def __init__(self, cfg: ModelConfig, weights: dict, inputs: list[torch.Tensor]):
        dtype = inputs[0].dtype
        ones = torch.ones(cfg.hidden, dtype=dtype)
        self.cfg, self.inputs = cfg, inputs
        self.layer = Layer(attn_norm=ones, bqkv=None, ffn_norm=ones, **weights)
        self.rope = Rope(cfg, cfg.max_seq_len, dtype).layer(0)
        self.kv = torch.zeros(2, cfg.n_kv_heads, cfg.max_seq_len, cfg.head_dim, dtype=dtype)

    def __call__(self, i: int) -> torch.Tensor:
        x = self.inputs[i]
        return layer_forward(x, self.layer, [Segment(self.kv, POSITION, x.shape[0])], self.cfg, self.rope)


def timed_rounds(call, errors: dict[str, float], native_bf16: bool = True) -> tuple[dict, dict]:
    """({dtype: {rows: fastest seconds}}, {dtype: rounds timed}) of rounds of call(dtype, index into ROWS) -> seconds,
    until the times have settled and their choice (choose) has held STABLE rounds, ROUNDS to MAX_ROUNDS rounds."""
    best = {d: dict.fromkeys(ROWS, math.inf) for d in errors}
    rounds, alive, leaders = dict.fromkeys(errors, 0), list(errors), []
    scores = {d: [] for d in errors}  # each round's best score so far
    for turn in range(MAX_ROUNDS):
        for d in alive:
            for i, rows in enumerate(ROWS):
                best[d][rows] = min(best[d][rows], call(d, i))
            rounds[d] += 1
            scores[d].append(_score(best[d]))
        if turn:  # after two rounds: one alone may have been disturbed
            fastest = min(_score(best[d]) for d in alive)
            alive = [d for d in alive if _score(best[d]) <= LOSER * fastest]
        leaders.append(_leader(best, errors, native_bf16))
        settled = all(len(scores[d]) >= STABLE and scores[d][-STABLE] <= scores[d][-1] * (1 + SETTLE) for d in alive)
        if turn + 1 >= ROUNDS and len(set(leaders[-STABLE:])) == 1 and settled:
            break
    return best, rounds


def _leader(best: dict, errors: dict[str, float], native_bf16: bool) -> str | None:
    """What choose() makes of the times so far (None: no candidate is exact enough, which measure() reports)."""
    try:
        return choose({d: Probe(_score(best[d]), errors[d], 0) for d in best}, native_bf16)
    except RuntimeError:
        return None


def _score(by_rows: dict[int, float]) -> float:
    return sum(t / rows for rows, t in by_rows.items())


def _stored(fmt: str, w: torch.Tensor) -> tuple:
    if fmt == "int4":
        q, dm = quantize_int4(w)
        return pack_int4(q, machine_layout()), dm
    return quantize_int8(w) if fmt == "int8" else (w,)


def _weight(fmt: str, stored: tuple, dtype: torch.dtype):
    if fmt == "int4":
        return Int4.from_dm(*stored, dtype, machine_layout())
    return Int8(*stored, dtype) if fmt == "int8" else stored[0].to(dtype)


def _dequantized(fmt: str, stored: tuple) -> torch.Tensor:
    """The weights as stored, exactly (float64 [N, K])."""
    if fmt == "int4":
        packed, dm = stored
        q = unpack_int4(packed, machine_layout()).double()
        d, m = (dm[..., j].double().t().repeat_interleave(32, dim=1) for j in (0, 1))  # [N, K]
        return d * q + m
    if fmt == "int8":
        q, scale = stored
        return q.double() * scale.double()[:, None]
    return stored[0].double()


def _json(p: Probe) -> dict:
    def finite(v):  # strict JSON: no Infinity
        return {str(k): finite(x) for k, x in v.items()} if isinstance(v, dict) else v if math.isfinite(v) else None

    return {k: finite(v) for k, v in asdict(p).items() if v is not None}


def _error(y: torch.Tensor, exact: torch.Tensor) -> float:
    err = ((y.double() - exact).abs().max() / exact.abs().max()).item()
    return err if math.isfinite(err) else math.inf


def _read(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("format") == FORMAT and isinstance(doc.get("machines"), dict):
            return doc
    except (OSError, ValueError):
        pass
    return {"format": FORMAT, "machines": {}}  # missing, unreadable or older: measured again


def _write(path: Path, doc: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
