"""Write the JSON Schemas of KServe's ServingRuntime and InferenceService that `make lint` checks
deploy/kserve/*.yaml against (check-jsonschema), offline.

KServe publishes its CRDs' OpenAPI schemas only inside its Helm charts and release YAML, not as a
package, so this folder vendors them as JSON Schema (draft 2020-12). The KServe-specific types
are written out below from KServe's API reference (pkg/apis/serving: ServingRuntimeSpec,
InferenceServiceSpec, PredictorSpec, ModelSpec, ComponentExtensionSpec); the Kubernetes types they
embed (Container, Volume, PodSpec, ObjectMeta, ...) are copied from the strict Kubernetes schemas
of the pinned `kubernetes-validate` package, so an embedded container is checked exactly as
`kubernetes-validate --strict` checks a Deployment's. See README.md.

    .venv/bin/python deploy/kserve/schemas/generate.py          # rewrite the two files
    .venv/bin/python deploy/kserve/schemas/generate.py --check  # exit 1 when they are stale
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate

KUBERNETES_VERSION = "1.29.0"
"""Kubernetes types of this release (OpenShift 4.16's), the oldest the manifests target."""
HERE = Path(__file__).resolve().parent
K8S_REF = "/api/_definitions.json#/$defs/"
CORE = "io.k8s.api.core.v1."
META = "io.k8s.apimachinery.pkg.apis.meta.v1."


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/$defs/{name}"}


def _strict(props: dict[str, Any], required: tuple[str, ...] = (), doc: str = "") -> dict:
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = list(required)
    if doc:
        out["description"] = doc
    return out


STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
INT = {"type": "integer"}
BOOL = {"type": "boolean"}
STR = {"type": "string"}


def _k8s_definitions() -> dict[str, Any]:
    path = (
        Path(kubernetes_validate.__file__).parent
        / "kubernetes-json-schema"
        / f"v{KUBERNETES_VERSION}-local-strict"
        / "_definitions.json"
    )
    return json.loads(path.read_text())["$defs"]


def _without_docs(schema: Any, in_properties: bool = False) -> Any:
    """`schema` without its descriptions (a property named description is kept), with its
    $refs pointing into the output's own $defs."""
    if isinstance(schema, list):
        return [_without_docs(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if not in_properties and key == "description" and isinstance(value, str):
            continue
        if not in_properties and key == "$ref" and value.startswith(K8S_REF):
            out[key] = "#/$defs/" + value[len(K8S_REF) :]
        else:
            out[key] = _without_docs(value, in_properties=not in_properties and key == "properties")
    return out


def _closure(defs: dict[str, Any], schema: Any, into: dict[str, Any]) -> None:
    """Copy into `into` every definition of `defs` that `schema` refers to, transitively."""
    if isinstance(schema, list):
        for s in schema:
            _closure(defs, s, into)
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#/$defs/"):
                name = value[len("#/$defs/") :]
                if name in defs and name not in into:
                    into[name] = defs[name]
                    _closure(defs, into[name], into)
            else:
                _closure(defs, value, into)


def _object(api_version: str, kinds: list[str], spec: dict[str, Any], doc: str) -> dict:
    return {
        "type": "object",
        "description": doc,
        "properties": {
            "apiVersion": {"enum": [api_version]},
            "kind": {"enum": kinds},
            "metadata": _ref(META + "ObjectMeta"),
            "spec": spec,
            "status": {"type": "object"},
        },
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
    }


def _serving_runtime_pod_spec() -> dict[str, Any]:
    """ServingRuntimePodSpec (v1alpha1), inlined into ServingRuntimeSpec and WorkerSpec."""
    return {
        "containers": {"type": "array", "items": _ref(CORE + "Container")},
        "volumes": {"type": "array", "items": _ref(CORE + "Volume")},
        "nodeSelector": STRING_MAP,
        "affinity": _ref(CORE + "Affinity"),
        "tolerations": {"type": "array", "items": _ref(CORE + "Toleration")},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        "imagePullSecrets": {"type": "array", "items": _ref(CORE + "LocalObjectReference")},
        "schedulerName": STR,
        "hostIPC": BOOL,
        "hostNetwork": BOOL,
        "dnsPolicy": STR,
    }


def serving_runtime_schema(defs: dict[str, Any]) -> dict[str, Any]:
    pod = _serving_runtime_pod_spec()
    spec = _strict(
        {
            "supportedModelFormats": {
                "type": "array",
                "items": _strict(
                    {
                        "name": STR,
                        "version": STR,
                        "autoSelect": BOOL,
                        "priority": {"type": "integer", "minimum": 1},
                    },
                    required=("name",),
                ),
            },
            "multiModel": BOOL,
            "disabled": BOOL,
            "protocolVersions": {
                "type": "array",
                "items": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]},
            },
            **pod,
            "grpcEndpoint": STR,
            "grpcDataEndpoint": STR,
            "httpDataEndpoint": STR,
            "replicas": {"type": "integer", "minimum": 0, "maximum": 65535},
            "storageHelper": _strict({"disabled": BOOL}),
            "builtInAdapter": _strict(
                {
                    "serverType": {"enum": ["triton", "mlserver", "ovms", "torchserve"]},
                    "runtimeManagementPort": INT,
                    "memBufferBytes": INT,
                    "modelLoadingTimeoutMillis": INT,
                    "env": {"type": "array", "items": _ref(CORE + "EnvVar")},
                }
            ),
            "workerSpec": _strict({**pod, "pipelineParallelSize": INT, "tensorParallelSize": INT}),
        },
        required=("containers",),
        doc="ServingRuntimeSpec (serving.kserve.io/v1alpha1).",
    )
    return _document(
        _object(
            "serving.kserve.io/v1alpha1",
            ["ServingRuntime", "ClusterServingRuntime"],
            spec,
            "KServe ServingRuntime / ClusterServingRuntime (see README.md: what is covered).",
        ),
        defs,
        "servingruntime",
    )


def inference_service_schema(defs: dict[str, Any]) -> dict[str, Any]:
    container_props = copy.deepcopy(defs[CORE + "Container"]["properties"])
    model = _strict(
        {
            **container_props,
            "modelFormat": _strict({"name": STR, "version": STR}, required=("name",)),
            "runtime": STR,
            "storageUri": STR,
            "runtimeVersion": STR,
            "protocolVersion": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]},
            "storage": _strict(
                {"path": STR, "schemaPath": STR, "parameters": STRING_MAP, "key": STR}
            ),
        },
        required=("modelFormat",),
        doc="ModelSpec: the model's container (a core/v1 Container, name optional) and where "
        "its model comes from.",
    )
    pod_props = copy.deepcopy(defs[CORE + "PodSpec"]["properties"])
    component_extension = {
        "minReplicas": {"type": "integer", "minimum": 0},
        "maxReplicas": {"type": "integer", "minimum": 0},
        "scaleTarget": INT,
        "scaleMetric": {"enum": ["cpu", "memory", "concurrency", "rps"]},
        "containerConcurrency": INT,
        "timeout": INT,
        "canaryTrafficPercent": INT,
        "logger": _strict(
            {"url": STR, "mode": {"enum": ["all", "request", "response"]}},
        ),
        "batcher": _strict({"maxBatchSize": INT, "maxLatency": INT, "timeout": INT}),
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        "deploymentStrategy": _ref("io.k8s.api.apps.v1.DeploymentStrategy"),
    }
    predictor = _strict(
        {
            **pod_props,
            **component_extension,
            "model": model,
            "workerSpec": _strict(
                {**pod_props, "pipelineParallelSize": INT, "tensorParallelSize": INT}
            ),
        },
        doc="PredictorSpec: a core/v1 PodSpec (containers optional) with KServe's "
        "ComponentExtensionSpec, `model` and `workerSpec`.",
    )
    spec = _strict(
        {
            "predictor": predictor,
            "transformer": {"type": "object", "description": "not checked here"},
            "explainer": {"type": "object", "description": "not checked here"},
        },
        required=("predictor",),
        doc="InferenceServiceSpec (serving.kserve.io/v1beta1).",
    )
    return _document(
        _object(
            "serving.kserve.io/v1beta1",
            ["InferenceService"],
            spec,
            "KServe InferenceService (see README.md: what is covered).",
        ),
        defs,
        "inferenceservice",
    )


def _document(root: dict[str, Any], defs: dict[str, Any], name: str) -> dict[str, Any]:
    needed: dict[str, Any] = {}
    _closure(defs, root, needed)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://specserve.invalid/deploy/kserve/schemas/{name}.json",
        "$comment": f"Generated by generate.py from KServe's API and Kubernetes "
        f"{KUBERNETES_VERSION}'s strict schemas (kubernetes-validate "
        f"{kubernetes_validate.__version__}); do not edit.",
        **root,
        "$defs": dict(sorted(needed.items())),
    }


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=1, sort_keys=False) + "\n"


def outputs() -> dict[Path, str]:
    defs = {k: _without_docs(v) for k, v in _k8s_definitions().items()}
    return {
        HERE / "servingruntime.json": render(serving_runtime_schema(defs)),
        HERE / "inferenceservice.json": render(inference_service_schema(defs)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when a file is stale")
    args = parser.parse_args()
    stale = []
    for path, text in outputs().items():
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)}; run {Path(__file__).name}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
