"""Build hook: every build of specserve carries the gRPC stubs of `proto/generation.proto`.

The project is declared in pyproject.toml; this file only extends setuptools' ``build_py`` so
that `server.proto_gen` compiles the proto into the built ``server/pb`` (a wheel, ``pip install
.``) or, for an editable install (``pip install -e .``), into the checkout's ``server/pb``.
grpcio-tools is a build requirement (pyproject.toml's ``[build-system]``), not a run-time one.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _proto_gen() -> ModuleType:
    """`server/proto_gen.py` loaded by path: importing the `server` package would need the
    run-time dependencies, which the isolated build environment does not have."""
    spec = importlib.util.spec_from_file_location("proto_gen", ROOT / "server" / "proto_gen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    """``build_py`` that also writes ``server/pb/generation_pb2{.py,.pyi,_grpc.py}``."""

    def run(self) -> None:
        super().run()
        proto_gen = _proto_gen()
        if self.editable_mode:
            proto_gen.generate()  # in place, when missing or older than the proto
        else:
            proto_gen.generate(force=True, pb_dir=Path(self.build_lib) / proto_gen.PACKAGE_DIR)


setup(cmdclass={"build_py": BuildPyWithStubs})
