"""O3's additions to vLLM's OpenAI server, as one ASGI middleware:

    vllm serve o3 --middleware vllm_o3.middleware.O3Middleware \\
        --scheduler-cls vllm_o3.scheduler.O3Scheduler

- `/openapi.json` with these additions documented (`vllm_o3.openapi`);
- `/v2/health/live` (the process answers) and `/v2/health/ready` (the model is
  loaded and the engine answers vLLM's own `/health`), as Triton users expect;
- the priority-tier request fields and errors (`scheduler.http`);
- a guard for a vLLM 0.32 CPU-backend crash: a request with `seed` kills the
  engine's worker when its prompt is prefilled in chunks ("CPU Generator does
  not use offset", vLLM's model runner rewinds the generator's offset, which
  CPU generators lack). On the CPU platform such requests get HTTP 400;
- a guard for a vLLM 0.32 shutdown race: on SIGTERM, `AsyncLLM.shutdown` kills
  the engine and cancels the output handler, and when the cancellation comes
  first no request hears that the engine is gone: open streams wait forever,
  and so does uvicorn's graceful shutdown. `end_requests_when_engine_dies`
  fails them the way vLLM does when it notices itself.
"""

from __future__ import annotations

import asyncio
import json

from vllm_o3.openapi import with_o3_additions
from vllm_o3.scheduler.http import (
    GENERATION_PATHS,
    O3TierMiddleware,
    error_body,
    read_body,
    replay,
    respond,
)

LIVE, READY = "/v2/health/live", "/v2/health/ready"
OPENAPI = "/openapi.json"
SEED_REFUSAL = (
    "per-request `seed` is refused on this server: vLLM 0.32's CPU backend crashes "
    "its worker on seeded requests whose prompt is prefilled in chunks"
)


ENGINE_POLL_S = 0.5


class O3Middleware:
    def __init__(self, app):
        self.app = app
        self.tiers = O3TierMiddleware(app)
        self.engine_watch: asyncio.Task | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.engine_watch is None:
            engine = getattr(scope["app"].state, "engine_client", None)
            if hasattr(engine, "output_processor"):
                self.engine_watch = asyncio.create_task(
                    end_requests_when_engine_dies(engine)
                )
        path = scope["path"]
        if path == LIVE:
            return await respond(send, 200, b'{"status": "live"}')
        if path == READY:
            return await self.ready(scope, send)
        if path == OPENAPI:
            return await self.openapi(scope, receive, send)
        if scope["method"] == "POST" and path in GENERATION_PATHS and cpu_platform():
            raw = await read_body(receive)
            if has_seed(raw):
                body = error_body(SEED_REFUSAL, "BadRequestError", 400, "seed")
                return await respond(send, 400, body)
            receive = replay(raw, receive)
        return await self.tiers(scope, receive, send)

    async def openapi(self, scope, receive, send) -> None:
        """vLLM's schema with O3's additions; anything but a 200 as it was."""
        start, body = await captured_response(self.app, scope, receive)
        if start.get("status") == 200:
            body = json.dumps(with_o3_additions(json.loads(body))).encode()
        await respond(send, start.get("status", 500), body, start)

    async def ready(self, scope, send) -> None:
        """Ask vLLM's own /health; ready when it answers 200."""

        async def no_body():
            return {"type": "http.request", "body": b"", "more_body": False}

        health = {**scope, "path": "/health", "raw_path": b"/health", "method": "GET"}
        start, _ = await captured_response(self.app, health, no_body)
        if start.get("status") == 200:
            return await respond(send, 200, b'{"status": "ready"}')
        await respond(send, 503, b'{"status": "not ready"}')


async def captured_response(app, scope, receive) -> tuple[dict, bytes]:
    """Run `app` for one request and keep its response: the start message
    and the whole body."""
    start, chunks = {}, []

    async def capture(message):
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, capture)
    return start, b"".join(chunks)


async def end_requests_when_engine_dies(engine) -> None:
    """Once the engine client reports the engine gone, end every request
    still waiting for output with `EngineDeadError`."""
    from vllm.v1.engine.exceptions import EngineDeadError

    while not engine.errored:
        await asyncio.sleep(ENGINE_POLL_S)
    engine.output_processor.propagate_error(EngineDeadError())


def has_seed(raw: bytes) -> bool:
    try:
        body = json.loads(raw)
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("seed") is not None


def cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
