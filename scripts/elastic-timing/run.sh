#!/usr/bin/env bash
# Issue 35's timing targets of `tandem launch --keep-survivors`, measured on this machine from
# the sample trace (TANDEM_SAMPLE_TRACE: each committed step's `time`, on every worker):
#   kill   kill -9 of one of 4 workers -> first step committed at world size 3
#   stop   SIGSTOP of one of 4 workers -> first step committed at world size 3
#   join   kill -9 of one of 4 workers with --replace-lost -> first step committed at world
#          size 4 again (the replacement started, let in, given a member's state)
#   cost   steady-state step time of rank 0, --keep-survivors against without it
#   scale  W workers (default 32): launcher start -> first step, kill -9 of 8 -> first step at W-8
set -euo pipefail

usage="usage: $0 [--trials N] [--scale-trials N] [--scale-workers W] [--cost-steps N] [--cost-runs N] [--only kill,stop,join,cost,scale] [--tandem BINARY]"
here=$(dirname "$(realpath "$0")")
tandem=$here/../../target/release/tandem
[ -n "${CARGO_TARGET_DIR:-}" ] && tandem=$CARGO_TARGET_DIR/release/tandem
trials=20
scale_trials=3
scale_workers=32
cost_steps=200
cost_runs=2
only=kill,stop,join,cost,scale
while [ $# -gt 0 ]; do
    case $1 in
        --trials) trials=${2:?$usage}; shift 2 ;;
        --scale-trials) scale_trials=${2:?$usage}; shift 2 ;;
        --scale-workers) scale_workers=${2:?$usage}; shift 2 ;;
        --cost-steps) cost_steps=${2:?$usage}; shift 2 ;;
        --cost-runs) cost_runs=${2:?$usage}; shift 2 ;;
        --only) only=${2:?$usage}; shift 2 ;;
        --tandem) tandem=${2:?$usage}; shift 2 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "$0: unknown argument '$1'" >&2; echo "$usage" >&2; exit 2 ;;
    esac
done
(( scale_workers > 8 )) || { echo "$0: --scale-workers must be more than 8" >&2; exit 2; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/elastic-timing.XXXXXX")
job_pid=
# Each job is started with setsid: the launcher leads a process group that holds its workers.
stop_job() {
    if [ -n "$job_pid" ]; then
        kill -KILL -- "-$job_pid" 2>/dev/null || true
        wait "$job_pid" 2>/dev/null || true
        job_pid=
    fi
}
failed=0
# A failed measurement keeps the temporary folder (logs, traces) for a look.
cleanup() {
    stop_job
    if [ "$failed" = 1 ]; then
        echo "logs of the failed measurements kept in $tmp" >&2
    else
        rm -rf "$tmp"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# shellcheck source=common.sh
source "$here/common.sh"
require_tools


# One step of 4 samples per worker at 32 workers, one thread each.
tiny=(--model resnet-base --n-blocks 1,1,1 --n-channels 4,4,4 --bottlenecks none --data synthetic
    --synthetic-train 4096 --synthetic-test 64 --threads 1 --seed 5 --device cpu --log-every-steps 0
    --optimizer sgd --momentum 0.9 --lr 0.05)

# start_job NAME NPROC KEEP(0|1|2) TRAIN_ARGS...: starts a launcher (1: --keep-survivors, 2: and
# --replace-lost); sets job_dir, trace, job_pid.
start_job() {
    local name=$1 nproc=$2 keep=$3
    shift 3
    job_dir=$tmp/$name
    trace=$job_dir/trace
    rm -rf "$job_dir"
    mkdir -p "$trace"
    local flags=(launch --standalone --nproc-per-node "$nproc" --max-restarts 0)
    [ "$keep" != 0 ] && flags+=(--keep-survivors)
    [ "$keep" = 2 ] && flags+=(--replace-lost --max-restarts 1)
    TANDEM_SAMPLE_TRACE=$trace setsid "$tandem" "${flags[@]}" -- train "$@" \
        --output-dir "$job_dir/out" </dev/null >"$job_dir/stdout" 2>"$job_dir/stderr" &
    job_pid=$!
}

job_alive() { kill -0 "$job_pid" 2>/dev/null; }
job_done() { ! job_alive; }

# The process id of the launcher's worker of RANK (its environment's RANK).
worker_pid() {
    local child
    for child in $(pgrep -P "$job_pid"); do
        if tr '\0' '\n' <"/proc/$child/environ" 2>/dev/null | grep -qx "RANK=$1"; then
            echo "$child"
            return 0
        fi
    done
    echo "no worker of rank $1" >&2
    return 1
}


# outside_interference RANK...: names what the launcher lost or received that the script did
# not cause (another user's signals on this shared machine); prints nothing when all is ours.
outside_interference() {
    local lost rank
    lost=$(grep -o 'rank [0-9]* (pid [0-9]*)' "$job_dir/stderr" | cut -d' ' -f2 | sort -un)
    for rank in $lost; do
        [[ " $* " == *" $rank "* ]] || echo -n "rank $rank lost without our signal; "
    done
    grep -q 'launcher received SIG' "$job_dir/stderr" && echo -n "the launcher received a stop signal we did not send; "
    return 0
}

failure() {
    local what=${1%"; "}
    failed=1
    echo "  FAILED: ${what%;} (logs in $job_dir); launcher stderr (tail):"
    tail -n 15 "$job_dir/stderr" | sed 's/^/    /'
    echo "  rank 0 stdout (tail):"
    tail -n 5 "$job_dir/stdout" | sed 's/^/    /'
}

# send_to_one SIGNAL TRIAL KEEP: starts a 4-worker job (KEEP as for start_job) and sends
# SIGNAL to one worker once training is under way; sets rank and t_signal. On a failure it
# says so and stops the job.
send_to_one() {
    local signal=$1 trial=$2 keep=$3 victim
    start_job "$signal-$keep-$trial" 4 "$keep" "${small[@]}" --epochs 1000
    wait_for 60 records_at_least 20 || { failure "training never got under way"; stop_job; return 1; }
    rank=$(( 1 + trial % 3 ))
    victim=$(worker_pid "$rank") || { failure "no worker of rank $rank"; stop_job; return 1; }
    t_signal=$(now)
    kill "-$signal" "$victim"
}

# signal_one SIGNAL TRIAL KEEP: send_to_one, then waits for the first step at world size 3;
# sets rank, t_signal and t_first.
signal_one() {
    local signal=$1
    send_to_one "$@" || return 1
    if ! wait_for 60 world_size_seen 3; then
        failure "no step at world size 3 within 60 s of $signal; $(outside_interference "$rank")"
        stop_job
        return 1
    fi
    t_first=$(trace_query first 3)
}

# undisturbed TRIAL: stops the job; whether only the script's signal reached it (else says so).
undisturbed() {
    stop_job
    local outside
    outside=$(outside_interference "$rank")
    [ -z "$outside" ] && return 0
    echo "  trial $1: DISTURBED, not counted: $outside"
    return 1
}

# lose_one SIGNAL TRIAL: one 4-worker trial; prints the latency or a failure.
lose_one() {
    local signal=$1 trial=$2 rank t_signal t_first reformed
    signal_one "$signal" "$trial" 1 || return 1
    undisturbed "$trial" || return 1
    reformed=$(grep -o 're-formed in [0-9.]* s' "$job_dir/stdout" | head -1 || true)
    echo "  trial $trial: rank $rank, $(sub "$t_first" "$t_signal") s (rank 0: ${reformed:-no re-form line})"
    sub "$t_first" "$t_signal" >>"$tmp/latencies"
}

# The process id of the worker the launcher started in place of the lost one, once it says so.
replacement_pid() {
    sed -n 's/.*rank [0-9]* (pid \([0-9]*\)) started in place of the lost one.*/\1/p' "$job_dir/stderr" | head -1
}

# replacement_trained: the replacement committed a step (it is let in at world size 4).
replacement_trained() {
    local pid
    pid=$(replacement_pid)
    [ -n "$pid" ] && [ -n "$(trace_query first_of "$pid")" ]
}

# join_one KILL TRIAL: one 4-worker trial with --replace-lost; prints the latency or a failure.
# The replacement may be let in before the other three commit a step at world size 3.
join_one() {
    local trial=$2 rank t_signal t_first t_back at_3
    send_to_one KILL "$trial" 2 || return 1
    if ! wait_for 60 replacement_trained; then
        failure "the replacement committed no step within 60 s of kill -9; $(outside_interference "$rank")"
        stop_job
        return 1
    fi
    t_back=$(trace_query first_of "$(replacement_pid)")
    t_first=$(trace_query first_after 3 "$t_signal")
    undisturbed "$trial" || return 1
    at_3="no step at 3"
    [ -n "$t_first" ] && at_3="at 3 after $(sub "$t_first" "$t_signal") s"
    echo "  trial $trial: rank $rank, back at 4 workers after $(sub "$t_back" "$t_signal") s ($at_3)"
    sub "$t_back" "$t_signal" >>"$tmp/latencies"
}

# measure TRIAL_FUNCTION SIGNAL TITLE: TRIAL_FUNCTION SIGNAL N for each trial N, then the
# latencies' summary.
measure() {
    local run_trial=$1 signal=$2 title=$3 trial
    echo "== $title: 4 workers, seed-004 small model, G 128, M 16, $trials trials"
    : >"$tmp/latencies"
    for (( trial = 1; trial <= trials; trial++ )); do
        "$run_trial" "$signal" "$trial" || true
    done
    summary <"$tmp/latencies" | sed 's/^/  latency: /'
}

measure_cost() {
    local warmup=10 epochs run mode keep m
    epochs=$(( (warmup + cost_steps + 1) / 20 + 2 ))
    echo "== cost: 4 workers, seed-004 small model, G 128, M 16: median step time of rank 0 over $cost_steps steps (after $warmup), runs alternated"
    : >"$tmp/cost-1"
    : >"$tmp/cost-0"
    for (( run = 1; run <= cost_runs; run++ )); do
        for keep in 1 0; do
            mode=$([ "$keep" = 1 ] && echo "--keep-survivors" || echo "without")
            start_job "cost-$keep-$run" 4 "$keep" "${small[@]}" --epochs "$epochs"
            if ! wait_for 300 job_done; then failure "$mode run $run did not finish"; stop_job; continue; fi
            wait "$job_pid" || { failure "$mode run $run failed"; job_pid=; continue; }
            job_pid=
            m=$(trace_query step_median "$warmup" "$cost_steps") || { failure "$mode run $run: too few steps"; continue; }
            echo "$m" >>"$tmp/cost-$keep"
            printf '  run %d %-16s median step %.2f ms\n' "$run" "$mode" "$(python3 -c "print(float('$m') * 1000)")"
        done
    done
    python3 - "$tmp/cost-1" "$tmp/cost-0" <<'PY'
import statistics, sys
keep, plain = ([float(x) for x in open(p).read().split()] for p in sys.argv[1:])
if keep and plain:
    k, p = statistics.median(keep) * 1000, statistics.median(plain) * 1000
    print(f"  --keep-survivors {k:.2f} ms/step, without {p:.2f} ms/step: {100 * (k / p - 1):+.1f} %")
PY
}

measure_scale() {
    local w=$scale_workers trial t_start t_formed t_kill t_first victims pid rank outside
    local global=$(( w * 4 ))
    (( global / 2 >= w )) || { echo "G/M smaller than the worker count" >&2; return 1; }
    echo "== scale: $w workers, tiny model (channels 4,4,4), G $global, M 2, one thread each; kill -9 of 8 workers; $scale_trials trials"
    for (( trial = 1; trial <= scale_trials; trial++ )); do
        t_start=$(now)
        start_job "scale-$trial" "$w" 1 "${tiny[@]}" --global-batch-size "$global" --batch-size 2 --epochs 1000
        if ! wait_for 180 records_at_least $(( 3 * w )); then
            failure "$w workers never trained; $(outside_interference)"
            stop_job
            continue
        fi
        t_formed=$(trace_query first_any)
        echo "  trial $trial: launcher start -> first step $(sub "$t_formed" "$t_start") s"
        victims=()
        for (( rank = w - 8; rank < w; rank++ )); do
            pid=$(worker_pid "$rank") || { failure "no worker of rank $rank"; break; }
            victims+=("$pid")
        done
        (( ${#victims[@]} == 8 )) || { stop_job; continue; }
        t_kill=$(now)
        kill -KILL "${victims[@]}"
        if ! wait_for 60 world_size_seen $(( w - 8 )); then
            failure "no step at world size $(( w - 8 )) within 60 s; $(outside_interference $(seq $(( w - 8 )) $(( w - 1 ))))"
            echo "  world sizes seen: $(cat "$trace"/*.jsonl | grep -o '"world_size":[0-9]*' | sort | uniq -c | tr '\n' ' ')"
            stop_job
            continue
        fi
        t_first=$(trace_query first $(( w - 8 )))
        stop_job
        outside=$(outside_interference $(seq $(( w - 8 )) $(( w - 1 ))))
        echo "  trial $trial: kill -9 of ranks $(( w - 8 ))..$(( w - 1 )) -> first step at $(( w - 8 )) $(sub "$t_first" "$t_kill") s; memberships: $(grep -c 'membership [0-9]*:' "$job_dir/stderr" || true)${outside:+; DISTURBED: $outside}"
        grep -o 'membership [0-9]*: .*' "$job_dir/stderr" | sed 's/^/    /' | cut -c1-160
    done
}

echo "elastic timing: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $("$tandem" --version 2>/dev/null || echo tandem)"
for part in ${only//,/ }; do
    case $part in
        kill) measure lose_one KILL "kill -9 -> first step at the smaller size" ;;
        stop) measure lose_one STOP "SIGSTOP -> first step at the smaller size (heartbeat timeout 1 s)" ;;
        join) measure join_one KILL "kill -9 with --replace-lost -> first step at 4 workers again" ;;
        cost) measure_cost ;;
        scale) measure_scale ;;
        *) echo "$0: unknown part '$part'" >&2; exit 2 ;;
    esac
    echo "  (load average now $(cut -d' ' -f1-3 /proc/loadavg))"
done
cat <<'TXT'
== torchrun, for comparison: its documented defaults, NOT a measurement
  an elastic round (--nnodes MIN:MAX) completes 30 s after it reaches MIN (rendezvous
  last_call_timeout default 30 s) unless MAX joined; on a lost worker every worker is
  stopped, the round is redone, and all are relaunched and reload the checkpoint:
  floor >= 30 s + process start + checkpoint reload per lost worker.
TXT
