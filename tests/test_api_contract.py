"""The API contract in CI: the OpenAPI schema served with the plugin,
O3Scheduler and O3Middleware has no breaking change against the committed
snapshot (Optic decides) and is that snapshot. An intended change updates
the snapshot in the same commit:

    python -m vllm_o3.tools.api_contract MODEL --update
"""

from __future__ import annotations

import json

import pytest

from vllm_o3.scheduler.tiers import TIER_NAMES
from vllm_o3.tools.api_contract import (
    SNAPSHOT,
    OpticUnavailable,
    breaking_changes,
    optic_program,
    served_schema,
    write_schema,
)
from vllm_o3.tools.server import O3_SERVE_ARGS, start_server, stop_server


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("contract")
    server = start_server(
        tiny_checkpoint, folder / "server.log",
        "--max-model-len", "256", "--enforce-eager", *O3_SERVE_ARGS,
    )  # fmt: skip
    try:
        schema = served_schema(server.url)
    finally:
        stop_server(server)
    write_schema(schema, folder / "openapi.json")
    return folder / "openapi.json"


def test_served_schema_documents_the_o3_additions(served):
    schema = json.loads(served.read_text())
    for path in ("/v1/completions", "/v1/chat/completions"):
        operation = schema["paths"][path]["post"]
        headers = {p["name"]: p["schema"] for p in operation["parameters"]}
        assert headers["X-O3-Tier"]["enum"] == list(TIER_NAMES)
        assert "X-O3-Deadline-Ms" in headers
        assert "deadline_exceeded" in operation["responses"]["503"]["description"]
    request = schema["components"]["schemas"]["ChatCompletionRequest"]
    xargs = next(
        branch
        for branch in request["properties"]["vllm_xargs"]["anyOf"]
        if branch.get("type") == "object"
    )
    assert xargs["properties"]["tier"]["enum"] == list(TIER_NAMES)
    assert xargs["properties"]["deadline_ms"]["exclusiveMinimum"] == 0
    assert {"/v2/health/live", "/v2/health/ready"} <= schema["paths"].keys()


@pytest.fixture(scope="module")
def optic():
    """Optic from the npm registry; where no registry answers the two checks
    that need it are skipped, with npm's error as the reason."""
    try:
        return optic_program()
    except OpticUnavailable as error:
        pytest.skip(str(error))


def test_no_breaking_change_against_the_snapshot(served, optic):
    findings, report = breaking_changes(SNAPSHOT, served)
    assert not findings, report


def test_snapshot_is_the_served_schema(served):
    assert served.read_text() == SNAPSHOT.read_text(), (
        "the served schema changed without breaking clients: commit the new "
        "snapshot (python -m vllm_o3.tools.api_contract MODEL --update)"
    )


def test_the_check_fails_on_changes_that_break_clients(served, optic, tmp_path):
    schema = json.loads(served.read_text())
    del schema["paths"]["/v2/health/ready"]
    request = schema["components"]["schemas"]["CompletionRequest"]
    request["properties"]["n"] = {"type": "string"}
    request["properties"]["o3_new"] = {"type": "string"}
    request["required"] = [*request.get("required", []), "o3_new"]
    broken = tmp_path / "broken.json"
    write_schema(schema, broken)

    findings, report = breaking_changes(served, broken)
    for rule in (
        "prevent operation removal",
        "prevent request property type changes",
        "prevent changing request property to required",
    ):
        assert any(rule in finding for finding in findings), report
