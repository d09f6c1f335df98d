"""Generated hostile messages at every service of a real 2-node ring: no crash, every rejection a clear
status, and a normal request is served afterwards. 10,000+ messages in all (hypothesis, bounded): frames, Generate,
Assign (windows out of range) and SetPeer, undecodable bytes, a Fetch of paths outside the store, Join and Leave of
generated addresses. The HTTP dialects are fuzzed in test_fuzz_http.py."""

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prima_rpc.app import ring
from prima_rpc.channel import sync_channel
from prima_rpc.v1 import prima_pb2 as pb
from prima_rpc.v1 import prima_pb2_grpc as rpc

pytestmark = pytest.mark.slow
H = 64  # the tiny preset's hidden size
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS}
FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None, derandomize=True)


@pytest.fixture(scope="module")
def target(tiny_rings):
    local = tiny_rings(2, [4, 4])
    channel = sync_channel(local.addresses[1])  # a worker: its Ring service sees the frames
    head = sync_channel(local.addresses[0])
    yield local, channel, head, ring.walk(local.addresses[0])[0][1].epoch


def expect_clear(call) -> None:
    try:
        call()
    except grpc.RpcError as exc:
        assert exc.code() in CLEAR, f"{exc.code()}: {exc.details()}"
        assert exc.details(), "a rejection without a message"


tensors = st.builds(
    pb.Tensor,
    dtype=st.one_of(st.sampled_from(["float32", "float16", "bfloat16", "int8", "", "float64"]), st.text(max_size=20)),
    shape=st.one_of(st.just([2, H]), st.lists(st.integers(-3, 1 << 40), max_size=10)),
    data=st.one_of(st.binary(max_size=1024), st.just(b"\0" * 8 * H), st.just(b"\0" * 4 * H)),
)


def frames(epoch: int):
    return st.builds(
        pb.Frame, request_id=st.text(max_size=150), kind=st.integers(0, 7),
        start_pos=st.one_of(st.integers(0, 10), st.integers(0, (1 << 32) - 1)),
        next_layer=st.one_of(st.integers(0, 9), st.integers(0, (1 << 32) - 1)),
        capacity=st.integers(0, (1 << 32) - 1), hidden=tensors, error=st.text(max_size=50),
        seq=st.integers(0, (1 << 64) - 1), epoch=st.one_of(st.just(epoch), st.integers(0, (1 << 64) - 1)),
    )


def test_ring_frames(target):
    local, channel, _, epoch = target
    stub = rpc.RingStub(channel)

    @settings(FUZZ, max_examples=6000)
    @given(frames(epoch))
    def one(frame):
        expect_clear(lambda: list(stub.Stream(iter([frame]), timeout=10)))

    one()
    assert all(p.poll() is None for p in local.processes)


def test_generate_requests(target):
    local, _, head, _ = target
    stub = rpc.InferenceStub(head)
    messages = st.lists(st.builds(pb.ChatMessage, role=st.sampled_from(["user", "system", "bot", ""]),
                                  content=st.text(max_size=40)), max_size=3)

    @settings(FUZZ, max_examples=2000)
    @given(st.builds(pb.GenerateRequest, prompt=st.text(max_size=60), messages=messages, raw=st.booleans(),
                     max_tokens=st.integers(-3, 2), temperature=st.floats(allow_nan=True, width=32),
                     top_k=st.integers(-5, 100), top_p=st.floats(allow_nan=True, width=32),
                     seed=st.integers(0, (1 << 64) - 1), stop=st.lists(st.text(max_size=5), max_size=20),
                     request_id=st.text(max_size=200)))
    def one(req):
        expect_clear(lambda: list(stub.Generate(req, timeout=30)))

    one()
    assert all(p.poll() is None for p in local.processes)


def test_control_requests(target):
    local, channel, _, _ = target
    stub = rpc.ControlStub(channel)
    ranges = st.lists(st.builds(pb.LayerRange, start=st.integers(0, 20), stop=st.integers(0, 20)), max_size=4)
    assigns = st.builds(pb.AssignRequest, windows=ranges, head=st.booleans(), ring_layers=st.integers(0, 20),
                        model_id=st.text(min_size=1, max_size=70), epoch=st.integers(0, 9),
                        ring=st.lists(st.text(max_size=300), max_size=3))
    peers = st.one_of(st.text(max_size=300).filter(lambda p: not p.rpartition(":")[2].isdigit()),
                      st.from_regex(r"[a-z]{1,8}:(0|[7-9][0-9]{5})", fullmatch=True))  # port out of range

    @settings(FUZZ, max_examples=1500)
    @given(st.one_of(assigns, peers))
    def one(msg):
        if isinstance(msg, str):
            expect_clear(lambda: stub.SetPeer(pb.SetPeerRequest(peer=msg), timeout=10))
        else:
            expect_clear(lambda: list(stub.Assign(msg, timeout=10)))

    one()
    assert all(p.poll() is None for p in local.processes)


def test_undecodable_bytes_at_every_method(target):
    local, channel, head, _ = target
    # (SetPeer is left out: bytes that decode to a valid HOST:PORT are a legitimate rewiring; its
    # validation is fuzzed with strings in test_control_requests.)
    methods = ["/prima.v1.Ring/Stream", "/prima.v1.Control/Info", "/prima.v1.Control/Assign",
               "/prima.v1.Inference/Generate", "/prima.v1.Inference/Cancel"]

    @settings(FUZZ, max_examples=600)
    @given(st.sampled_from(methods), st.binary(min_size=1, max_size=200))
    def one(method, raw):
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        try:
            call(raw, timeout=10)
        except grpc.RpcError as exc:  # undecodable protobuf: gRPC's own status naming the message type
            if exc.code() not in CLEAR:
                assert exc.code() == grpc.StatusCode.UNKNOWN and "Error parsing message with type" in exc.details()

    one()
    assert all(p.poll() is None for p in local.processes)


def test_a_normal_request_is_served_afterwards(target):
    local, _, head, _ = target
    events = list(rpc.InferenceStub(head).Generate(pb.GenerateRequest(prompt="hello", raw=True, max_tokens=5),
                                                   timeout=30))
    assert [e.WhichOneof("event") for e in events] == ["token"] * 5 + ["finished"]


FETCH_NAMES = st.one_of(st.text(max_size=80), st.sampled_from([
    "../manifest.json", "/etc/passwd", "..", ".", "", "a/../../etc/passwd", "layers/../../x", "\\..\\x", "x\0y",
    "manifest.json/..", "//etc/passwd", "~/.ssh/id_rsa", "%2e%2e/secret", "tokenizer.json", "manifest.json"]))


def test_fetch_requests_never_reach_outside_the_store(target, tiny_store):
    local, _, head, _ = target
    stub = rpc.ControlStub(head)
    model_id = ring.walk(local.addresses[0])[0][1].model_id
    served = {p.relative_to(tiny_store).as_posix() for p in tiny_store.rglob("*") if p.is_file()}

    @settings(FUZZ, max_examples=800)
    @given(st.builds(pb.FetchRequest, model_id=st.one_of(st.just(model_id), st.text(max_size=70)), name=FETCH_NAMES,
                     offset=st.one_of(st.integers(0, 4096), st.integers(0, (1 << 64) - 1))))
    def one(req):
        try:
            chunks = list(stub.Fetch(req, timeout=10))
        except grpc.RpcError as exc:
            assert exc.code() in CLEAR, f"{exc.code()}: {exc.details()}"
            assert exc.details()
            return
        assert req.model_id == model_id and req.name in served, f"served {req.name!r} from outside the store"
        assert all(c.total_bytes == (tiny_store / req.name).stat().st_size for c in chunks)

    one()
    assert all(p.poll() is None for p in local.processes)


def test_membership_requests_with_generated_addresses(target):
    local, _, head, _ = target
    stub = rpc.ControlStub(head)
    before = [a for a, _ in ring.walk(local.addresses[0])]
    addresses = st.one_of(st.text(max_size=100), st.from_regex(r"[a-z0-9.]{0,12}:[0-9]{0,7}", fullmatch=True),
                          st.sampled_from(local.addresses))

    @settings(FUZZ, max_examples=400)
    @given(st.sampled_from(["join", "leave"]), addresses, st.text(max_size=70))
    def one(kind, address, model_id):
        if kind == "join":  # a node nobody serves does not answer the head: UNAVAILABLE, with a message
            call = lambda: stub.Join(pb.JoinRequest(address=address, model_id=model_id), timeout=20)  # noqa: E731
        elif address in local.addresses:
            return  # a member's leave (the head's too: it hands over) is the ring's own operation, not a hostile one
        else:
            call = lambda: stub.Leave(pb.LeaveRequest(address=address), timeout=20)  # noqa: E731
        try:
            call()
        except grpc.RpcError as exc:
            assert exc.code() in CLEAR | {grpc.StatusCode.UNAVAILABLE}, f"{exc.code()}: {exc.details()}"
            assert exc.details()

    one()
    assert [a for a, _ in ring.walk(local.addresses[0])] == before
    assert all(p.poll() is None for p in local.processes)
