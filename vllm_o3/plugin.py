"""Registration of O3 with transformers and vLLM; safe to call any number of times."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

from vllm_o3.cpu_queue_polling import configure_queue_polling
from vllm_o3.quantization.int4_format import QUANT_METHOD

VLLM_MODEL_CLASS = "vllm_o3.model.vllm_model:O3ForCausalLM"


def register_with_transformers() -> None:
    """Make `AutoConfig` / `AutoModelForCausalLM` know model_type "o3"."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from vllm_o3.model import O3Config, O3ForCausalLM

    AutoConfig.register(O3Config.model_type, O3Config, exist_ok=True)
    AutoModelForCausalLM.register(O3Config, O3ForCausalLM, exist_ok=True)


def is_api_server_process() -> bool:
    """`vllm serve ...` or `python -m vllm.entrypoints.openai.api_server`."""
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    if program == "vllm":
        return sys.argv[1:2] == ["serve"]
    return sys.argv[0].endswith(os.path.join("openai", "api_server.py"))


def share_worker_metrics() -> None:
    """Let Prometheus counters of the engine and worker processes (the router
    statistics) reach the API server's `/metrics`.

    vLLM collects other processes' metrics only from a multiprocess directory
    set before its processes start. Plugins load before vLLM creates any
    metric, so in the API server's process this sets one up (the processes it
    starts inherit it; it is removed at exit) and switches prometheus_client,
    which `vllm serve` has already imported, to file-backed values for the
    metrics still to come. Other processes (offline `LLM` scripts, tests) are
    left alone: a directory they set would leak into servers they start.
    """
    if "PROMETHEUS_MULTIPROC_DIR" in os.environ or not is_api_server_process():
        return
    path = tempfile.mkdtemp(prefix="vllm-o3-prometheus-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    owner = os.getpid()
    atexit.register(lambda: os.getpid() == owner and shutil.rmtree(path, True))
    if "prometheus_client" in sys.modules:
        from prometheus_client import values

        values.ValueClass = values.get_value_class()


def request_amx_tiles() -> None:
    """Ask Linux for the AMX tile state once per process, on CPUs with AMX.

    vLLM's CPU attention runs AMX instructions where the CPU has them without
    asking first (oneDNN's and torch's own AMX paths ask); a process whose
    first AMX instruction is the attention's dies of SIGILL. Seen on an Intel
    Xeon: a server of a small model died on its first request, whose linears
    oneDNN had run without AMX.
    """
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def key_compile_cache() -> None:
    """O3's environment variables that change what torch.compile traces join
    vLLM's own in its compile-cache key (`vllm.envs.compile_factors` hashes
    every variable vLLM knows), or an engine would reuse a graph compiled
    with another setting."""
    from vllm import envs

    from vllm_o3.kernels.cpu_bf16_linear import OPT_OUT

    envs.environment_variables.setdefault(OPT_OUT, lambda: os.environ.get(OPT_OUT))


def register() -> None:
    """vLLM plugin entry point: O3's config, model class, metrics and the
    `o3_int4` quantization method; the AMX tile state where the CPU has it,
    queue polling that leaves CPU cores to the API server and the model, and
    O3's switches in vLLM's compile-cache key."""
    from vllm import ModelRegistry
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS,
        register_quantization_config,
    )

    register_with_transformers()
    share_worker_metrics()
    request_amx_tiles()
    configure_queue_polling()
    key_compile_cache()
    if "O3ForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("O3ForCausalLM", VLLM_MODEL_CLASS)
    if QUANT_METHOD not in QUANTIZATION_METHODS:
        from vllm_o3.quantization.o3_int4 import O3Int4Config

        register_quantization_config(QUANT_METHOD)(O3Int4Config)
