#!/usr/bin/env bash
# Issue 35's "no single point of failure" target of `tandem launch --store-replicas`, measured on
# this machine: 3 nodes x 2 workers on loopback keep the store replicated among their agents;
# node 0 (the host of the first replica, the node that decides the membership, and rank 0's home),
# or with --node K node K, or with --node leader the host of the store's leader as `tandem status`
# names it just before, is killed with SIGKILL, agent and workers at once, mid-run. The first
# leader is node 1's or node 2's replica more often than node 0's, whose launcher first looks
# whether a job is under way. The latency is the first step
# committed at world size 4 (from the sample trace) minus the kill.
set -euo pipefail

usage="usage: $0 [--trials N] [--node K|leader] [--tandem BINARY]"
here=$(dirname "$(realpath "$0")")
tandem=$here/../../target/release/tandem
[ -n "${CARGO_TARGET_DIR:-}" ] && tandem=$CARGO_TARGET_DIR/release/tandem
trials=20
lost=0
while [ $# -gt 0 ]; do
    case $1 in
        --trials) trials=${2:?$usage}; shift 2 ;;
        --node) lost=${2:?$usage}; shift 2 ;;
        --tandem) tandem=${2:?$usage}; shift 2 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "$0: unknown argument '$1'" >&2; echo "$usage" >&2; exit 2 ;;
    esac
done
case $lost in 0|1|2|leader) ;; *) echo "$0: --node is 0, 1, 2 or leader" >&2; exit 2 ;; esac
tandem=$(realpath "$tandem")
# shellcheck source=common.sh
source "$here/common.sh"
require_tools

tmp=$(mktemp -d "${TMPDIR:-/tmp}/elastic-replicated.XXXXXX")
pids=()
failed=0
cleanup() {
    stop_jobs
    if [ "$failed" = 1 ]; then
        echo "logs of the failed trials kept in $tmp" >&2
    else
        rm -rf "$tmp"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

small+=(--epochs 1000)

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# start_node NODE REPLICAS: starts node NODE's launcher in a session of its own.
start_node() {
    TANDEM_JOB_TOKEN=replicated-timing TANDEM_SAMPLE_TRACE=$trace setsid \
        "$tandem" launch --nnodes 3 --node-rank "$1" --store-replicas "$2" --nproc-per-node 2 \
        --keep-survivors --max-restarts 0 --log-dir "$job_dir/logs-$1" -- train "${small[@]}" \
        --output-dir "$job_dir/out" </dev/null >"$job_dir/stdout-$1" 2>"$job_dir/stderr-$1" &
    pids+=($!)
}

job_alive() { kill -0 "${pids[decider]}" 2>/dev/null; }

# leader_node REPLICAS: the node whose replica leads the store, as `tandem status` says.
leader_node() {
    local said leader node
    said=$("$tandem" status "$job_dir/logs-0" 2>/dev/null | head -1) || return 1
    leader=$(grep -o 'store leader [0-9.:]*' <<<"$said" | cut -d' ' -f3) || return 1
    IFS=, read -r -a node <<<"$1"
    for i in 0 1 2; do [ "${node[i]}" = "$leader" ] && { echo "$i"; return 0; }; done
    return 1
}

failure() {
    failed=1
    echo "  FAILED: $1 (logs in $job_dir); node 1's launcher (tail):"
    tail -n 8 "$job_dir/stderr-$decider" | sed 's/^/    /'
}

# trial N: one kill of node $lost (or of the leader's host); prints the latency or a failure.
trial() {
    local n=$1 replicas t_kill t_first line node victim
    decider=1
    job_dir=$tmp/trial-$n
    trace=$job_dir/trace
    mkdir -p "$trace"
    replicas="127.0.0.1:$(free_port),127.0.0.1:$(free_port),127.0.0.1:$(free_port)"
    for node in 0 1 2; do start_node "$node" "$replicas"; done
    if ! wait_for 90 records_at_least 60; then failure "training never got under way"; stop_jobs; return 1; fi
    victim=$lost
    if [ "$lost" = leader ] && ! victim=$(leader_node "$replicas"); then
        failure "tandem status named no leader"; stop_jobs; return 1
    fi
    # The node that decides the membership once the victim is lost.
    decider=$(( victim == 0 ? 1 : 0 ))
    t_kill=$(now)
    kill -KILL -- "-${pids[victim]}"
    { wait "${pids[victim]}"; } 2>/dev/null || true
    if ! wait_for 60 world_size_seen 4; then failure "no step at world size 4 within 60 s"; stop_jobs; return 1; fi
    t_first=$(trace_query first 4)
    stop_jobs
    line=$(grep -o "membership 1: node $victim lost (its launcher sent no heartbeat for [0-9.]* s)" "$job_dir/stderr-$decider" | head -1 || true)
    echo "  trial $n: $(sub "$t_first" "$t_kill") s; ${line:-no membership line}"
    sub "$t_first" "$t_kill" >>"$tmp/latencies"
}

echo "replicated-store timing: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $("$tandem" --version 2>/dev/null || echo tandem)"
case $lost in
    0) what="node 0 (store replica, deciding node, rank 0)" ;;
    leader) what="the host of the store's leader" ;;
    *) what="node $lost (store replica)" ;;
esac
echo "== kill -9 of $what -> first step at world size 4: 3 nodes x 2 workers on loopback, --store-replicas, --keep-survivors, heartbeat timeout 1 s, seed-004 small model, G 128, M 16, $trials trials"
: >"$tmp/latencies"
for (( n = 1; n <= trials; n++ )); do
    trial "$n" || true
done
summary <"$tmp/latencies" | sed 's/^/  latency: /'
echo "  (load average now $(cut -d' ' -f1-3 /proc/loadavg))"
