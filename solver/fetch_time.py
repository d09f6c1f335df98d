"""An added term of a plan: how long its first start takes when devices must fetch their layers first.

A device without the model fetches the unit files of its windows from the head before it loads them:
its bytes over its measured link throughput, and all of them over the head's, whose uplink they share.
The term does not change which plan is chosen (fetching happens once, a token's time every token); it
says what the first start costs.
"""

from collections.abc import Sequence

from prima_rpc.spec.profiles import DeviceProfile
from solver.model_profile import ModelProfile


def add_first_start(result: dict, model: ModelProfile, devices: Sequence[DeviceProfile],
                    holds: Sequence[bool]) -> dict:
    """result: plan_to_json's dict (devices in ring order, the head first); holds[i]: device i has the model.
    Adds fetch_bytes and fetch_s per device and first_start_s (0: nobody fetches)."""
    total = 0
    slowest = 0.0
    for d, profile, has in zip(result["devices"], devices, holds):
        n = 0
        if not has and d.get("window"):
            n = sum(sum(model.layer_bytes[a:b]) for a, b in d["layers"])
            n += model.embed_bytes + model.head_bytes if d.get("role") == "head" else 0
        d["fetch_bytes"] = n
        d["fetch_s"] = n / profile.link_bandwidth if n else 0.0
        total += n
        slowest = max(slowest, d["fetch_s"])
    head_bw = devices[0].link_bandwidth if devices else 0.0
    result["first_start_s"] = max(slowest, total / head_bw if total else 0.0)
    return result
