"""The device profiler: measures this node into a prima_rpc.spec.profiles.DeviceProfile, cached on disk.

Measured, not guessed: matmul FLOP/s of the compute dtype (CPU, and the GPU torch sees), memory
read bandwidth, disk reads of the store's filesystem past the page cache, available RAM by the OS
rule, free VRAM, and the link to the successor over the real Ring stream. The local part takes a
few seconds and runs off the event loop; the link part ~20 PINGs and a few large frames.

Figures, as the scheduler reads them (solver.device_costs.layer_time is a roofline):
  cpu_flops / gpu_flops    the decode-shaped GEMV rate (weights streamed from memory), not the GEMM peak;
                           with a store, the CPU's is calibrated on decode steps through the node's own
                           Shard over the store's first layers (nodes/profiling/compute.py)
  ram_bandwidth            CPU memory read bandwidth (with a store: the layer's bytes / its decode time);
                           vram_bandwidth the GPU's
  disk_seq_read            1 MiB reads in order; disk_rand_read random reads of 4 KiB-1 MiB; with
                           $PRIMA_DISK_MBPS the reply caps it at what the node's own reader streams the store's
                           layer files at through that emulated disk, measured at each reply (its pacing loses
                           a few %, more while other processes load the machine)
  ram_available, vram_free a snapshot when measured (a cached profile keeps it; refresh to re-read);
                           the reply caps ram_available at what the node will use (--mem-budget, or
                           nodes.engine.prefetch.DEFAULT_FRACTION of it) and disk_seq_read at $PRIMA_DISK_MBPS
  frame_s                  the software cost of one hop on this device: a frame encoded, parsed,
                           decoded and handed through the node's queue and compute thread (in-process)
  token_s                  the head's own work per token on this device: the embedding and logits handed
                           through the compute thread, the ring's answer on the event loop, sampling,
                           detokenising (with a store's tokenizer) and the token's Generate event
  output_s                 with a store's weights: its final norm and output projection for one token
  host                     this machine (a hash of its machine id): nodes on one host share its CPU
  batch_cost               with a store's weights: a decode step of b = 1, 2, 4, 8 requests at once over one
                           request's, per layer (nodes/profile_compute.measure_batch_cost); none: b (no gain);
                           output_batch_cost the same for the output layer (one large matrix: its own curve)
  visit_s                  with a store's weights: what a window visit costs beyond its layers (one layer
                           visited after a quiet gap, as the ring comes back to a node, less layer_s)
  read_cpu_s               with a store's weights: the CPU seconds a byte the node streams costs it (its store's
                           first layers run resident, then streamed through its own prefetcher and reader, with
                           $PRIMA_DISK_MBPS's pacing; nodes/profile_compute.measure_streaming);
                           stream_layer_s the same run's compute of a streamed layer beyond a resident one's
  read_loss_s              with a store's weights: the compute seconds lost per byte a second reader streams
                           beside resident steps (nodes/profile_compute.measure_read_loss): what the cost model
                           charges a streamed byte read while a node computes
  link_latency_s           one hop = mean PING round trip / 2, each PING after IDLE_S of quiet (as a
                           ring's frame finds its successor idle); link_bandwidth from PINGs that
                           carry 1 MiB of padding (the successor acks a PING without reading it)

Cache file ($PRIMA_HOME/profile-<name>.json unless told), plain JSON written atomically:
  {"format": "prima-profile/2",
   "measured_at": 1764400000.0,      # unix seconds of the local measurement; stale after MAX_AGE_S
   "dtype": "bfloat16",              # the compute dtype the FLOP/s are for (by default the node's: float32 for
                                     #   float stores, nodes/engine/dtype_choice.py's measured choice for quantized)
   "store_dir": "/abs/store" | null, # whose filesystem the disk figures are for (null: $PRIMA_HOME)
   "link_peer": "host:port" | null,  # the successor the link figures are for (null: no link)
   "profile": {...},                 # DeviceProfile.to_json(), the prima_rpc.spec.profiles schema
   "details": {"matmul_cpu": {...}, "matmul_gpu": {...} | null, "gpu": {...}, "disk": {...},
               "compute_dtypes": {"choice": {...}, "probes": {...}, ...},  # the machine's dtype choice, its timings
               "link": {...} | null, "local_s": 4.1, "link_s": 0.1}}
A cache is reused when fresh and made for the same dtype and store; a new successor re-measures
only the link.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import os
import random
import re
import socket
import statistics
import tempfile
import time
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol

import structlog
import torch

from nodes.engine.diskio import emulated_rate
from nodes.engine.dtype_choice import compute_dtype, machine_choice
from nodes.engine.memory_room import give_back
from nodes.engine.prefetch import DEFAULT_FRACTION
from nodes.engine.store import LayerStore
from nodes.errors import LinkDown
from nodes.generation.text import TextCodec
from nodes.profiling.bench import measure_matmul_flops, measure_memory_bandwidth
from nodes.profiling.compute import measure_batch_cost, measure_node_layers, measure_read_loss, measure_streaming
from nodes.profiling.disk import measure_disk, measure_stream_rate
from nodes.profiling.frame import (
    measure_frame_overhead,
    measure_output_layer,
    measure_token_overhead,
    measure_window_visit,
)
from nodes.profiling.host import available_ram, gpu_info, os_kind
from prima_rpc import codec
from prima_rpc.spec.home import prima_home
from prima_rpc.spec.manifest import StoreError
from prima_rpc.spec.profiles import DeviceProfile
from prima_rpc.v1 import prima_pb2 as pb

log = structlog.get_logger()

FORMAT = "prima-profile/11"  # /11: dtype by default the machine's measured choice (details.compute_dtypes), int8
# off oneDNN where it saturates, float rows in fixed-width GEMMs; /10: read_loss_s from longer phases; /9:
# read_loss_s; /8: compute probes after 0.5 ms gaps (OpenMP spins briefly); /7: token_s with its stream write,
# output_s cache-cold, means not medians; /6: read_cpu_s, stream_layer_s; /5: visit_s; /4: host, batch_cost; /3:
# token_s, output_s, rates from the node's path (an older cache is measured again)
MAX_AGE_S = 24 * 3600
PINGS = 20
IDLE_S = 0.02  # each timed PING waits this long first: in the ring a successor is idle when a frame arrives
PAD_BYTES = 1 << 20  # padding per throughput frame
MIN_TRANSFER_S = 0.05  # the throughput probe doubles its frames until a burst takes this long
MAX_TRANSFER_BYTES = 64 << 20
LINK_FIELDS = ("link_latency_s", "link_bandwidth")
DEFAULT_HIDDEN = 4096  # activation width the frame probe uses without a store
DEFAULT_VOCAB = 128256  # vocabulary the token probe samples from without a store
NO_LINK_BANDWIDTH = 1e12  # B/s written when there is no successor (DeviceProfile needs > 0): a hop costs ~0


# ------------------------------------------------------------------ the link


class Link(Protocol):
    """What the link probe uses of a node's link to its successor (nodes/ring/link.py's RingLink)."""

    peer: str

    async def ping(self, seq: int, timeout: float) -> None: ...

    async def send(self, frame: pb.Frame) -> None: ...


@dataclass(frozen=True)
class LinkRates:
    peer: str
    rtt_s: float  # mean PING round trip (TPOT is a mean over tokens: a hop's slow moments count)
    latency_s: float  # one hop: rtt_s / 2
    bandwidth: float  # B/s
    method: str  # "ping-padding": bytes of padded PINGs / (burst time - rtt)
    pings: int
    burst_bytes: int


async def measure_link(link: Link, *, pings: int = PINGS, pad_bytes: int = PAD_BYTES,
                       timeout: float = 5.0) -> LinkRates:
    """Latency and throughput to the successor over the real Ring stream.

    Raises LinkDown when it cannot be reached, TimeoutError when it does not answer.
    """
    seqs = itertools.count(random.getrandbits(40) << 16)  # apart from any other pinger's numbers
    for _ in range(2):  # opens the stream: connection set-up is no part of a hop
        await link.ping(next(seqs), timeout)
    rtts = []
    for _ in range(pings):
        await asyncio.sleep(IDLE_S)  # back-to-back PINGs find the peer awake; a ring's frames do not
        start = time.perf_counter()
        await link.ping(next(seqs), timeout)
        rtts.append(time.perf_counter() - start)
    rtt = statistics.fmean(rtts)
    # The stream is ordered and the successor handles frames in turn: the Ack of the closing PING
    # comes back only after every padded frame before it has crossed and been parsed.
    # zeros without a torch kernel: this is the event loop's thread (see profile_device on OpenMP workers)
    padding = codec.encode(torch.frombuffer(bytearray(max(pad_bytes // 4, 1) * 4), dtype=torch.float32))
    frame_bytes = pb.Frame(kind=pb.PING, seq=1 << 60, hidden=padding).ByteSize()
    frames = 2
    while True:
        start = time.perf_counter()
        for _ in range(frames):
            await link.send(pb.Frame(kind=pb.PING, seq=next(seqs), hidden=padding))
        await link.ping(next(seqs), timeout)
        elapsed = time.perf_counter() - start
        if elapsed >= max(MIN_TRANSFER_S, 10 * rtt) or 2 * frames * frame_bytes > MAX_TRANSFER_BYTES:
            break
        frames *= 2
    bandwidth = frames * frame_bytes / max(elapsed - rtt, elapsed / 2)
    return LinkRates(link.peer, rtt, rtt / 2, bandwidth, "ping-padding", pings, frames * frame_bytes)


# ------------------------------------------------------------------ this machine


def freed(probe, *args):
    """probe(*args), and what it held given back to the OS (nodes/engine/memory_room.give_back)."""
    try:
        return probe(*args)
    finally:
        give_back()


def measure_local(dtype: str, store_dir: Path | None) -> tuple[dict, dict]:
    """The DeviceProfile fields of this machine but the link ones, and the probes' raw results."""
    start = time.perf_counter()
    kind = os_kind()
    gpu = gpu_info()  # before the probes allocate anything on it
    cpu = freed(measure_matmul_flops, dtype, "cpu")
    ram_bandwidth = freed(measure_memory_bandwidth, "cpu")
    gpu_rates, vram_bandwidth, gpu_error = None, 0.0, None
    if gpu.device is not None:
        try:
            gpu_rates = measure_matmul_flops(dtype, gpu.device)
            vram_bandwidth = measure_memory_bandwidth(gpu.device)
        except RuntimeError as exc:  # e.g. the dtype unsupported by this GPU: profile it as CPU-only
            gpu_error = str(exc)[:500]
            log.warning("GPU probe failed; profiling the CPU only", gpu=gpu.name, error=gpu_error)
        if gpu.kind == "cuda":
            torch.cuda.empty_cache()
    disk_dir = Path(store_dir) if store_dir else prima_home()
    disk_dir.mkdir(parents=True, exist_ok=True)
    disk = measure_disk(disk_dir)
    ram = available_ram(kind)
    has_gpu = gpu_rates is not None
    # With a store, the CPU rates are calibrated on the node's own compute path (see profile_compute).
    # each probe's buffers back to the OS before the next: a memory group counts what the heap keeps
    decode, batch, streaming, loss = (freed(f, store_dir, dtype) if store_dir else None for f in (
        measure_node_layers, measure_batch_cost, measure_streaming, measure_read_loss))
    store = LayerStore(store_dir) if store_dir else None
    hidden = store.config.hidden if store else DEFAULT_HIDDEN
    vocab = store.config.vocab if store else DEFAULT_VOCAB
    cpu_flops = decode["flops_rate"] if decode else cpu.gemv
    ram_bandwidth = decode["bytes_rate"] if decode else ram_bandwidth
    fields = dict(
        os=kind, cpu_flops=cpu_flops, gpu_flops=gpu_rates.gemv if has_gpu else 0.0,
        gpu_kind=gpu.kind if has_gpu else "none", ram_bandwidth=ram_bandwidth,
        vram_bandwidth=vram_bandwidth if has_gpu else 0.0,
        disk_seq_read=disk.seq_read, disk_rand_read=disk.rand_read, ram_available=ram,
        frame_s=measure_frame_overhead(hidden, getattr(torch, dtype)),
        token_s=measure_token_overhead(vocab, hidden, getattr(torch, dtype), _text(store)),
        output_s=measure_output_layer(store_dir, dtype, bytes_rate=decode["bytes_rate"] if decode else 0.0)
        if store else 0.0,
        host=host_id(), batch_cost=batch["batch_cost"] if batch else {},
        output_batch_cost=batch["output_batch_cost"] if batch else {},
        visit_s=measure_window_visit(store_dir, dtype, decode["layer_s"]) if decode else 0.0,
        read_cpu_s=streaming["read_cpu_s"] if streaming else 0.0,
        read_loss_s=loss["read_loss_s"] if loss else 0.0,
        stream_layer_s=streaming["stream_layer_s"] if streaming else 0.0,
        # Metal shares the RAM pool: what it may take is also bounded by free RAM.
        vram_free=(min(gpu.vram_free, ram) if gpu.kind == "metal" else gpu.vram_free) if has_gpu else 0)
    details = dict(matmul_cpu=asdict(cpu), matmul_gpu=asdict(gpu_rates) if has_gpu else None,
                   gpu=asdict(gpu), gpu_error=gpu_error, disk=asdict(disk), disk_dir=str(disk_dir),
                   decode_layer=decode, batch=batch, streaming=streaming, read_loss=loss,
                   torch_threads=torch.get_num_threads(), compute_dtypes=machine_choice(),
                   local_s=time.perf_counter() - start)
    give_back()  # what the probes held, back before the node loads its windows
    return fields, details


def store_compute_dtype(store_dir: Path | None) -> str:
    """The dtype a node computes a store in by default (float32 without a store)."""
    return compute_dtype(LayerStore(store_dir).manifest.dtype if store_dir else "float32")


def host_id() -> str:
    """This machine, the same for every node on it (their compute shares its cores): a hash of its machine id
    (not the id itself, which is meant to stay private), or of its hostname where there is none."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            ident = Path(path).read_text().strip()
        except OSError:
            continue
        if ident:
            break
    else:
        ident = socket.gethostname()
    return hashlib.sha256(f"prima-host:{ident}".encode()).hexdigest()[:16]


def _text(store: LayerStore | None) -> TextCodec | None:
    """The store's tokenizer for the token probe's detokenising (None: no store, or none in it)."""
    try:
        return TextCodec(store.manifest, store.tokenizer_path()) if store else None
    except StoreError:
        return None


# ------------------------------------------------------------------ the cache


def default_cache_path(name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name) or "node"
    return prima_home() / f"profile-{safe}.json"


def read_cache(path: Path) -> dict | None:
    """The cache document at `path` when it is well-formed (its age is the caller's to judge)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        if doc.get("format") != FORMAT or not isinstance(doc.get("measured_at"), (int, float)) \
                or not isinstance(doc.get("details"), dict) or "link_peer" not in doc:
            raise ValueError(f"not a {FORMAT} document")
        DeviceProfile.from_json(doc["profile"])
        return doc
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring a bad profile cache", path=str(path), error=str(exc)[:200])
        return None


def write_cache(path: Path, doc: dict) -> None:
    """Write atomically: a temp file beside `path`, then a rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _usable(doc: dict | None, dtype: str, store_key: str | None, now: float) -> bool:
    return (doc is not None and 0 <= now - doc["measured_at"] < MAX_AGE_S
            and doc.get("dtype") == dtype and doc.get("store_dir") == store_key)


# ------------------------------------------------------------------ the profile


async def profile_device(name: str, store_dir: Path | None, link: Link | None, *, dtype: str | None = None,
                         cache_path: Path | None = None, refresh: bool = False,
                         is_head: bool = False, mem_budget: int = 0,
                         compute: Executor | None = None) -> DeviceProfile:
    """This node's DeviceProfile: from the cache when fresh, else measured (and cached), as the node
    will run: RAM capped at its memory budget (0: the default share of what is available), the disk
    at its emulated speed when $PRIMA_DISK_MBPS is set. compute: the node's compute thread, where the
    probes run as its layers do (None: a thread of the event loop's executor). Another thread that ran torch's
    parallel kernels keeps OpenMP workers of its own, and libgomp spins only 100 times once a process holds more
    of them than cores: with GOMP_SPINCOUNT=10000 a node profiled from another thread decoded SmolLM2 at
    0.84-0.92 ms a layer instead of 0.5 from then on (a 3-node ring: 22.4 ms a token before, 33.0 after).

    dtype: the compute dtype (None: the node's default for its store, compute_dtype's).
    Raises LinkDown when the successor cannot be profiled; nothing is cached then.
    """
    loop = asyncio.get_running_loop()
    if dtype is None:  # its first use on this machine times kernels: on the compute thread
        dtype = await loop.run_in_executor(compute, store_compute_dtype, store_dir)
    path = Path(cache_path) if cache_path else default_cache_path(name)
    store_key = str(Path(store_dir).resolve()) if store_dir else None
    peer = link.peer if link is not None else None
    doc = None if refresh else read_cache(path)
    measure = not _usable(doc, dtype, store_key, time.time())
    if measure:
        measured_at = time.time()
        fields, details = await loop.run_in_executor(compute, measure_local, dtype, store_dir)
        doc = {"format": FORMAT, "measured_at": measured_at, "dtype": dtype, "store_dir": store_key,
               "link_peer": None, "profile": None, "details": details}
    else:
        fields = {k: v for k, v in doc["profile"].items() if k not in LINK_FIELDS + ("name", "is_head")}
    if measure or doc["link_peer"] != peer:  # a new successor: only the link is measured again
        start = time.perf_counter()
        rates = await _link_rates(link) if link is not None else None
        doc["profile"] = _profile(name, fields, rates, is_head).to_json()
        doc["link_peer"] = peer
        doc["details"] = {**doc["details"], "link": asdict(rates) if rates else None,
                          "link_s": time.perf_counter() - start}
        write_cache(path, doc)
    profile = DeviceProfile.from_json(doc["profile"])
    ram = min(profile.ram_available, mem_budget or int(profile.ram_available * DEFAULT_FRACTION))
    if not mem_budget and store_dir:  # the default budget keeps a unit's read beside its copy (engine/budget.py)
        ram = max(0, ram - _largest_layer_unit(Path(store_dir)))
    # An emulated disk: what the prefetcher's reader gets from it (its pacing, whatever else reads the disk now).
    rate = emulated_rate()
    stream = await loop.run_in_executor(compute, measure_stream_rate, Path(store_dir), rate) \
        if rate and store_dir else 0.0
    disk = min(profile.disk_seq_read, rate or math.inf, stream or math.inf)
    return replace(profile, name=name, is_head=is_head, ram_available=ram, disk_seq_read=disk,
                   disk_rand_read=min(profile.disk_rand_read, disk))


def _largest_layer_unit(store_dir: Path) -> int:
    try:
        units = LayerStore(store_dir, verify=False).manifest.units()
    except (OSError, StoreError):
        return 0
    return max((e.bytes for name, e in units.items() if name.startswith("layer.")), default=0)


async def _link_rates(link: Link) -> LinkRates:
    try:
        rates = await measure_link(link)
    except TimeoutError:
        raise LinkDown(f"profiling the link: successor {link.peer} did not answer a PING") from None
    except LinkDown as exc:
        raise LinkDown(f"profiling the link: {exc}") from None
    log.info("link profiled", peer=link.peer, rtt_ms=round(rates.rtt_s * 1e3, 3),
             mb_s=round(rates.bandwidth / 1e6, 1))
    return rates


def _profile(name: str, fields: dict, link: LinkRates | None, is_head: bool) -> DeviceProfile:
    latency, bandwidth = (link.latency_s, link.bandwidth) if link else (0.0, NO_LINK_BANDWIDTH)
    assert math.isfinite(bandwidth) and bandwidth > 0, f"link bandwidth {bandwidth}"
    return DeviceProfile(name=name, **fields, link_latency_s=latency, link_bandwidth=bandwidth, is_head=is_head)
