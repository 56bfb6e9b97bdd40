"""O3Config: the spec's defaults, and refusal of bad values naming the field."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

import vllm_o3  # noqa: F401  (registers model_type "o3")
from vllm_o3.model import O3Config

BASE = dict(
    num_hidden_layers=6, hidden_size=256, num_attention_heads=4, num_key_value_heads=2
)


def test_defaults_follow_the_spec():
    config = O3Config(**BASE)
    assert config.model_type == "o3"
    assert config.router_hidden_size == 64
    assert config.router_threshold == 0.85
    assert config.router_layers == [1, 2, 3, 4]  # all but the first and the last
    assert config.light_rank == 256 // 8
    assert config.attn_output_gate is False


def test_saved_config_round_trips_through_autoconfig(tmp_path):
    O3Config(**BASE, router_layers=[2, 3], router_threshold=0.5).save_pretrained(
        tmp_path
    )
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "o3" and saved["router_layers"] == [2, 3]
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, O3Config)
    assert loaded.router_layers == [2, 3] and loaded.router_threshold == 0.5


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("router_threshold", "high", "router_threshold"),
        ("router_threshold", float("nan"), "router_threshold"),
        ("router_threshold", True, "router_threshold"),
        ("router_layers", [1, 6], "router_layers"),
        ("router_layers", [-1], "router_layers"),
        ("router_layers", [2, 2], "router_layers"),
        ("router_layers", ["1"], "router_layers"),
        ("light_rank", 0, "light_rank"),
        ("light_rank", 257, "light_rank"),
        ("router_hidden_size", 0, "router_hidden_size"),
        ("num_key_value_heads", 3, "num_key_value_heads"),
        ("num_attention_heads", 3, "hidden size"),
        ("hidden_act", "gelu", "hidden_act"),
        ("mlp_bias", True, "mlp_bias"),
        ("attention_bias", "yes", "attention_bias"),
    ],
)
def test_bad_value_is_refused_naming_the_field(field, value, words):
    with pytest.raises(Exception, match=words):
        O3Config(**{**BASE, field: value})


def test_bad_config_json_is_refused_at_load(tmp_path):
    O3Config(**BASE).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(
        path.read_text().replace(
            '"router_threshold": 0.85', '"router_threshold": "high"'
        )
    )
    with pytest.raises(Exception, match="router_threshold"):
        AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("threshold", [0, 0.0, 1.5, -1])
def test_threshold_extremes_are_valid(threshold):
    assert O3Config(**BASE, router_threshold=threshold).router_threshold == threshold


def test_assignment_is_validated_again_by_validate():
    config = O3Config(**BASE)
    config.router_layers = [99]
    with pytest.raises(Exception, match="router_layers"):
        config.validate()
