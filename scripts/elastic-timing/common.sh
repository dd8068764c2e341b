# Helpers of the elastic timing scripts (run.sh, linkdown.sh, replicated.sh, partition.sh): sourced, not run.
# A script that sources it defines job_alive (whether the job it watches still runs) and sets
# trace (the folder of the job's sample trace) before it calls them.

now() { date +%s.%N; }

# require_tools [root]: exits 2 naming what is missing: the tandem binary at $tandem, python3
# (to read the traces), and with `root` the root user (for the network namespaces).
require_tools() {
    [ -x "$tandem" ] || { echo "$0: no tandem binary at $tandem (cargo build --release -p tandem, or --tandem)" >&2; exit 2; }
    command -v python3 >/dev/null || { echo "$0: python3 is needed to read the traces" >&2; exit 2; }
    if [ "${1:-}" = root ]; then
        [ "$(id -u)" = 0 ] || { echo "$0: needs root for the network namespaces" >&2; exit 2; }
    fi
}

# stop_jobs: kills the process group of every launcher in `pids` (each started in a session of
# its own), reaps it quietly, and empties `pids`.
stop_jobs() {
    local pid
    for pid in "${pids[@]}"; do
        kill -KILL -- "-$pid" 2>/dev/null || true
        { wait "$pid"; } 2>/dev/null || true
    done
    pids=()
}

# The seed-004 small model of crates/tandem/tests/world_size.rs (epochs not set).
small=(--model resnet-base --n-blocks 1,1,1 --n-channels 8,16,32 --bottlenecks none --data synthetic
    --synthetic-train 2560 --synthetic-test 64 --global-batch-size 128 --batch-size 16 --threads 1
    --seed 5 --device cpu --log-every-steps 0 --optimizer sgd --momentum 0.9 --nesterov --lr 0.05)

# wait_for SECONDS COMMAND...: polls COMMAND every 20 ms until it succeeds; fails when the
# job ends first or the time is up.
wait_for() {
    local deadline
    deadline=$(( $(date +%s) + $1 ))
    shift
    until "$@"; do
        job_alive || { "$@" && return 0; echo "the job ended" >&2; return 1; }
        (( $(date +%s) < deadline )) || { echo "timed out" >&2; return 1; }
        sleep 0.02
    done
}

records_at_least() { (( $(cat "$trace"/*.jsonl 2>/dev/null | wc -l) >= $1 )); }
world_size_seen() { grep -qs "\"world_size\":$1," "$trace"/*.jsonl; }

# trace_query first WS | first_after WS TIME | first_any | first_of PID | step_median WARMUP STEPS
trace_query() {
    python3 - "$trace" "$@" <<'PY'
import glob, json, statistics, sys
folder, what, *args = sys.argv[1:]
records = []
for path in glob.glob(folder + "/*.jsonl"):
    for line in open(path):
        try:
            records.append(json.loads(line))
        except ValueError:
            pass  # a line cut short by a killed worker
if what == "first":
    times = [r["time"] for r in records if r["world_size"] == int(args[0])]
    print(f"{min(times):.6f}" if times else "")
elif what == "first_after":
    times = [r["time"] for r in records if r["world_size"] == int(args[0]) and r["time"] > float(args[1])]
    print(f"{min(times):.6f}" if times else "")
elif what == "first_of":
    times = []
    for line in open(f"{folder}/samples-{args[0]}.jsonl") if glob.glob(f"{folder}/samples-{args[0]}.jsonl") else []:
        try:
            times.append(json.loads(line)["time"])
        except ValueError:
            pass
    print(f"{min(times):.6f}" if times else "")
elif what == "first_any":
    print(f"{min(r['time'] for r in records):.6f}" if records else "")
elif what == "step_median":
    warmup, steps = int(args[0]), int(args[1])
    rank0 = sorted((r["epoch"], r["step"], r["time"]) for r in records if r["rank"] == 0)
    times = [t for _, _, t in rank0][warmup:warmup + steps + 1]
    if len(times) < steps + 1:
        sys.exit(f"only {len(times) - 1} step times after the warm-up, wanted {steps}")
    print(f"{statistics.median(b - a for a, b in zip(times, times[1:])):.6f}")
PY
}

# Reads numbers, one a line; prints "n N median M p95 P" (p95 nearest-rank).
summary() {
    python3 -c '
import math, statistics, sys
xs = sorted(float(x) for x in sys.stdin.read().split())
if not xs:
    print("n 0"); sys.exit()
p95 = xs[math.ceil(0.95 * len(xs)) - 1]
print(f"n {len(xs)} median {statistics.median(xs):.3f} s p95 {p95:.3f} s min {xs[0]:.3f} s max {xs[-1]:.3f} s")'
}

sub() { python3 -c "import sys; print(f'{float(sys.argv[1]) - float(sys.argv[2]):.3f}')" "$1" "$2"; }
