"""What a node reports of itself (Control.Info): its role, windows, members, standby copy and running totals."""

import psutil

from nodes.ring import frames, owner
from prima_rpc.v1 import prima_pb2 as pb


def info(node) -> pb.NodeInfo:
    """node: a nodes.ring.node.Node (not imported: it calls this)."""
    rss = psutil.Process().memory_info().rss
    stall = node.stats.stall_s + (node.shard.stall_s if node.shard else 0.0)
    disk = node.shard.disk if node.shard else None
    stats = frames.node_stats(
        resident_bytes=node.shard.resident_bytes() if node.shard else 0,
        disk_read_bytes=node.store.bytes_read if node.store else 0,
        compute_s=node.stats.compute_s - stall, stall_s=stall, link_s=node.stats.link_s, frames=node.stats.frames,
        last_token_ms=node.stats.last_token_ms, rss_bytes=rss, decode_s=node.stats.decode_s,
        decode_frames=node.stats.decode_frames,
        active_requests=len(node.shard.caches) if node.shard else 0,
        batches=node.stats.batches, batched_frames=node.stats.batched_frames,
        max_batch_seen=node.stats.max_batch_seen, queue_depth=node.inbox.qsize(),
        queue_wait_s=node.stats.queue_wait_s, max_batch=node.max_batch,
        prefilled_tokens=node.stats.prefilled_tokens, prefix_hit_tokens=node.stats.prefix_hit_tokens,
        prefix_cached_tokens=node.shard.prefixes.positions() if node.shard else 0,
        prefix_disk_bytes=disk.held_bytes(node.shard.windows.ranges) if disk else 0,
        prefix_disk_tokens=node.stats.prefix_disk_tokens + (node.shard.disk_loaded if node.shard else 0))
    return frames.node_info(
        stats=stats, windows=node.windows.ranges if node.windows else (),
        members=node.head.members.states() if node.head else (),
        name=node.cfg.name or node.address, address=node.address, peer=node.peer, role=node.role,
        loaded=node.windows is not None, n_layers=node.store.config.n_layers if node.store else 0,
        model_id=node.store.model_id if node.store else "",
        model_name=node.store.manifest.name if node.store else "",
        mem_budget=node.shard.plan.budget if node.shard else node.mem_budget,
        node_id=node.node_id, error=node.last_error, epoch=node.epoch, state="fetching" if node.fetching else "up",
        head=node.head_address,
        cached_units=node.cached_units, fetched_bytes=node.fetched_bytes,
        predicted_ms=node.predicted[0], predicted_tpot_ms=node.predicted[1], standby=node.standby.asked,
        compute_dtype=str(node.shard.dtype).removeprefix("torch.") if node.shard else "",
        head_copy=node.holds_head_copy(), ring=node.standby.ring,
        kv_positions=node.shard.kv_positions() if node.shard else 0,
        kv_dtype=node.shard.kv_dtype.name if node.shard else "",
        kv_bytes_per_token=node.shard.kv_bytes_per_token() if node.shard else 0, draft=node.drafts is not None,
        **owner_fields(node))


def owner_fields(node) -> dict:
    """The owner's limits, what the device has left, and (the head) the live re-plans."""
    pressure = owner.memory_pressure()
    replanner = node.head.replanner if node.head is not None else None
    return {"max_cpu": node.cfg.max_cpu, "max_memory": owner.budget(node.cfg.max_memory, node.memory_cap),
            "nice": node.cfg.nice, "replan": bool(node.cfg.replan and replanner),
            "available_memory": owner.available_memory(), "memory_pressure": -1.0 if pressure is None else pressure,
            "memory_low": node.memory_low, "replan_state": replanner.state if replanner else "",
            "replans": replanner.records if replanner else ()}
