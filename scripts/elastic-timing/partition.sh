#!/usr/bin/env bash
# Issue 35's partition targets of `tandem launch --store-replicas --keep-survivors`, measured on
# this machine: three network namespaces on one bridge act as three hosts (each sees a boot id
# of its own, so the nodes talk only through their links), 3 nodes x 2 workers train the small
# model of run.sh with the store replicated among the agents. `ip -n NS link set VETH down`
# cuts one node off mid-run: the cut's latency is the first step committed at world size 4
# minus the moment the link went down. Once the cut-off node says it pauses, its link comes up
# again: the rejoin's latency is the first step committed at world size 6 after that moment.
# Needs root, `ip netns` and `unshare`.
set -euo pipefail

usage="usage: $0 [--trials N] [--node K] [--keep-logs] [--tandem BINARY]"
here=$(dirname "$(realpath "$0")")
tandem=$here/../../target/release/tandem
[ -n "${CARGO_TARGET_DIR:-}" ] && tandem=$CARGO_TARGET_DIR/release/tandem
trials=20
cut=0
keep=0
while [ $# -gt 0 ]; do
    case $1 in
        --trials) trials=${2:?$usage}; shift 2 ;;
        --node) cut=${2:?$usage}; shift 2 ;;
        --keep-logs) keep=1; shift ;;
        --tandem) tandem=${2:?$usage}; shift 2 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "$0: unknown argument '$1'" >&2; echo "$usage" >&2; exit 2 ;;
    esac
done
case $cut in 0|1|2) ;; *) echo "$0: --node is 0, 1 or 2" >&2; exit 2 ;; esac
tandem=$(realpath "$tandem")
# shellcheck source=common.sh
source "$here/common.sh"
require_tools root

tag=$$
hub=tpt${tag}h
ns=(tpt${tag}0 tpt${tag}1 tpt${tag}2)
veth=(tp${tag}0 tp${tag}1 tp${tag}2)
subnet=10.204.0
port=29581
replicas="$subnet.1:$port,$subnet.2:$port,$subnet.3:$port"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/elastic-partition.XXXXXX")
pids=()
failed=0
cleanup() {
    stop_jobs
    for name in "${ns[@]}" "$hub"; do ip netns delete "$name" 2>/dev/null || true; done
    if [ "$failed" = 1 ] || [ "$keep" = 1 ]; then
        echo "logs kept in $tmp" >&2
    else
        rm -rf "$tmp"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$hub"
ip -n "$hub" link add br0 type bridge
ip -n "$hub" link set br0 up
for i in 0 1 2; do
    ip netns add "${ns[$i]}"
    ip link add "${veth[$i]}" type veth peer name "${veth[$i]}h"
    ip link set "${veth[$i]}" netns "${ns[$i]}"
    ip link set "${veth[$i]}h" netns "$hub"
    ip -n "$hub" link set "${veth[$i]}h" master br0 up
    ip -n "${ns[$i]}" addr add "$subnet.$(( i + 1 ))/24" dev "${veth[$i]}"
    ip -n "${ns[$i]}" link set "${veth[$i]}" up
    ip -n "${ns[$i]}" link set lo up
    echo "tandem-partition-node-$i-$tag" >"$tmp/boot_id_$i"
done

small+=(--epochs 1000)

# start_node NODE: starts node NODE's launcher on its host, in a session of its own.
start_node() {
    local node=$1
    TANDEM_JOB_TOKEN=partition-timing TANDEM_SAMPLE_TRACE=$trace setsid \
        ip netns exec "${ns[$node]}" unshare --mount sh -c \
        'mount --bind "$0" /proc/sys/kernel/random/boot_id && exec "$@"' "$tmp/boot_id_$node" \
        "$tandem" launch --nnodes 3 --node-rank "$node" --store-replicas "$replicas" \
        --nproc-per-node 2 --keep-survivors --max-restarts 0 --log-dir "$job_dir/logs-$node" \
        -- train "${small[@]}" --output-dir "$job_dir/out" \
        </dev/null >"$job_dir/stdout-$node" 2>"$job_dir/stderr-$node" &
    pids+=($!)
}

# The job watched is the majority's: a node other than the one cut off.
job_alive() { kill -0 "${pids[$(( (cut + 1) % 3 ))]}" 2>/dev/null; }

# Whether a node of the majority published the membership without the cut-off node.
published() { cat "$job_dir"/stderr-* | grep -qs "membership 1: node $cut lost"; }

paused() { grep -qs "node $cut is cut off from the job's store" "$job_dir/stderr-$cut"; }

failure() {
    failed=1
    echo "  FAILED: $1 (logs in $job_dir); the launchers (tail):"
    for node in 0 1 2; do tail -n 4 "$job_dir/stderr-$node" | sed "s/^/    node $node: /"; done
}

# trial N: one cut and its healing; prints both latencies or a failure.
trial() {
    local n=$1 t_down t_published t_first t_up t_back node
    job_dir=$tmp/trial-$n
    trace=$job_dir/trace
    mkdir -p "$trace"
    # A trial that failed may have left its cut in place.
    ip -n "${ns[$cut]}" link set "${veth[$cut]}" up
    for node in 0 1 2; do start_node "$node"; done
    if ! wait_for 90 records_at_least 60; then failure "training never got under way"; stop_jobs; return 1; fi
    t_down=$(now)
    ip -n "${ns[$cut]}" link set "${veth[$cut]}" down
    if ! wait_for 60 published; then failure "no membership without node $cut within 60 s"; stop_jobs; return 1; fi
    t_published=$(now)
    if ! wait_for 60 world_size_seen 4; then failure "no step at world size 4 within 60 s"; stop_jobs; return 1; fi
    t_first=$(trace_query first 4)
    if ! wait_for 60 paused; then failure "node $cut never paused"; stop_jobs; return 1; fi
    t_up=$(now)
    ip -n "${ns[$cut]}" link set "${veth[$cut]}" up
    local back=""
    for _ in $(seq 600); do
        back=$(trace_query first_after 6 "$t_up")
        [ -n "$back" ] && break
        sleep 0.05
    done
    stop_jobs
    [ -n "$back" ] || { failure "node $cut's workers not back within 30 s"; return 1; }
    echo "  trial $n: cut $(sub "$t_first" "$t_down") s (membership published after about $(sub "$t_published" "$t_down") s), paused after $(sub "$t_up" "$t_down") s, back $(sub "$back" "$t_up") s after the link came up"
    sub "$t_first" "$t_down" >>"$tmp/cuts"
    sub "$back" "$t_up" >>"$tmp/rejoins"
}

echo "elastic partition timing: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $("$tandem" --version 2>/dev/null || echo tandem)"
echo "== ip link set down of node $cut, then up once it pauses: 3 hosts x 2 workers, --store-replicas, --keep-survivors, heartbeat timeout 1 s, seed-004 small model, G 128, M 16, $trials trials"
: >"$tmp/cuts"
: >"$tmp/rejoins"
for (( n = 1; n <= trials; n++ )); do
    trial "$n" || true
done
summary <"$tmp/cuts" | sed 's/^/  link down -> first step at world size 4: /'
summary <"$tmp/rejoins" | sed 's/^/  link up -> first step at world size 6: /'
echo "  (load average now $(cut -d' ' -f1-3 /proc/loadavg))"
