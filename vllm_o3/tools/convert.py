"""`vllm-o3 convert`: a Llama-family checkpoint becomes an O3 checkpoint.

Attention, FFN, norms, embeddings and head are copied unchanged (with
`router_threshold: 0` the result computes exactly its parent). What is added,
from measurement on calibration text of several domains:

1. light paths and routers fitted per layer to the parent's FFNs (`fit`);
2. the operating point: which layers route and how many of their tokens go
   heavy. Layers with massive-activation tokens stay dense; the others are
   ranked by how well their light path fits. A sweep over (layers routed,
   heavy fraction) measures perplexity on held-out calibration text per
   domain;
3. optional end-to-end distillation (`distill`), then the same sweep again
   with the trained tensors. Of all points measured, fitted or trained, the
   largest FFN saving whose every domain stays within `--max-ppl-increase`
   wins (or `--heavy-fraction` sets the fraction): training that does not
   generalise cannot make the result worse than fitting alone;
4. each router's bias calibrated so that the spec's threshold (0.85) gives
   the chosen fraction on text of all domains.

The config records the operating point and the measured figures.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig

from vllm_o3.model import O3Config, O3ForCausalLM
from vllm_o3.tools.corpora import Corpus, load_corpora
from vllm_o3.tools.debian import DEFAULT_CACHE
from vllm_o3.tools.distill import cache_teacher, distill
from vllm_o3.tools.evaluate import ffn_flops_saved, reference_perplexity
from vllm_o3.tools.fit import LayerFit, calibrate_routers, fit_layer
from vllm_o3.tools.output import atomic_output_dir
from vllm_o3.tools.parent import (
    Parent,
    full_attention_positions,
    llama_fields,
    load_parent,
)

WINDOW = 512
HEAVY_FRACTIONS = (0.75, 0.6, 0.5, 0.4, 0.3)
LAYER_SHARES = (1.0, 0.75, 0.5)
ROUTER_HIDDEN = 64
ALL_HEAVY_BIAS = 1e4  # a router bias that sends every token heavy
CALIBRATION_STRIDE = 4  # the sweep calibrates biases on every 4th fit window
TRAIN_HEAVY_FRACTION = 0.6  # near the points the budget can reach after training


@dataclass
class ConvertOptions:
    max_ppl_increase: float = 0.10
    heavy_fraction: float | None = None  # fixes the fraction instead of the budget
    fit_windows_per_domain: int = 8
    dev_windows_per_domain: int = 2
    train_minutes: float = 0.0
    light_rank: int | None = None
    dtype: torch.dtype = torch.bfloat16
    cache: Path = DEFAULT_CACHE
    seed: int = 0
    routing_out: Path | None = None  # also write the routers and light paths alone
    command: str = ""  # how this conversion was asked for, for the record


@dataclass
class OperatingPoint:
    layers: list[int]
    heavy_fraction: float
    ppl: dict[str, float] = field(default_factory=dict)
    heavy_measured: float = 0.0
    flops_saved: float = 0.0
    trained: bool = False  # measured with the distilled routers and light paths


def token_windows(
    tokenizer, texts: list[str], count: int, from_end: bool
) -> list[torch.Tensor]:
    """`count` windows of WINDOW tokens from the start (or end) of the texts."""
    ids = tokenizer("\n\n".join(texts)).input_ids
    usable = len(ids) // WINDOW
    picked = range(usable - count, usable) if from_end else range(min(count, usable))
    return [torch.tensor(ids[i * WINDOW : (i + 1) * WINDOW]) for i in picked]


def o3_from_parent(
    parent: Parent,
    router_layers: list[int],
    light_rank: int | None,
    router_hidden: int = ROUTER_HIDDEN,
) -> O3ForCausalLM:
    """The O3 model with the parent's weights; routers and light paths empty."""
    fields = llama_fields(parent.model.config)
    config = O3Config(
        **fields,
        router_layers=router_layers,
        router_hidden_size=router_hidden,
        light_rank=light_rank or fields["hidden_size"] // 8,
        architectures=["O3ForCausalLM"],
    )
    model = O3ForCausalLM(config).float().eval().requires_grad_(False)
    missing, unexpected = model.load_state_dict(parent.model.state_dict(), strict=False)
    # A Qwen2 parent has q/k/v biases only; O3's attention_bias adds o_proj's.
    zeroed = {n for n in missing if n.endswith(".o_proj.bias")}
    for name in zeroed:
        model.get_parameter(name).zero_()
    new = {n for n in missing if ".router." in n or ".light." in n} | zeroed
    if unexpected or set(missing) - new - {"lm_head.weight"}:
        raise ValueError(f"parent tensors do not map onto O3: {unexpected or missing}")
    model.tie_weights()
    return model


@torch.no_grad()
def capture_ffn_activations(
    parent: Parent, windows: list[torch.Tensor]
) -> tuple[list, list]:
    """Per layer, the FFN's inputs and outputs over all windows (float32)."""
    layers = parent.model.model.layers
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]
    outputs: list[list[torch.Tensor]] = [[] for _ in layers]

    def record(index: int):
        def hook(_module, args, output) -> None:
            inputs[index].append(args[0][0])
            outputs[index].append(output[0])

        return hook

    hooks = [
        layer.mlp.register_forward_hook(record(i)) for i, layer in enumerate(layers)
    ]
    try:
        for window in tqdm(windows, desc="parent activations", leave=False):
            parent.model(window.unsqueeze(0))
    finally:
        for hook in hooks:
            hook.remove()
    return [torch.cat(x) for x in inputs], [torch.cat(y) for y in outputs]


@torch.no_grad()
def install_fits(model: O3ForCausalLM, fits: dict[int, LayerFit]) -> None:
    for index, fit in fits.items():
        layer = model.model.layers[index]
        layer.light.down.weight.copy_(fit.light_down)
        layer.light.up.weight.copy_(fit.light_up)
        layer.router.fc1.weight.copy_(fit.fc1_weight)
        layer.router.fc1.bias.copy_(fit.fc1_bias)
        layer.router.fc2.weight.copy_(fit.fc2_weight)
        layer.router.fc2.bias.copy_(fit.fc2_bias)


def evaluate(
    model: O3ForCausalLM, dev: dict[str, list[torch.Tensor]]
) -> tuple[dict[str, float], dict[int, float]]:
    """Perplexity per domain and heavy fraction per routed layer (all domains)."""
    ppl, heavy = {}, {}
    for domain, windows in dev.items():
        ppl[domain], domain_heavy = reference_perplexity(
            model, [w.tolist() for w in windows]
        )
        for index, fraction in domain_heavy.items():
            heavy[index] = heavy.get(index, 0.0) + fraction / len(dev)
    return ppl, heavy


@torch.no_grad()
def set_operating_point(
    model: O3ForCausalLM,
    fits: dict[int, LayerFit],
    point: OperatingPoint,
    fit_windows: torch.Tensor,
) -> None:
    """Route `point.layers` at `point.heavy_fraction`; other fitted layers all heavy."""
    install_fits(model, fits)
    fractions = {i: (point.heavy_fraction if i in point.layers else 1.0) for i in fits}
    calibrate_routers(model, fit_windows, fractions)
    for index in fits:
        if index not in point.layers:
            model.model.layers[index].router.fc2.bias.fill_(ALL_HEAVY_BIAS)


def sweep(
    model: O3ForCausalLM,
    fits: dict[int, LayerFit],
    candidates: list[int],
    fractions: tuple[float, ...],
    fit_windows: torch.Tensor,
    dev: dict[str, list[torch.Tensor]],
) -> list[OperatingPoint]:
    points = []
    shares = LAYER_SHARES if len(candidates) > 2 else (1.0,)
    grid = [(s, f) for f in fractions for s in shares]
    for share, fraction in tqdm(grid, desc="operating points", leave=False):
        layers = candidates[: max(1, round(share * len(candidates)))]
        point = OperatingPoint(sorted(layers), fraction)
        set_operating_point(model, fits, point, fit_windows)
        point.ppl, heavy = evaluate(model, dev)
        routed_heavy = {i: heavy[i] for i in point.layers}
        point.heavy_measured = sum(routed_heavy.values()) / len(routed_heavy)
        point.flops_saved = ffn_flops_saved(model.config, routed_heavy)
        points.append(point)
    return points


def within_budget(
    point: OperatingPoint, parent_ppl: dict[str, float], budget: float
) -> bool:
    return all(point.ppl[d] <= parent_ppl[d] * (1 + budget) for d in parent_ppl)


def convert(
    src: str | Path,
    out: str | Path,
    options: ConvertOptions,
    corpora: dict[str, Corpus] | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert `src` (HF folder or .gguf) into an O3 checkpoint at `out`."""
    started, cpu_started = time.monotonic(), time.process_time()
    torch.manual_seed(options.seed)
    parent = load_parent(src)
    positions = full_attention_positions(parent.model.config)
    if positions < WINDOW:
        raise ValueError(
            f"{src}: the parent takes {positions} positions (max_position_embeddings "
            f"or sliding_window), fewer than the {WINDOW}-token calibration windows"
        )
    corpora = corpora or load_corpora(options.cache)
    tok = parent.tokenizer
    per_domain = options.fit_windows_per_domain
    fit_windows = torch.stack(
        [
            window
            for corpus in corpora.values()
            for window in token_windows(tok, corpus.calibration, per_domain, False)
        ]
    )
    dev = {
        d: token_windows(
            tok, c.calibration, options.dev_windows_per_domain, from_end=True
        )
        for d, c in corpora.items()
    }
    layers = parent.model.config.num_hidden_layers
    eligible = list(range(1, layers - 1))
    model = o3_from_parent(parent, eligible, options.light_rank)
    config = model.config
    inputs, outputs = capture_ffn_activations(parent, list(fit_windows))
    initial_fraction = options.heavy_fraction or 0.5
    fits = {
        i: fit_layer(
            inputs[i],
            outputs[i],
            config.light_rank,
            ROUTER_HIDDEN,
            initial_fraction,
            seed=options.seed + i,
        )
        for i in tqdm(eligible, desc="fitting layers")
    }
    del inputs, outputs
    kept_dense = {
        i: "massive-activation tokens"
        for i, f in fits.items()
        if f.massive_fraction > 0
    }
    candidates = sorted(
        (i for i in eligible if i not in kept_dense), key=lambda i: fits[i].light_error
    )
    config.router_threshold = 0.0
    parent_ppl, _ = evaluate(model, dev)  # threshold 0: the parent itself
    config.router_threshold = 0.85
    fractions = (options.heavy_fraction,) if options.heavy_fraction else HEAVY_FRACTIONS
    points = sweep(model, fits, candidates, fractions, fit_windows, dev)
    fitted_points, fitted_fits, trained = points, fits, None
    if options.train_minutes > 0 and candidates:
        # Train where the fitted model is not yet good enough: every candidate
        # layer at the training fraction; the sweep afterwards picks the point.
        fraction = options.heavy_fraction or TRAIN_HEAVY_FRACTION
        set_operating_point(
            model, fits, OperatingPoint(candidates, fraction), fit_windows
        )
        teacher = cache_teacher(parent.model, fit_windows)
        losses = distill(
            model,
            fit_windows,
            teacher,
            dict.fromkeys(candidates, fraction),
            options.train_minutes,
            seed=options.seed,
        )
        fits = refreshed_fits(model, fits)
        trained = {
            "minutes": options.train_minutes,
            "steps": len(losses),
            "heavy_fraction": fraction,
            "kl_first": losses[0],
            "kl_last": sum(losses[-20:]) / len(losses[-20:]),
        }
        points = sweep(model, fits, candidates, fractions, fit_windows, dev)
        for point in points:
            point.trained = True
    chosen = pick(fitted_points + (points if trained else []), parent_ppl, options)
    if not chosen.trained:
        fits = fitted_fits
    # Calibrate the biases on the weights as they will be stored.
    fits = {i: rounded(f, options.dtype) for i, f in fits.items()}
    set_operating_point(model, fits, chosen, fit_windows)
    for index in eligible:
        if index not in chosen.layers:
            kept_dense.setdefault(index, "left dense by the quality budget")
    report = {
        "parent": str(src),
        "command": options.command,
        "operating_point": {
            "routed_layers": chosen.layers,
            "heavy_fraction": chosen.heavy_fraction,
            "trained": chosen.trained,
        },
        "heavy_fraction_measured": round(chosen.heavy_measured, 4),
        "ffn_flops_saved": round(chosen.flops_saved, 4),
        "max_ppl_increase": options.max_ppl_increase,
        "dev_perplexity": {
            d: {"parent": round(parent_ppl[d], 3), "o3": round(chosen.ppl[d], 3)}
            for d in parent_ppl
        },
        "dense_layers": {str(i): why for i, why in sorted(kept_dense.items())},
        "training": trained,
        "sweep_fitted_only": sweep_report(fitted_points, parent_ppl),
        "sweep": sweep_report(points, parent_ppl),
        "cpu_minutes": round((time.process_time() - cpu_started) / 60, 1),
        "wall_minutes": round((time.monotonic() - started) / 60, 1),
    }
    write_checkpoint(
        model, chosen.layers, parent, out, options.dtype, report, overwrite
    )
    if options.routing_out is not None:
        save_routing(model, chosen.layers, report, options.routing_out)
    print(json.dumps(report, indent=1))
    return Path(out)


def sweep_report(
    points: list[OperatingPoint], parent_ppl: dict[str, float]
) -> list[dict]:
    return [
        {
            "layers": p.layers,
            "heavy_fraction": p.heavy_fraction,
            "heavy_measured": round(p.heavy_measured, 4),
            "flops_saved": round(p.flops_saved, 4),
            "ppl_increase": {
                d: round(p.ppl[d] / parent_ppl[d] - 1, 4) for d in parent_ppl
            },
        }
        for p in points
    ]


def pick(
    points: list[OperatingPoint], parent_ppl, options: ConvertOptions
) -> OperatingPoint:
    if options.heavy_fraction is not None:  # every layer it can route, best quality
        most = max(len(p.layers) for p in points)
        widest = [p for p in points if len(p.layers) == most]
        return min(
            widest, key=lambda p: max(p.ppl[d] / parent_ppl[d] for d in parent_ppl)
        )
    good = [p for p in points if within_budget(p, parent_ppl, options.max_ppl_increase)]
    if not good:
        return OperatingPoint([], 1.0, dict(parent_ppl))
    return max(good, key=lambda p: p.flops_saved)


def rounded(fit: LayerFit, dtype: torch.dtype) -> LayerFit:
    """`fit` with its tensors rounded to `dtype` (kept in float32)."""
    tensors = ("light_down", "light_up", "fc1_weight", "fc1_bias", "fc2_weight")
    return replace(fit, **{t: getattr(fit, t).to(dtype).float() for t in tensors})


def refreshed_fits(
    model: O3ForCausalLM, fits: dict[int, LayerFit]
) -> dict[int, LayerFit]:
    """The trained tensors, as fits (so operating points can be set again)."""
    refreshed = {}
    for index, fit in fits.items():
        layer = model.model.layers[index]
        refreshed[index] = LayerFit(
            light_down=layer.light.down.weight.detach().clone(),
            light_up=layer.light.up.weight.detach().clone(),
            fc1_weight=layer.router.fc1.weight.detach().clone(),
            fc1_bias=layer.router.fc1.bias.detach().clone(),
            fc2_weight=layer.router.fc2.weight.detach().clone(),
            fc2_bias=layer.router.fc2.bias.detach().clone(),
            massive_fraction=fit.massive_fraction,
            light_error=fit.light_error,
        )
    return refreshed


def write_checkpoint(
    model: O3ForCausalLM,
    routed: list[int],
    parent: Parent,
    out,
    dtype,
    report: dict,
    overwrite: bool,
) -> None:
    """Save with only the routed layers' routers and light paths."""
    config = model.config
    state = {
        name: tensor.to(dtype)
        for name, tensor in model.state_dict().items()
        if not (
            (".router." in name or ".light." in name)
            and int(name.split(".")[2]) not in routed
        )
    }
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config.router_layers = routed
    config.router_threshold = 0.85
    config.dtype = dtype
    config.o3_conversion = report
    config.validate()
    from safetensors.torch import save_file

    with atomic_output_dir(out, overwrite=overwrite) as folder:
        save_file(
            {k: v.contiguous() for k, v in state.items()},
            folder / "model.safetensors",
            metadata={"format": "pt"},
        )
        config.save_pretrained(folder)
        parent.tokenizer.save_pretrained(folder)
        GenerationConfig.from_model_config(parent.model.config).save_pretrained(folder)


ROUTING_KEYS = (".router.", ".light.")


def save_routing(
    model: O3ForCausalLM, routed: list[int], report: dict, path: Path
) -> None:
    """The routed layers' routers and light paths (bfloat16) with the config
    fields and report: with the parent, all it takes to rebuild the model."""
    from safetensors.torch import save_file

    config = model.config
    tensors = {
        name: tensor.to(torch.bfloat16).contiguous()
        for name, tensor in model.state_dict().items()
        if any(k in name for k in ROUTING_KEYS) and int(name.split(".")[2]) in routed
    }
    fields = {
        "router_layers": routed,
        "router_hidden_size": config.router_hidden_size,
        "light_rank": config.light_rank,
        "o3_conversion": report,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path, metadata={"o3": json.dumps(fields)})


def load_routing(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as handle:
        fields = json.loads(handle.metadata()["o3"])
    return load_file(path), fields


def build_from_routing(
    parent_source: str | Path,
    routing: Path,
    out: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    overwrite: bool = False,
) -> Path:
    """A converted model rebuilt from its parent and its saved routing."""
    tensors, fields = load_routing(routing)
    parent = load_parent(parent_source)
    model = o3_from_parent(
        parent,
        fields["router_layers"],
        fields["light_rank"],
        fields["router_hidden_size"],
    )
    missing = [
        n
        for n in model.state_dict()
        if any(k in n for k in ROUTING_KEYS) and n not in tensors
    ]
    if missing:
        raise ValueError(f"{routing} lacks {missing[:4]}")
    with torch.no_grad():
        for name, tensor in tensors.items():
            model.get_parameter(name).copy_(tensor.float())
    write_checkpoint(
        model,
        fields["router_layers"],
        parent,
        out,
        dtype,
        fields["o3_conversion"],
        overwrite,
    )
    return Path(out)
