"""Reading the gateway's answers: its own problems versus whatever a downstream said."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDictProxy

from fencegate.errors import PROBLEM_TYPE_PREFIX, ProblemError, error_from_problem

__all__ = ["RawAnswer", "gateway_problem"]


@dataclass(frozen=True, slots=True)
class RawAnswer:
    """One HTTP answer as the SDK read it."""

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


def gateway_problem(answer: RawAnswer) -> ProblemError | None:
    """The typed error if ``answer`` is the gateway's own problem (not a downstream's)."""
    if answer.status < 400:
        return None
    content_type = answer.headers.get("Content-Type", "").split(";")[0].strip().lower()
    if content_type != "application/problem+json":
        return None
    try:
        body = answer.json()
    except ValueError:
        return None
    if not isinstance(body, dict) or not str(body.get("type", "")).startswith(PROBLEM_TYPE_PREFIX):
        return None
    return error_from_problem(answer.status, body, answer.headers)
