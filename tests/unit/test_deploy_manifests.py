"""The Kubernetes and KServe manifests under deploy/ stay in step with the server: the env vars
they set are ones the server reads, with values it accepts; their ports, probe and metrics paths
are the server's; the ServingRuntime's launcher arguments parse with the server's own CLI parser;
and the schema checks `make lint` runs catch a misspelled field (real validators, no cluster)."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from server.cli import (
    DEFAULT_TERMINATION_LOG,
    IGNORED_LAUNCHER_FLAGS,
    TERMINATION_LOG_ENV,
    parse_launcher,
)
from server.config import ServerConfig
from server.http_server import HttpServer
from server.metrics import ServerMetrics
from server.openai.app import build_app
from server.setting import declared

kubernetes_validate = pytest.importorskip("kubernetes_validate")

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KSERVE = DEPLOY / "kserve"
SCHEMAS = KSERVE / "schemas"
RUNTIME = KSERVE / "servingruntime.yaml"
ISVCS = sorted(KSERVE.glob("inferenceservice*.yaml"))
K8S_FILES = sorted((DEPLOY / "kubernetes").glob("*.yaml"))

READ_OUTSIDE_CONFIG = {"LOG_LEVEL", "SPECSERVE_HOME", TERMINATION_LOG_ENV}
"""Env vars server.main reads itself, not through ServerConfig."""


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kserve_schemas", SCHEMAS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _docs(paths: list[Path]) -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in paths for d in _load(p)]


def _config_env_names() -> set[str]:
    names: set[str] = set()
    for d in declared(ServerConfig):
        names.update(d.env)
    return names


def _server_env_names() -> set[str]:
    """Every env var the server reads. NUM_SHARD is read by the launcher: as a ServerConfig
    field once tensor parallelism is in, until then as an accepted TGIS flag's env var."""
    names = _config_env_names() | READ_OUTSIDE_CONFIG
    if "--num-shard" in IGNORED_LAUNCHER_FLAGS:
        names.add("NUM_SHARD")
    return names


def _image_env() -> dict[str, str]:
    """The ENV of the Dockerfile's cuda stage (the image the manifests run)."""
    dockerfile = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    stage = re.search(r"^FROM \S+ AS cuda\n(.*?)(?=^FROM |\Z)", dockerfile, re.M | re.S)
    assert stage
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV (.*)$", stage.group(1), re.M):
        env.update(re.findall(r"(\w+)=(\S+)", line))
    return env


def _env(container: dict[str, Any]) -> dict[str, str]:
    out = {}
    for var in container.get("env", []):
        assert set(var) == {"name", "value"}, f"{var}: literal values only"
        assert isinstance(var["value"], str), f"{var['name']}: quote the value"
        out[var["name"]] = var["value"]
    return out


def _runtime_container() -> dict[str, Any]:
    (runtime,) = _load(RUNTIME)
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"
    return container


def _deployment() -> dict[str, Any]:
    (deployment,) = [d for _, d in _docs(K8S_FILES) if d["kind"] == "Deployment"]
    return deployment


def _pod_containers() -> Iterator[tuple[str, dict[str, str], dict[str, Any]]]:
    """(where, pod annotations, container) of every container that runs the server."""
    template = _deployment()["spec"]["template"]
    (container,) = template["spec"]["containers"]
    yield "deployment", template["metadata"]["annotations"], container
    (runtime,) = _load(RUNTIME)
    yield "servingruntime", runtime["spec"]["annotations"], _runtime_container()


def _isvc_launch(path: Path) -> tuple[dict[str, Any], dict[str, str], Any]:
    """An InferenceService's predictor, its container's env as KServe merges it (the runtime
    container's, then the model's) and the server's parse of the runtime's args with it."""
    (isvc,) = _load(path)
    predictor = isvc["spec"]["predictor"]
    runtime = _runtime_container()
    env = _image_env() | _env(runtime) | _env(predictor["model"])
    return predictor, env, parse_launcher(runtime["args"], env)


def test_every_env_var_set_is_read_by_the_server_and_parses() -> None:
    known = _server_env_names()
    containers = [c for _, _, c in _pod_containers()]
    containers += [_load(p)[0]["spec"]["predictor"]["model"] for p in ISVCS]
    for container in containers:
        env = _env(container)
        assert env, "no env in a manifest"
        assert not sorted(set(env) - known), "env vars the server does not read"
        parse_launcher([], env)  # ValueError: a value the server rejects


def test_launcher_args_parse_into_the_expected_config() -> None:
    defaults = ServerConfig()
    runtime = _runtime_container()
    assert runtime["command"] == ["text-generation-launcher"]
    launch = parse_launcher(runtime["args"], _image_env() | _env(runtime))
    assert launch.config.model_name == "/mnt/models/"
    assert (launch.config.port, launch.config.grpc_port) == (defaults.port, defaults.grpc_port)
    assert launch.config.device == "cuda"
    assert launch.config.dtype == "float16"
    assert not launch.warnings

    for path in ISVCS:
        predictor, _, launch = _isvc_launch(path)
        model = predictor["model"]
        assert model["runtime"] == _load(RUNTIME)[0]["metadata"]["name"]
        assert model["modelFormat"]["name"] in {
            f["name"] for f in _load(RUNTIME)[0]["spec"]["supportedModelFormats"]
        }
        assert model["storageUri"].startswith("pvc://")
        assert launch.config.model_name == "/mnt/models/"
        # The speculator is a volume the predictor mounts (KServe has one storageUri).
        mounts = {m["mountPath"]: m for m in model["volumeMounts"]}
        assert launch.config.speculator_path in mounts
        volumes = {v["name"] for v in predictor["volumes"]}
        assert mounts[launch.config.speculator_path]["name"] in volumes
        assert launch.config.max_sequence_length == 4096

    deployment = _deployment()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "args" not in container and "command" not in container  # the image's CMD specserve
    config = parse_launcher([], _image_env() | _env(container)).config
    (models,) = [m for m in container["volumeMounts"] if m["name"] == "models"]
    for path in (config.model_name, config.speculator_path):
        assert path is not None and path.startswith(models["mountPath"] + "/")
    assert (config.port, config.grpc_port) == (defaults.port, defaults.grpc_port)


def test_sharded_service_has_one_gpu_per_shard() -> None:
    shards = {}
    for path in ISVCS:
        predictor, env, _ = _isvc_launch(path)
        resources = predictor["model"]["resources"]
        gpus = int(resources["limits"]["nvidia.com/gpu"])
        assert int(resources["requests"]["nvidia.com/gpu"]) == gpus
        shards[path.name] = int(env.get("NUM_SHARD", "1"))
        assert shards[path.name] == gpus, path.name
    assert sorted(shards.values()) == [1, 2]


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return int(number)


def test_ports_probes_and_termination_log_match_the_server() -> None:
    defaults = ServerConfig()
    for where, pod_annotations, container in _pod_containers():
        ports = {p["containerPort"] for p in container["ports"]}
        assert defaults.grpc_port in ports, where
        assert ports <= {defaults.grpc_port, defaults.port}, where
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] == "/health", (where, probe)
            assert _port_number(container, get["port"]) == defaults.port, (where, probe)
        assert container["terminationMessagePath"] == DEFAULT_TERMINATION_LOG
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
        assert pod_annotations["prometheus.io/scrape"] == "true"
        assert pod_annotations["prometheus.io/port"] == str(defaults.port)
        assert pod_annotations["prometheus.io/path"] == "/metrics"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    (runtime,) = _load(RUNTIME)
    assert runtime["spec"]["multiModel"] is False
    (grpc,) = _runtime_container()["ports"]
    assert grpc["name"] == "h2c" and grpc["containerPort"] == defaults.grpc_port


def test_service_targets_the_server_ports() -> None:
    defaults = ServerConfig()
    deployment = _deployment()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (service,) = [d for _, d in _docs(K8S_FILES) if d["kind"] == "Service"]
    assert service["spec"]["selector"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    assert by_name["grpc"]["port"] == defaults.grpc_port
    assert by_name["http"]["port"] == defaults.port
    for port in by_name.values():
        assert _port_number(container, port["targetPort"]) == port["port"]
    claims = {
        d["metadata"]["name"] for _, d in _docs(K8S_FILES) if d["kind"] == "PersistentVolumeClaim"
    }
    pod = deployment["spec"]["template"]["spec"]
    assert {
        v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    } <= claims


def test_grace_period_outlasts_the_shutdown_grace() -> None:
    deployment = _deployment()
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    grace = float(_env(container)["SHUTDOWN_GRACE_SECONDS"])
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + grace + 10
    for path in ISVCS:
        predictor, _, launch = _isvc_launch(path)
        assert predictor["terminationGracePeriodSeconds"] >= launch.config.shutdown_grace_s + 10


def test_probe_and_metrics_paths_are_the_servers_routes() -> None:
    """GET the manifests' probe and scrape paths from the server's own HTTP server."""
    paths = {"/metrics"}
    for _, _, container in _pod_containers():
        paths |= {container[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe")}
    app = build_app(lambda: True, ServerMetrics(4096, 1024, 32))

    async def probe() -> None:
        http = HttpServer("127.0.0.1", 0, app)
        await http.start()
        try:
            base = f"http://127.0.0.1:{http.port}"
            for path in sorted(paths):
                status = await asyncio.to_thread(_get_status, base + path)
                assert status == 200, path
            with pytest.raises(urllib.error.HTTPError):  # the check can fail
                await asyncio.to_thread(_get_status, base + "/healthz")
        finally:
            await http.stop()

    asyncio.run(probe())


def _get_status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return int(reply.status)


def _misspelled(doc: dict[str, Any], path: tuple[str, ...], wrong: str) -> dict[str, Any]:
    """A copy of `doc` whose key at `path` is renamed to `wrong`."""
    copy: dict[str, Any] = yaml.safe_load(yaml.safe_dump(doc))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[wrong] = node.pop(path[-1])
    return copy


def test_kubernetes_objects_validate_and_a_misspelling_fails() -> None:
    version = _generator().KUBERNETES_VERSION
    assert f"--strict --kubernetes-version {version}" in (REPO / "Makefile").read_text()
    for _, doc in _docs(K8S_FILES):
        # Raises SchemaNotFoundError for a kind without a schema (the CLI only warns).
        kubernetes_validate.validate(doc, version, strict=True)
    bad = _misspelled(
        _deployment(),
        ("spec", "template", "spec", "terminationGracePeriodSeconds"),
        "terminationGracePeriodSecond",
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


def _check_jsonschema(schema: Path, *files: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--schemafile", str(schema), *map(str, files)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_kserve_schemas_are_current() -> None:
    generator = _generator()
    for path, text in generator.outputs().items():
        assert path.read_text() == text, f"{path.name} is stale: run {generator.__file__}"


def test_kserve_manifests_validate_and_misspellings_fail(tmp_path: Path) -> None:
    runtime_schema = SCHEMAS / "servingruntime.json"
    isvc_schema = SCHEMAS / "inferenceservice.json"
    bad_runtime = _misspelled(_load(RUNTIME)[0], ("spec", "multiModel"), "multiModell")
    # In the embedded core/v1 Container: Kubernetes' own schema applies there.
    bad_probe = _misspelled(
        _load(RUNTIME)[0], ("spec", "containers", 0, "readinessProbe", "httpGet"), "httpGett"
    )
    bad_isvc = _misspelled(
        _load(ISVCS[0])[0], ("spec", "predictor", "model", "storageUri"), "storageUrl"
    )
    bad_minreplicas = _load(ISVCS[0])[0]
    bad_minreplicas["spec"]["predictor"]["minReplicas"] = "one"
    files = {}
    for name, doc in [
        ("runtime.yaml", bad_runtime),
        ("probe.yaml", bad_probe),
        ("isvc.yaml", bad_isvc),
        ("replicas.yaml", bad_minreplicas),
    ]:
        files[name] = tmp_path / name
        files[name].write_text(yaml.safe_dump(doc))

    good = _check_jsonschema(runtime_schema, RUNTIME)
    assert good.returncode == 0, good.stdout + good.stderr
    good = _check_jsonschema(isvc_schema, *ISVCS)
    assert good.returncode == 0, good.stdout + good.stderr
    for schema, name, field in [
        (runtime_schema, "runtime.yaml", "multiModell"),
        (runtime_schema, "probe.yaml", "httpGett"),
        (isvc_schema, "isvc.yaml", "storageUrl"),
        (isvc_schema, "replicas.yaml", "one"),
    ]:
        bad = _check_jsonschema(schema, files[name])
        assert bad.returncode == 1, (name, bad.stdout, bad.stderr)
        assert field in bad.stdout, bad.stdout
