"""Registration of O3 with transformers and vLLM; safe to call any number of times."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

VLLM_MODEL_CLASS = "vllm_o3.model.vllm_model:O3ForCausalLM"


def register_with_transformers() -> None:
    """Make `AutoConfig` / `AutoModelForCausalLM` know model_type "o3"."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_o3.model import O3Config, O3ForCausalLM

    AutoConfig.register(O3Config.model_type, O3Config, exist_ok=True)
    AutoModelForCausalLM.register(O3Config, O3ForCausalLM, exist_ok=True)


def share_worker_metrics() -> None:
    """Let Prometheus counters of the engine and worker processes (the router
    statistics) reach the API server's `/metrics`.

    vLLM collects other processes' metrics only from a multiprocess directory
    set before its processes start. Plugins load before vLLM creates any
    metric, so this sets one up (the processes started later inherit it; it is
    removed at exit) and switches prometheus_client, which `vllm serve` has
    already imported, to file-backed values for the metrics still to come.
    """
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
        return
    path = tempfile.mkdtemp(prefix="vllm-o3-prometheus-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, True))
    if "prometheus_client" in sys.modules:
        from prometheus_client import values

        values.ValueClass = values.get_value_class()


def register() -> None:
    """vLLM plugin entry point: O3's config, model class and extensions."""
    from vllm import ModelRegistry

    register_with_transformers()
    share_worker_metrics()
    if "O3ForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("O3ForCausalLM", VLLM_MODEL_CLASS)
