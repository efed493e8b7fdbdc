"""Generated protobuf and gRPC stubs for `proto/generation.proto` (package `fmaas`).

Use as ``from server.pb import generation_pb2, generation_pb2_grpc``. The modules are generated,
never edited and never committed: every build of the package writes them (setup.py runs
`server.proto_gen`), and ``make gen-proto`` does in a checkout. Importing this package only
checks that they are there: it raises ImportError, saying how to make them, when they are not,
and warns when a checkout's proto is newer than them.
"""

import warnings
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_STUBS = ("generation_pb2.py", "generation_pb2_grpc.py")
_PROTO = _HERE.parent.parent / "proto" / "generation.proto"  # present in a checkout only

_missing = [name for name in _STUBS if not (_HERE / name).is_file()]
if _missing:
    raise ImportError(
        f"the gRPC stubs {', '.join(_missing)} are missing from {_HERE}: in a checkout run "
        "`make gen-proto` (python -m server.proto_gen), or reinstall specserve "
        "(pip install builds them)"
    )
if _PROTO.is_file() and any(
    (_HERE / name).stat().st_mtime_ns < _PROTO.stat().st_mtime_ns for name in _STUBS
):
    warnings.warn(
        f"the gRPC stubs in {_HERE} are older than {_PROTO}: run `make gen-proto`", stacklevel=2
    )
