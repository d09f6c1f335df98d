"""Plan for the live ring: profile every node (one at a time), then solve with the head's manifest."""

import json
from collections.abc import Callable

import grpc

from prima_rpc.app import ring
from prima_rpc.control import Control
from prima_rpc.spec.profiles import devices_from_json
from solver.fetch_time import add_first_start
from solver.kv_term import kv_tokens
from solver.model_profile import ModelProfile
from solver.strategies import plan_for


def profile_ring(head: str, token: str | None, refresh: bool = False,
                 progress: Callable[[int, int], None] = lambda done, total: None) -> tuple[dict, dict]:
    """({"devices": [...], "_holds_model": [bool, ...]} in ring order named by address, the head's manifest);
    progress(devices profiled, devices)."""
    nodes = ring.walk(head, token)
    devices, manifest, held = [], "", []
    # Sequentially: profiles taken in parallel on shared cores would measure each other.
    for i, (address, _) in enumerate(nodes):
        progress(i, len(nodes))
        try:
            with Control(address, token) as peer:
                reply = peer.profile(refresh)
        except grpc.RpcError as exc:
            raise ring.RingError(f"{address}: profile failed: {exc.code().name}: {exc.details()}",
                                 exc.code()) from None
        device = json.loads(reply.json)
        device.update(name=address, is_head=(i == 0))
        devices.append(device)
        manifest = manifest or (reply.manifest if i == 0 else "")
        held.append(bool(manifest) and reply.manifest == manifest)
    progress(len(nodes), len(nodes))
    if not manifest:
        raise ring.RingError(f"the head {head} has no model to plan for (start it with --model)")
    return {"devices": devices, "_holds_model": held}, json.loads(manifest)


def plan_live(head: str, token: str | None, strategy: str = "halda", refresh: bool = False,
              concurrency: int = 1, speculation: tuple[int, float, float] | None = None,
              progress: Callable[[int, int], None] = lambda done, total: None, ctx: int = 0) -> dict:
    """ctx: the context each request gets (0: the model's own); given, devices at --kv-dtype auto are priced with
    the most precise KV dtype that holds it (solver.strategies.choose_kv_dtype)."""
    profiles, manifest = profile_ring(head, token, refresh, progress)
    devices = devices_from_json(profiles)
    # KV for the requests asked for, each at the whole context: plan memory the way the nodes will use it.
    n_ctx = kv_tokens(ctx or ModelProfile.from_json(manifest).max_seq_len, concurrency)
    result = plan_for(devices, manifest, strategy, n_ctx=n_ctx, concurrency=concurrency,
                      speculation=speculation, choose_kv=bool(ctx))
    if "devices" in result:  # nodes without the model fetch their layers from the head first
        add_first_start(result, ModelProfile.from_json(manifest), devices, profiles["_holds_model"])
    result["profiles"] = profiles
    return result


def plan_live_shown(head: str, token: str | None, strategy: str = "halda", refresh: bool = False,
                    concurrency: int = 1, speculation: tuple[int, float, float] | None = None, ctx: int = 0) -> dict:
    """plan_live with a bar of the devices profiled (a first profile takes a minute) and a summary line."""
    import time

    from prima_rpc.app.progress import bar, summary

    started, count = time.monotonic(), [0]

    def report(done: int, total: int) -> None:
        count[0] = total
        progress(done, total, f"profiling device {min(done + 1, total)} of {total}")

    with bar("profiling the devices") as progress:
        result = plan_live(head, token, strategy, refresh, concurrency, speculation, report, ctx)
    summary(f"profiled {count[0]} devices and solved the plan in {time.monotonic() - started:.1f} s")
    return result
