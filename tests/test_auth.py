"""Every RPC of every service checks the cluster token: none or a wrong one is UNAUTHENTICATED."""

import grpc
import pytest

from prima_rpc.app import ring
from prima_rpc.channel import metadata, sync_channel
from prima_rpc.client import PrimaError
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc
from tests.rings import SECRET, collect

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def secured(secured_rings):
    return secured_rings(2, [4, 4])


def calls(address: str):
    """One call of every RPC, as (name, thunk)."""
    channel = sync_channel(address)
    control, inference, ring_stub = rpc.ControlStub(channel), rpc.InferenceStub(channel), rpc.RingStub(channel)
    return {
        "Control.Info": lambda md: control.Info(pb.InfoRequest(), metadata=md, timeout=5),
        "Control.Assign": lambda md: list(control.Assign(pb.AssignRequest(), metadata=md, timeout=5)),
        "Control.Profile": lambda md: control.Profile(pb.ProfileRequest(), metadata=md, timeout=30),
        "Inference.Generate": lambda md: list(inference.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2),
                                                                 metadata=md, timeout=10)),
        "Inference.Cancel": lambda md: inference.Cancel(pb.CancelRequest(request_id="x"), metadata=md, timeout=5),
        "Ring.Stream": lambda md: list(ring_stub.Stream(iter([pb.Frame(kind=pb.PING, seq=1)]), metadata=md,
                                                        timeout=5)),
    }


@pytest.mark.parametrize("name", ["Control.Info", "Control.Assign", "Control.Profile", "Inference.Generate",
                                  "Inference.Cancel", "Ring.Stream"])
@pytest.mark.parametrize("token", [None, "wrong"])
def test_rpc_without_the_token_is_unauthenticated(secured, name, token):
    with pytest.raises(grpc.RpcError) as err:
        calls(secured.addresses[0])[name](metadata(token))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "cluster token" in err.value.details()


def test_shutdown_without_the_token_is_refused_and_the_node_stays(secured):
    stub = rpc.ControlStub(sync_channel(secured.addresses[1]))
    with pytest.raises(grpc.RpcError) as err:
        stub.Shutdown(pb.ShutdownRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert secured.processes[1].poll() is None


def test_with_the_token_everything_is_served(secured):
    assert len(ring.walk(secured.addresses[0], SECRET)) == 2
    ping = calls(secured.addresses[0])["Ring.Stream"](metadata(SECRET))
    assert [a.seq for a in ping] == [1]

    assert len(collect(secured.addresses[0], "hi", 3, SECRET, raw=True)[0]) == 3
    with pytest.raises(PrimaError) as err:
        collect(secured.addresses[0], "hi", 3, "nope", raw=True)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
