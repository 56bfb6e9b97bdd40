"""The HTTP side of the tiers: validate and carry the request fields in, make
deadline drops explicit on the way out.

    vllm serve MODEL --scheduler-cls vllm_o3.scheduler.O3Scheduler \\
        --middleware vllm_o3.scheduler.http.O3TierMiddleware

In: `vllm_xargs.tier` / `vllm_xargs.deadline_ms` and the headers `X-O3-Tier` /
`X-O3-Deadline-Ms` are validated (HTTP 400 with a message naming the field on
a bad value) and the header values are written into `vllm_xargs`, where the
scheduler reads them. Behind a gateway that drops them, the headers may come
as the `o3` member of `tracestate` (see `with_tracestate_fields`).

Out: a request the scheduler dropped at its deadline gets HTTP 503 with
`{"error": {"type": "deadline_exceeded", ...}}` naming its tier and deadline;
a streaming one gets that error as an SSE event before `[DONE]` (vLLM itself
would send a bare `[DONE]`, after an empty role chunk for chat: a request ended
before its first token yields no output, so a stream of a request that had a
deadline reaching `[DONE]` without output is that drop).
"""

from __future__ import annotations

import json
from typing import Any

from vllm_o3.scheduler.tiers import (
    DEADLINE_FIELD,
    DEADLINE_HEADER,
    TIER_FIELD,
    TIER_HEADER,
    SchedulerPolicy,
    Tier,
    parse_deadline_ms,
    parse_request_fields,
)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
DEADLINE_EXCEEDED = "deadline_exceeded"
DONE_EVENT = b"data: [DONE]"


def error_body(message: str, kind: str, code: int, param: str | None = None) -> bytes:
    """vLLM's (OpenAI's) error JSON."""
    error = {"message": message, "type": kind, "param": param, "code": code}
    return json.dumps({"error": error}).encode()


# Gateways that forward only tracing headers (smg 1.13) carry the X-O3-*
# headers across as the `o3` member of W3C `tracestate`, which the cluster's
# nginx writes: `o3=tier:high;deadline-ms:50`.
TRACESTATE_MEMBER = "o3"
TRACESTATE_KEYS = {"tier": TIER_HEADER, "deadline-ms": DEADLINE_HEADER}


def with_tracestate_fields(headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus the X-O3-* values carried in `tracestate`, where the
    headers themselves are absent."""
    members = (m.strip() for m in headers.get("tracestate", "").split(","))
    state = next(
        (m.partition("=")[2] for m in members if m.startswith(f"{TRACESTATE_MEMBER}=")),
        None,
    )
    if state is None or TIER_HEADER in headers or DEADLINE_HEADER in headers:
        return headers
    carried = dict(item.partition(":")[::2] for item in state.split(";") if item)
    return {
        **headers,
        **{
            header: carried[key]
            for key, header in TRACESTATE_KEYS.items()
            if carried.get(key)
        },
    }


class BadField(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def merged_fields(body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """The body's `vllm_xargs` with the O3 header values added; raises BadField."""
    xargs = body.get("vllm_xargs")
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, dict):
        raise BadField("vllm_xargs", f"vllm_xargs must be a JSON object, got {xargs!r}")
    try:
        parse_request_fields(xargs)
    except ValueError as error:
        field = TIER_FIELD if str(error).startswith("tier") else DEADLINE_FIELD
        raise BadField(f"vllm_xargs.{field}", str(error)) from None
    merged = dict(xargs)
    for header, field, parse in (
        (TIER_HEADER, TIER_FIELD, lambda v: Tier.parse(v).label),
        (
            DEADLINE_HEADER,
            DEADLINE_FIELD,
            lambda v: parse_deadline_ms(v, "X-O3-Deadline-Ms"),
        ),
    ):
        if header not in headers:
            continue
        try:
            value = parse(headers[header])
        except ValueError as error:
            raise BadField(header, f"{header}: {error}") from None
        if field in xargs and xargs[field] != value:
            raise BadField(
                header,
                f"{field} is given twice, as vllm_xargs.{field}={xargs[field]!r} "
                f"and {header}: {headers[header]!r}",
            )
        merged[field] = value
    return merged


class O3TierMiddleware:
    """ASGI middleware for the OpenAI completions and chat endpoints."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or scope["method"] != "POST"
            or scope["path"] not in GENERATION_PATHS
        ):
            return await self.app(scope, receive, send)
        raw = await read_body(receive)
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):  # vLLM answers malformed bodies itself
            return await self.app(scope, replay(raw, receive), send)
        headers = with_tracestate_fields(
            {k.decode().lower(): v.decode("latin-1") for k, v in scope["headers"]}
        )
        try:
            fields = merged_fields(body, headers)
        except BadField as error:
            return await respond(
                send, 400, error_body(str(error), "BadRequestError", 400, error.param)
            )
        if fields:
            body["vllm_xargs"] = fields
            raw = json.dumps(body).encode()
            scope = with_content_length(scope, len(raw))
        tier = Tier.parse(fields.get(TIER_FIELD, "normal"))
        deadline_ms = fields.get(DEADLINE_FIELD)
        if deadline_ms is None:
            deadline_ms = tier_policy(scope).tiers[tier].deadline_ms
        drop = DropTranslator(send, tier, deadline_ms)
        await self.app(scope, replay(raw, receive), drop.send)


def tier_policy(scope) -> SchedulerPolicy:
    """The server's tier policy (from `--additional-config`), for messages."""
    state = getattr(scope.get("app"), "state", None)
    config = getattr(state, "vllm_config", None)
    additional = getattr(config, "additional_config", None) or {}
    try:
        return SchedulerPolicy.from_config(additional.get("o3_scheduler"))
    except ValueError:
        return SchedulerPolicy()


class DropTranslator:
    """Wraps `send`: turns a dropped request's response into the 503 error."""

    def __init__(self, send, tier: Tier, deadline_ms: float | None):
        self._send = send
        self.tier, self.deadline_ms = tier, deadline_ms
        self.start: dict | None = None
        self.streaming = False
        self.held = b""
        self.seen_chunk = False

    def message(self) -> bytes:
        return error_body(
            f"request of tier '{self.tier.label}' was not scheduled within its "
            f"queue deadline of {self.deadline_ms:g} ms and was dropped",
            DEADLINE_EXCEEDED,
            503,
        )

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.start = message
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            self.streaming = content_type.startswith(b"text/event-stream")
            if self.streaming:
                await self._send(message)
            return
        if message["type"] != "http.response.body":
            return await self._send(message)
        if self.streaming:
            return await self._stream_body(message)
        self.held += message.get("body", b"")
        if message.get("more_body"):
            return
        status, body = self.start["status"], self.held
        if status == 200 and self.deadline_ms is not None and all_dropped(body):
            status, body = 503, self.message()
        await respond(self._send, status, body, self.start)

    async def _stream_body(self, message: dict) -> None:
        """Hold events until one carries output; a stream that reaches
        `[DONE]` first (chat sends a bare role chunk before) was dropped."""
        if self.seen_chunk or self.deadline_ms is None:
            return await self._send(message)
        self.held += message.get("body", b"")
        events = self.held.split(b"\n\n")[:-1]
        if any(carries_output(event) for event in events):
            self.seen_chunk = True
            held, self.held = self.held, b""
            return await self._send({**message, "body": held})
        if any(event.strip() == DONE_EVENT for event in events):
            self.seen_chunk = True
            self.held = b""
            event = b"data: " + self.message() + b"\n\n" + DONE_EVENT + b"\n\n"
            return await self._send({**message, "body": event})
        if not message.get("more_body"):
            await self._send({**message, "body": self.held})


def carries_output(event: bytes) -> bool:
    """Whether an SSE event is more than an empty opening chunk."""
    event = event.strip()
    if not event.startswith(b"data: {"):
        return False
    try:
        data = json.loads(event[len(b"data: ") :])
    except ValueError:
        return True
    if "choices" not in data:
        return True  # an error or usage event
    for choice in data["choices"]:
        delta = choice.get("delta") or {}
        if choice.get("finish_reason") or choice.get("text") or delta.get("content"):
            return True
        if delta.get("tool_calls") or choice.get("token_ids"):
            return True
    return False


def all_dropped(body: bytes) -> bool:
    try:
        choices = json.loads(body).get("choices") or []
    except (ValueError, AttributeError):
        return False
    return bool(choices) and all(
        c.get("stop_reason") == DEADLINE_EXCEEDED for c in choices
    )


async def read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def replay(raw: bytes, receive):
    """A `receive` that yields `raw` as the body, then the client's own
    messages (so a real disconnect still reaches the app)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replayed


def with_content_length(scope, length: int):
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    headers.append((b"content-length", str(length).encode()))
    return {**scope, "headers": headers}


async def respond(send, status: int, body: bytes, start: dict | None = None) -> None:
    headers = [
        (k, v)
        for k, v in (start or {}).get("headers", [])
        if k.lower() not in (b"content-length", b"content-type")
    ]
    headers += [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
