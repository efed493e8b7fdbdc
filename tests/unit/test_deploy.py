"""Deployment files stay in step with the server: docs/configuration.md's env var table, the
Dockerfile's TGIS defaults and the compose services. (hadolint and the compose-spec schema run in
`make lint`.)"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from server.config import ServerConfig
from server.setting import declared

REPO = Path(__file__).resolve().parents[2]


def _env_names() -> list[str]:
    names = ["LOG_LEVEL", "SPECSERVE_HOME"]
    for d in declared(ServerConfig):
        names += d.env
    return names


def test_configuration_doc_lists_every_env_var() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    table_rows = [line for line in doc.splitlines() if line.startswith("| `")]
    documented = {name for row in table_rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row)}
    assert not [n for n in _env_names() if n not in documented]


def _stage(dockerfile: str, name: str) -> str:
    match = re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", dockerfile, re.M | re.S)
    assert match, f"no stage {name}"
    return match.group(1).replace("\\\n", " ")


def test_dockerfile_targets_carry_tgis_defaults() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    last_from = re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.M)[-1]
    assert last_from == "cuda"
    defaults = ServerConfig()
    for name in ("cuda", "cpu"):
        stage = _stage(dockerfile, name)
        assert f"GRPC_PORT={defaults.grpc_port}" in stage and f"PORT={defaults.port}" in stage
        assert "HF_HUB_OFFLINE=1" in stage
        assert re.search(r"^EXPOSE 8033 3000$", stage, re.M)
        assert re.search(r"^USER 2000$", stage, re.M)
        assert re.search(r"^HEALTHCHECK .*/health", stage, re.M)
        assert re.search(r'^CMD \["specserve"\]$', stage, re.M)
    for name in ("cpu-builder", "cuda-builder"):  # the tested versions, stubs built by pip
        assert "pip install -c constraints.txt" in _stage(dockerfile, name)


def test_compose_gpu_service_and_cpu_profile() -> None:
    compose: dict[str, Any] = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    gpu, cpu = compose["services"]["specserve"], compose["services"]["specserve-cpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert any(v.endswith(":/models:ro") for v in gpu["volumes"])
    assert gpu["environment"]["PAGED_ATTENTION"] == "true"
    assert "profiles" not in gpu and cpu["profiles"] == ["cpu"]
    assert cpu["build"]["target"] == "cpu"
    for service in (gpu, cpu):
        assert "/health" in " ".join(service["healthcheck"]["test"])
