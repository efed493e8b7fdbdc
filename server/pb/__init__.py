"""Generated protobuf and gRPC stubs for `proto/generation.proto` (package `fmaas`).

Use as ``from server.pb import generation_pb2, generation_pb2_grpc``. The modules are generated,
never edited and never committed: importing this package (re)generates them first when they are
missing or older than the proto (see `server.proto_gen`), so a fresh clone works after
``pip install -e .`` without a separate build step.
"""

from server.proto_gen import ensure_generated

ensure_generated()
