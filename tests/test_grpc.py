"""`vllm serve --grpc` (vLLM's gRPC front end, smg-grpc-servicer) serves O3:
generation through the smg-grpc-proto stubs matches the reference's greedy
tokens, streaming included; the standard gRPC health service answers."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc as pb_grpc
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.utils import PROMPTS, reference_generations
from vllm_o3.tools.server import launch_server, stop_server

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def grpc_server(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("grpc") / "server.log"
    server = launch_server(
        tiny_checkpoint, log, "--grpc", "--dtype", "float32",
        "--max-model-len", "256", "--enforce-eager",
    )  # fmt: skip
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + 600
    while True:
        assert server.process.poll() is None, log.read_text()[-4000:]
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            if status == health_pb2.HealthCheckResponse.SERVING:
                break
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(1)
    yield pb_grpc.VllmEngineStub(channel)
    channel.close()
    stop_server(server)


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    prompts = PROMPTS[:3]
    generations = reference_generations(model.eval(), tokenizer, prompts, MAX_TOKENS, 1)
    return [
        (tokenizer(p).input_ids, g.token_ids)
        for p, g in zip(prompts, generations, strict=True)
    ]


def request(prompt_ids: list[int], stream: bool, n: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"o3-grpc-{n}-{stream}",
        tokenized=pb.TokenizedInput(input_ids=prompt_ids),
        sampling_params=pb.SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True
        ),
        stream=stream,
    )


def test_generate_matches_reference_greedy(grpc_server, expected):
    for n, (prompt_ids, want) in enumerate(expected):
        (reply,) = list(
            grpc_server.Generate(request(prompt_ids, False, n), timeout=120)
        )
        assert list(reply.complete.output_ids) == want
        assert reply.complete.prompt_tokens == len(prompt_ids)


def test_streamed_tokens_add_up_to_the_reference(grpc_server, expected):
    prompt_ids, want = expected[0]
    tokens = []
    for reply in grpc_server.Generate(request(prompt_ids, True, 0), timeout=120):
        if reply.HasField("chunk"):
            tokens.extend(reply.chunk.token_ids)
    assert tokens == want


def test_model_info_names_the_o3_architecture(grpc_server):
    info = grpc_server.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert "O3ForCausalLM" in info.architectures
