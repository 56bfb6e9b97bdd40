"""The served OpenAPI schema with what O3Middleware adds to vLLM's API: the
tier and deadline request fields and headers, the deadline-drop error, and
the health probes. Clients, schemathesis and the API contract check
(`tests/test_api_contract.py`) read it from `/openapi.json`."""

from __future__ import annotations

import copy
from typing import Any

from vllm_o3.scheduler.http import DEADLINE_EXCEEDED, GENERATION_PATHS
from vllm_o3.scheduler.tiers import (
    DEADLINE_FIELD,
    DEADLINE_HEADER,
    MAX_DEADLINE_MS,
    TIER_FIELD,
    TIER_HEADER,
    TIER_NAMES,
)

REQUEST_SCHEMAS = ("CompletionRequest", "ChatCompletionRequest")
TIER_DOC = (
    "Priority tier (case-insensitive); a request without one is `normal`. "
    "Higher tiers are scheduled first and may preempt running lower-tier requests."
)
DEADLINE_DOC = (
    "Maximum queue wait in milliseconds from arrival, in (0, one day]; the tier's "
    "default when absent. A request not scheduled by then is dropped with HTTP 503 "
    f"`{DEADLINE_EXCEEDED}`."
)


def tier_schema() -> dict[str, Any]:
    return {"type": "string", "enum": list(TIER_NAMES), "description": TIER_DOC}


def deadline_schema() -> dict[str, Any]:
    return {
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": MAX_DEADLINE_MS,
        "description": DEADLINE_DOC,
    }


def with_o3_additions(schema: dict[str, Any]) -> dict[str, Any]:
    """vLLM's schema plus O3's fields, headers, errors and paths."""
    schema = copy.deepcopy(schema)
    for name in REQUEST_SCHEMAS:
        document_xargs(schema["components"]["schemas"].get(name))
    for path in GENERATION_PATHS:
        operation = schema["paths"].get(path, {}).get("post")
        if operation is not None:
            add_tier_headers(operation)
    schema["paths"].update(health_probe_paths())
    return schema


def document_xargs(request: dict[str, Any] | None) -> None:
    """Name the O3 keys in the object branch of the request's `vllm_xargs`."""
    if request is None or "vllm_xargs" not in request.get("properties", {}):
        return
    xargs = request["properties"]["vllm_xargs"]
    for branch in xargs.get("anyOf", [xargs]):
        if branch.get("type") == "object":
            branch.setdefault("properties", {}).update(
                {TIER_FIELD: tier_schema(), DEADLINE_FIELD: deadline_schema()}
            )


def add_tier_headers(operation: dict[str, Any]) -> None:
    """The `X-O3-*` headers (the same fields, for clients that cannot set a
    body field) and the deadline-drop response."""
    header_deadline = {
        "type": "string",
        "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*$",
        "description": DEADLINE_DOC,
    }
    parameters = operation.setdefault("parameters", [])
    parameters += [
        {"name": header.title(), "in": "header", "required": False, "schema": value}
        for header, value in (
            (TIER_HEADER, tier_schema()),
            (DEADLINE_HEADER, header_deadline),
        )
    ]
    operation["responses"]["503"] = {
        "description": (
            f"`{DEADLINE_EXCEEDED}`: the request was not scheduled within its "
            "queue deadline (the message names its tier and deadline); a "
            "streaming request gets this error as an event before `[DONE]`"
        ),
        "content": {
            "application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}
            }
        },
    }


def health_probe_paths() -> dict[str, Any]:
    def probe(summary: str, unavailable: str | None) -> dict[str, Any]:
        status = {"type": "object", "properties": {"status": {"type": "string"}}}
        responses = {
            "200": {
                "description": "OK",
                "content": {"application/json": {"schema": status}},
            }
        }
        if unavailable:
            responses["503"] = {
                "description": unavailable,
                "content": {"application/json": {"schema": status}},
            }
        return {"get": {"summary": summary, "responses": responses}}

    return {
        "/v2/health/live": probe("Liveness: the process answers", None),
        "/v2/health/ready": probe(
            "Readiness: the model is loaded and the engine answers",
            "the engine does not answer yet",
        ),
    }
