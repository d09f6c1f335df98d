"""The committed stubs import cleanly and match protos/ (regenerate with `python tools/gen_protos.py`)."""

from google.protobuf import descriptor_pb2

from prima_rpc.v1 import prima_pb2, prima_pb2_grpc
from tools.gen_protos import descriptor_set


def test_committed_stubs_match_the_proto(tmp_path):
    # Compare compiled descriptors, not text: the generated text varies with the protoc version.
    descriptor_set(tmp_path / "set.pb")
    fresh = descriptor_pb2.FileDescriptorSet.FromString((tmp_path / "set.pb").read_bytes()).file[0]
    for message in fresh.message_type:  # the stubs embed descriptors without derived json names
        for f in message.field:
            f.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto()
    prima_pb2.DESCRIPTOR.CopyToProto(committed)
    assert committed == fresh, "prima_rpc/v1/prima_pb2.py is stale: run `python tools/gen_protos.py`"


def test_every_service_has_stubs():
    services = prima_pb2.DESCRIPTOR.services_by_name
    assert set(services) == {"Ring", "Control", "Inference"}
    for name in services:
        assert hasattr(prima_pb2_grpc, f"{name}Stub") and hasattr(prima_pb2_grpc, f"{name}Servicer")
