#!/usr/bin/env bash
# The GPU check of issue 12, run on the GPU machine from the repository root with `.carry`
# carried (scripts/gpu-check/pack.sh makes it): a smoke section of under 30 s (which library
# files were loaded, one fp32 step of each model against the CPU, one captured and replayed
# step, one NCCL step at world size 1), written to the report at once, then the GPU tests from
# the carried test binaries,
# then Tandem's `bench step --device cuda` beside PyTorch's best setups, then time to accuracy
# (Tandem `train` against bench/pytorch/time_to_accuracy.py, same data and recipe, several
# seeds), then the torch.compile rows. Writes $OUT/report.md (also printed), $OUT/results.tsv
# and $OUT/log.txt (every command's full output). Every step has a timeout and the whole run
# a budget: a step that no longer fits is skipped with a line saying so. A step that fails is
# reported with its error and the run goes on.
#
# usage: scripts/gpu-check/run.sh [--dry-run] [--budget SECONDS] [--seeds N] [--only SECTIONS]
#   --dry-run      on a machine without a GPU: tiny sizes, PyTorch on the CPU, Tandem on
#                  $GPU_CHECK_TANDEM_DEVICE (default cpu), to check the script itself
#   --budget S     seconds for the whole run (default 450; steps that do not fit are skipped)
#   --seeds N      time-to-accuracy seeds on each side (default 5)
#   --only LIST    comma-separated sections of smoke,tests,bench,tta,ddp,compile (default all)
# environment: PYTHON (default python3), OUT (default a temporary folder), GPU_CHECK_DRY_RUN=1,
#   GPU_CHECK_LIBRARY_DIRS (folders of CUDA libraries to prefer, colon-separated)
set -uo pipefail

BUDGET=450
SEEDS=5
ONLY=smoke,tests,bench,tta,ddp,compile
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
PYTHON=${PYTHON:-python3}
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --budget) BUDGET=$2; shift ;;
        --seeds) SEEDS=$2; shift ;;
        --only) ONLY=$2; shift ;;
        -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "run.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
[[ $BUDGET =~ ^[0-9]+$ && $SEEDS =~ ^[0-9]+$ && $SEEDS -ge 1 ]] || {
    echo "run.sh: --budget and --seeds take whole numbers, --seeds at least 1" >&2
    exit 2
}
for section in ${ONLY//,/ }; do
    [[ ,smoke,tests,bench,tta,ddp,compile, == *,$section,* ]] || {
        echo "run.sh: unknown section '$section' in --only (sections: smoke,tests,bench,tta,ddp,compile)" >&2
        exit 2
    }
done

START=$SECONDS
ROOT=$(pwd)
CARRY=$ROOT/.carry
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
OUT=${OUT:-$WORK/out}
mkdir -p "$OUT"
# The work folder goes at the end, unless the report is in it.
[[ $OUT == "$WORK"/* ]] || trap 'rm -rf "$WORK"' EXIT
LOG=$OUT/log.txt
REPORT=$OUT/report.md
RESULTS=$OUT/results.tsv
: >"$LOG"
printf 'row\twho\tvariant\ttrain\teval\tpeak_mb\tstatus\tnote\n' >"$RESULTS"

DATA_DIR=$CARRY/shared/data/cifar10
DATA=$DATA_DIR/cifar-10-batches-bin
EPOCHS=15
DDP_EPOCHS=5
BENCH_STEPS=100
if [ "$DRY_RUN" = 1 ]; then
    TANDEM_DEVICE=${GPU_CHECK_TANDEM_DEVICE:-cpu}
    TORCH_DEVICE=cpu
    EPOCHS=1
    DDP_EPOCHS=2
    BENCH_STEPS=1
    BATCH_OVERRIDE=8
else
    TANDEM_DEVICE=cuda
    TORCH_DEVICE=cuda
    BATCH_OVERRIDE=
    # A library or GPU the probe misses fails the tests instead of skipping them.
    export TANDEM_REQUIRE_NVRTC=1 TANDEM_REQUIRE_GPU=1
fi

section_on() { [[ ,$ONLY, == *,$1,* ]]; }
elapsed() { echo $((SECONDS - START)); }
remaining() { echo $((BUDGET - SECONDS + START)); }
say() { echo "[$(elapsed)s] $*" | tee -a "$LOG"; }
one_line() { tr '\t\n|' '  /' | sed 's/  */ /g; s/^ //; s/ $//' | cut -c1-300; }

# A failed step's error as one line for the report: its last line naming an error, else its
# last three lines.
error_of() {
    local line
    line=$(grep -i 'error' "$1" | tail -n 1)
    if [ -n "$line" ]; then one_line <<<"$line"; else grep -v '^\s*$' "$1" | tail -n 3 | one_line; fi
}

# run_step NAME LIMIT NEED COMMAND...: runs COMMAND with a timeout of LIMIT seconds (less when
# less of the budget is left), output in $WORK/NAME.out and the log; skipped when under NEED
# seconds of the budget are left. Sets STEP_STATUS (ok, failed, timeout, skipped), STEP_NOTE
# and STEP_WALL (seconds, with decimals).
run_step() {
    local name=$1 limit=$2 need=$3 left start_ns rc
    shift 3
    left=$(remaining)
    STEP_OUT=$WORK/$name.out
    : >"$STEP_OUT"
    STEP_WALL=0
    if [ "$left" -lt "$need" ]; then
        STEP_STATUS=skipped
        STEP_NOTE="${left}s of the ${BUDGET}s budget left, the step needs ${need}s"
        say "$name: skipped: $STEP_NOTE"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    printf '\n### %s (timeout %ss): %s\n' "$name" "$limit" "$*" >>"$LOG"
    start_ns=$(date +%s%N)
    timeout -k 5 "$limit" "$@" </dev/null >"$STEP_OUT" 2>&1
    rc=$?
    STEP_WALL=$(awk -v a="$start_ns" -v b="$(date +%s%N)" 'BEGIN { printf "%.2f", (b - a) / 1e9 }')
    cat "$STEP_OUT" >>"$LOG"
    case $rc in
        0) STEP_STATUS=ok; STEP_NOTE= ;;
        124 | 137) STEP_STATUS=timeout; STEP_NOTE="timed out after ${limit}s: $(error_of "$STEP_OUT")" ;;
        *) STEP_STATUS=failed; STEP_NOTE="exit $rc: $(error_of "$STEP_OUT")" ;;
    esac
    say "$name: $STEP_STATUS in ${STEP_WALL}s${STEP_NOTE:+ ($STEP_NOTE)}"
    [ "$rc" -eq 0 ]
}

# The value of `LABEL: X ...` in a step's output (the first match), or empty.
value_of() {
    awk -v label="$1: " 'index($0, label) == 1 { split(substr($0, length(label) + 1), rest, " "); print rest[1]; exit }' "$2"
}

record() { printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >>"$RESULTS"; }

record_bench() { # ROW WHO VARIANT
    record "$1" "$2" "$3" "$(value_of train "$STEP_OUT")" "$(value_of eval "$STEP_OUT")" \
        "$(value_of 'peak memory' "$STEP_OUT")" "$STEP_STATUS" "$STEP_NOTE"
}

# --- Setting up: binaries, CUDA libraries, shared data ------------------------------------
say "gpu-check: budget ${BUDGET}s, seeds $SEEDS, sections $ONLY, dry run $DRY_RUN, work $WORK, out $OUT"
[ -f "$CARRY/bin.tar.xz" ] || { echo "run.sh: no $CARRY/bin.tar.xz: run scripts/gpu-check/pack.sh first and carry .carry" >&2; exit 2; }
mkdir -p "$WORK/bin"
if ! tar -C "$WORK/bin" -xJf "$CARRY/bin.tar.xz" 2>>"$LOG"; then
    "$PYTHON" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        "$CARRY/bin.tar.xz" "$WORK/bin" || { echo "run.sh: cannot unpack $CARRY/bin.tar.xz" >&2; exit 2; }
fi
TANDEM=$WORK/bin/tandem
# The tandem crate's tests start the binary by the path cargo baked into them.
baked=$(awk -F'\t' '$1 == "tandem_path" { print $2 }' "$WORK/bin/manifest.tsv")
if [ -n "$baked" ] && [ -L "$baked" ]; then
    rm -f "$baked" # a link left by an earlier run on a warm machine
fi
if [ -n "$baked" ] && [ ! -e "$baked" ]; then
    mkdir -p "$(dirname "$baked")" && ln -s "$TANDEM" "$baked" && say "linked $baked -> $TANDEM"
elif [ -n "$baked" ] && ! cmp -s "$baked" "$TANDEM"; then
    say "warning: the tandem tests will run $baked, which is not the carried binary"
fi
export TANDEM_SHARED=$CARRY/shared
export TANDEM_PTX_CACHE=$WORK/ptx-cache

# CUDA libraries: every one from one place, PyTorch's pip packages (nvidia/*/lib) first, then
# the toolkit and the driver's folders for what they lack. library-path.sh links each library's
# files from the first folder that has it into one folder of aliases, which goes first in both
# TANDEM_CUDA_LIBRARY_PATH and LD_LIBRARY_PATH: cudarc's dlopen of a bare name (libcublas.so),
# a library's own dependencies by SONAME (libcublasLt.so.13) and the probe's preloads then all
# reach the same files, never the toolkit's copy of one beside the wheel's copy of another.
site=$(timeout 60 "$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
library_dirs=()
# GPU_CHECK_LIBRARY_DIRS (colon-separated) come first: e.g. the fake GPU's folder in a dry run.
IFS=':' read -r -a extra_dirs <<<"${GPU_CHECK_LIBRARY_DIRS:-}"
for dir in "${extra_dirs[@]}" "$site"/nvidia/*/lib /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    /usr/local/nvidia/lib64 /usr/local/nvidia/lib; do
    [ -d "$dir" ] && library_dirs+=("$dir")
done
aliases=$WORK/library-aliases
while IFS='=' read -r name value; do
    export "$name=$value"
done < <(bash "$ROOT/scripts/gpu-check/library-path.sh" "$aliases" "${library_dirs[@]}")
say "CUDA library folders: ${library_dirs[*]:-none found} (through the aliases in $aliases)"
# The NVRTC that compiles the kernels (its CUBIN must suit the driver's CUDA major version).
say "NVRTC: $(for dir in "${library_dirs[@]}"; do ls "$dir"/libnvrtc.so.* 2>/dev/null; done | head -n 2 | one_line)"
# An NCCL join or collective that fails then says why.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

if command -v nvidia-smi >/dev/null; then
    gpu=$(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1 | one_line)
else
    gpu="no nvidia-smi on this machine"
fi
torch_info=$(timeout 60 "$PYTHON" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, GPU available {torch.cuda.is_available()}")' 2>&1 | tail -n 1 | one_line)
say "GPU: $gpu"
say "PyTorch: $torch_info"
build=$(awk -F'\t' '$1 == "built" || $1 == "commit" { printf "%s %s; ", $1, $2 }' "$WORK/bin/manifest.tsv")

# The carried test binary of PACKAGE's TEST target.
test_binary() {
    awk -F'\t' -v package="$1" -v test="$2" '$1 == "test" && $2 == package && $3 == test { print $4 }' \
        "$WORK/bin/manifest.tsv"
}

report_header() {
    echo "# GPU check $(date -u '+%F %T UTC')"
    echo
    echo "- GPU: $gpu"
    echo "- PyTorch: $torch_info"
    echo "- Tandem: ${build}first line of bench step: ${DEVICE_LINE:-none}"
    echo "- budget ${BUDGET}s, used $(elapsed)s; seeds $SEEDS; sections $ONLY$([ "$DRY_RUN" = 1 ] && echo "; DRY RUN (no GPU: tiny sizes, PyTorch on the CPU, Tandem on $TANDEM_DEVICE)")"
}

smoke_report() {
    echo
    echo "## Smoke (the first seconds)"
    echo
    echo "| check | status | result |"
    echo "| --- | --- | --- |"
    printf '%s\n' "${smoke_rows[@]}"
    if [ -s "$WORK/smoke-libraries.txt" ]; then
        echo
        echo "CUDA libraries (the probe's choice, then every CUDA file mapped into the process), and the fp32 steps:"
        echo
        echo '```'
        cat "$WORK/smoke-libraries.txt"
        echo '```'
    fi
}

# --- Smoke: seconds that tell whether the rest can work -----------------------------------
smoke_rows=()
if section_on smoke; then
    # smoke_check NAME LIMIT PACKAGE TEST [FILTER]: one carried test binary (or one exact test
    # of it) as a row of the smoke table.
    smoke_check() {
        local file
        file=$(test_binary "$3" "$4")
        if [ -z "$file" ]; then
            STEP_OUT=/dev/null
            smoke_rows+=("| $1 | missing | no $3/$4 among the carried binaries |")
            return
        fi
        run_step "smoke-$1" "$2" 5 "$WORK/bin/$file" --nocapture --test-threads 1 ${5:+--exact "$5"}
        local summary
        summary=$(grep -h '^test result:' "$STEP_OUT" | tail -n 1 | sed 's/^test result: //; s/; finished in.*//' | one_line)
        smoke_rows+=("| $1 | $STEP_STATUS in ${STEP_WALL}s | ${summary:-none}${STEP_NOTE:+; $STEP_NOTE} |")
    }
    smoke_check libraries-and-fp32-steps 30 tandem-cuda gpu_smoke
    # --nocapture puts a test's first line after its `test NAME ... `: match anywhere.
    grep -ho '\(library\|mapped\|smoke\): .*' "$STEP_OUT" | sed 's/^smoke: /step: /' >"$WORK/smoke-libraries.txt"
    smoke_check captured-step 20 tandem-cuda gpu_executor graphed_steps_equal_eager_steps_bit_for_bit
    smoke_check nccl-world-1 20 tandem-cuda gpu_nccl a_world_of_one_through_nccl_leaves_every_bit_as_without_it
    smoke_check exact-sum-kernels 20 tandem-cuda gpu_kernels exact_sum_kernels_equal_tandem_dist_exact_bit_for_bit
    # In the report now: a call cut short later still brings these lines back.
    { report_header; smoke_report; echo; echo "(the run goes on; this report is rewritten at its end)"; } >"$REPORT"
    say "smoke: $(printf '%s ' "${smoke_rows[@]}" | one_line)"
fi

# --- Tests --------------------------------------------------------------------------------
test_rows=()
if section_on tests; then
    while IFS=$'\t' read -r kind package test file _; do
        [ "$kind" = test ] || continue
        # tandem-cuda's binaries run in-process on the GPU: 60 s each. The binary's tests that
        # run `tandem` children bound each child at 100-120 s themselves: the binary gets more,
        # so that their own message says which hung.
        limit=60
        [[ $package == tandem ]] && limit=120
        [[ $package == tandem && $test == gpu_* ]] && limit=240
        run_step "test-$package-$test" "$limit" 15 "$WORK/bin/$file" --nocapture
        summary=$(grep -h '^test result:' "$STEP_OUT" | tail -n 1 | sed 's/^test result: //; s/; finished in.*//' | one_line)
        skips=$(grep -c ': skipped' "$STEP_OUT")
        reason=$(grep -h ': skipped' "$STEP_OUT" | head -n 1 | sed 's/.*: skipped, //' | one_line)
        failing=$(grep -h '^test .* FAILED$' "$STEP_OUT" | awk '{ print $2 }' | paste -sd' ' | one_line)
        test_rows+=("| $package/$test | $STEP_STATUS | ${summary:-none} | $skips${reason:+: $reason} | ${failing:-${STEP_NOTE}} |")
    done <"$WORK/bin/manifest.tsv"
fi

# --- Throughput rows ----------------------------------------------------------------------
# One row of the issue's table a line: id | title | tandem flags | targets | PyTorch variants,
# each `name=flags`, `;`-separated; a variant whose name starts with `compile` runs in the
# compile section, last. Every PyTorch variant measures both train and eval unless its flags
# say `--mode`.
ROWS=(
    "r18-b128|ResNet-18, batch 128, train (tf32)|--model resnet18 --batch 128|train 1.2|eager=;eager-cl=--channels-last;graph=--cuda-graph;graph-cl=--channels-last --cuda-graph;compile-cl=--channels-last --compile reduce-overhead --mode train"
    "r18-b512-bf16|ResNet-18, batch 512, train and eval, bf16|--model resnet18 --batch 512 --precision bf16|train 1.0,eval 1.0|eager-cl-bf16=--channels-last --amp bf16;graph-cl-bf16=--channels-last --amp bf16 --cuda-graph;compile-cl-bf16=--channels-last --amp bf16 --compile default"
    "base-b256|seed-004 model, batch 256, train (tf32)|--model resnet-base --batch 256|train 1.2|eager=;eager-cl=--channels-last;graph=--cuda-graph;graph-cl=--channels-last --cuda-graph;eager-cl-deterministic=--channels-last --deterministic;compile-cl=--channels-last --compile reduce-overhead --mode train"
    "base-b1024|seed-004 model, batch 1024, train (tf32)|--model resnet-base --batch 1024|train 1.0|eager=;eager-cl=--channels-last;graph-cl=--channels-last --cuda-graph;compile-cl-bf16=--channels-last --amp bf16 --compile default --mode train"
)

# The rows where Tandem also runs with `--algorithms fastest` (the cost of determinism, beside
# PyTorch's `eager-cl-deterministic`).
DETERMINISM_ROWS="base-b256 r18-b128"

model_of() { awk '{ for (i = 1; i < NF; i++) if ($i == "--model") print $(i + 1) }' <<<"$1"; }
batch_of() { awk '{ for (i = 1; i < NF; i++) if ($i == "--batch") print $(i + 1) }' <<<"$1"; }

# torch_variant ROW TANDEM_FLAGS NAME FLAGS
torch_variant() {
    local model batch limit=60 need=20 flags
    model=$(model_of "$2")
    batch=${BATCH_OVERRIDE:-$(batch_of "$2")}
    read -r -a flags <<<"$4"
    if [[ $3 == compile* ]]; then
        limit=180
        need=60
    fi
    run_step "torch-$1-$3" "$limit" "$need" "$PYTHON" bench/pytorch/step.py "$model" \
        --device "$TORCH_DEVICE" --batch "$batch" --steps "$BENCH_STEPS" \
        ${BATCH_OVERRIDE:+--warmup 1} "${flags[@]}"
    record_bench "$1" pytorch "$3"
}

# for_each_variant ROW_LINE compile|plain: runs the row's PyTorch variants of that kind.
for_each_variant() {
    local id tandem variants variant is_compile
    IFS='|' read -r id _ tandem _ variants <<<"$1"
    IFS=';' read -r -a variants <<<"$variants"
    for variant in "${variants[@]}"; do
        is_compile=plain
        [[ $variant == compile* ]] && is_compile=compile
        [ "$is_compile" = "$2" ] && torch_variant "$id" "$tandem" "${variant%%=*}" "${variant#*=}"
    done
}

# A row's Tandem flags, with the dry run's batch size.
tandem_flags_of() {
    if [ -n "$BATCH_OVERRIDE" ]; then
        # shellcheck disable=SC2001
        sed "s/--batch [0-9]*/--batch $BATCH_OVERRIDE/" <<<"$1"
    else
        echo "$1"
    fi
}

if section_on bench; then
    for line in "${ROWS[@]}"; do
        IFS='|' read -r id _ tandem _ _ <<<"$line"
        read -r -a tandem_flags <<<"$(tandem_flags_of "$tandem")"
        run_step "tandem-$id" 120 20 "$TANDEM" bench step --device "$TANDEM_DEVICE" \
            --steps "$BENCH_STEPS" "${tandem_flags[@]}"
        # Whether the timed steps replayed a CUDA graph (`graphs: on; ...` or `graphs: off (why)`).
        [ "$STEP_STATUS" = ok ] && STEP_NOTE=$(grep -m1 '^graphs:' "$STEP_OUT" | one_line)
        record_bench "$id" tandem "bench step --device $TANDEM_DEVICE ${tandem_flags[*]}"
        DEVICE_LINE=${DEVICE_LINE:-$(grep -m1 '^device:' "$STEP_OUT" | one_line)}
        # The same steps eagerly: what capturing the whole step as a CUDA graph gains.
        run_step "tandem-$id-eager" 120 20 env TANDEM_CUDA_GRAPHS=0 "$TANDEM" bench step \
            --device "$TANDEM_DEVICE" --steps "$BENCH_STEPS" "${tandem_flags[@]}"
        record_bench "$id" tandem "bench step --device $TANDEM_DEVICE ${tandem_flags[*]} (TANDEM_CUDA_GRAPHS=0)"
        # What determinism costs: the fastest measured cuDNN algorithms instead.
        if [[ " $DETERMINISM_ROWS " == *" $id "* ]]; then
            run_step "tandem-$id-fastest" 120 20 "$TANDEM" bench step --device "$TANDEM_DEVICE" \
                --steps "$BENCH_STEPS" "${tandem_flags[@]}" --algorithms fastest
            record_bench "$id" tandem "bench step --device $TANDEM_DEVICE ${tandem_flags[*]} --algorithms fastest"
        fi
        for_each_variant "$line" plain
    done
fi

# --- Time to accuracy ---------------------------------------------------------------------
tta_rows=()
if section_on tta; then
    seeds=$(seq -s, 0 $((SEEDS - 1)))
    run_step torch-tta $((60 + 25 * SEEDS)) 60 "$PYTHON" bench/pytorch/time_to_accuracy.py \
        "$DATA" --device "$TORCH_DEVICE" --channels-last --epochs "$EPOCHS" --seeds "$seeds" \
        ${BATCH_OVERRIDE:+--warmup-epochs 0 --train-images 512}
    # `seed 3: 12.34 s for 15 epochs, test accuracy 0.5012`
    awk '$1 == "seed" && $2 ~ /^[0-9]+:$/ { printf "tta\tpytorch\tseed %s\t%s\t%s\t\tok\t\n", substr($2, 1, length($2) - 1), $3, $NF }' \
        "$STEP_OUT" >>"$RESULTS"
    warmup=$(value_of warm-up "$STEP_OUT")
    torch_summary=$(grep -m1 '^summary:' "$STEP_OUT" | sed 's/^summary: //')
    [ "$STEP_STATUS" = ok ] || torch_summary="$STEP_NOTE${torch_summary:+; $torch_summary}"
    tta_rows+=("| PyTorch eager channels_last, data on $TORCH_DEVICE (each seed from its fresh model to its last accuracy) | ${torch_summary:-no result} | ${warmup:+warm-up epoch $warmup s, not counted; }the process took ${STEP_WALL} s in all |")

    times=() accuracies=()
    for seed in $(seq 0 $((SEEDS - 1))); do
        run_dir=$WORK/tta/seed$seed
        run_step "tandem-tta-seed$seed" 150 30 "$TANDEM" train --device "$TANDEM_DEVICE" \
            --model resnet-base --data cifar10-bin --data-dir "$DATA_DIR" \
            --mean 0.485,0.456,0.406 --std 0.229,0.224,0.225 --epochs "$EPOCHS" --batch-size 256 \
            --optimizer sgd --momentum 0.9 --nesterov --lr 0.1 --weight-decay 5e-4 \
            --lr-schedule onecycle --seed "$seed" --log-every-steps 0 --output-dir "$run_dir"
        accuracy=$(tail -n 1 "$run_dir/metrics.jsonl" 2>/dev/null |
            "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["val_accuracy"])' 2>/dev/null)
        record tta tandem "seed $seed" "$STEP_WALL" "$accuracy" "" "$STEP_STATUS" "$STEP_NOTE"
        if [ "$STEP_STATUS" != ok ] || [ -z "$accuracy" ]; then
            [ "$STEP_STATUS" = ok ] && STEP_NOTE="no val_accuracy in $run_dir/metrics.jsonl"
            tta_rows+=("| Tandem train, seed $seed | $STEP_STATUS: $STEP_NOTE | remaining seeds not run |")
            break
        fi
        times+=("$STEP_WALL")
        accuracies+=("$accuracy")
    done
    if [ ${#times[@]} -gt 0 ]; then
        tandem_summary=$(paste <(printf '%s\n' "${times[@]}") <(printf '%s\n' "${accuracies[@]}") | awk '
            { t += $1; a += $2; if (NR == 1 || $1 < tmin) tmin = $1; if ($1 > tmax) tmax = $1
              if (NR == 1 || $2 < amin) amin = $2; if ($2 > amax) amax = $2 }
            END { printf "%d seeds, time mean %.2f s (min %.2f, max %.2f), test accuracy mean %.4f (min %.4f, max %.4f)",
                  NR, t / NR, tmin, tmax, a / NR, amin, amax }')
        tta_rows+=("| Tandem train (whole command, start to exit) | $tandem_summary | |")
    fi
fi

# --- Data-parallel overhead (issue 13) -----------------------------------------------------
# The same training four ways, images per second over the epochs after the first
# (metrics.jsonl): one process; under launch with NCCL at world size 1 (the whole DDP path:
# buckets, broadcasts; target within 5% of the first); two processes sharing the GPU on the
# ring (reported beside it, not a target: they share one card); and NCCL at world size 1 with
# CUDA graphs off (the graphed NCCL steps measured both ways; last, so the first skipped).
ddp_rows=()
if section_on ddp; then
    ddp_args=(--device "$TANDEM_DEVICE" --model resnet-base --data cifar10-bin --data-dir "$DATA_DIR"
        --epochs "$DDP_EPOCHS" --batch-size 256 --optimizer sgd --momentum 0.9 --lr 0.1
        --log-every-steps 0 --seed 0)
    for variant in one-process nccl-world-1 ring-2-processes nccl-world-1-eager; do
        dir=$WORK/ddp/$variant
        case $variant in
            one-process) run_step "ddp-$variant" 120 30 "$TANDEM" train "${ddp_args[@]}" --output-dir "$dir" ;;
            nccl-world-1) run_step "ddp-$variant" 120 30 "$TANDEM" launch --nproc-per-node 1 -- \
                train "${ddp_args[@]}" --backend nccl --output-dir "$dir" ;;
            ring-2-processes) run_step "ddp-$variant" 150 40 "$TANDEM" launch --nproc-per-node 2 -- \
                train "${ddp_args[@]}" --backend ring --output-dir "$dir" ;;
            nccl-world-1-eager) run_step "ddp-$variant" 120 30 env TANDEM_CUDA_GRAPHS=0 "$TANDEM" \
                launch --nproc-per-node 1 -- train "${ddp_args[@]}" --backend nccl --output-dir "$dir" ;;
        esac
        # The mean over the epochs after the first (which captures graphs and warms up).
        rate=$("$PYTHON" -c 'import json, sys
epochs = [json.loads(line)["images_per_second"] for line in open(sys.argv[1]) if line.strip()][1:]
print(round(sum(epochs) / len(epochs), 1))' "$dir/metrics.jsonl" 2>/dev/null)
        graphs=$(grep -m1 'CUDA graphs' "$STEP_OUT" | one_line)
        record ddp tandem "$variant" "$rate" "" "" "$STEP_STATUS" "${STEP_NOTE:-$graphs}"
        ddp_rows+=("| $variant | ${rate:-none} | $STEP_STATUS${STEP_NOTE:+: $STEP_NOTE} | ${graphs:-no graphs note} |")
    done
fi

# --- torch.compile rows (last: each compiles for a minute or more) ------------------------
if section_on compile; then
    for line in "${ROWS[@]}"; do
        for_each_variant "$line" compile
    done
fi

# --- Report -------------------------------------------------------------------------------
# ratio ROW COLUMN(train|eval): Tandem's figure (its first row: the default settings) over
# PyTorch's best in this run, and that best.
ratio() {
    awk -F'\t' -v row="$1" -v col="$2" '
        $1 == row { v = (col == "train") ? $4 : $5
                    if ($2 == "tandem") { if (!seen) { t = v; seen = 1 } }
                    else if (v != "" && v + 0 > best) { best = v + 0; name = $3 } }
        END { if (best == 0) print "no PyTorch figure"
              else if (t == "") printf "no Tandem figure (PyTorch best %.1f, %s)", best, name
              else printf "%.2fx (Tandem %.1f, PyTorch best %.1f, %s)", t / best, t, best, name }' "$RESULTS"
}

# Tandem's mean time over PyTorch's and the difference of mean accuracies, over the seeds each
# side finished.
tta_comparison() {
    awk -F'\t' '$1 == "tta" && $7 == "ok" && $5 != "" { n[$2]++; t[$2] += $4; a[$2] += $5 }
        END { if (!n["tandem"] || !n["pytorch"]) { print "no comparison (a side has no finished seed)"; exit }
              printf "time %.2fx (%.2f s vs %.2f s), accuracy %+.2f points (%.2f%% vs %.2f%%; %d vs %d seeds)",
                  (t["tandem"] / n["tandem"]) / (t["pytorch"] / n["pytorch"]), t["tandem"] / n["tandem"],
                  t["pytorch"] / n["pytorch"], 100 * (a["tandem"] / n["tandem"] - a["pytorch"] / n["pytorch"]),
                  100 * a["tandem"] / n["tandem"], 100 * a["pytorch"] / n["pytorch"], n["tandem"], n["pytorch"] }' "$RESULTS"
}

{
    report_header
    section_on smoke && smoke_report
    if section_on tests; then
        echo
        echo "## GPU tests (carried binaries, --nocapture)"
        echo
        echo "| binary | status | result | skipped (first reason) | failing / error |"
        echo "| --- | --- | --- | --- | --- |"
        printf '%s\n' "${test_rows[@]}"
    fi
    if section_on bench || section_on compile; then
        echo
        echo "## Images per second, same run (Tandem bench step vs bench/pytorch/step.py)"
        for line in "${ROWS[@]}"; do
            IFS='|' read -r id title _ targets _ <<<"$line"
            echo
            echo "### $title"
            echo
            echo "| who | setup | train | eval | peak MB | status |"
            echo "| --- | --- | --- | --- | --- | --- |"
            awk -F'\t' -v row="$id" '$1 == row { printf "| %s | %s | %s | %s | %s | %s%s |\n",
                $2, $3, $4, $5, $6, $7, ($8 == "" ? "" : ": " $8) }' "$RESULTS"
            IFS=',' read -r -a wanted <<<"$targets"
            for target in "${wanted[@]}"; do
                read -r column at_least <<<"$target"
                echo
                echo "Tandem / PyTorch's best, $column: $(ratio "$id" "$column") (target: at least ${at_least}x)"
            done
        done
    fi
    if section_on tta; then
        echo
        echo "## Time to accuracy: seed-004 recipe, $EPOCHS epochs, train data_batch_1 (10,000), test first 5,000 of test_batch"
        echo
        echo "| who | result | note |"
        echo "| --- | --- | --- |"
        printf '%s\n' "${tta_rows[@]}"
        echo
        echo "Tandem / PyTorch, same run: $(tta_comparison) (target: time at most 0.33x, mean accuracy within 0.5 points)"
    fi
    if section_on ddp; then
        echo
        echo "## Data-parallel overhead: seed-004 model, batch 256, $DDP_EPOCHS epochs, images/s over epochs 2 to $DDP_EPOCHS"
        echo
        echo "| run | images/s | status | CUDA graphs |"
        echo "| --- | --- | --- | --- |"
        printf '%s\n' "${ddp_rows[@]}"
        echo
        echo "NCCL at world size 1 / one process: $(awk -F'\t' '$1 == "ddp" && $4 != "" { r[$3] = $4 }
            END { if (r["one-process"] && r["nccl-world-1"]) printf "%.3f", r["nccl-world-1"] / r["one-process"]; else print "no figure" }' "$RESULTS") (target: at least 0.95)"
        echo "NCCL at world size 1, CUDA graphs on / off: $(awk -F'\t' '$1 == "ddp" && $4 != "" { r[$3] = $4 }
            END { if (r["nccl-world-1"] && r["nccl-world-1-eager"]) printf "%.3f", r["nccl-world-1"] / r["nccl-world-1-eager"]; else print "no figure" }' "$RESULTS")"
    fi
    skipped=$(grep -c ': skipped: ' "$LOG")
    echo
    echo "Steps skipped for the budget: $skipped$([ "$skipped" -gt 0 ] && echo " (rerun with --only SECTIONS)")."
} >"$REPORT"
cat "$REPORT"
