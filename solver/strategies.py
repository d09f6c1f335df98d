"""Offline planning entry point for `prima-ctl plan`: profiles file + manifest -> JSON-able plan."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from prima_rpc.spec.profiles import DeviceProfile, load_profiles
from solver.baselines import even_split, exo_split, halda_noselect
from solver.cost_model import Breakdown, Instance, evaluate
from solver.halda import halda
from solver.halda_batch import halda_for
from solver.kv_term import KV_DTYPES, kv_bytes_per_token_layer, priced
from solver.model_profile import ModelProfile
from solver.plan import Infeasible, RingPlan
from solver.speculation import inflight_json, speculation_json
from solver.throughput import Throughput, predict_throughput

# what the plan assumes of a mixture's expert cache (solver.device_terms.expert_terms)
EXPERT_HIT_RATE = "uniform routing: a cache of a share f of a node's experts hits f of the routed ones"
STRATEGIES = {"halda": halda, "halda-noselect": halda_noselect, "exo": exo_split, "even": even_split}


def plan_to_json(plan: RingPlan, n_layers: int, breakdown: Breakdown | None = None) -> dict:
    """breakdown (the cost model's terms of this plan) adds per-token timings, which `--timeline` draws:
    output_ms (the head's per-token constant), ring_ms, terms_ms, and per device compute_ms, disk_ms, inline_ms,
    serial_ms, turn_ms, cycle_ms, link_ms and loads_hidden."""
    ranges = plan.layer_ranges(n_layers)
    out = {
        "strategy": plan.strategy,
        "k": plan.k,
        "predicted_tpot_ms": plan.predicted_tpot_s * 1e3,
        "solve_ms": plan.solve_ms,
        "devices": [
            {"name": d.name, "role": d.role, "window": d.window, "gpu_layers": d.gpu_layers,
             "set": d.set_label, "memory_bytes": d.memory_bytes, "predicted_ms": d.predicted_s * 1e3,
             "buffer_layers": d.buffer_layers,
             "layers": [list(r) for r in rs]}  # half-open [start, stop) per round
            for d, rs in zip(plan.devices, ranges)],
    }
    if any(d.routed_expert_bytes for d in plan.devices):  # a mixture of experts: what each node's experts cost
        out["experts"] = {"hit_rate": EXPERT_HIT_RATE}
        for d, js in zip(plan.devices, out["devices"]):
            js.update(routed_expert_bytes_per_token=d.routed_expert_bytes, expert_bytes_per_token=d.expert_read_bytes)
    if breakdown is not None:
        # TPOT = max(ring_ms, each device's cycle_ms), ring_ms = output_ms + its turn_ms and link_ms; terms_ms
        # adds it up (compute, reads on the path, hops, head, wait for a device's cycle).
        out["output_ms"] = breakdown.kappa_s * 1e3
        out["ring_ms"] = breakdown.ring_s * 1e3
        out["terms_ms"] = {key: v * 1e3 for key, v in breakdown.terms_s.items()}
        for m, d in enumerate(out["devices"]):
            # Per token, all k rounds together; inline_ms: the reads in the device's own turns (beside its
            # compute but serial_ms of it), the rest prefetched while the ring works; loads_hidden: all.
            x, i = breakdown.disk_s[m], breakdown.inline_s[m]
            d.update(compute_ms=breakdown.compute_s[m] * 1e3, disk_ms=x * 1e3, inline_ms=i * 1e3,
                     read_cpu_ms=breakdown.read_cpu_s[m] * 1e3,
                     serial_ms=breakdown.serial_s[m] * 1e3, turn_ms=breakdown.turn_s[m] * 1e3,
                     cycle_ms=breakdown.cycle_s[m] * 1e3, link_ms=breakdown.hop_s[m] * 1e3,
                     loads_hidden=x > 0 and i == 0)
    return out


def plan_offline(profiles_path: Path, manifest: dict, strategy: str = "halda", *, n_ctx: int = 0,
                 must_stay: Collection[str] = (), concurrency: int = 1,
                 speculation: tuple[int, float, float] | None = None, choose_kv: bool = False) -> dict:
    """must_stay: devices the ring cannot route around (they become relays if given no layers)."""
    return plan_for(load_profiles(profiles_path), manifest, strategy, n_ctx=n_ctx, must_stay=must_stay,
                    concurrency=concurrency, speculation=speculation, choose_kv=choose_kv)


def plan_for(devices: tuple[DeviceProfile, ...], manifest: dict, strategy: str = "halda", *, n_ctx: int = 0,
             must_stay: Collection[str] = (), concurrency: int = 1,
             speculation: tuple[int, float, float] | None = None, choose_kv: bool = False) -> dict:
    """concurrency: requests decoding at once; Halda then optimises their throughput (halda_batch), and the
    result carries the throughput fields (throughput_fields). speculation: (N, R[, C]), every trip verifying N
    drafted tokens accepted at rate R, drafted at C seconds a token (adds `speculation`, and the windows in flight
    and draft length it picks: `depth` and `draft_tokens`, 1 and 0 where speculating does not pay). choose_kv:
    devices whose KV dtype is auto take the most precise one whose plan holds every layer in memory
    (choose_kv_dtype); else auto is float."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {sorted(STRATEGIES)}, got {strategy!r}")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an int >= 1, got {concurrency!r}")
    model = ModelProfile.from_json(manifest)

    def solve(kv: str) -> tuple[Instance, RingPlan | Infeasible, Throughput | None]:
        inst = Instance(devices, model, n_ctx=n_ctx, must_stay=frozenset(must_stay),
                        kv_dtypes=priced((d.kv_dtype for d in devices), kv))
        if strategy.startswith("halda") and concurrency > 1:
            got = halda_for(inst, concurrency, select=strategy == "halda")
            return (inst, got, None) if isinstance(got, Infeasible) else (inst, *got)
        plan = STRATEGIES[strategy](inst)
        return inst, plan, None if isinstance(plan, Infeasible) else predict_throughput(plan, inst, concurrency)

    auto = choose_kv and any(d.kv_dtype == "auto" for d in devices)
    inst, plan, tput = choose_kv_dtype(solve) if auto else solve("float")
    if isinstance(plan, Infeasible):
        return {"infeasible": plan.reason, "strategy": strategy, "solve_ms": plan.solve_ms}
    out = plan_to_json(plan, model.n_layers, evaluate(inst, plan.k, plan.window_sizes, plan.gpu_layers, plan.in_ring))
    out["ctx"] = inst.n_ctx
    for d, kv, js in zip(plan.devices, inst.priced_kv, out["devices"], strict=True):
        js.update(kv_dtype=kv, kv_bytes=kv_bytes_per_token_layer(model, kv) * inst.n_ctx * d.window * plan.k)
    if speculation is not None:  # (N, R) or (N, R, the drafter's seconds a token)
        args = (inst, plan.k, plan.window_sizes, plan.gpu_layers, plan.predicted_tpot_s)
        out["speculation"] = speculation_json(*args, *speculation[:2])
        out["speculation"] |= (pick := inflight_json(*args, *speculation[1:]))
        out["depth"], out["draft_tokens"] = pick["depth"], pick["inflight_draft_tokens"]  # what the head should run
    return out | throughput_fields(tput)


def choose_kv_dtype(solve):
    """solve(kv) -> (instance, plan, throughput) with auto devices' KV in kv: the first of KV_DTYPES (most precise
    first) whose plan reads no layer from disk a token, else the one of the lowest predicted TPOT (float on a tie)."""
    tried = []
    for kv in KV_DTYPES:
        got = solve(kv)
        inst, plan = got[0], got[1]
        if not isinstance(plan, Infeasible) and not any(
                evaluate(inst, plan.k, plan.window_sizes, plan.gpu_layers, plan.in_ring).disk_s):
            return got
        tried.append(got)
    feasible = [g for g in tried if not isinstance(g[1], Infeasible)]
    return min(feasible, key=lambda g: g[1].predicted_tpot_s) if feasible else tried[0]


def throughput_fields(t: Throughput) -> dict:
    """The plan's figures for `concurrency` requests at once (issue 16's JSON contract)."""
    return {"concurrency": t.concurrency, "aggregate_tps": t.aggregate_tps, "tpot_ms_per_request": t.tpot_s * 1e3,
            "mode": t.mode, "bottleneck": t.bottleneck, "max_batch": t.max_batch, "micro_batches": t.micro_batches}
