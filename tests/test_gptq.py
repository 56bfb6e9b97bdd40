"""GPTQ and scale tuning for `o3_int4` (`vllm-o3 quantize --method gptq`):
against round-to-nearest, on hand-built inputs and on a checkpoint through the
reference."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import vllm_o3  # noqa: F401
from vllm_o3.model import O3Config
from vllm_o3.model.checkpoint import expected_tensor_shapes, pop_int4_weights
from vllm_o3.quantization.gptq import gptq_quantize, refit_scales
from vllm_o3.quantization.int4_format import (
    FFN_PROJECTIONS,
    SYMMETRIC_ZERO,
    Int4Weight,
    dequantize,
    quantize,
    unpack_int4,
)
from vllm_o3.quantization.scale_tuning import GroupScales, tune_scales
from vllm_o3.tools.distill import bucket_kl
from vllm_o3.tools.quantize import calibrate, load_float32, quantize_checkpoint


@pytest.mark.parametrize("sym", [True, False])
def test_with_uncorrelated_inputs_gptq_rounds_to_nearest_and_fits_each_group(sym):
    # An identity Hessian spreads no error: every column rounds on its own,
    # and each group's scale becomes the least-squares fit to its values,
    # sum(w (q - z)) / sum((q - z)^2).
    torch.manual_seed(0)
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    gptq = gptq_quantize(weight, torch.eye(128), 32, sym)
    rtn = quantize(weight, 32, sym)
    assert torch.equal(gptq.qweight, rtn.qweight)
    assert sym or torch.equal(gptq.qzeros, rtn.qzeros)
    codes = dequantize(Int4Weight(rtn.qweight, torch.ones_like(rtn.scales), rtn.qzeros))
    w, codes = weight.float().reshape(64, 4, 32), codes.float().reshape(64, 4, 32)
    fit = ((w * codes).sum(-1) / codes.pow(2).sum(-1)).t()
    torch.testing.assert_close(gptq.scales.float(), fit, rtol=8e-3, atol=0)
    assert not torch.equal(gptq.scales, rtn.scales)


@pytest.mark.parametrize("sym", [True, False])
def test_refitted_scales_are_each_channels_least_squares_fit(sym):
    """Against torch's least squares on the inputs themselves: per output
    channel, min over its group scales of |X (w - A s)| where column g of A
    holds the group's values minus its zero point."""
    torch.manual_seed(2)
    weight = torch.randn(16, 96)
    x = torch.randn(512, 8) @ torch.randn(8, 96) + 0.2 * torch.randn(512, 96)
    rtn = quantize(weight, 32, sym)
    q = unpack_int4(rtn.qweight, dim=0).float()  # [in, out]
    zeros = (
        torch.full_like(rtn.scales, SYMMETRIC_ZERO)
        if sym
        else unpack_int4(rtn.qzeros, dim=1).float()
    )
    fitted = refit_scales(weight, x.t() @ x, q, zeros, rtn.scales.float())
    codes = (q - zeros.repeat_interleave(32, dim=0)).t()  # [out, in]
    for o in range(16):
        a = torch.block_diag(*codes[o].reshape(3, 32, 1))  # [in, groups]
        want = torch.linalg.lstsq(x @ a, x @ weight[o]).solution
        torch.testing.assert_close(fitted[:, o], want, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("sym", [True, False])
def test_gptq_moves_outputs_on_correlated_inputs_less(sym):
    torch.manual_seed(0)
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    x = torch.randn(2048, 16) @ torch.randn(16, 128) + 0.1 * torch.randn(2048, 128)

    def output_error(packed):
        delta = weight.float() - dequantize(packed, torch.float32)
        return float((x @ delta.t()).pow(2).mean())

    gptq = gptq_quantize(weight, x.t() @ x, 32, sym)
    assert output_error(gptq) < 0.5 * output_error(quantize(weight, 32, sym))


@pytest.mark.parametrize("sym", [True, False])
def test_the_input_with_most_energy_is_rounded_first(sym):
    # Act-order: column 77 has the largest Hessian diagonal, so it is rounded
    # before any error reaches it (to the value round-to-nearest picks, on
    # the same static grid) while the columns after it absorb errors.
    torch.manual_seed(1)
    weight = torch.randn(64, 128, dtype=torch.bfloat16)
    x = torch.randn(2048, 16) @ torch.randn(16, 128) + 0.1 * torch.randn(2048, 128)
    x[:, 77] *= 10
    gptq = unpack_int4(gptq_quantize(weight, x.t() @ x, 32, sym).qweight, dim=0)
    rtn = unpack_int4(quantize(weight, 32, sym).qweight, dim=0)
    assert torch.equal(gptq[77], rtn[77])
    assert not torch.equal(gptq, rtn)


@pytest.fixture(scope="module")
def calibration(tiny_checkpoint):
    torch.manual_seed(0)
    vocab = O3Config.from_pretrained(tiny_checkpoint).vocab_size
    return calibrate(tiny_checkpoint, torch.randint(vocab, (4, 128)).tolist())


def logits(folder, windows: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_float32(folder)(windows).logits


def test_calibrated_checkpoint_is_closer_to_16_bit(
    tiny_checkpoint, calibration, tmp_path
):
    gptq = quantize_checkpoint(
        tiny_checkpoint, tmp_path / "gptq", 32, False, calibration=calibration
    )
    rtn = quantize_checkpoint(tiny_checkpoint, tmp_path / "rtn", 32, False)
    config = O3Config.from_pretrained(gptq)
    assert config.int4_format == (32, False)
    tensors = load_file(gptq / "model.safetensors")
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    assert shapes == expected_tensor_shapes(config)
    windows = calibration.windows
    want = logits(tiny_checkpoint, windows)
    gptq_error = (logits(gptq, windows) - want).pow(2).mean()
    rtn_error = (logits(rtn, windows) - want).pow(2).mean()
    assert gptq_error < rtn_error


@pytest.mark.parametrize("sym", [True, False])
def test_group_scales_start_as_the_packed_weight(sym):
    torch.manual_seed(3)
    packed = quantize(torch.randn(24, 64, dtype=torch.bfloat16), 32, sym)
    weight = GroupScales(packed)(torch.empty(0))
    torch.testing.assert_close(weight, dequantize(packed, torch.float32))
    assert torch.equal(GroupScales(packed).scales(), packed.scales)


def test_scale_tuning_lowers_the_kl_to_16_bit_and_moves_only_scales(
    tiny_checkpoint, calibration, tmp_path
):
    """Tuned against the 16-bit model's top-k log-probabilities: the KL on
    the calibration windows falls, the 4-bit values and zero points stay as
    GPTQ chose them, and the model's own weights are left as they were."""
    gptq = quantize_checkpoint(
        tiny_checkpoint, tmp_path / "gptq", 32, False, calibration=calibration,
        tune_steps=0,
    )  # fmt: skip
    model = load_float32(tiny_checkpoint)
    before = {n: p.clone() for n, p in model.named_parameters()}
    packed = pop_int4_weights(load_file(gptq / "model.safetensors"))
    tuned = tune_scales(
        model, packed, calibration.windows, calibration.teacher, steps=12, lr=1e-2
    )
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name

    def kl(weights: dict[str, Int4Weight]) -> float:
        with torch.no_grad():
            for name, weight in weights.items():
                model.get_submodule(name).weight.copy_(dequantize(weight))
            out = model(calibration.windows).logits
        teacher = calibration.teacher
        return sum(
            float(bucket_kl(out[i], teacher.indices[i], teacher.logprobs[i]))
            for i in range(len(out))
        )

    assert kl(tuned) < 0.9 * kl(packed)
    for name, weight in tuned.items():
        assert torch.equal(weight.qweight, packed[name].qweight)
        assert torch.equal(weight.qzeros, packed[name].qzeros)
        assert weight.scales.dtype == packed[name].scales.dtype
        assert not torch.equal(weight.scales, packed[name].scales)


def test_calibration_hessians_are_the_ffn_inputs(tiny_checkpoint):
    """One X^T X per projection: down_proj's from the activations, gate_proj's
    (shared with up_proj, same input) from the normed hidden states, each
    counting the rows that reached the FFN; and the model's top-k
    log-probabilities of each window."""
    config = O3Config.from_pretrained(tiny_checkpoint)
    window = list(range(3, 3 + 24))
    calibration = calibrate(tiny_checkpoint, [window])
    hessians = calibration.hessians
    projections = {
        n.removesuffix(".weight")
        for n in expected_tensor_shapes(config)
        if n.removesuffix(".weight").endswith(FFN_PROJECTIONS)
    }
    assert set(hessians) == projections
    for name, h in hessians.items():
        size = config.intermediate_size if "down_proj" in name else config.hidden_size
        assert h.shape == (size, size) and h.dtype == torch.float64
        assert torch.allclose(h, h.t())
        assert torch.linalg.eigvalsh(h).min() > -1e-6 * h.diagonal().max()
        if name.endswith("up_proj"):
            assert h is hessians[name.removesuffix("up_proj") + "gate_proj"]
    want = logits(tiny_checkpoint, torch.tensor([window]))[0].log_softmax(-1)
    teacher = calibration.teacher
    torch.testing.assert_close(teacher.logprobs[0], want.topk(64).values)


@pytest.mark.parametrize("command", ["quantize", "convert"])
@pytest.mark.parametrize("count", ["0", "-3"])
def test_cli_refuses_calibration_windows_below_one(command, count, tmp_path, capsys):
    from vllm_o3.tools.cli import main

    with pytest.raises(SystemExit):
        main(
            [
                command,
                str(tmp_path),
                str(tmp_path / "out"),
                "--calibration-windows",
                count,
            ]
        )
    assert (
        f"--calibration-windows: must be at least 1, got {count}"
        in capsys.readouterr().err
    )
    assert not (tmp_path / "out").exists()


def test_cli_refuses_tune_steps_without_calibration(tiny_checkpoint, tmp_path):
    from vllm_o3.tools.cli import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit, match="--tune-steps needs --method gptq"):
        main(["quantize", str(tiny_checkpoint), str(out), "--tune-steps", "4"])
    assert not out.exists()
