"""The plan's first-start term: devices without the model fetch their windows' bytes over their links."""

from prima_rpc.spec.profiles import DeviceProfile
from solver.fetch_time import add_first_start
from solver.model_profile import ModelProfile


def partial(cls, **fields):
    """A profile with only the fields the term reads (the others play no part in it)."""
    obj = cls.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


def test_first_start_is_the_slowest_fetch_or_the_heads_shared_uplink():
    model = partial(ModelProfile, layer_bytes=(100,) * 6, embed_bytes=1000, head_bytes=1000)
    devices = [partial(DeviceProfile, link_bandwidth=bw) for bw in (1000.0, 100.0, 1000.0)]
    result = {"devices": [{"role": "head", "window": 2, "layers": [[4, 6]]},
                          {"role": "worker", "window": 2, "layers": [[0, 2]]},
                          {"role": "worker", "window": 2, "layers": [[2, 4]]}]}
    add_first_start(result, model, devices, [True, False, False])
    assert [d["fetch_bytes"] for d in result["devices"]] == [0, 200, 200]
    assert [d["fetch_s"] for d in result["devices"]] == [0.0, 2.0, 0.2]
    assert result["first_start_s"] == 2.0  # node 1's slow link; the head's uplink needs 400 / 1000 s
    devices[1] = partial(DeviceProfile, link_bandwidth=1000.0)
    add_first_start(result, model, devices, [True, False, False])
    assert result["first_start_s"] == 0.4  # now the head's shared uplink bounds it: 400 bytes at 1000 B/s
    add_first_start(result, model, devices, [True, True, True])
    assert result["first_start_s"] == 0.0
