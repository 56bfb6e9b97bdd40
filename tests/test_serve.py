"""`vllm serve <O3 checkpoint>` in vLLM's default (compiled) mode, answering
OpenAI completions and chat through the `openai` client, streamed and not,
with the same greedy text as the offline engine computes."""

from __future__ import annotations

import openai
import pytest

from tests.utils import PROMPTS
from vllm_o3.tools.server import (
    group_exits,
    metric,
    metric_samples,
    start_server,
    stop_server,
)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    server = start_server(
        tiny_checkpoint, log, "--dtype", "float32", "--max-model-len", "512"
    )
    yield server
    stop_server(server)
    assert group_exits(server.process.pid), "server processes left running"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def test_completion(client, model_name):
    reply = client.completions.create(
        model=model_name, prompt=PROMPTS[0], max_tokens=8, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 8 and choice.text


def test_streamed_completion_equals_unstreamed(client, model_name):
    kwargs = dict(model=model_name, prompt=PROMPTS[2], max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_uses_the_chat_template(client, model_name):
    reply = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Name three rivers."}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    # The ChatML template wraps the message in role markers.
    assert reply.usage.prompt_tokens > 6


def test_streamed_chat_equals_unstreamed(client, model_name):
    kwargs = dict(
        model=model_name,
        messages=[{"role": "user", "content": "Write a haiku about compilers."}],
        max_tokens=10,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        if chunk.choices
    )
    assert streamed == whole


def test_greedy_completion_matches_reference(client, model_name, tiny_checkpoint):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.utils import reference_generations

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    expected = reference_generations(model, tokenizer, PROMPTS[3:4], 8, 1)[0]
    reply = client.completions.create(
        model=model_name,
        prompt=PROMPTS[3],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert reply.choices[0].token_ids == expected.token_ids


def test_metrics_count_routed_tokens_beside_vllms_own(server, client, model_name):
    import time

    reply = client.completions.create(
        model=model_name, prompt=PROMPTS[1], max_tokens=4, temperature=0
    )
    tokens = reply.usage.prompt_tokens + reply.usage.completion_tokens - 1
    deadline = time.monotonic() + 10  # the worker exports once a second
    while True:
        samples = metric_samples(server.url)
        routed = {
            dict(labels)["layer"]
            for name, labels in samples
            if name == "o3_router_tokens_total"
        }
        if routed and all(
            metric(samples, "o3_router_tokens_total", layer=layer) >= tokens
            for layer in routed
        ):
            break
        assert time.monotonic() < deadline, f"router counts too low: {samples}"
        time.sleep(0.5)
    assert routed == {"1", "2"}  # the tiny preset's routed layers
    assert metric(samples, "vllm:generation_tokens_total") > 0
