#!/usr/bin/env bash
# The GPU checks in one call: the Triton kernels' tests natively (routed FFN,
# CUDA-graph replay, W4A16 GEMM), then benchmarks/gpu_kernels.py. Needs only
# torch, triton, pytest and tqdm: where the packages that `import vllm_o3`
# registers with (transformers) are missing, the kernels are imported without
# that registration. Results: docs/bench_gpu_kernels.md, copied to $1 if given;
# further arguments go to the benchmark (e.g. --parts ffn tiles).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-}
shift || true
bench_args=""
[ $# -gt 0 ] && bench_args=$(printf "'%s', " "$@")
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.total --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
run() {  # python3 with vllm_o3's kernels importable, then the given code
    python3 -c "
import sys, types
try:
    import vllm_o3
except Exception as e:
    print('import vllm_o3 failed (%s): kernels imported without registration' % e)
    for name in list(sys.modules):
        if name.startswith('vllm_o3'):
            del sys.modules[name]
    stub = types.ModuleType('vllm_o3'); stub.__path__ = ['vllm_o3']
    sys.modules['vllm_o3'] = stub
$1"
}
export PYTHONUNBUFFERED=1
run "
import pytest
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_kernels.py', 'tests/test_int4_triton.py']))
" 2>&1 | tee ${out:+$out/tests.log}
run "
import runpy
sys.argv = ['benchmarks/gpu_kernels.py', '--repeats', '20', '--calls', '20', ${bench_args%, }]
runpy.run_module('benchmarks.gpu_kernels', run_name='__main__')
" 2>&1 | tee ${out:+$out/bench.log}
[ -n "$out" ] && cp docs/bench_gpu_kernels.md "$out/" 2>/dev/null
exit 0
