#!/usr/bin/env bash
# Issue 35's link-down target of `tandem launch --keep-survivors` across nodes, measured on
# this machine: two network namespaces joined by a veth pair act as two hosts (node 1 sees a
# boot id of its own, so the nodes talk only through the link), 2 nodes x 2 workers train the
# small model of run.sh; `ip -n NS link set VETH down` cuts node 1 off mid-run, and the
# latency is the first step committed at world size 2 (from the sample trace) minus the
# moment the link went down. Needs root, `ip netns` and `unshare`.
set -euo pipefail

usage="usage: $0 [--trials N] [--tandem BINARY]"
here=$(dirname "$(realpath "$0")")
tandem=$here/../../target/release/tandem
[ -n "${CARGO_TARGET_DIR:-}" ] && tandem=$CARGO_TARGET_DIR/release/tandem
trials=20
while [ $# -gt 0 ]; do
    case $1 in
        --trials) trials=${2:?$usage}; shift 2 ;;
        --tandem) tandem=${2:?$usage}; shift 2 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "$0: unknown argument '$1'" >&2; echo "$usage" >&2; exit 2 ;;
    esac
done
tandem=$(realpath "$tandem")
# shellcheck source=common.sh
source "$here/common.sh"
require_tools root

tag=$$
ns=(tdl${tag}a tdl${tag}b)
veth=(tl${tag}a tl${tag}b)
subnet=10.203.0
tmp=$(mktemp -d "${TMPDIR:-/tmp}/elastic-linkdown.XXXXXX")
pids=()
failed=0
cleanup() {
    stop_jobs
    ip netns delete "${ns[0]}" 2>/dev/null || true
    ip netns delete "${ns[1]}" 2>/dev/null || true
    if [ "$failed" = 1 ]; then
        echo "logs of the failed trials kept in $tmp" >&2
    else
        rm -rf "$tmp"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "${ns[0]}"
ip netns add "${ns[1]}"
ip link add "${veth[0]}" type veth peer name "${veth[1]}"
for i in 0 1; do
    ip link set "${veth[$i]}" netns "${ns[$i]}"
    ip -n "${ns[$i]}" addr add "$subnet.$(( i + 1 ))/24" dev "${veth[$i]}"
    ip -n "${ns[$i]}" link set lo up
done
echo "tandem-linkdown-node-1-$tag" >"$tmp/boot_id"


small+=(--epochs 1000)

# start_node NODE PORT: starts node NODE's launcher in its namespace, in a session of its own.
start_node() {
    local node=$1 port=$2 wrap=()
    # Node 1 sees a boot id of its own: no Unix socket or shared memory reaches across.
    [ "$node" = 1 ] && wrap=(unshare --mount sh -c 'mount --bind "$0" /proc/sys/kernel/random/boot_id && exec "$@"' "$tmp/boot_id")
    TANDEM_JOB_TOKEN=linkdown-timing TANDEM_SAMPLE_TRACE=$trace setsid \
        ip netns exec "${ns[$node]}" "${wrap[@]}" "$tandem" launch --nnodes 2 --node-rank "$node" \
        --master-addr "$subnet.1" --master-port "$port" --nproc-per-node 2 --keep-survivors \
        --max-restarts 0 --log-dir "$job_dir/logs-$node" -- train "${small[@]}" \
        --output-dir "$job_dir/out" </dev/null >"$job_dir/stdout-$node" 2>"$job_dir/stderr-$node" &
    pids+=($!)
}

job_alive() { kill -0 "${pids[0]}" 2>/dev/null; }

failure() {
    failed=1
    echo "  FAILED: $1 (logs in $job_dir); node 0's launcher (tail):"
    tail -n 8 "$job_dir/stderr-0" | sed 's/^/    /'
    echo "  node 1's launcher (tail):"
    tail -n 4 "$job_dir/stderr-1" | sed 's/^/    /'
}

# trial N: one link-down; prints the latency or a failure.
trial() {
    local n=$1 port=$(( 29600 + $1 )) t_down t_first t_paused="" line
    job_dir=$tmp/trial-$n
    trace=$job_dir/trace
    mkdir -p "$trace"
    ip -n "${ns[0]}" link set "${veth[0]}" up
    ip -n "${ns[1]}" link set "${veth[1]}" up
    start_node 0 "$port"
    start_node 1 "$port"
    if ! wait_for 90 records_at_least 40; then failure "training never got under way"; stop_jobs; return 1; fi
    t_down=$(now)
    ip -n "${ns[1]}" link set "${veth[1]}" down
    if ! wait_for 60 world_size_seen 2; then failure "no step at world size 2 within 60 s"; stop_jobs; return 1; fi
    t_first=$(trace_query first 2)
    # Node 1's launcher, cut off, pauses (its workers wait for the cut to heal).
    for _ in $(seq 200); do
        grep -q "node 1 is cut off from the job's store" "$job_dir/stderr-1" 2>/dev/null && { t_paused=$(now); break; }
        sleep 0.05
    done
    stop_jobs
    line=$(grep -o 'membership 1: node 1 lost (its launcher sent no heartbeat for [0-9.]* s)' "$job_dir/stderr-0" | head -1 || true)
    local paused="more than 10 s"
    [ -n "$t_paused" ] && paused="$(sub "$t_paused" "$t_down") s"
    echo "  trial $n: $(sub "$t_first" "$t_down") s; node 1's launcher paused after $paused; ${line:-no membership line}"
    sub "$t_first" "$t_down" >>"$tmp/latencies"
}

echo "elastic link-down timing: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg), $("$tandem" --version 2>/dev/null || echo tandem)"
echo "== ip link set down of node 1 -> first step at world size 2: 2 nodes x 2 workers, --keep-survivors, heartbeat timeout 1 s, seed-004 small model, G 128, M 16, $trials trials"
: >"$tmp/latencies"
for (( n = 1; n <= trials; n++ )); do
    trial "$n" || true
done
summary <"$tmp/latencies" | sed 's/^/  latency: /'
echo "  (load average now $(cut -d' ' -f1-3 /proc/loadavg))"
