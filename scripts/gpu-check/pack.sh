#!/usr/bin/env bash
# Packs into .carry/ (git-ignored) what scripts/gpu-check/run.sh needs on the GPU machine,
# which has no Rust toolchain and takes at most 64 MiB per call:
#   .carry/bin.tar.xz      stripped release `tandem` and the GPU test binaries (xz: 4x smaller)
#   .carry/manifest.tsv    what is in bin.tar.xz, and the paths baked into the test binaries
#   .carry/shared/         the TANDEM_SHARED of the GPU run: the golden files and CIFAR-10's
#                          data_batch_1.bin + the first 5,000 records of test_batch.bin
# Run it here, in the checkout whose tree the device call sends, then `run` with carry [".carry"].
# Fails when what would travel (tracked + untracked-not-ignored files + .carry) exceeds 60 MiB.
set -euo pipefail

LIMIT_MIB=${GPU_CHECK_LIMIT_MIB:-60}
TEST_RECORDS=5000
RECORD_BYTES=3073
DATA_BATCH_1_MD5=5dd7e06a14cb22eb9f671a540d1b7c25
GOLDEN_FILES=(README.md resnet18_seed000.safetensors resnet_bottleneck_seed004.safetensors)

ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
SHARED=${TANDEM_SHARED:-$ROOT/../shared}
ARCHIVE=$SHARED/data/cifar10/cifar-10-batches-bin.tar.gz
CARRY=.carry
LIST=scripts/gpu-check/gpu-tests.txt

die() { echo "pack.sh: $*" >&2; exit 1; }
[ -f "$ARCHIVE" ] || die "missing $ARCHIVE (set TANDEM_SHARED to the shared folder)"
git check-ignore -q "$CARRY" || die "$CARRY is not git-ignored: it would travel twice"

# The test targets: the list plus every crates/<package>/tests/gpu*.rs.
declare -A TESTS=()
while read -r package test; do
    [ -n "$package" ] && TESTS["$package $test"]=1
done < <(grep -v '^#' "$LIST")
for file in crates/*/tests/gpu*.rs; do
    [ -e "$file" ] || continue
    package=${file#crates/}; package=${package%%/*}
    test=$(basename "$file" .rs)
    TESTS["$package $test"]=1
done

echo "== building the release binary and ${#TESTS[@]} test binaries"
cargo build --release -p tandem --bin tandem
json=$(mktemp)
trap 'rm -f "$json"; rm -rf "${stage:-}" "${unpacked:-}"' EXIT
for package in $(printf '%s\n' "${!TESTS[@]}" | cut -d' ' -f1 | sort -u); do
    targets=()
    for key in "${!TESTS[@]}"; do
        [ "${key%% *}" = "$package" ] && targets+=(--test "${key#* }")
    done
    cargo test --release --no-run --message-format=json -p "$package" "${targets[@]}" >>"$json"
done

stage=$(mktemp -d)
mkdir -p "$stage/tests"
cp target/release/tandem "$stage/tandem"
{
    printf 'built\t%s\n' "$(date -u +%FT%TZ)"
    printf 'commit\t%s%s\n' "$(git rev-parse --short HEAD)" "$(git diff --quiet HEAD -- crates Cargo.toml Cargo.lock || echo ' (with uncommitted changes)')"
    printf 'tandem_path\t%s\n' "$ROOT/target/release/tandem"
} >"$stage/manifest.tsv"
python3 - "$json" "$LIST" "${!TESTS[@]}" >>"$stage/manifest.tsv" <<'PY'
import json, os, sys
path, listed, wanted = sys.argv[1], sys.argv[2], set(sys.argv[3:])
# run.sh runs the tests in this order: the list's order first (the cheapest and most telling
# first), then the unlisted gpu*.rs, tandem-cuda's before the binary's.
order = [" ".join(line.split()) for line in open(listed) if line.strip() and not line.startswith("#")]
def rank(key):
    package = key.split()[0]
    return (order.index(key) if key in order else len(order), package != "tandem-cuda", key)
found = {}
for line in open(path):
    message = json.loads(line)
    if message.get("reason") != "compiler-artifact" or not message.get("executable"):
        continue
    if message["target"]["kind"] != ["test"]:
        continue
    package = os.path.basename(os.path.dirname(message["manifest_path"]))
    key = f"{package} {message['target']['name']}"
    if key in wanted:
        found[key] = message["executable"]
missing = wanted - found.keys()
if missing:
    sys.exit(f"pack.sh: no test executable for {sorted(missing)}")
for key in sorted(found, key=rank):
    package, test = key.split()
    print(f"test\t{package}\t{test}\ttests/{package}__{test}\t{found[key]}")
PY
while IFS=$'\t' read -r kind _ _ name executable; do
    [ "$kind" = test ] && cp "$executable" "$stage/$name"
done <"$stage/manifest.tsv"
strip "$stage/tandem" "$stage"/tests/*

echo "== writing $CARRY"
rm -rf "$CARRY/bin.tar.xz" "$CARRY/manifest.tsv" "$CARRY/shared/golden"
mkdir -p "$CARRY/shared/golden" "$CARRY/shared/data/cifar10/cifar-10-batches-bin"
tar -C "$stage" -cf - . | xz -6 -T2 >"$CARRY/bin.tar.xz"
cp "$stage/manifest.tsv" "$CARRY/manifest.tsv"
for file in "${GOLDEN_FILES[@]}"; do
    cp "$SHARED/golden/$file" "$CARRY/shared/golden/"
done

# CIFAR-10 in the layout tandem and time_to_accuracy.py read. data_batch_2..5 are empty, so
# that the training set is data_batch_1 alone (10,000 images).
batches=$CARRY/shared/data/cifar10/cifar-10-batches-bin
test_bytes=$((TEST_RECORDS * RECORD_BYTES))
if [ "$(md5sum 2>/dev/null <"$batches/data_batch_1.bin" | cut -d' ' -f1)" != "$DATA_BATCH_1_MD5" ] ||
    [ "$(stat -c %s "$batches/test_batch.bin" 2>/dev/null)" != "$test_bytes" ]; then
    unpacked=$(mktemp -d)
    tar -C "$unpacked" -xzf "$ARCHIVE" cifar-10-batches-bin/data_batch_1.bin \
        cifar-10-batches-bin/test_batch.bin cifar-10-batches-bin/batches.meta.txt
    [ "$(md5sum <"$unpacked/cifar-10-batches-bin/data_batch_1.bin" | cut -d' ' -f1)" = "$DATA_BATCH_1_MD5" ] ||
        die "data_batch_1.bin in $ARCHIVE does not have the official md5"
    cp "$unpacked/cifar-10-batches-bin/data_batch_1.bin" "$unpacked/cifar-10-batches-bin/batches.meta.txt" "$batches/"
    head -c "$test_bytes" "$unpacked/cifar-10-batches-bin/test_batch.bin" >"$batches/test_batch.bin"
fi
for batch in 2 3 4 5; do
    : >"$batches/data_batch_$batch.bin"
done

echo "== sizes"
carry_bytes=$(du -sb "$CARRY" | cut -f1)
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }')
total_bytes=$((carry_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
du -b "$CARRY/bin.tar.xz" "$batches"/*.bin "$CARRY/shared/golden"/* | sed 's/^/  /'
echo "  binaries unpacked: $(mib "$(du -sb --exclude=manifest.tsv "$stage" | cut -f1)")"
echo "carry $(mib "$carry_bytes") + working tree $(mib "$tree_bytes") = $(mib "$total_bytes") travel (limit $LIMIT_MIB MiB)"
[ "$total_bytes" -le $((LIMIT_MIB * 1048576)) ] || die "over the $LIMIT_MIB MiB limit"
