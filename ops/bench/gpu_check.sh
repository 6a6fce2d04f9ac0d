#!/usr/bin/env bash
# The GPU check (issues 29, 30): on a CUDA machine, within ~7 minutes and without the network,
# measure copy bandwidth and a bf16 matmul, run the Triton kernel tests natively, time
# each kernel (ops/bench/gpu_check.py), then the engine on CUDA with an 8B-shaped random model
# (ops/bench/gpu_check_engine.py: decode tok/s for BF16 and FP8 KV under one KV budget, graphs
# on/off, the tag pass's cost) and with a GLM-MoE-shaped one served in INT4 and in block FP8
# (ops/bench/gpu_check_moe_engine.py: decode tok/s at 1/8/32, prefill tok/s).
# Each section's output also goes to $LOGS/<section>.log ($OUT where set, else ops/bench/out/).
# `gpu_check.sh SECTION...` runs only those sections (tests, kernels, gemm, moe_mla, engine,
# moe_engine; and sweep, not run by default: decode attention's launch configs). Wheels the machine lacks may be carried in ops/bench/wheels/ (installed with
# --no-index into a folder of their own). Without CUDA: exits 2 at once, one line.
set -uo pipefail
cd "$(dirname "$0")/../.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no CUDA device (nvidia-smi finds none); nothing measured" >&2
    exit 2
fi
PY=${PYTHON:-python3}
if [ -d ops/bench/wheels ] && ls ops/bench/wheels/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/gpu_check_site \
        ops/bench/wheels/*.whl && export PYTHONPATH=/tmp/gpu_check_site \
        || echo "gpu_check: carried wheels did not install; continuing with what is there"
fi
if ! "$PY" -c "import sys, torch, triton; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA device (or triton is missing); nothing measured" >&2
    exit 2
fi
unset TRITON_INTERPRET
# unbuffered: a section its timeout stops still shows the rows it printed. TESSERA_NATIVE=0:
# the C++ CPU ops serve CPU tensors only, and compiling them would spend device time.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TESSERA_TRITON_NATIVE=1 PYTHONUNBUFFERED=1 \
    TESSERA_NATIVE=0
LOGS=${OUT:-ops/bench/out}
mkdir -p "$LOGS"
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=(tests kernels gemm moe_mla engine moe_engine)
"$PY" -c "import torch, triton, sys; print('## gpu_check:', torch.cuda.get_device_name(), \
'| torch', torch.__version__, '| triton', triton.__version__, '| python', sys.version.split()[0])"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
    --format=csv,noheader
status=0
# run SECTION SECONDS CMD...: one section, bounded, its output to the screen and its log
run() {
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo
    echo "## section $name (limit ${limit} s)"
    timeout -k 5 "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "## section $name: rc $rc in $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}
xdist=()
"$PY" -c "import xdist" 2>/dev/null && xdist=(-n 8)
# budgets sum to ~7 minutes: one run and a shorter rerun of some sections fit a 15-minute
# device budget with two machine starts
for section in "${sections[@]}"; do
    case $section in
    tests) run tests 110 "$PY" -m pytest -q -p no:cacheprovider "${xdist[@]}" \
        tests/kernels/test_triton_paged_attention.py tests/kernels/test_triton_store_kv.py \
        tests/kernels/test_triton_verify_pages.py tests/kernels/test_triton_fused_moe.py \
        tests/kernels/test_triton_mla_decode.py tests/kernels/test_triton_latent.py \
        tests/kernels/test_triton_w4a16.py tests/kernels/test_triton_fp8_block.py \
        tests/kernels/test_triton_weight_ops.py ;;
    kernels) run kernels 70 "$PY" -m ops.bench.gpu_check ;;
    sweep) run sweep 90 "$PY" -m ops.bench.gpu_check --sweep ;;
    gemm) run gemm 50 "$PY" -m ops.bench.gpu_check_gemm ;;
    moe_mla) run moe_mla 50 "$PY" -m ops.bench.gpu_check_moe_mla ;;
    engine) run engine 100 "$PY" -m ops.bench.gpu_check_engine ;;
    moe_engine) run moe_engine 80 "$PY" -m ops.bench.gpu_check_moe_engine ;;
    *) echo "gpu_check: unknown section $section" >&2; status=1 ;;
    esac
done
exit $status
