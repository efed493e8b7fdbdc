"""The package as declared, built and installed: dependency floors are the versions
constraints.txt pins (the ones installed and tested), the run-time dependencies leave out the
build's and the optional parts' packages, and a built wheel carries the gRPC stubs and the
prompt data, so an installed specserve runs without grpcio-tools."""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
DEV_EXTRAS = ("otel", "cuda", "models")
"""The extras `dev` brings in: the ones installed (and so tested) by `make install`."""
NOT_AT_RUN_TIME = ("grpcio-tools", "opentelemetry-sdk", "triton", "flash-attn", "pytest")


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = Version(version)
    return pins


def _installed_requirements() -> list[Requirement]:
    """The dependencies and every requirement of the extras `make install` installs."""
    extras = PROJECT["optional-dependencies"]
    lines = PROJECT["dependencies"] + extras["dev"]
    lines += [line for name in DEV_EXTRAS for line in extras[name]]
    return [r for r in map(Requirement, lines) if r.name != PROJECT["name"]]


def test_dev_brings_the_extras_it_tests() -> None:
    self_reference = [
        Requirement(line)
        for line in PROJECT["optional-dependencies"]["dev"]
        if Requirement(line).name == PROJECT["name"]
    ]
    assert [sorted(r.extras) for r in self_reference] == [sorted(DEV_EXTRAS)]


def test_floors_are_the_pinned_versions() -> None:
    """Each requirement's lower bound (``>=`` or ``==``) is exactly constraints.txt's version:
    what is declared to work is what is installed and tested."""
    pins = _pins()
    wrong = []
    for req in _installed_requirements():
        pin = pins.get(canonicalize_name(req.name))
        floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
        if pin is None or floors != [pin]:
            wrong.append(f"{req} (constraints.txt: {pin})")
    assert not wrong, "floors that are not the tested version:\n" + "\n".join(wrong)


def test_the_environment_has_the_pinned_versions() -> None:
    """The environment running the tests was installed with constraints.txt."""
    pins = _pins()
    wrong = []
    for req in _installed_requirements():
        name = canonicalize_name(req.name)
        installed = Version(importlib.metadata.version(name))
        if not SpecifierSet(f"=={pins[name]}").contains(installed, prereleases=True):
            wrong.append(f"{name} {installed} (constraints.txt: {pins[name]})")
    assert not wrong, "installed versions off constraints.txt:\n" + "\n".join(wrong)


def test_grpcio_floor_is_what_the_build_generates_for() -> None:
    """The stubs from the build's grpcio-tools refuse an older grpcio at import."""
    build = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    tools = next(r for r in build if r.name == "grpcio-tools")
    grpcio = next(r for r in map(Requirement, PROJECT["dependencies"]) if r.name == "grpcio")
    assert str(tools.specifier) == f"=={_pins()['grpcio-tools']}"
    assert str(grpcio.specifier) == f">={_pins()['grpcio-tools']}"


def test_makefile_installs_with_the_constraints() -> None:
    makefile = (REPO / "Makefile").read_text()
    installs = [
        line
        for line in makefile.splitlines()
        if "pip install" in line and "--upgrade pip" not in line  # pip is no dependency
    ]
    assert installs and all("-c constraints.txt" in line for line in installs), installs


BUILD_INPUTS = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "constraints.txt")
BUILD_TREES = ("proto", "engine", "server", "training")
"""What the images copy to build the package (the Dockerfile's COPY lines)."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the package's sources without generated stubs (the build
    makes them) or caches."""
    src = tmp_path_factory.mktemp("src")
    for name in BUILD_INPUTS:
        shutil.copy2(REPO / name, src / name)
    skip = shutil.ignore_patterns("*_pb2*", ".gen-*", "__pycache__", "*.pyc")
    for name in BUILD_TREES:
        shutil.copytree(REPO / name, src / name, ignore=skip)
    assert not list((src / "server" / "pb").glob("*_pb2*"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"),
            *("--wheel-dir", str(out), str(src)),
        ],
        check=True,
        env={**os.environ, "PIP_NO_INDEX": "1"},
    )
    (built,) = out.glob("specserve-*.whl")
    return built


def test_wheel_carries_stubs_and_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [f"engine/kernels/{p.name}" for p in (REPO / "engine" / "kernels").glob("*.[ch]")]
    assert sources
    for name in (
        "server/pb/generation_pb2.py",
        "server/pb/generation_pb2.pyi",
        "server/pb/generation_pb2_grpc.py",
        "training/prompts.json",
        *sources,
    ):
        assert name in names, name


def test_wheel_requires_no_build_or_optional_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        (metadata,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        lines = zf.read(metadata).decode().splitlines()
    requires = [
        Requirement(line.split(":", 1)[1]) for line in lines if line.startswith("Requires-Dist:")
    ]
    unconditional = {r.name for r in requires if r.marker is None}
    assert "opentelemetry-api" in unconditional and "grpcio" in unconditional
    assert not unconditional & set(NOT_AT_RUN_TIME)


def _run(code: str, path: Path) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter that imports the project from `path` only, with
    grpc_tools unimportable."""
    prelude = f"import sys; sys.modules['grpc_tools'] = None; sys.path.insert(0, {str(path)!r})\n"
    return subprocess.run(
        [sys.executable, "-I", "-c", prelude + code], capture_output=True, text=True, cwd=path
    )


def test_installed_wheel_imports_stubs_and_prompts_without_grpc_tools(
    wheel: Path, tmp_path: Path
) -> None:
    zipfile.ZipFile(wheel).extractall(tmp_path)
    done = _run(
        "from server.pb import generation_pb2_grpc as g\n"
        "from training.prompts import CHAT_PROMPTS, builtin_prompts\n"
        "print(g.__file__, len(CHAT_PROMPTS), len(builtin_prompts()))",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    file, chat, builtin = done.stdout.split()
    assert Path(file).is_relative_to(tmp_path)
    assert (int(chat), int(builtin)) == (20, 3956)


def test_missing_stubs_say_how_to_make_them(tmp_path: Path) -> None:
    for name in ("server/__init__.py", "server/pb/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((REPO / name).read_text())
    done = _run("import server.pb", tmp_path)
    assert done.returncode == 1
    assert "ImportError" in done.stderr and "make gen-proto" in done.stderr
    assert "reinstall specserve" in done.stderr


def test_tracing_without_the_otel_extra_names_the_fix() -> None:
    code = (
        "sys.modules['opentelemetry.sdk'] = None\n"
        "from server.tracing import start_tracing\n"
        "start_tracing('http://127.0.0.1:1', None)"
    )
    done = _run(code, REPO)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: OTLP_ENDPOINT is set"), last
    assert "pip install 'specserve[otel]'" in last


def test_the_images_copy_what_the_build_reads() -> None:
    """Each builder stage of the Dockerfile copies every input of the wheel build above."""
    dockerfile = (REPO / "Dockerfile").read_text()
    for stage in re.split(r"^FROM ", dockerfile, flags=re.M)[1:]:
        if not stage.split("\n", 1)[0].endswith("-builder"):
            continue
        copied = {
            name.rstrip("/")
            for line in re.findall(r"^COPY (?!--from)(.*)$", stage, re.M)
            for name in line.split()[:-1]
        }
        assert copied >= {*BUILD_INPUTS, *BUILD_TREES}, stage.split("\n", 1)[0]
