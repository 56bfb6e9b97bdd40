"""What O3 computes: its config, the plain PyTorch reference and the vLLM model.

The vLLM model (`vllm_o3.model.vllm_model`) is not imported here: vLLM loads it
lazily by name, and the reference must stay importable without vLLM.
"""

from vllm_o3.model.config import O3Config
from vllm_o3.model.reference import O3ForCausalLM, O3Model

__all__ = ["O3Config", "O3ForCausalLM", "O3Model"]
