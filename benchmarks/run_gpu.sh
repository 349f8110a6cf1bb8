#!/usr/bin/env bash
# Everything a CUDA machine should check, in one command: the CUDA tests, then the kernel benchmarks against their
# goals, the static ptxas report with this machine's Triton, and the engine-level benchmarks on CUDA.
#
#   bash benchmarks/run_gpu.sh [OUT_DIR]        (default: benchmarks/results/gpu-<date>)
#   STEPS="rank kernels-splits" bash benchmarks/run_gpu.sh "$OUT"     (a subset, run in the order STEPS names them)
#
# Environment: STEPS (which steps, in that order; an unknown name stops the script before anything runs);
# DEADLINE_S (seconds from the script's start, the install included, after which no step starts: a step starts only
# with MIN_STEP_S, default 30, left, and its own limit is cut to what is left, so a time-limited call returns what
# it finished); ARCHIVE (a .tgz path: OUT_DIR packed into it when the script ends, for a runner that returns few
# files); RELAYGR_COMMIT (the commit named in every header, else `git rev-parse`). OUT_DIR/steps.tsv lists each
# step's seconds and exit status (or "not run"), so later calls can be sized from it.
#
# A lent GPU session may have 15 device minutes in all, the machine's start included, and a call returns at most 8
# files: one call, its timeout_s about 560, of
#   RELAYGR_COMMIT=<sha> DEADLINE_S=480 ARCHIVE=$OUT/gpu.tgz STEPS="..." bash benchmarks/run_gpu.sh /tmp/gpu-run
# with, in order of what is least known and most asked (as of 2026-11-27, after five sessions' runs:
# benchmarks/results/gpu-h100-2026-11-2{6,6b,7}/ and gpu-h200-2026-11-26{,b}/; the first steps compile the kernels'
# variants for the later ones, which find them in Triton's cache), calls back to back (a warm machine is given
# back 30 s after a call: have the second command ready):
#   0. STEPS="kv8-probe tests-kv8" (90 + 240 s; the 8-bit read after the static finding of 2026-11-28,
#      benchmarks/results/static-kv8-2026-11-28/: the probes say which hypothesis holds, the tests whether the pruned
#      configs pass; then again with TRITON_PTXAS_PATH at the CUDA 13 ptxas, below, into another OUT_DIR)
#   1. one seed at a time: STEPS=slo-seeds SLO_SEEDS=<n> SLO_ARGS=--quick DEADLINE_S=<what is left> (never run
#      at this shape: its length is unknown; its first try, 2026-11-27, spent its 200 s in the latency calibration,
#      which then ran the torch reference and now times the baseline's graphed ranking; a seed cut short resumes in
#      a later call from its points.jsonl, its folder copied back into OUT_DIR/slo-seeds first; the calibration
#      itself must finish within one call)
#   2. STEPS="ncu-kernel profile-graphs kernels-hopper-softmax"
#   3. STEPS="kernels-fp8 kernels-int8 kernels-vsplits-rank rank-compile tiers sync kernels-vsplits"
# A CUDA 13 ptxas for Triton 3.6 (whose wheel assembles sm_90 code with ptxas 12.8.93; Triton 3.9's with 13.4.59;
# public reports tie Hopper wgmma faults of our kind to ptxas before CUDA 13; tried on 2026-11-27: the kernel's
# 8-bit read no longer faults with 13.4 but its results are wrong, benchmarks/results/gpu-h100-2026-11-27/): copy Triton 3.9's
# `triton/backends/nvidia/bin/ptxas-blackwell` (52 MB) into an ignored folder of the checkout, e.g. `.carry/ptxas`
# (`echo /.carry/ >> .git/info/exclude`), name `.carry` in the device call's carry, and prefix the command with
# TRITON_PTXAS_PATH=$PWD/.carry/ptxas (Triton 3.6-3.8 read it for sm_90; 3.9 reads TRITON_PTXAS_BLACKWELL_PATH and
# already uses 13.4; the env step prints which ptxas assembles sm_90 code).
# Done on 2026-11-26 (rerun after a change to what they measure): tests-hopper-twin kernels-hopper-rank rank-hopper
# rank host tests-hopper profile-graphs kernels-splits tiers-8k kernels-hopper kernels-split-dtype; in the second
# run tests-gpu sanitize-kv8 kernels-d64 kernels-d128 kernels-d256 ncu profile-graphs-hopper; in the third (H200)
# tests-hopper-twin kernels-hopper-rank rank tests-gpu rank-hopper (tests-cuda and sanitize-kv8 cut); in the fourth
# (H200) tests-cuda (all pass), tests-kv8 (int8 and fp8 fault), kernels-hopper; in the fifth (H100, 2026-11-27)
# kernels-rule-d256 kernels-rule-d128 kernels-rule-d64 kernels-rule (the fewest-waves rule 1.16x the former), and
# with TRITON_PTXAS_PATH at a CUDA 13 ptxas: tests-kv8 (no fault: wrong results), rank.
# (ptxas: the static report, done on any machine with the wheel's ptxas.)
# `kernels` (and `kernels-rule`) only join the parts' JSON that are there (no GPU work): run them afterwards on any
# machine, with the parts' files in OUT.
#
# Steps: env tests-gpu kernels-d64 kernels-d128 kernels-d256 kernels kernels-rule-d64 kernels-rule-d128
# kernels-rule-d256 kernels-rule kernels-splits kernels-split-dtype kernels-vsplits
# kernels-vsplits-rank tests-hopper-twin tests-hopper kernels-hopper kernels-hopper-softmax kernels-hopper-rank
# rank-hopper ptxas kernels-fp8 kernels-int8 kv8-probe tests-kv8 sanitize-kv8 sync host rank rank-compile profile
# profile-graphs
# profile-graphs-hopper ncu ncu-hopper
# ncu-kernel rank-small tiers tiers-8k slo slo-graphs tests-cuda kernels-persistent (all but tiers-8k and tests-hopper-twin, a
# part of tests-hopper, by default;
# about 20-30 minutes on an H100, most of it Triton compiling and autotuning), and slo-seeds (only when named in STEPS:
# the SLO benchmark at NVIDIA's HSTU shape and production lengths over three seeds, an hour or more). tests-gpu runs the CUDA tests alone
# (minutes); tests-cuda the whole suite (the interpreter tests skip on a CUDA machine). rank is NVIDIA's public HSTU
# inference shape (8 layers, 4 heads x 256, bf16, 4096 tokens of which 3968 cached, 256 candidates).
# Needs torch with CUDA, triton, pybind11, cmake and ninja already installed: no network is used (the package is
# installed with --no-build-isolation --no-deps). Each step writes its output to OUT_DIR as soon as it finishes, with
# a header naming the device, date and commit, so a run cut short keeps what
# it finished. Steps that fail are listed at the end; the script exits non-zero if any did.
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

STEPS=${STEPS:-env tests-gpu kernels-d64 kernels-d128 kernels-d256 kernels kernels-rule-d64 kernels-rule-d128 kernels-rule-d256 kernels-rule kernels-splits kernels-split-dtype kernels-vsplits kernels-vsplits-rank tests-hopper kernels-hopper kernels-hopper-softmax kernels-hopper-rank rank-hopper ptxas kernels-fp8 kernels-int8 kv8-probe tests-kv8 sanitize-kv8 sync host rank rank-compile profile profile-graphs profile-graphs-hopper ncu ncu-hopper ncu-kernel rank-small tiers slo slo-graphs tests-cuda kernels-persistent}
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
# The split count's rule (kernels/_split.py, least_waves: the fewest waves of programs, 2026-11-27) beside the rule it
# replaced (fill: about two programs per SM, none once the tiles make a wave), every shape under both in one run, by
# head dim as above (the fill rows time the kernel alone, beside the matmul rate; their baselines are the auto
# rows'): matmul_fraction_long_{mode} (the launcher's rule) beside matmul_fraction_long_{mode}_fill,
# geomean_ms_split_{auto,fill}. (Split counts are runtime arguments: no new binary, but a split launch is its own
# autotuned variant where the other rule does not split.)
for d in 64 128 256; do
    step "kernels-rule-d${d}" 600 $PY -m relaygr_engine.cli bench kernels --head-dims "${d}" --splits auto,fill \
        --json "${OUT_DIR}/kernels-rule-d${d}.json"
done
step kernels-rule 60 bash -c "$PY -m relaygr_engine.cli bench kernels --summarize \
    \"${OUT_DIR}\"/kernels-rule-d*.json --json \"${OUT_DIR}/kernels-rule.json\""
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
# The warp-specialised sm_90 kernel for tiles' full cached blocks, HSTU and softmax (kernels/_hopper.py, Gluon;
# opt-in; first run 2026-11-26: right, not faster; its HSTU loop overlapped in FlashAttention-3's order on request
# (right on an H200, 14% slower than the sequential default), `--hopper-overlap auto,yes` timing the two in one run): first whether it is right (its CUDA tests: against its torch twin, then the
# reference within bf16 tolerance, eagerly and in a graph), then beside the portable kernel in one run: the long
# head-dim-256 HSTU shapes (matmul_fraction_long_hstu_hopper beside matmul_fraction_long_hstu), one ranking layer at
# NVIDIA's shape, the softmax shapes at every head dim (matmul_fraction_long_softmax_hopper); a whole ranking with it.
step tests-hopper-twin 150 $PY -m pytest -q -rfEs -m gpu python_tests/test_hopper.py -k twin -p no:cacheprovider
step tests-hopper 330 $PY -m pytest -q -rfEs -m gpu python_tests/test_hopper.py -p no:cacheprovider
step kernels-hopper 420 $PY -m relaygr_engine.cli bench kernels --modes hstu --head-dims 256 --hopper-kernel no,yes \
    --hopper-overlap auto,yes \
    --json "${OUT_DIR}/kernels-hopper.json"
step kernels-hopper-softmax 500 $PY -m relaygr_engine.cli bench kernels --modes softmax --hopper-kernel no,yes \
    --json "${OUT_DIR}/kernels-hopper-softmax.json"
step kernels-hopper-rank 240 $PY -m relaygr_engine.cli bench kernels --modes hstu \
    --shape B=1,P=3968,n=128,C=256,H=4,D=256 --hopper-kernel no,yes --hopper-overlap auto,yes --splits auto,11,16 \
    --json "${OUT_DIR}/kernels-hopper-rank.json"
step rank-hopper 300 env RELAYGR_HOPPER_KERNEL=1 $PY -m relaygr_engine.cli bench rank --device cuda \
    --model nvidia-hstu --page-size 64 --lengths 4096 --new 128 --candidates 256 --repeats 10 --cuda-graphs \
    --json "${OUT_DIR}/rank-hopper.json"
step ptxas 900 $PY -m relaygr_engine.cli bench ptxas --defaults --json "${OUT_DIR}/ptxas.json"
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
# The 8-bit read's probes (relaygr bench kv8_probe; benchmarks/results/static-kv8-2026-11-28): the CUDA test's batch
# launched ten ways, each in a process of its own (a fault loses only its process's CUDA context), all at once: the
# launcher's configs on bf16, int8 and fp8 pages; fixed configs: 3 stages (which ptxas 12.8 miscompiles for 8-bit
# candidate tiles: the autotuner drops them there) on bf16, int8 and fp8, split and whole; 2 and 1 stages;
# two warps (warp-level mma, no wgmma). A table (max error, mismatched fraction, fault) and a RESULT line
# (probe_<name>=ok|wrong|fault). With TRITON_PTXAS_PATH set for the call (see above), the same with that ptxas.
step kv8-probe 90 env RELAYGR_COMPILE_WORKERS=2 $PY -m relaygr_engine.cli bench kv8_probe --jobs 10 --timeout 80 \
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
step sync 120 $PY benchmarks/sync_audit.py
# (RELAYGR_AUTOTUNE_FILE: the configs the autotuner keeps at this shape saved as a file of choices, which a serving
# process on this GPU and Triton can load instead of tuning: kernels/_autotune_store.py. This step only: the other
# steps tune as before.)
step rank 300 env RELAYGR_AUTOTUNE_FILE="${OUT_DIR}/autotune-rank.json" $PY -m relaygr_engine.cli bench rank \
    --device cuda --model nvidia-hstu --page-size 64 --lengths 4096 --new 128 --candidates 256 --repeats 10 \
    --cuda-graphs --json "${OUT_DIR}/rank.json"
# The engine's host work in a graphed cached ranking at the shape of rank, the replay stubbed (this machine's CPU; a
# ranking's latency is this, then the graph launch and the GPU work), and where it goes (--phases).
step host 180 $PY benchmarks/host_work.py --device cuda --phases
# The same with the whole model compiled (torch.compile) on every path: fewer, fused kernels per graph.
step rank-compile 420 $PY -m relaygr_engine.cli bench rank --device cuda --model nvidia-hstu \
    --page-size 64 --lengths 4096 --new 128 --candidates 256 --repeats 10 --cuda-graphs --compile \
    --json "${OUT_DIR}/rank-compile.json"
step profile 300 $PY benchmarks/profile_rank.py
step profile-graphs 300 $PY benchmarks/profile_rank.py --cuda-graphs --interleave
# The same ranking on the sm_90 kernel: on 2026-11-26 it made a graphed ranking 0.35 ms slower (1.65 vs 1.30 ms)
# where one layer alone was 4 us slower (0.062 vs 0.058 ms): which of its kernels take the rest.
step profile-graphs-hopper 300 env RELAYGR_HOPPER_KERNEL=1 $PY benchmarks/profile_rank.py --cuda-graphs --interleave
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
# The same for a ranking on the sm_90 Hopper kernel (RELAYGR_HOPPER_KERNEL=1): its launches and the portable
# kernel's SKIP_FULL share, what bounds them now.
step ncu-hopper 300 bash -c "command -v ncu >/dev/null || { echo 'ncu not found: step skipped'; exit 0; }; \
    RELAYGR_HOPPER_KERNEL=1 ncu --profile-from-start off --kernel-name 'regex:hopper_kernel|prefix_attention' \
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
