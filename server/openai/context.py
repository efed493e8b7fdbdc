"""`ApiContext`: what the HTTP API's handlers share: the request runner the gRPC API uses too,
the served model's id and the limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import PurePath

from server.request_runner import RequestRunner
from server.validation import Limits


def served_model_id(model_name: str) -> str:
    """The id the API serves a model under: MODEL_NAME as given (a prepared model's name, a Hub
    id, a relative path), or an absolute path's last component."""
    path = PurePath(model_name)
    return path.name if path.is_absolute() and path.name else model_name


@dataclass(frozen=True)
class ApiContext:
    """`model_name` is MODEL_NAME as configured; requests may name the model by it or by its
    `model_id` (`served_model_id`), which /v1/models lists; `vocab_size` bounds token ids
    (prompts, logit_bias)."""

    runner: RequestRunner
    model_name: str
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_id(self) -> str:
        return served_model_id(self.model_name)

    def serves(self, model: str) -> bool:
        return model in (self.model_id, self.model_name)

    @property
    def limits(self) -> Limits:
        return self.runner.limits

    @property
    def max_concurrent_requests(self) -> int:
        return self.runner.admission.max_concurrent_requests
