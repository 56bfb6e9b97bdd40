"""`o3_int4`: the format (O3_SPEC section 4), `vllm-o3 quantize`, the CPU
kernels against the dequantized reference, and the quantization method in
vLLM (offline and online) against the reference model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import vllm_o3  # noqa: F401
from tests.utils import (
    PROMPTS,
    check_logprobs_close,
    reference_generations,
    vllm_engine,
    vllm_generations,
)
from vllm_o3.kernels import cpu_int4_gemm
from vllm_o3.kernels.int4_linear import (
    Int4Linear,
    dense_buffer,
    gemm_dtype,
    packed_max_rows,
)
from vllm_o3.model import O3Config
from vllm_o3.model.checkpoint import expected_tensor_shapes
from vllm_o3.quantization.int4_format import (
    Int4Weight,
    dequantize,
    largest_group_size,
    pack_int4,
    quantize,
    unpack_int4,
)
from vllm_o3.tools.quantize import quantize_checkpoint


def test_packing_is_lowest_nibble_first_along_the_given_dim():
    values = torch.arange(16).view(16, 1) % 16
    packed = pack_int4(values, dim=0)
    assert packed.tolist() == [[0x76543210], [0xFEDCBA98 - (1 << 32)]]
    assert torch.equal(unpack_int4(packed, dim=0).long(), values)
    wide = torch.randint(0, 16, (3, 24))
    assert torch.equal(unpack_int4(pack_int4(wide, dim=1), dim=1).long(), wide)


def test_hand_computed_symmetric_group():
    # One group of 32 inputs, one output, on the grid of scale 0.5 (absmax 3.5
    # = 7 * scale): w = (q - 8) * 0.5 is stored exactly.
    q = 1 + torch.arange(32) % 15
    weight = ((q - 8) * 0.5).float().view(1, 32)
    packed = quantize(weight, group_size=32, sym=True)
    assert packed.qzeros is None
    assert packed.scales.tolist() == [[0.5]]
    first_word = sum(int(v) << (4 * k) for k, v in enumerate(q[:8]))
    assert packed.qweight.shape == (4, 1) and packed.qweight[0, 0] == first_word
    assert torch.equal(dequantize(packed), weight)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_round_to_nearest_error_is_at_most_half_a_step(sym, group_size):
    weight = torch.randn(48, 256)
    packed = quantize(weight, group_size, sym)
    error = (dequantize(packed, torch.float32) - weight).abs()
    step = packed.scales.float().repeat_interleave(group_size, dim=0).t()
    assert (error <= step / 2 + 1e-6).all()
    assert packed.qweight.dtype == torch.int32 and packed.qweight.shape == (32, 48)
    assert packed.scales.shape == (256 // group_size, 48)
    if not sym:
        assert packed.qzeros.shape == (256 // group_size, 6)


def test_a_group_size_that_does_not_divide_the_input_is_refused():
    with pytest.raises(ValueError, match="does not divide the input size 96"):
        quantize(torch.randn(16, 96), 64, sym=True)


def test_the_default_group_size_is_the_largest_that_divides():
    assert largest_group_size("m", 2048, 5632) == 128
    assert largest_group_size("m", 576, 1536) == 64  # SmolLM2-135M
    assert largest_group_size("m", 576) == 64
    assert largest_group_size("m", 1536) == 128
    assert largest_group_size("m", 608, 1536) == 32
    with pytest.raises(ValueError, match=r"m: no group size .* \(576, 1000\)"):
        largest_group_size("m", 576, 1000)


def assert_matches_dequantized(linear: Int4Linear, packed: Int4Weight, rows: int):
    x = torch.randn(rows, linear.in_features, dtype=torch.bfloat16)
    want = x.float() @ dequantize(packed, torch.float32).t()
    got = linear(x).float()
    torch.testing.assert_close(
        got, want, atol=0.05 * want.abs().max().item(), rtol=0.02
    )


def test_the_int4_kernel_runs_on_the_best_isa_the_cpu_has():
    # Not a silent fallback: on a CPU with AVX512-BF16, or else AVX2 and FMA,
    # the kernel must build, and bfloat16 layers must run it.
    flags = Path("/proc/cpuinfo").read_text().split()
    if "avx512_bf16" in flags or ("avx2" in flags and "fma" in flags):
        assert cpu_int4_gemm.unavailable_reason() is None
        packed = quantize(torch.randn(64, 128, dtype=torch.bfloat16), 32, True)
        linear = Int4Linear(packed, torch.bfloat16)
        assert linear.forward == linear._forward_kernel
    else:
        assert "neither AVX512-BF16 nor AVX2" in cpu_int4_gemm.unavailable_reason()


def test_the_amx_path_is_taken_where_the_cpu_has_amx():
    # Not a silent fallback either: with AMX-BF16, calls from
    # AMX_CROSSOVER_ROWS rows run on its tiles.
    flags = Path("/proc/cpuinfo").read_text().split()
    if cpu_int4_gemm.unavailable_reason() is None and "amx_bf16" in flags:
        assert cpu_int4_gemm.AMX_MIN_ROWS == cpu_int4_gemm.AMX_CROSSOVER_ROWS
    else:
        assert cpu_int4_gemm.AMX_MIN_ROWS == 0


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("rows", [1, 3])
def test_kernel_is_exact_to_rounding_for_inputs_far_from_zero(isa, sym, rows):
    # Below AMX's rows the AVX-512 kernel sums (128 + q) x per group and
    # takes (zero + 128) * scale * sum(x) off: inputs of mean 8 make both
    # terms hundreds of times the result. What is left must stay at the
    # output's bfloat16 rounding (~2e-3 of the norm, as before this form);
    # the AVX2 kernel's dequantized weight must too.
    torch.manual_seed(0)
    weight = torch.randn(200, 1024, dtype=torch.bfloat16)
    packed = quantize(weight, 128, sym)
    linear = Int4Linear(packed, torch.bfloat16)
    x = (torch.randn(rows, 1024) + 8).bfloat16()
    want = x.double() @ dequantize(packed, torch.float64).t()
    error = (linear(x).double() - want).norm() / want.norm()
    assert error < 3e-3


@pytest.mark.parametrize("rows", [1, 3, 300])
@pytest.mark.parametrize("power", [-90, 60])
def test_kernel_output_scales_exactly_with_its_input(isa, rows, power):
    # Every product and sum scales by the same power of two, unless some
    # step leaves float32's normal range: the AVX2 tiles multiply inputs by
    # down to 2^-24 (`kInputScale`), and x * 2^-90 must still come out
    # exactly as x's result times 2^-90 (as must 300 rows, the float32 GEMM).
    torch.manual_seed(0)
    packed = quantize(torch.randn(96, 512, dtype=torch.bfloat16), 128, False)
    linear = Int4Linear(packed, torch.bfloat16)
    x = torch.randn(rows, 512, dtype=torch.bfloat16)
    assert torch.equal(linear(x * 2.0**power), linear(x) * 2.0**power)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 20, 50, 70, 300])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(96, 256), (64, 4096), (200, 128)]
)
@pytest.mark.parametrize("amx_min_rows", [0, 4])
def test_int4_kernel_equals_dequantized_matmul(
    isa, sym, group_size, rows, out_features, in_features, amx_min_rows, monkeypatch
):
    # Outputs not a multiple of the 64-wide tile (96, 200), row counts that
    # leave partial 4-row tiles, and 4096 inputs, where 50 rows span two of
    # the chunks of rows the kernel keeps in cache (AVX2: 20 rows span two,
    # and 300 rows run torch's float32 GEMM on the dequantized weight);
    # with amx_min_rows 4, on a CPU with AMX, AVX-512 calls from 4 rows take
    # the AMX path: tiles of the call's rows (4, 5, 20 = 16 + 4), 32-row
    # chunks with a partial last one (50), and from 64 rows the dequantized
    # weight on the tiles (300).
    monkeypatch.setattr(cpu_int4_gemm, "AMX_MIN_ROWS", amx_min_rows)
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    packed = quantize(weight, group_size, sym)
    linear = Int4Linear(packed, torch.bfloat16)
    assert linear.forward == linear._forward_kernel
    assert_matches_dequantized(linear, packed, rows)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize(
    "in_features, rows, out_features",
    [
        # Two blocks of rows (320 + 280), each through every pair, the weight
        # dequantized once per block; 600 rows end on a partial chunk.
        (2048, 600, 840),
        # 1 MB holds under 256 rows of 2560 inputs: no blocks; panels of 3
        # block pairs, the next between the tile products of the last. 840
        # outputs are 28 pairs, so 1, 2 or 4 threads end on a partial panel.
        (2560, 420, 840),
        # y of 1 MB or more whose pairs are whole lines (outputs a multiple
        # of 32): written with non-temporal stores, one pair at a time
        # (512 inputs) and in panels (2560).
        (512, 700, 768),
        (2560, 620, 896),
        # Below 1536 rows, x of 2048 inputs or fewer stays on the tiles: four
        # blocks of rows (288 x 3 + 236), y streamed.
        (2048, 1100, 768),
        # From 640 rows such x (over 2048 inputs): the whole weight dequantized
        # and torch's GEMM.
        (2560, 700, 840),
    ],
)
def test_calls_whose_rows_outgrow_the_cache_equal_dequantized_matmul(
    isa, sym, group_size, in_features, rows, out_features
):
    # On AMX CPUs, x or y of 1-2 MB or more; elsewhere many chunks of rows.
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
    packed = quantize(weight, group_size, sym)
    assert_matches_dequantized(Int4Linear(packed, torch.bfloat16), packed, rows)


@pytest.mark.parametrize("sym", [True, False])
def test_calls_of_thousands_of_rows_equal_dequantized_matmul(isa, sym):
    # On AMX CPUs, the whole weight dequantized and torch's GEMM.
    torch.manual_seed(0)
    packed = quantize(torch.randn(200, 128, dtype=torch.bfloat16), 32, sym)
    assert_matches_dequantized(Int4Linear(packed, torch.bfloat16), packed, 1540)


def test_int4_kernel_compiles_as_one_opaque_operation(isa):
    torch.manual_seed(0)
    packed = quantize(torch.randn(96, 256, dtype=torch.bfloat16), 128, True)
    linear = Int4Linear(packed, torch.bfloat16)
    compiled = torch.compile(linear, dynamic=True, fullgraph=True)
    for rows in (1, 7, 300):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        assert torch.equal(compiled(x), linear(x))


@pytest.mark.parametrize("kernel", [True, False])
def test_inputs_of_any_leading_shape_and_layout(kernel, request):
    # vLLM passes 2-D contiguous rows, which go to the kernels as they are;
    # other shapes and strided inputs are flattened to rows and back.
    if not kernel:
        request.getfixturevalue("without_int4_kernel")
    elif cpu_int4_gemm.unavailable_reason() is not None:
        pytest.skip(str(cpu_int4_gemm.unavailable_reason()))
    torch.manual_seed(0)
    packed = quantize(torch.randn(96, 256, dtype=torch.bfloat16), 32, False)
    linear = Int4Linear(packed, torch.bfloat16)
    for x in (
        torch.randn(2, 3, 256, dtype=torch.bfloat16),
        torch.randn(256, 5, dtype=torch.bfloat16).t(),
        torch.randn(5, 512, dtype=torch.bfloat16)[:, ::2],
    ):
        got = linear(x).float()
        want = x.float() @ dequantize(packed, torch.float32).t()
        assert got.shape == want.shape
        torch.testing.assert_close(
            got, want, atol=0.05 * want.abs().max().item(), rtol=0.02
        )


# Where torch's packed INT4 matmul hands over to dequantize + GEMM.
SWITCH = packed_max_rows(torch.bfloat16)


@pytest.fixture
def without_int4_kernel(monkeypatch):
    monkeypatch.setattr(cpu_int4_gemm, "unavailable_reason", lambda: "disabled")


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("rows", [1, 5, SWITCH, SWITCH + 1, 2 * SWITCH + 3])
def test_without_int4_kernel_torch_kernels_equal_dequantized_matmul(
    without_int4_kernel, sym, group_size, rows
):
    torch.manual_seed(0)
    packed = quantize(torch.randn(96, 256, dtype=torch.bfloat16), group_size, sym)
    linear = Int4Linear(packed, torch.bfloat16)
    assert linear.forward == linear._forward_torch_packed
    assert_matches_dequantized(linear, packed, rows)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
def test_dequantizing_path_holds_the_reference_weight(
    without_int4_kernel, sym, group_size
):
    # The weight the GEMM path multiplies by: the reference, rounded once.
    torch.manual_seed(0)
    packed = quantize(torch.randn(96, 256, dtype=torch.bfloat16), group_size, sym)
    linear = Int4Linear(packed, torch.bfloat16)
    linear(torch.randn(SWITCH + 1, 256, dtype=torch.bfloat16))
    dtype = gemm_dtype(torch.bfloat16)
    dense = dense_buffer((96, 256), dtype).float()
    want = dequantize(packed, torch.float32)
    assert torch.equal(dense, want.to(dtype).float())


def test_compiled_linear_picks_the_path_per_call(without_int4_kernel):
    # vLLM compiles once, with a large batch, and drops the guards (as below)
    # so that one graph serves every batch size: a one-row call must still
    # take the packed INT4 matmul.
    torch.manual_seed(0)
    packed = quantize(torch.randn(96, 256, dtype=torch.bfloat16), 128, True)
    linear = Int4Linear(packed, torch.bfloat16)
    compiled = torch.compile(
        linear,
        dynamic=True,
        fullgraph=True,
        options={"guard_filter_fn": lambda guards: [False] * len(guards)},
    )
    compiled(torch.randn(4 * SWITCH, 256, dtype=torch.bfloat16))
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    packed_path = torch._weight_int4pack_mm_for_cpu(
        x, linear.packed, linear.group_size, linear.scale_zero
    )
    dense_path = x @ dequantize(packed, torch.bfloat16).t()
    assert not torch.equal(packed_path, dense_path)  # the paths are told apart
    assert torch.equal(compiled(x), packed_path)


@pytest.fixture(scope="module")
def narrow_checkpoint(tmp_path_factory):
    """Sizes that are multiples of 64 but not of 128, as SmolLM2-135M's
    hidden size 576: group 128 cannot hold them."""
    from vllm_o3.tools.create import create_checkpoint

    sizes = dict(hidden_size=192, intermediate_size=320, num_attention_heads=3)
    folder = tmp_path_factory.mktemp("narrow") / "narrow"
    return create_checkpoint(folder, "tiny", num_key_value_heads=1, **sizes)


@pytest.fixture(scope="module")
def int4_checkpoints(tiny_checkpoint, narrow_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("int4")
    return {
        "sym128": quantize_checkpoint(tiny_checkpoint, root / "sym128", 128, True),
        "asym32": quantize_checkpoint(tiny_checkpoint, root / "asym32", 32, False),
        "narrow": quantize_checkpoint(narrow_checkpoint, root / "narrow"),
    }


def test_quantize_defaults_to_the_largest_group_that_divides(int4_checkpoints):
    config = O3Config.from_pretrained(int4_checkpoints["narrow"])
    assert config.quantization_config["group_size"] == 64
    config = O3Config.from_pretrained(int4_checkpoints["sym128"])
    assert config.quantization_config["group_size"] == 128


def test_quantize_writes_the_spec_tensors(int4_checkpoints):
    for folder in int4_checkpoints.values():
        config = O3Config.from_pretrained(folder)
        tensors = load_file(folder / "model.safetensors")
        shapes = {name: tuple(t.shape) for name, t in tensors.items()}
        assert shapes == expected_tensor_shapes(config)
        for name, tensor in tensors.items():
            if name.endswith((".qweight", ".qzeros")):
                assert tensor.dtype == torch.int32
            elif ".mlp." in name:
                assert name.endswith(".scales") and tensor.dtype == torch.bfloat16
        assert (folder / "tokenizer.json").exists()
        assert (folder / "generation_config.json").exists()


def test_reference_loads_int4_with_the_encoded_weights(
    tiny_checkpoint, int4_checkpoints
):
    folder = int4_checkpoints["asym32"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    packed = Int4Weight(
        tensors[f"{name}.qweight"], tensors[f"{name}.scales"], tensors[f"{name}.qzeros"]
    )
    torch.testing.assert_close(
        model.model.layers[1].mlp.down_proj.weight, dequantize(packed, torch.float32)
    )
    dense = load_file(tiny_checkpoint / "model.safetensors")
    torch.testing.assert_close(
        model.model.layers[1].self_attn.q_proj.weight,
        dense["model.layers.1.self_attn.q_proj.weight"].float(),
    )


def test_bad_int4_checkpoints_are_refused_naming_the_tensor(int4_checkpoints, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(int4_checkpoints["asym32"], folder)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.2.mlp.up_proj.qzeros"]
    tensors["model.layers.0.mlp.gate_proj.qweight"] = tensors[
        "model.layers.0.mlp.gate_proj.qweight"
    ][:8].clone()
    save_file(tensors, path)
    with pytest.raises(Exception, match=r"model\.layers\.0\.mlp\.gate_proj\.qweight"):
        AutoModelForCausalLM.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"]["group_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match="quantization_config.group_size"):
        O3Config.from_pretrained(folder)


def loaded_dtypes(model) -> dict[str, str]:
    """Runs in the worker: how each weight-holding module of the model holds
    its weights."""
    from vllm_o3.quantization.o3_int4 import describe_weights

    return describe_weights(model)


@pytest.fixture(scope="module")
def int4_engine_runs(tiny_checkpoint, narrow_checkpoint, int4_checkpoints):
    """Parity runs in float32 (INT4 weights, float32 arithmetic, as the
    reference), and one in bfloat16, the dtype INT4 serves in."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    runs = {}
    bf16 = {"dtype": "bfloat16"}  # the checkpoint's: online quantizes as offline
    for name, model, options in (
        ("offline", int4_checkpoints["sym128"], {}),
        ("asym32", int4_checkpoints["asym32"], {}),
        ("bf16", int4_checkpoints["sym128"], bf16),
        ("bf16_online", tiny_checkpoint, {**bf16, "quantization": "o3_int4"}),
        ("bf16_narrow", int4_checkpoints["narrow"], bf16),
        ("bf16_narrow_online", narrow_checkpoint, {**bf16, "quantization": "o3_int4"}),
    ):
        with vllm_engine(model, **{"dtype": "float32", **options}) as llm:
            runs[name] = (
                vllm_generations(llm.generate(PROMPTS, greedy, use_tqdm=False)),
                llm.apply_model(loaded_dtypes)[0],
            )
    return runs


def test_only_the_ffn_is_int4_layer_by_layer(int4_engine_runs):
    for name, (_, weights) in int4_engine_runs.items():
        dtype = "torch.bfloat16" if name.startswith("bf16") else "torch.float32"
        for module, kind in weights.items():
            if ".mlp." in module:
                assert kind == "o3_int4", (name, module, kind)
            elif ".router." in module:
                assert kind == "torch.float32", (name, module, kind)
            else:
                assert kind == dtype, (name, module, kind)
        assert sum(k == "o3_int4" for k in weights.values()) == 2 * 4  # 4 layers


def test_online_quantization_equals_offline_round_to_nearest(int4_engine_runs):
    offline, _ = int4_engine_runs["bf16"]
    online, _ = int4_engine_runs["bf16_online"]
    assert [g.token_ids for g in online] == [g.token_ids for g in offline]


def test_online_quantization_takes_the_group_that_divides(int4_engine_runs):
    """The narrow model's sizes 192 and 320 refuse group 128: online, each
    projection takes 64, as `vllm-o3 quantize` does by default. Compared
    the way vLLM's model tests do: this random bfloat16 model has near-ties
    that two runs of one engine have been seen to break differently."""
    offline, _ = int4_engine_runs["bf16_narrow"]
    online, _ = int4_engine_runs["bf16_narrow_online"]
    check_logprobs_close(offline, online, "offline", "online")


@pytest.mark.parametrize("name", ["offline", "asym32"])
def test_int4_engine_matches_the_reference_on_the_encoded_weights(
    int4_engine_runs, int4_checkpoints, name
):
    folder = int4_checkpoints["sym128" if name == "offline" else name]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    expected = reference_generations(model, tokenizer, PROMPTS, 12, 5)
    check_logprobs_close(expected, int4_engine_runs[name][0], "reference", "vllm")
    matched = sum(
        e.token_ids == g.token_ids
        for e, g in zip(expected, int4_engine_runs[name][0], strict=True)
    )
    assert matched >= len(PROMPTS) - 1


def test_bfloat16_int4_engine_generates(int4_engine_runs):
    generations, _ = int4_engine_runs["bf16"]
    assert all(len(g.token_ids) == 12 for g in generations)
