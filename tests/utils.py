"""Shared test helpers: engines, the reference runner and output comparison."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Prompts of several kinds of text, none from the tokenizer's training corpus.
PROMPTS = [
    "It is a truth universally acknowledged, that a single man in possession",
    "The mitochondria is the powerhouse of the cell, and",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Breaking news: the central bank raised interest rates by half a point",
    "Once upon a time",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY",
]


@dataclass
class Generation:
    """One greedy continuation: token ids, text and per-step top-k logprobs."""

    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] = field(default_factory=list)


def check_logprobs_close(
    outputs_0: Sequence[Generation],
    outputs_1: Sequence[Generation],
    name_0: str,
    name_1: str,
) -> None:
    """vLLM's model-test convention: greedy tokens must match until the first
    divergence, where each side's token must be in the other's top-k; the
    sequences are not compared after that."""
    assert len(outputs_0) == len(outputs_1)
    for i, (a, b) in enumerate(zip(outputs_0, outputs_1, strict=True)):
        for step, (token_a, token_b) in enumerate(
            zip(a.token_ids, b.token_ids, strict=False)
        ):
            if token_a == token_b:
                continue
            message = (
                f"prompt {i}, step {step}: matched {a.token_ids[:step]}\n"
                f"{name_0}: {token_a} top-k {a.logprobs[step]}\n"
                f"{name_1}: {token_b} top-k {b.logprobs[step]}"
            )
            assert token_a in b.logprobs[step], message
            assert token_b in a.logprobs[step], message
            break


def vllm_generations(outputs) -> list[Generation]:
    """vLLM RequestOutputs as Generations (first completion of each)."""
    result = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = [
            {token: lp.logprob for token, lp in step.items()}
            for step in (completion.logprobs or [])
        ]
        result.append(Generation(list(completion.token_ids), completion.text, logprobs))
    return result


@torch.no_grad()
def reference_generations(
    model, tokenizer, prompts: Sequence[str], max_tokens: int, top_k: int
) -> list[Generation]:
    """Greedy decoding with the reference, recomputing the whole sequence at
    each step (no KV cache), one prompt at a time."""
    result = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generation = Generation([], "")
        for _ in range(max_tokens):
            logprobs = model(ids, use_cache=False).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(top_k)
            generation.logprobs.append(
                dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            )
            token = int(top.indices[0])
            generation.token_ids.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        generation.text = tokenizer.decode(generation.token_ids)
        result.append(generation)
    return result


@contextlib.contextmanager
def vllm_engine(model: str | Path, **kwargs) -> Iterator:
    """An `LLM` on the CPU with test-sized defaults, shut down on exit."""
    from vllm import LLM

    options = dict(dtype="float32", max_model_len=512, max_num_seqs=16, seed=0)
    options.update(kwargs)
    llm = LLM(model=str(model), **options)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A `vllm serve` process started by a test."""

    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def vllm_command() -> list[str]:
    """`vllm` from the environment the tests run in."""
    return [str(Path(sys.executable).with_name("vllm"))]


def start_server(
    model: str | Path, log: Path, *args: str, timeout: float = 600, env=None
) -> Server:
    """Start `vllm serve MODEL` on a free loopback port; wait until it is healthy."""
    import urllib.request

    port = free_port()
    command = [
        *vllm_command(),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    with open(log, "wb") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    server = Server(process, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text()[-4000:]
            raise RuntimeError(f"vllm serve exited with {process.returncode}:\n{tail}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{server.url}/health", timeout=5) as reply,
        ):
            if reply.status == 200:
                return server
        time.sleep(1)
    stop_server(server)
    raise TimeoutError(
        f"vllm serve not healthy after {timeout}s:\n{log.read_text()[-4000:]}"
    )


def stop_server(server: Server, timeout: float = 60) -> int:
    """SIGTERM the server's process group by PID; SIGKILL what is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.process.pid, signal.SIGTERM)
    try:
        return server.process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        return server.process.wait()


def processes_in_group(pgid: int) -> list[int]:
    """PIDs still alive in process group `pgid` (a server and its engine)."""
    import psutil

    alive = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if (
                os.getpgid(process.pid) == pgid
                and process.status() != psutil.STATUS_ZOMBIE
            ):
                alive.append(process.pid)
    return alive


def group_exits(pgid: int, timeout: float = 15) -> bool:
    """Whether every process of group `pgid` is gone within `timeout` seconds
    (vLLM's engine and workers exit shortly after the front end)."""
    deadline = time.monotonic() + timeout
    while processes_in_group(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, the seed's output-norm accuracy figure."""
    return float((a - b).norm() / b.norm())
