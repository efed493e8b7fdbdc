"""TGIS-style YAML test cases, with expected outputs from an oracle
(docs/tgis-compatibility.md, "The client flow and the integration suite").

A case file is a YAML list of cases::

    - name: <str>
      request_type: generate | generate_stream | tokenize   # default generate
      request: <dict for json_format.ParseDict: BatchedGenerationRequest,
                SingleGenerationRequest or BatchedTokenizeRequest>
      # exactly one of:
      response: <the exact expected MessageToDict of the response>
      oracle: true     # the expected response is computed at test time (oracle.py)
      error: {code: <grpc StatusCode name>, message: <exact details>}
      # optional:
      expect: [<dict>, ...]   # per input: fields the response must have (checked against the
                              # oracle's and the server's response: the case's point)
      stream: false           # no GenerateStream twin (default: a twin for one-input generate)

Two tags build long inputs: ``!repeat [" word", 186]`` is the string repeated 186 times and
``!replicate [{text: x}, 3]`` a list of 3 copies of the item.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CASE_KEYS = {"name", "request_type", "request", "response", "oracle", "error", "expect", "stream"}
REQUEST_TYPES = ("generate", "generate_stream", "tokenize")


@dataclass(frozen=True)
class Case:
    """One request and what must come back."""

    name: str
    request_type: str
    request: dict[str, Any]
    response: dict[str, Any] | None
    oracle: bool
    error: tuple[str, str] | None
    expect: list[dict[str, Any]]
    stream: bool

    @property
    def inputs(self) -> list[dict[str, Any]]:
        return list(self.request.get("requests", []))

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.request.get("params", {}))

    def stream_request(self) -> dict[str, Any]:
        """The SingleGenerationRequest twin of a one-input generate case."""
        twin = {k: v for k, v in self.request.items() if k != "requests"}
        twin["request"] = self.inputs[0]
        return twin


class _Loader(yaml.SafeLoader):
    pass


def _repeat(loader: yaml.SafeLoader, node: yaml.Node) -> str:
    assert isinstance(node, yaml.SequenceNode)
    text, count = loader.construct_sequence(node)
    return str(text) * int(count)


def _replicate(loader: yaml.SafeLoader, node: yaml.Node) -> list[Any]:
    assert isinstance(node, yaml.SequenceNode)
    item, count = loader.construct_sequence(node, deep=True)
    return [item] * int(count)


_Loader.add_constructor("!repeat", _repeat)
_Loader.add_constructor("!replicate", _replicate)


def load_cases(path: Path) -> list[Case]:
    """Parse and check a case file; raises ValueError naming the faulty case."""
    raw = yaml.load(path.read_text(), Loader=_Loader)
    if not isinstance(raw, list):
        raise ValueError(f"{path}: expected a list of cases")
    cases, names = [], set()
    for item in raw:
        name = item.get("name", "?")
        where = f"{path.name}: case {name!r}"
        unknown = set(item) - CASE_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        if name in names:
            raise ValueError(f"{where}: duplicate name")
        names.add(name)
        kind = item.get("request_type", "generate")
        if kind not in REQUEST_TYPES:
            raise ValueError(f"{where}: request_type must be one of {REQUEST_TYPES}")
        outcomes = [k for k in ("response", "error") if k in item]
        if item.get("oracle"):
            outcomes.append("oracle")
        if len(outcomes) != 1:
            raise ValueError(f"{where}: give exactly one of response, oracle, error")
        error = item.get("error")
        request = item.get("request") or {}
        single = kind == "generate" and len(request.get("requests", [])) == 1
        cases.append(
            Case(
                name=name,
                request_type=kind,
                request=request,
                response=item.get("response"),
                oracle=bool(item.get("oracle")),
                error=(error["code"], error["message"]) if error else None,
                expect=list(item.get("expect", [])),
                stream=bool(item.get("stream", single)) and single,
            )
        )
    return cases
