"""API fuzzing with schemathesis against the server's own OpenAPI schema, with
the O3 plugin, O3Scheduler and the O3 middleware on: no 5xx (503 is the
designed answer to a deadline drop), no hang, the server alive afterwards.
The O3 fields travel in `vllm_xargs` (in the schema) and in the `X-O3-*`
headers (added by a hypothesis strategy)."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_o3.tools.server import errors_while_serving, start_server, stop_server

OPERATIONS = (
    r"^/(v1/(completions|chat/completions|models)|tokenize|detokenize|health|version)$"
)
EXAMPLES = 25
# uvicorn's own answer to a request line or header h11 cannot parse.
UVICORN_REFUSAL = "Invalid HTTP request received."


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    server = start_server(
        tiny_checkpoint, log,
        "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager",
        "--scheduler-cls", "vllm_o3.scheduler.O3Scheduler",
        "--middleware", "vllm_o3.middleware.O3Middleware",
    )  # fmt: skip
    yield server
    stop_server(server)
    assert not errors_while_serving(log), errors_while_serving(log)[:40]


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json").include(
        path_regex=OPERATIONS
    )


def test_no_server_error_from_schema_examples(api_schema):
    # Each operation's strategy is run here rather than through schemathesis'
    # pytest plugin, whose fixture support breaks on pytest 9.2.
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 7, [op.label for op in operations]
    for operation in operations:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def no_server_error(case):
            response = case.call(timeout=120)
            assert response.status_code < 500 or response.status_code == 503, (
                f"{case.operation.label}: {response.status_code} {response.text[:500]}"
            )

        no_server_error()


tier_values = st.one_of(
    st.sampled_from(["critical", "high", "normal", "low", "HIGH", ""]),
    st.text(max_size=20),
)
deadline_values = st.one_of(
    st.sampled_from(["1", "50", "0", "-5", "NaN", "inf", "1e400", "abc", ""]),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.text(max_size=12),
)
xargs_values = st.dictionaries(
    st.sampled_from(["tier", "deadline_ms", "other"]),
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.text(max_size=10),
        st.lists(st.integers(), max_size=3),
    ),  # fmt: skip
    max_size=3,
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    tier=st.none() | tier_values,
    deadline=st.none() | deadline_values,
    xargs=xargs_values,
)
def test_o3_fields_never_break_the_server(server, tier, deadline, xargs):
    headers = {"content-type": "application/json"}
    for name, value in (("X-O3-Tier", tier), ("X-O3-Deadline-Ms", deadline)):
        if value is not None:  # any byte a client can put on the wire
            headers[name] = value.encode("utf-8", "replace")
    body = {"model": "m", "prompt": "The river", "max_tokens": 2, "vllm_xargs": xargs}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body["model"] = client.get("/v1/models").json()["data"][0]["id"]
        try:
            reply = client.post("/v1/completions", content=json.dumps(body),
                                headers=headers)  # fmt: skip
        except httpx.LocalProtocolError:
            return  # a header value httpx itself refuses to send
        assert reply.status_code in (200, 400, 503), reply.text[:300]
        if reply.status_code == 400 and reply.text != UVICORN_REFUSAL:
            assert reply.json()["error"]["message"]
        assert client.get("/health").status_code == 200
