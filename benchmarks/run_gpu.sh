#!/usr/bin/env bash
# Every check a CUDA machine should run, in one command: CUDA tests, kernel and engine benchmarks, static reports.
#   bash benchmarks/run_gpu.sh [OUT_DIR]   OUT_DIR default benchmarks/results/gpu-<date>; steps default: all but
#                                          slo-gpu, slo-seeds, tiers-8k, tests-hopper-twin (20-30 min: compiles)
#   STEPS="rank kernels-splits" bash benchmarks/run_gpu.sh OUT_DIR     (a subset, in the order STEPS names them)
# Needs torch with CUDA, triton, pybind11, cmake, ninja installed; no network (pip --no-build-isolation --no-deps).
# Env: STEPS: the steps, in order (an unknown name stops the script before anything runs). DEADLINE_S: seconds from
#   the start (install included) after which no step starts; a step needs MIN_STEP_S (default 30) left and its limit
#   is cut to what is left. ARCHIVE: a .tgz that OUT_DIR is packed into at exit. RELAYGR_COMMIT: the commit in every
#   header (else git rev-parse). SLO_SEEDS (default 0,1,2), SLO_ARGS: slo-seeds' seeds and extra options.
# Output: OUT_DIR/<step>.txt under a device/date/commit header as each step ends; OUT_DIR/steps.tsv: seconds, exit
#   status or "not run"; failed steps listed at the end (exit 1). Steps, ~seconds measured on H100/H200 or <=limit:
#   env ~12: versions, GPU, sm_90 ptxas | tests-gpu ~190: pytest -m gpu | tests-cuda ~540: the whole suite
#   tests-hopper-twin ~30, tests-hopper ~100: sm_90 kernel vs its twin, vs the reference | sync <=120: device syncs
#   tests-kv8 ~60 (strict xfail), sanitize-kv8 <=300: 8-bit CUDA tests, kernel's read on | kv8-probe ~90: 8-bit probes
#   kernels-d64|d128|d256 ~100 each, kernels (join, no GPU): bench kernels, one part per head dim
#   kernels-splits ~30, kernels-split-dtype ~30, kernels-vsplits-rank <=300: one ranking layer at NVIDIA's shape
#   kernels-vsplits <=600, kernels-persistent <=600, kernels-fp8|int8 <=900 (8-bit pages) | ptxas <=900: static
#   kernels-hopper ~100, kernels-hopper-softmax <=500, kernels-hopper-rank ~75, rank-hopper ~30: the sm_90 kernel
#   rank ~40, rank-compile <=420: bench rank, NVIDIA's shape; rank-small <=300 | host ~13: a replay's host work
#   profile <=300, profile-graphs ~30, profile-graphs-hopper ~30 | ncu ~50, ncu-hopper, ncu-kernel <=300: Nsight
#   tiers <=600, tiers-8k ~26: DRAM onload | slo, slo-graphs <=600: small model | slo-seeds <=7200: NVIDIA's shape
#   slo-gpu ~330: bench slo --budget-s 330, 3 seeds at NVIDIA's shape (first in the next run's plan)
# Next GPU run: 1. STEPS=slo-gpu (one call) 2. rank profile-graphs kv8-probe tests-kv8; plan: benchmarks/results/
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-benchmarks/results/gpu-$(date -u +%F)}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
DEADLINE_S=${DEADLINE_S:-}
MIN_STEP_S=${MIN_STEP_S:-30}
ARCHIVE=${ARCHIVE:-}
if [ -n "$ARCHIVE" ]; then  # packed however the script ends
    trap 'tar czf "$ARCHIVE" -C "$(dirname "$OUT_DIR")" "$(basename "$OUT_DIR")" && echo "archived in $ARCHIVE"' EXIT
fi

commit=${RELAYGR_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
if [ -z "$gpu" ]; then
    echo "run_gpu.sh: no NVIDIA GPU visible (nvidia-smi found none); this script is for a CUDA machine" >&2
    exit 2
fi
header="device: ${gpu} | date: $(date -u +%F) | commit: ${commit}"
failed=()
skipped=()

STEPS=${STEPS:-env tests-gpu kernels-d64 kernels-d128 kernels-d256 kernels kernels-splits kernels-split-dtype kernels-vsplits kernels-vsplits-rank tests-hopper kernels-hopper kernels-hopper-softmax kernels-hopper-rank rank-hopper ptxas kernels-fp8 kernels-int8 kv8-probe tests-kv8 sanitize-kv8 sync host rank rank-compile profile profile-graphs profile-graphs-hopper ncu ncu-hopper ncu-kernel rank-small tiers slo slo-graphs tests-cuda kernels-persistent}
# not in the default list (long): STEPS="slo-seeds" bash benchmarks/run_gpu.sh "$OUT"

declare -A STEP_CMD STEP_LIMIT
step() {  # step NAME TIMEOUT_S COMMAND...: define a step (run later, in the order STEPS names them)
    local name=$1 limit=$2
    shift 2
    printf -v "STEP_CMD[$name]" '%q ' "$@"
    STEP_LIMIT[$name]=$limit
}

# run_step NAME: run it under its limit (cut to DEADLINE_S), tee to OUT_DIR/NAME.txt under a header. A step past its
# limit gets SIGINT (then SIGKILL 30 s later), so pytest prints the failures it has seen and a benchmark its traceback.
run_step() {
    local name=$1 limit=${STEP_LIMIT[$1]} cut=""
    if [ -n "$DEADLINE_S" ]; then
        local left=$(( DEADLINE_S - SECONDS ))
        if [ "$left" -lt "$MIN_STEP_S" ]; then
            echo "== ${name}: not run (${left} s left before DEADLINE_S=${DEADLINE_S})"
            printf '%s\t-\tnot run\n' "$name" >> "${OUT_DIR}/steps.tsv"
            skipped+=("$name")
            return 0
        fi
        if [ "$left" -lt "$limit" ]; then limit=$left; cut=" (cut to the deadline)"; fi
    fi
    echo "== ${name} (limit ${limit} s${cut}): ${STEP_CMD[$name]}"
    local t0=$SECONDS
    { echo "# ${STEP_CMD[$name]}| ${header}"; eval "timeout -s INT -k 30 ${limit} ${STEP_CMD[$name]}" 2>&1; } | tee "${OUT_DIR}/${name}.txt"
    local rc=${PIPESTATUS[0]}
    local took=$(( SECONDS - t0 ))
    echo "# ${name}: ${took} s, exit ${rc}${cut}" | tee -a "${OUT_DIR}/${name}.txt"
    printf '%s\t%s\t%s\n' "$name" "$took" "$rc" >> "${OUT_DIR}/steps.tsv"
    [ "$rc" -eq 0 ] || failed+=("${name} (exit ${rc}${cut})")
}

# (and the ptxas that assembles sm_90 code: Triton's own, or TRITON_PTXAS_PATH's where set, see the header)
step env 60 bash -c "$PY -m relaygr_engine.cli info; nvidia-smi; $PY -c 'import torch, triton; print(\"torch\", torch.__version__, \"triton\", triton.__version__)'; \
    $PY -c 'from triton.backends.nvidia import compiler as c; print(\"ptxas for sm_90:\", c.get_ptxas(90).path, c.get_ptxas_version(90))'"
# pytest-xdist where installed: the CUDA tests' time is mostly Triton compiling each autotuned config, which
# parallelises over the CPU cores (the GPU work is small).
xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
step tests-gpu 540 $PY -m pytest -q -rfEs ${xdist} -m gpu python_tests -p no:cacheprovider
# The kernel first: its RESULT has matmul_fraction_long_{softmax,hstu} beside the matmul rate of the same run. Split
# by head dim (each part compiles and autotunes its own variants: pointer and TMA page reads, 4 and 8 warps), so each
# fits a time-limited call; `kernels` joins them (no GPU work: it can run anywhere on the parts' JSON files).
for d in 64 128 256; do
    step "kernels-d${d}" 600 $PY -m relaygr_engine.cli bench kernels --head-dims "${d}" --json "${OUT_DIR}/kernels-d${d}.json"
done
step kernels 60 bash -c "$PY -m relaygr_engine.cli bench kernels --summarize \"${OUT_DIR}\"/kernels-d*.json \
    --json \"${OUT_DIR}/kernels.json\""
# One layer of a ranking at NVIDIA's shape (1 user, 128 new rows + 256 candidates over 3968 cached keys, 4 x 256):
# the launcher's split count (auto) beside fixed ones, the two kinds of tile launched on two streams at once (auto)
# and one after the other (no), each a CUDA-graph replay. (Run 2, one stream: 1 split 0.290 ms, 31 splits 0.095.)
# 11 and 22 fill whole waves of 132 SMs at one and two programs per SM (12 tile-head pairs); split counts are
# runtime arguments, so the values compile nothing new.
step kernels-splits 420 $PY -m relaygr_engine.cli bench kernels --modes hstu --shape B=1,P=3968,n=128,C=256,H=4,D=256 \
    --splits auto,7,9,11,13,15,22 --concurrent-tiles auto,no --json "${OUT_DIR}/kernels-splits.json"
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
# The warp-specialised sm_90 kernel for tiles' full cached blocks, HSTU and softmax (relaygr_engine/kernels/_hopper.py,
# Gluon; opt-in: faster on the long HSTU shapes, slower in a ranking): first whether it is right (its CUDA tests:
# against its torch twin, then the reference within bf16 tolerance, eagerly and in a graph), then beside the
# portable kernel in one run: the long head-dim-256 HSTU shapes (matmul_fraction_long_hstu_hopper beside
# matmul_fraction_long_hstu), one ranking layer at NVIDIA's shape, the softmax shapes at every head dim
# (matmul_fraction_long_softmax_hopper); a whole ranking with it.
step tests-hopper-twin 150 $PY -m pytest -q -rfEs -m gpu python_tests/test_hopper.py -k twin -p no:cacheprovider
step tests-hopper 330 $PY -m pytest -q -rfEs -m gpu python_tests/test_hopper.py -p no:cacheprovider
step kernels-hopper 420 $PY -m relaygr_engine.cli bench kernels --modes hstu --head-dims 256 --hopper-kernel no,yes \
    --json "${OUT_DIR}/kernels-hopper.json"
step kernels-hopper-softmax 500 $PY -m relaygr_engine.cli bench kernels --modes softmax --hopper-kernel no,yes \
    --json "${OUT_DIR}/kernels-hopper-softmax.json"
step kernels-hopper-rank 240 $PY -m relaygr_engine.cli bench kernels --modes hstu \
    --shape B=1,P=3968,n=128,C=256,H=4,D=256 --hopper-kernel no,yes --splits auto,11,16 \
    --json "${OUT_DIR}/kernels-hopper-rank.json"
step rank-hopper 300 env RELAYGR_HOPPER_KERNEL=1 $PY -m relaygr_engine.cli bench rank --device cuda \
    --model nvidia-hstu --page-size 64 --lengths 4096 --new 128 --candidates 256 --repeats 10 --cuda-graphs \
    --json "${OUT_DIR}/rank-hopper.json"
step ptxas 900 $PY -m benchmarks.tools.ptxas --defaults --json "${OUT_DIR}/ptxas.json"
# The 8-bit cache: the same shapes' pages in fp8 and int8 beside bf16 (kv8_speedup, kv8_err).
# (The kernel's 8-bit read is off on CUDA until it passes there, relaygr_engine.quant.kernel_runs: these switch it on.
# On 2026-11-26 its fp8 pages stopped with an illegal memory access; sanitize-kv8 says where.)
step kernels-fp8 900 env RELAYGR_KV8_KERNEL=1 $PY -m relaygr_engine.cli bench kernels --kv-dtype fp8_e4m3 \
    --json "${OUT_DIR}/kernels-fp8.json"
step kernels-int8 900 env RELAYGR_KV8_KERNEL=1 $PY -m relaygr_engine.cli bench kernels --kv-dtype int8 \
    --json "${OUT_DIR}/kernels-int8.json"
# The 8-bit CUDA tests with the kernel switched on, plainly, each format in its own process (a fault loses the
# process's CUDA context): whether int8 and fp8 pass, in seconds (under memcheck, below, int8's autotuning alone
# outlasted the 43 s a call had left on 2026-11-26). The kernel-read test is a strict expected failure on CUDA until
# it passes there: XFAIL is the known state; XPASS (which fails the step) means the 8-bit read is right.
step tests-kv8 240 bash -c "rc=0; for kd in int8 fp8_e4m3; do echo \"== \$kd\"; RELAYGR_KV8_KERNEL=1 \
    $PY -m pytest -q -rfEsxX -m gpu python_tests/test_kvquant.py -k \"cuda_8bit and \$kd\" -p no:cacheprovider \
    || rc=1; done; exit \$rc"
# The 8-bit read's probes (python -m benchmarks.tools.kv8_probe; benchmarks/results/static-kv8-2026-11-28): the CUDA test's batch
# launched ten ways, each in a process of its own (a fault loses only its process's CUDA context), all at once: the
# launcher's configs on bf16, int8 and fp8 pages; fixed configs: 3 stages (which ptxas 12.8 miscompiles for 8-bit
# candidate tiles: the autotuner drops them there) on bf16, int8 and fp8, split and whole; 2 and 1 stages;
# two warps (warp-level mma, no wgmma). A table (max error, mismatched fraction, fault) and a RESULT line
# (probe_<name>=ok|wrong|fault). With TRITON_PTXAS_PATH set for the call (see above), the same with that ptxas.
step kv8-probe 90 env RELAYGR_COMPILE_WORKERS=2 $PY -m benchmarks.tools.kv8_probe --jobs 10 --timeout 80 \
    --json "${OUT_DIR}/kv8-probe.json"
# The 8-bit CUDA tests with the kernel switched on, under compute-sanitizer's memcheck: the kernel, the access and
# the address of the first faults (serial compiles: one process, no worker threads launching), each format in its
# own process (a fault loses the process's CUDA context); the autotuner names each config before timing it
# (TRITON_PRINT_AUTOTUNING, pytest -s), so the last one named before a fault is the one that faulted. On 2026-11-26
# fp8 faulted at the P.V wgmma of HSTU's candidate tiles (gpu-h100-2026-11-26b/README.md); int8 had not run.
step sanitize-kv8 300 bash -c "command -v compute-sanitizer >/dev/null || { echo 'compute-sanitizer not found'; \
    exit 0; }; rc=0; for kd in int8 fp8_e4m3; do echo \"== \$kd\"; RELAYGR_KV8_KERNEL=1 RELAYGR_COMPILE_WORKERS=0 \
    TRITON_PRINT_AUTOTUNING=1 compute-sanitizer --tool memcheck --print-limit 12 $PY -m pytest -q -s -rs -m gpu \
    python_tests/test_kvquant.py -k \"cuda_8bit and \$kd\" -p no:cacheprovider || rc=1; done; exit \$rc"
step sync 120 $PY benchmarks/tools/sync_audit.py
# (RELAYGR_AUTOTUNE_FILE: the configs the autotuner keeps at this shape saved as a file of choices, which a serving
# process on this GPU and Triton can load instead of tuning: relaygr_engine/kernels/_autotune_store.py. This step only: the other
# steps tune as before.)
step rank 300 env RELAYGR_AUTOTUNE_FILE="${OUT_DIR}/autotune-rank.json" $PY -m relaygr_engine.cli bench rank \
    --device cuda --model nvidia-hstu --page-size 64 --lengths 4096 --new 128 --candidates 256 --repeats 10 \
    --cuda-graphs --json "${OUT_DIR}/rank.json"
# The engine's host work in a graphed cached ranking at the shape of rank, the replay stubbed (this machine's CPU; a
# ranking's latency is this, then the graph launch and the GPU work), and where it goes (each step's time).
step host 180 $PY -m relaygr_engine.cli bench host --device cuda --json "${OUT_DIR}/host.json"
# The same with the whole model compiled (torch.compile) on every path: fewer, fused kernels per graph.
step rank-compile 420 $PY -m relaygr_engine.cli bench rank --device cuda --model nvidia-hstu \
    --page-size 64 --lengths 4096 --new 128 --candidates 256 --repeats 10 --cuda-graphs --compile \
    --json "${OUT_DIR}/rank-compile.json"
step profile 300 $PY benchmarks/tools/profile_rank.py
step profile-graphs 300 $PY benchmarks/tools/profile_rank.py --cuda-graphs --interleave
# The same ranking on the sm_90 kernel: on 2026-11-26 it made a graphed ranking 0.35 ms slower (1.65 vs 1.30 ms)
# where one layer alone was 4 us slower (0.062 vs 0.058 ms): which of its kernels take the rest.
step profile-graphs-hopper 300 env RELAYGR_HOPPER_KERNEL=1 $PY benchmarks/tools/profile_rank.py --cuda-graphs --interleave
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
    $PY benchmarks/tools/profile_rank.py --cuda-profiler-window"
# The same for a ranking on the sm_90 Hopper kernel (RELAYGR_HOPPER_KERNEL=1): its launches and the portable
# kernel's SKIP_FULL share, what bounds them now.
step ncu-hopper 300 bash -c "command -v ncu >/dev/null || { echo 'ncu not found: step skipped'; exit 0; }; \
    RELAYGR_HOPPER_KERNEL=1 ncu --profile-from-start off --kernel-name 'regex:hopper_kernel|prefix_attention' \
    --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
    --section Occupancy --section WarpStateStats --section SchedulerStats \
    $PY benchmarks/tools/profile_rank.py --cuda-profiler-window"
# The same sections for the long HSTU shape of bench kernels at head dim 256 (4 users x 16384 cached keys, 1056 rows
# each): whether the kernel is bound by memory (K/V re-read by the candidate tiles of a user) or by issue; and
# SourceCounters: the SASS lines where warps stall most (the key loop's waits on its copies, its MMAs, its barriers).
step ncu-kernel 300 bash -c "command -v ncu >/dev/null || { echo 'ncu not found: step skipped'; exit 0; }; \
    ncu --profile-from-start off --kernel-name regex:prefix_attention --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section SourceCounters \
    $PY benchmarks/tools/profile_kernel.py"
step rank-small 300 $PY -m relaygr_engine.cli bench rank --device cuda --json "${OUT_DIR}/rank-small.json"
# DRAM reload at NVIDIA's model size (8 layers, 4 x 256, bf16): 32 MiB of KV per 1024 tokens; a ranking's DRAM hit
# copied serially vs layer-wise (layer l+1 on a side stream while layer l computes), each against the same
# ranking's HBM hit (dram_layer_vs_hbm_L8192: issue 26's goal, <= 1.3).
step tiers 600 $PY -m relaygr_engine.cli bench tiers --device cuda --model nvidia-hstu --page-size 64 \
    --lengths 1024,4096,8192,16384 --json "${OUT_DIR}/tiers.json"
# Issue 26's goal alone (one length: minutes less where device time is short).
step tiers-8k 300 $PY -m relaygr_engine.cli bench tiers --device cuda --model nvidia-hstu --page-size 64 \
    --lengths 8192 --json "${OUT_DIR}/tiers-8k.json"
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
# --resume: a seed cut short by the call's deadline keeps every point it measured (slo-seeds/seedN/points.jsonl,
# written as each finishes); copy its folder back in the same way and the next call serves only the points left.
# The three seeds at NVIDIA's shape in one call: --budget-s 330 plans them to end within 330 s of wall time (the
# calibration, compilation and graph capture paid once for all seeds), the install before it; the seeds' reports
# and the summary are left in slo-gpu/, ready to commit, with the autotune choices (autotune.json: a later call
# with the folder copied back reuses them and --resume its points).
step slo-gpu 560 env RELAYGR_AUTOTUNE_FILE="${OUT_DIR}/slo-gpu/autotune.json" $PY -m relaygr_engine.cli bench slo \
    --device cuda --model nvidia-hstu --seeds 0,1,2 --budget-s 330 --no-progress --resume --out "${OUT_DIR}/slo-gpu"
SLO_SEEDS=${SLO_SEEDS:-0,1,2}
SLO_ARGS=${SLO_ARGS:-}
step slo-seeds 7200 $PY -m relaygr_engine.cli bench slo --device cuda --model nvidia-hstu --seeds "${SLO_SEEDS}" \
    ${SLO_ARGS} --no-progress --resume --out "${OUT_DIR}/slo-seeds"
# The whole suite: on a CUDA machine the interpreter tests skip and the CUDA ones (marked gpu) run. No network there:
# the packaging tests (a fresh virtual environment) are left out.
step tests-cuda 900 $PY -m pytest -q -rfEs ${xdist} --durations=15 -m "not packaging" python_tests -p no:cacheprovider
step kernels-persistent 600 $PY -m relaygr_engine.cli bench kernels --persistent --json "${OUT_DIR}/kernels-persistent.json"

for name in $STEPS; do  # every name known before anything runs (a typo would cost a device call)
    if [ -z "${STEP_LIMIT[$name]+set}" ]; then
        echo "run_gpu.sh: unknown step '${name}' in STEPS; steps: ${!STEP_LIMIT[*]}" >&2
        exit 2
    fi
done
$PY -m pip install -q --no-build-isolation --no-deps -e . || { echo "install failed" >&2; exit 1; }
for name in $STEPS; do
    run_step "$name"
done

echo "results in ${OUT_DIR} (seconds per step: ${OUT_DIR}/steps.tsv)"
if [ ${#skipped[@]} -gt 0 ]; then
    echo "not run (deadline): ${skipped[*]}"
fi
if [ ${#failed[@]} -gt 0 ]; then
    printf 'failed: %s\n' "${failed[@]}"
    exit 1
fi
