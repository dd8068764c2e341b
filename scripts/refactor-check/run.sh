#!/usr/bin/env bash
# Runs the six CPU runs of issue 33's "what must not change" with one tandem binary and
# prints the sha256 of each run's final snapshot (state_hash.py). Run it with the binary of
# the commit before the refactor and with the new one; the lines must match.
#   scripts/refactor-check/run.sh TANDEM_BINARY OUTPUT_FOLDER
set -euo pipefail
binary=$(realpath "$1")
out=$2
here=$(dirname "$(realpath "$0")")
rm -rf "$out"
mkdir -p "$out"
small=(--data synthetic --synthetic-train 384 --synthetic-test 128 --batch-size 32 --log-every-steps 1000)

run() {
    local name=$1
    shift
    "$binary" "$@" --output-dir "$out/$name" >"$out/$name.log" 2>&1 ||
        { echo "run $name failed:"; tail -20 "$out/$name.log"; exit 1; }
}

run adam-2-threads train "${small[@]}" --epochs 2 --optimizer adam --lr 0.003 --threads 2 --seed 4
run adam-1-thread train "${small[@]}" --epochs 2 --optimizer adam --lr 0.003 --threads 1 --seed 4
run sgd-nesterov-smoothing-accum train "${small[@]}" --epochs 2 --optimizer sgd --momentum 0.9 \
    --nesterov --lr 0.05 --weight-decay 5e-4 --label-smoothing 0.1 --grad-accum 2 --threads 2 --seed 7
run adamw-no-bottleneck train "${small[@]}" --epochs 2 --optimizer adamw --lr 0.002 \
    --weight-decay 0.01 --bottlenecks none --n-blocks 2,2,2 --threads 2 --seed 9
run resnet18 train --data synthetic --synthetic-train 64 --synthetic-test 32 --batch-size 16 \
    --epochs 1 --model resnet18 --optimizer adam --lr 0.001 --threads 2 --seed 3 --log-every-steps 1000
run sync-bn-2-processes launch --standalone --nproc-per-node 2 -- train "${small[@]}" --epochs 2 \
    --optimizer sgd --momentum 0.9 --lr 0.05 --sync-bn --threads 1 --seed 5

for name in adam-2-threads adam-1-thread sgd-nesterov-smoothing-accum adamw-no-bottleneck resnet18 sync-bn-2-processes; do
    snapshot=$out/$name/snapshot.safetensors
    [ -f "$snapshot" ] || { echo "no snapshot in $out/$name"; ls -R "$out/$name"; exit 1; }
    printf '%-30s %s\n' "$name" "$(python3 "$here/state_hash.py" "$snapshot" | cut -d' ' -f1)"
done
