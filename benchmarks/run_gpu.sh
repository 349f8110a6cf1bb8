#!/usr/bin/env bash
# Everything a CUDA machine should check, in one command: the CUDA tests, then the kernel benchmarks against their
# goals, the static ptxas report with this machine's Triton, and the engine-level benchmarks on CUDA.
#
#   bash benchmarks/run_gpu.sh [OUT_DIR]        (default: benchmarks/results/gpu-<date>)
#   STEPS="tests-cuda kernels" bash benchmarks/run_gpu.sh "$OUT"     (a subset, e.g. to fit a time limit per call)
#
# Where each call may run 10 minutes (keep the same OUT across calls; each step writes its own files), in the order
# of what is least known (as of 2026-11-25: the even split shares, the two-stream launches and the 16-bit split
# partials were never timed):
#   1. STEPS="env kernels-splits rank profile-graphs"   2. STEPS="tests-gpu kernels-split-dtype"
#   3. STEPS="kernels-d256 kernels-vsplits-rank"        4. STEPS="kernels-d64 kernels-d128"  (about 8 minutes on an H100)
#   5. STEPS="kernels-vsplits ncu ncu-kernel"           6. STEPS="rank-compile tiers sync"
#   7+. STEPS=slo-seeds SLO_SEEDS=<one seed per call> SLO_ARGS=--quick  (the quick settings where a call has 10 minutes)
# (ptxas: the static report, done on any machine with the wheel's ptxas.)
# `kernels` only joins the parts' JSON (no GPU work): run it afterwards on any machine, with the parts' files in OUT.
#
# Steps: env tests-gpu kernels-d64 kernels-d128 kernels-d256 kernels kernels-splits kernels-split-dtype kernels-vsplits
# kernels-vsplits-rank ptxas kernels-fp8 kernels-int8 sync
# rank rank-compile profile profile-graphs ncu ncu-kernel
# rank-small tiers slo slo-graphs tests-cuda kernels-persistent (all by default;
# about 20-30 minutes on an H100, most of it Triton compiling and autotuning), and slo-seeds (only when named in STEPS:
# the SLO benchmark at NVIDIA's HSTU shape and production lengths over three seeds, an hour or more). tests-gpu runs the CUDA tests alone
# (minutes); tests-cuda the whole suite (the interpreter tests skip on a CUDA machine). rank is NVIDIA's public HSTU
# inference shape (8 layers, 4 heads x 256, bf16, 4096 tokens of which 3968 cached, 256 candidates).
# Needs torch with CUDA, triton, pybind11, cmake and ninja already installed: no network is used (the package is
# installed with --no-build-isolation --no-deps). Each step writes its output to OUT_DIR as soon as it finishes, with
# a header naming the device, date and commit (RELAYGR_COMMIT, else `git rev-parse`), so a run cut short keeps what
# it finished. Steps that fail are listed at the end; the script exits non-zero if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-benchmarks/results/gpu-$(date -u +%F)}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET

commit=${RELAYGR_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
if [ -z "$gpu" ]; then
    echo "run_gpu.sh: no NVIDIA GPU visible (nvidia-smi found none); this script is for a CUDA machine" >&2
    exit 2
fi
header="device: ${gpu} | date: $(date -u +%F) | commit: ${commit}"
failed=()

STEPS=${STEPS:-env tests-gpu kernels-d64 kernels-d128 kernels-d256 kernels kernels-splits kernels-split-dtype kernels-vsplits kernels-vsplits-rank ptxas kernels-fp8 kernels-int8 sync rank rank-compile profile profile-graphs ncu ncu-kernel rank-small tiers slo slo-graphs tests-cuda kernels-persistent}
# not in the default list (long): STEPS="slo-seeds" bash benchmarks/run_gpu.sh "$OUT"

step() {  # step NAME TIMEOUT_S COMMAND...: run, tee to OUT_DIR/NAME.txt under a header
    local name=$1 limit=$2
    shift 2
    case " ${STEPS} " in *" ${name} "*) ;; *) return 0 ;; esac
    echo "== ${name}: $*"
    { echo "# $* | ${header}"; timeout "$limit" "$@" 2>&1; } | tee "${OUT_DIR}/${name}.txt"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || failed+=("${name} (exit ${rc})")
}

$PY -m pip install -q --no-build-isolation --no-deps -e . || { echo "install failed" >&2; exit 1; }
step env 60 bash -c "$PY -m relaygr_engine.cli info; nvidia-smi; $PY -c 'import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__)'"
# pytest-xdist where installed: the CUDA tests' time is mostly Triton compiling each autotuned config, which
# parallelises over the CPU cores (the GPU work is small).
xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
step tests-gpu 540 $PY -m pytest -q -rs ${xdist} -m gpu python_tests -p no:cacheprovider
# The kernel first: its RESULT has matmul_fraction_long_{softmax,hstu} beside the matmul rate of the same run. Split
# by head dim (each part compiles and autotunes its own variants: pointer and TMA page reads, 4 and 8 warps), so each
# fits a time-limited call; `kernels` joins them (no GPU work: it can run anywhere on the parts' JSON files).
for d in 64 128 256; do
    step "kernels-d${d}" 600 $PY -m relaygr_engine.cli bench kernels --head-dims "${d}" --json "${OUT_DIR}/kernels-d${d}.json"
done
step kernels 60 $PY -m relaygr_engine.cli bench kernels --summarize "${OUT_DIR}/kernels-d64.json" \
    "${OUT_DIR}/kernels-d128.json" "${OUT_DIR}/kernels-d256.json" --json "${OUT_DIR}/kernels.json"
# One layer of a ranking at NVIDIA's shape (1 user, 128 new rows + 256 candidates over 3968 cached keys, 4 x 256):
# the launcher's split count (auto) beside fixed ones, the two kinds of tile launched on two streams at once (auto)
# and one after the other (no), each a CUDA-graph replay. (Run 2, one stream: 1 split 0.290 ms, 31 splits 0.095.)
step kernels-splits 420 $PY -m relaygr_engine.cli bench kernels --modes hstu --shape B=1,P=3968,n=128,C=256,H=4,D=256 \
    --splits auto,7,11,15 --concurrent-tiles auto,no --json "${OUT_DIR}/kernels-splits.json"
# The same layer's split partials in the model's dtype (bf16, the launcher's default: half the bytes the kernel writes
# and the merge reads) beside fp32 (what every earlier run stored).
step kernels-split-dtype 240 $PY -m relaygr_engine.cli bench kernels --modes hstu \
    --shape B=1,P=3968,n=128,C=256,H=4,D=256 --split-dtype model,fp32 --json "${OUT_DIR}/kernels-split-dtype.json"
# Head dim 256's value columns on one program or split over two (V_SPLITS; `auto` in the steps above lets the autotuner
# pick): the long shapes, and the ranking layer with 128-row candidate tiles (8 warps, one program per SM) beside
# 64-row ones (where the split's 4-warp config runs two programs per SM).
step kernels-vsplits 600 $PY -m relaygr_engine.cli bench kernels --head-dims 256 --value-splits 1,2 \
    --json "${OUT_DIR}/kernels-vsplits.json"
step kernels-vsplits-rank 300 $PY -m relaygr_engine.cli bench kernels --modes hstu \
    --shape B=1,P=3968,n=128,C=256,H=4,D=256 --value-splits 1,2 --block-m 128,64 --json "${OUT_DIR}/kernels-vsplits-rank.json"
step ptxas 900 $PY -m relaygr_engine.cli bench ptxas --defaults --json "${OUT_DIR}/ptxas.json"
# The 8-bit cache: the same shapes' pages in fp8 and int8 beside bf16 (kv8_speedup, kv8_err).
step kernels-fp8 900 $PY -m relaygr_engine.cli bench kernels --kv-dtype fp8_e4m3 --json "${OUT_DIR}/kernels-fp8.json"
step kernels-int8 900 $PY -m relaygr_engine.cli bench kernels --kv-dtype int8 --json "${OUT_DIR}/kernels-int8.json"
step sync 120 $PY benchmarks/sync_audit.py
step rank 300 $PY -m relaygr_engine.cli bench rank --device cuda --model nvidia-hstu \
    --page-size 64 --lengths 4096 --new 128 --candidates 256 --repeats 10 --cuda-graphs --json "${OUT_DIR}/rank.json"
# The same with the whole model compiled (torch.compile) on every path: fewer, fused kernels per graph.
step rank-compile 420 $PY -m relaygr_engine.cli bench rank --device cuda --model nvidia-hstu \
    --page-size 64 --lengths 4096 --new 128 --candidates 256 --repeats 10 --cuda-graphs --compile \
    --json "${OUT_DIR}/rank-compile.json"
step profile 300 $PY benchmarks/profile_rank.py
step profile-graphs 300 $PY benchmarks/profile_rank.py --cuda-graphs --interleave
# What bounds the engine's kernels in that ranking: Nsight Compute's speed-of-light, compute, memory and occupancy
# sections for each launch of the prefix kernel (16: history and candidate tiles of 8 layers), the bias table (8)
# and the split merge's reduction (8), in one ranking after warm-up, with why warps wait (WarpStateStats: stall
# reasons per issued instruction; SchedulerStats: eligible warps per cycle). (ncu runs launches one at a time: the
# two streams' overlap shows in profile-graphs, not here.) Needs ncu and access to the GPU's performance counters;
# says so and passes where ncu is missing.
step ncu 300 bash -c "command -v ncu >/dev/null || { echo 'ncu not found: step skipped'; exit 0; }; \
    ncu --profile-from-start off --kernel-name 'regex:prefix_attention|bias_table|reduce_kernel' \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section Occupancy --section WarpStateStats --section SchedulerStats \
    $PY benchmarks/profile_rank.py --cuda-profiler-window"
# The same sections for the long HSTU shape of bench kernels at head dim 256 (4 users x 16384 cached keys, 1056 rows
# each): whether the kernel is bound by memory (K/V re-read by the candidate tiles of a user) or by issue; and
# SourceCounters: the SASS lines where warps stall most (the key loop's waits on its copies, its MMAs, its barriers).
step ncu-kernel 300 bash -c "command -v ncu >/dev/null || { echo 'ncu not found: step skipped'; exit 0; }; \
    ncu --profile-from-start off --kernel-name regex:prefix_attention --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section SourceCounters \
    $PY benchmarks/profile_kernel.py"
step rank-small 300 $PY -m relaygr_engine.cli bench rank --device cuda --json "${OUT_DIR}/rank-small.json"
# DRAM reload at NVIDIA's model size (8 layers, 4 x 256, bf16): 32 MiB of KV per 1024 tokens; a ranking's DRAM hit
# copied serially vs layer-wise (layer l+1 on a side stream while layer l computes), each against the same
# ranking's HBM hit (dram_layer_vs_hbm_L8192: issue 26's goal, <= 1.3).
step tiers 600 $PY -m relaygr_engine.cli bench tiers --device cuda --model nvidia-hstu --page-size 64 \
    --lengths 1024,4096,8192,16384 --json "${OUT_DIR}/tiers.json"
# The small model at production lengths, both sides eager, then both graphed and compiled (the CUDA defaults).
step slo 600 $PY -m relaygr_engine.cli bench slo --device cuda --no-cuda-graphs --no-compile --quick --no-plots \
    --no-progress --out "${OUT_DIR}/slo"
step slo-graphs 600 $PY -m relaygr_engine.cli bench slo --device cuda --quick --no-plots --no-progress \
    --out "${OUT_DIR}/slo-graphs"
# The issue's seeds run: NVIDIA's HSTU shape, production lengths, graphs and compilation on both sides. SLO_SEEDS
# picks the seeds of this call (default 0,1,2): where a call is time-limited, run one seed per call into the same
# slo-seeds folder (copy the earlier seeds' folders back in first), then summarise them anywhere, no GPU needed:
# relaygr bench seeds OUT_DIR/slo-seeds (it refuses runs whose settings differ other than in their seed).
# SLO_ARGS: more options for every seed (e.g. --quick; give the same to each call: the summary checks it).
SLO_SEEDS=${SLO_SEEDS:-0,1,2}
SLO_ARGS=${SLO_ARGS:-}
step slo-seeds 7200 $PY -m relaygr_engine.cli bench slo --device cuda --model nvidia-hstu --seeds "${SLO_SEEDS}" \
    ${SLO_ARGS} --no-progress --out "${OUT_DIR}/slo-seeds"
# The whole suite: on a CUDA machine the interpreter tests skip and the CUDA ones (marked gpu) run. No network there:
# the packaging tests (a fresh virtual environment) are left out.
step tests-cuda 900 $PY -m pytest -q -rs ${xdist} -m "not packaging" python_tests -p no:cacheprovider
step kernels-persistent 600 $PY -m relaygr_engine.cli bench kernels --persistent --json "${OUT_DIR}/kernels-persistent.json"

echo "results in ${OUT_DIR}"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'failed: %s\n' "${failed[@]}"
    exit 1
fi
