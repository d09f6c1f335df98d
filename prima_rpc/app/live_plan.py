"""Plan for the live ring: profile every node (one at a time), then solve with the head's manifest."""

import json

import grpc

from nodes.engine.prefetch import KV_RESERVE_TOKENS
from prima_rpc.app import ring
from prima_rpc.control import Control
from prima_rpc.spec.profiles import devices_from_json
from solver.fetch_time import add_first_start
from solver.model_profile import ModelProfile
from solver.strategies import plan_for


def profile_ring(head: str, token: str | None, refresh: bool = False) -> tuple[dict, dict]:
    """({"devices": [...], "_holds_model": [bool, ...]} in ring order named by address, the head's manifest)."""
    nodes = ring.walk(head, token)
    devices, manifest, held = [], "", []
    # Sequentially: profiles taken in parallel on shared cores would measure each other.
    for i, (address, _) in enumerate(nodes):
        try:
            with Control(address, token) as peer:
                reply = peer.profile(refresh)
        except grpc.RpcError as exc:
            raise ring.RingError(f"{address}: profile failed: {exc.code().name}: {exc.details()}") from None
        device = json.loads(reply.json)
        device.update(name=address, is_head=(i == 0))
        devices.append(device)
        manifest = manifest or (reply.manifest if i == 0 else "")
        held.append(bool(manifest) and reply.manifest == manifest)
    if not manifest:
        raise ring.RingError(f"the head {head} has no model to plan for (start it with --model)")
    return {"devices": devices, "_holds_model": held}, json.loads(manifest)


def plan_live(head: str, token: str | None, strategy: str = "halda", refresh: bool = False,
              concurrency: int = 1, speculation: tuple[int, float] | None = None) -> dict:
    profiles, manifest = profile_ring(head, token, refresh)
    devices = devices_from_json(profiles)
    # The KV positions a node's memory budget keeps room for: plan memory the way the nodes will use it.
    result = plan_for(devices, manifest, strategy, n_ctx=KV_RESERVE_TOKENS, concurrency=concurrency,
                      speculation=speculation)
    if "devices" in result:  # nodes without the model fetch their layers from the head first
        add_first_start(result, ModelProfile.from_json(manifest), devices, profiles["_holds_model"])
    result["profiles"] = profiles
    return result
