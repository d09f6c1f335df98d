"""The one shape of a node's status row (`prima-ctl status --json`, the web page, the prediction benchmark)."""

from prima_rpc.v1 import prima_pb2 as pb


def status_row(address: str, member_state: str, info) -> dict:
    """A member's JSON row; a member that does not answer has only its address and state."""
    if info is None:
        info = pb.NodeInfo(role="unknown", error="does not answer")
    s = info.stats
    return {"address": address, "state": member_state, "name": info.name, "role": info.role, "peer": info.peer,
            "windows": [[r.start, r.stop] for r in info.windows], "loaded": info.loaded, "model": info.model_name,
            "resident_bytes": s.resident_bytes, "rss_bytes": s.rss_bytes, "disk_read_bytes": s.disk_read_bytes,
            "frames": s.frames, "compute_s": s.compute_s, "link_s": s.link_s, "stall_s": s.stall_s,
            "last_token_ms": s.last_token_ms, "active_requests": s.active_requests, "error": info.error,
            "cached_units": info.cached_units, "fetched_bytes": info.fetched_bytes, "compute_dtype": info.compute_dtype,
            "standby": info.standby, "head_copy": info.head_copy,  # keeps the head's units; holds all of them
            "batches": s.batches, "batched_frames": s.batched_frames,
            "mean_batch": s.batched_frames / s.batches if s.batches else 0.0, "max_batch_seen": s.max_batch_seen,
            "max_batch": s.max_batch, "queue_depth": s.queue_depth, "queue_wait_s": s.queue_wait_s,
            "prefilled_tokens": s.prefilled_tokens, "prefix_hit_tokens": s.prefix_hit_tokens,
            "prefix_cached_tokens": s.prefix_cached_tokens, "prefix_disk_bytes": s.prefix_disk_bytes,
            "prefix_disk_tokens": s.prefix_disk_tokens,
            "kv_dtype": info.kv_dtype, "kv_bytes_per_token": info.kv_bytes_per_token,  # "", 0: nothing loaded
            # The applied plan's per-token compute + stalls here, and the node's own since the assignment (its
            # one-token frames, k = its windows a token); None: no plan's prediction / no decode yet.
            "predicted_ms": round(info.predicted_ms, 3) or None,  # float32 on the wire
            "predicted_tpot_ms": round(info.predicted_tpot_ms, 3) or None,
            "measured_ms": s.decode_s / s.decode_frames * len(info.windows) * 1e3 if s.decode_frames else None,
            # its owner's limits and what the device has left (nodes/ring/owner.py); pressure: PSI "some" avg10 %
            "max_cpu": round(info.max_cpu, 3) or 1.0, "max_memory": info.max_memory or None, "nice": info.nice,
            "available_memory": info.available_memory or None,
            "memory_pressure": None if info.memory_pressure < 0 else round(info.memory_pressure, 2),
            "memory_low": info.memory_low, "replan": info.replan, "replan_state": info.replan_state or None}


def ring_replans(members: list[tuple[str, str, object]]) -> list[dict]:
    """The head's live re-plans, oldest first (`prima-ctl status --json`'s top-level `replans`)."""
    head = next((info for _, _, info in members if info is not None and info.role == "head"), None)
    return [{"at": r.at, "reason": r.reason, "node": r.node, "assumed_ms": round(r.assumed_ms, 3),
             "measured_ms": round(r.measured_ms, 3), "predicted_gain": round(r.predicted_gain, 4),
             "seconds": round(r.seconds, 3)} for r in (head.replans if head is not None else ())]


def busy_words(rows: list[dict], replans: list[dict]) -> str:
    """In words, for people: which device is busy or short of memory, and whether the ring adapted."""
    from datetime import datetime

    said = [f"{r['name'] or r['address']} gives memory back to its owner" for r in rows if r.get("memory_low")]
    if replans:
        r = replans[-1]
        why = {"slower": f"got busy ({r['measured_ms']:.0f} ms a token, the plan assumed {r['assumed_ms']:.0f})",
               "faster": "is free again", "memory": "needed memory back"}.get(r["reason"], r["reason"])
        said.append(f"{r['node']} {why}: the ring adapted at {datetime.fromtimestamp(r['at']).strftime('%H:%M:%S')}"
                    f" (predicted {r['predicted_gain'] * 100:.0f} % faster, moved in {r['seconds']:.1f} s)")
    return "; ".join(said)


def ring_prediction(rows: list[dict]) -> dict:
    """The applied plan's TPOT (the head's copy) and the head's last decode step, in ms (None: unknown)."""
    head = next((r for r in rows if r["role"] == "head"), None)
    return {"predicted_tpot_ms": head["predicted_tpot_ms"] if head else None,
            "measured_tpot_ms": (head["last_token_ms"] or None) if head else None}
