"""Regenerate the Python stubs under prima_rpc/ from protos/ (run after editing a .proto)."""

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTOS.rglob("*.proto"))


def _protoc(proto: Path, *outputs: str) -> None:
    include = Path(protoc.__file__).parent / "_proto"
    if protoc.main(["protoc", f"-I{PROTOS}", f"-I{include}", *outputs, str(proto)]) != 0:
        sys.exit(f"protoc failed on {proto}")


def generate(out_dir: Path) -> None:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py for every proto into out_dir (mirrors protos/)."""
    for proto in proto_files():
        _protoc(proto, f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}")


def descriptor_set(out_file: Path) -> None:
    """Write the compiled descriptors of every proto (what the stubs embed) as a FileDescriptorSet."""
    for proto in proto_files():
        _protoc(proto, f"--descriptor_set_out={out_file}")


if __name__ == "__main__":
    generate(ROOT)
    print("stubs regenerated under", ROOT / "prima_rpc")
