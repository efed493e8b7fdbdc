"""Generate `server/pb/generation_pb2{.py,.pyi,_grpc.py}` from `proto/generation.proto`.

Run as ``python -m server.proto_gen [--force]`` (``make gen-proto``) in a checkout; every build of
the package runs it too (setup.py), so the stubs are never committed and an installed specserve
needs no grpcio-tools. `import server.pb` never generates anything.

How the imports come out right without editing generated code: protoc names generated modules
after the proto's *virtual* path, the path relative to its ``--proto_path``. A plain
``-I proto`` makes that path ``generation.proto``, so the gRPC module would say
``import generation_pb2`` (TGIS then patches it with ``sed``). Here the include root is mapped
instead, ``--proto_path=server/pb=<repo>/proto``: the file on disk stays
``proto/generation.proto`` but protoc sees it as ``server/pb/generation.proto``, writes its outputs
to ``<out>/server/pb/`` and the gRPC module imports ``from server.pb import generation_pb2``.
The proto's package (``fmaas``) and so every message and service name is unaffected; only the
descriptor's file name becomes ``server/pb/generation.proto``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from importlib.resources import files
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_FILE = REPO_ROOT / "proto" / "generation.proto"
PACKAGE_DIR = "server/pb"
"""Virtual directory of the proto for protoc; equals the output package's path."""
PB_DIR = REPO_ROOT / PACKAGE_DIR
OUTPUT_NAMES = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")
OUTPUTS = tuple(PB_DIR / name for name in OUTPUT_NAMES)


def protoc_args(proto_file: Path, package_dir: str, out_dir: Path) -> list[str]:
    """The ``grpc_tools.protoc`` argv compiling `proto_file` as module(s) of `package_dir`.

    `package_dir` is a '/'-separated package path (``server/pb``); outputs land in
    ``out_dir/package_dir/`` and import each other as ``from <package> import ...``.
    """
    well_known = files("grpc_tools") / "_proto"  # google/protobuf/*.proto, should it import any
    return [
        "grpc_tools.protoc",
        f"--proto_path={package_dir}={proto_file.parent}",
        f"--proto_path={well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto_file),
    ]


def is_stale(pb_dir: Path = PB_DIR) -> bool:
    """True if an output in `pb_dir` is missing or older than the proto (which must exist)."""
    proto_mtime = PROTO_FILE.stat().st_mtime_ns
    outputs = [pb_dir / name for name in OUTPUT_NAMES]
    return any(not out.is_file() or out.stat().st_mtime_ns < proto_mtime for out in outputs)


def generate(force: bool = False, pb_dir: Path = PB_DIR) -> None:
    """Compile `PROTO_FILE` into `pb_dir` (an existing ``server/pb`` package directory: the
    checkout's, or a build's copy) if `force` or the outputs there are stale.

    Outputs are written to a temporary directory inside `pb_dir` and moved into place one by one
    with `os.replace`, so a concurrent importer sees either an old or a new complete file.
    Raises FileNotFoundError if the proto is missing and RuntimeError if protoc fails.
    """
    if not PROTO_FILE.is_file():
        raise FileNotFoundError(f"{PROTO_FILE} not found: stubs can only be built from a checkout")
    if not force and not is_stale(pb_dir):
        return
    from grpc_tools import protoc  # imported here: heavy, and only needed to generate

    tmp = Path(tempfile.mkdtemp(prefix=".gen-", dir=pb_dir))
    try:
        rc = protoc.main(protoc_args(PROTO_FILE, PACKAGE_DIR, tmp))
        if rc != 0:
            raise RuntimeError(f"grpc_tools.protoc failed on {PROTO_FILE} (exit code {rc})")
        for name in OUTPUT_NAMES:
            os.replace(tmp / PACKAGE_DIR / name, pb_dir / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m server.proto_gen [--force]``."""
    parser = argparse.ArgumentParser(description="Generate server/pb from proto/generation.proto")
    parser.add_argument("--force", action="store_true", help="regenerate even if up to date")
    args = parser.parse_args(argv)
    stale = args.force or not PROTO_FILE.is_file() or is_stale()
    generate(force=args.force)
    outputs = ", ".join(str(out.relative_to(REPO_ROOT)) for out in OUTPUTS)
    print(f"{'generated' if stale else 'up to date'}: {outputs}")


if __name__ == "__main__":
    main()
