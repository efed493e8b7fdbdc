"""`ApiContext`: what the HTTP API's handlers share: the request runner the gRPC API uses too,
the served model's id and the limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from server.request_runner import RequestRunner
from server.validation import Limits


@dataclass(frozen=True)
class ApiContext:
    """`model_id` is the model's name as configured (MODEL_NAME), the one `model` value the
    API serves; `vocab_size` bounds token ids (prompts, logit_bias)."""

    runner: RequestRunner
    model_id: str
    vocab_size: int
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def limits(self) -> Limits:
        return self.runner.limits

    @property
    def max_concurrent_requests(self) -> int:
        return self.runner.admission.max_concurrent_requests
