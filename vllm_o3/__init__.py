"""vllm_o3: the O3 model family served by vLLM.

Importing the package registers O3 with transformers (`AutoConfig`,
`AutoModelForCausalLM`, model_type "o3"); vLLM calls `register()` through the
`vllm.general_plugins` entry point in each of its processes. `O3Model` and
`O3Config` are the seed's Python API (`vllm_o3.api`).
"""

from vllm_o3.api import O3Config, O3Model
from vllm_o3.plugin import register, register_with_transformers

register_with_transformers()

__all__ = ["O3Config", "O3Model", "register"]
