"""Broken checkpoints and configs are refused at load, naming what is wrong,
by the reference and by `vllm serve` (which exits non-zero, leaving no process
behind)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import vllm_o3  # noqa: F401
from vllm_o3.tools.quantize import quantize_checkpoint
from vllm_o3.tools.server import group_exits, vllm_command


def edit_tensors(folder, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(folder, **fields) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


def drop_router_tensor(t):
    del t["model.layers.1.router.fc1.weight"]


def narrow_light_path(t):
    t["model.layers.2.light.down.weight"] = t["model.layers.2.light.down.weight"][
        :8
    ].clone()


def truncate_weights(folder) -> None:
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def misshape_int4_tensor(folder) -> None:
    shutil.rmtree(folder)
    quantize_checkpoint(folder.parent / "source", folder, group_size=128, sym=True)
    name = "model.layers.1.mlp.up_proj.qweight"
    edit_tensors(folder, lambda t: t.update({name: t[name][:4].clone()}))


def remove_tokenizer(folder) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink()


BROKEN = {
    "missing_router_tensor": (
        lambda f: edit_tensors(f, drop_router_tensor),
        "model.layers.1.router.fc1.weight",
    ),
    "wrong_light_shape": (
        lambda f: edit_tensors(f, narrow_light_path),
        "model.layers.2.light.down.weight",
    ),
    "threshold_high": (
        lambda f: edit_config(f, router_threshold="high"),
        "router_threshold",
    ),
    "router_layer_out_of_range": (
        lambda f: edit_config(f, router_layers=[1, 7]),
        "router_layers",
    ),
    "hidden_size_text": (lambda f: edit_config(f, hidden_size="big"), "hidden_size"),
    "attention_bias_without_biases": (
        lambda f: edit_config(f, attention_bias=True),
        "model.layers.0.self_attn.k_proj.bias",
    ),
    "truncated_safetensors": (truncate_weights, "model.safetensors"),
    "int4_tensor_wrong_shape": (
        misshape_int4_tensor,
        "model.layers.1.mlp.up_proj.qweight",
    ),
    "tokenizer_missing": (remove_tokenizer, "tokenizer"),
}


@pytest.fixture(params=list(BROKEN))
def broken(request, tiny_checkpoint, tmp_path):
    shutil.copytree(tiny_checkpoint, tmp_path / "source")
    folder = tmp_path / request.param
    shutil.copytree(tiny_checkpoint, folder)
    damage, words = BROKEN[request.param]
    damage(folder)
    return request.param, folder, words


def test_reference_refuses_naming_the_field_or_tensor(broken):
    name, folder, words = broken
    if name == "tokenizer_missing":
        pytest.skip("the reference model loads no tokenizer")
    with pytest.raises(Exception, match=words.replace(".", r"\.")):
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def serve_until_exit(folder, *args: str) -> tuple[int, str]:
    """Run `vllm serve` on a checkpoint expected to be refused: (code, output)."""
    command = [*vllm_command(), "serve", str(folder), "--port", "0", *args]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output, _ = process.communicate(timeout=300)
    assert group_exits(process.pid), "vllm serve left processes running"
    return process.returncode, output


def test_vllm_serve_exits_nonzero_naming_the_field_or_tensor(broken):
    _, folder, words = broken
    code, output = serve_until_exit(folder, "--max-model-len", "256")
    assert code != 0, output[-3000:]
    assert words in output, output[-3000:]


def test_vllm_serve_refuses_a_bad_threshold_override(tiny_checkpoint):
    code, output = serve_until_exit(
        tiny_checkpoint, "--hf-overrides", '{"router_threshold": "high"}'
    )
    assert code != 0, output[-3000:]
    assert "router_threshold" in output, output[-3000:]
