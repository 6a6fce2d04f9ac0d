#!/usr/bin/env bash
# The GPU check (issues 29, 30): on a CUDA machine, within ~9 minutes and without the network,
# measure copy bandwidth and a bf16 matmul, run the Triton kernel tests natively, time
# each kernel (ops/bench/gpu_check.py), then the engine on CUDA with an 8B-shaped random model
# (ops/bench/gpu_check_engine.py: decode tok/s with graphs on/off, the tag pass's cost) and
# with a GLM-MoE-shaped one served in INT4 and in block FP8 (ops/bench/gpu_check_moe_engine.py:
# decode tok/s at 1/8/32, prefill tok/s). Wheels the machine lacks may be carried in
# ops/bench/wheels/ (installed with --no-index). Without CUDA: exits 2 at once, one line.
set -uo pipefail
cd "$(dirname "$0")/../.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device (nvidia-smi finds none); nothing measured" >&2
    exit 2
fi
PY=${PYTHON:-python}
if [ -d ops/bench/wheels ] && ls ops/bench/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --find-links ops/bench/wheels ops/bench/wheels/*.whl \
        || echo "gpu_check: carried wheels did not install; continuing with what is there"
fi
if ! "$PY" -c "import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device (or triton is missing); nothing measured" >&2
    exit 2
fi
unset TRITON_INTERPRET
# unbuffered: a section its timeout stops still shows the rows it printed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TESSERA_TRITON_NATIVE=1 PYTHONUNBUFFERED=1
status=0
echo "## kernel tests, native (TRITON_INTERPRET unset)"
# budgets sum to 9 minutes: one run fits a 10-minute device call and ~60% of a 15-minute
# device budget (the machine's start and a shorter rerun of a section need the rest)
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_triton_paged_attention.py \
    tests/kernels/test_triton_store_kv.py tests/kernels/test_triton_verify_pages.py \
    tests/kernels/test_triton_fused_moe.py tests/kernels/test_triton_mla_decode.py \
    tests/kernels/test_triton_latent.py \
    tests/kernels/test_triton_w4a16.py tests/kernels/test_triton_fp8_block.py \
    tests/kernels/test_triton_weight_ops.py || status=1
echo
timeout 100 "$PY" -m ops.bench.gpu_check "$@" || status=1
timeout 70 "$PY" -m ops.bench.gpu_check_gemm "$@" || status=1
timeout 70 "$PY" -m ops.bench.gpu_check_moe_mla "$@" || status=1
echo
timeout 100 "$PY" -m ops.bench.gpu_check_engine "$@" || status=1
echo
timeout 80 "$PY" -m ops.bench.gpu_check_moe_engine "$@" || status=1
exit $status
