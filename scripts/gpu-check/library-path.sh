#!/usr/bin/env bash
# One release of each CUDA library for the GPU check: fills ALIASES with links to the library
# files of FOLDERS, each library from the first folder that has it (by stem: libcublas,
# libcublasLt, libcudnn_ops, ...), under the file's own names and its unversioned one
# (libnccl.so -> libnccl.so.2: cudarc asks for the bare name first). Prints the two
# assignments to export, with ALIASES first in both, so that a bare name, a SONAME and a
# library's $ORIGIN all reach the same file:
#   TANDEM_CUDA_LIBRARY_PATH=ALIASES:FOLDERS...
#   LD_LIBRARY_PATH=ALIASES:FOLDERS...[:the current LD_LIBRARY_PATH]
#
# usage: scripts/gpu-check/library-path.sh ALIASES FOLDER...   (FOLDERS in order of preference)
set -euo pipefail

[ $# -ge 1 ] || { echo "usage: $0 ALIASES FOLDER..." >&2; exit 2; }
aliases=$1
shift
mkdir -p "$aliases"

declare -A claimed=()
for dir in "$@"; do
    declare -A here=()
    for file in "$dir"/lib*.so "$dir"/lib*.so.*; do
        [ -e "$file" ] || continue
        name=$(basename "$file")
        stem=${name%%.so*}
        [ -n "${claimed[$stem]:-}" ] && continue
        here[$stem]=1
        [ -e "$aliases/$name" ] || ln -s "$file" "$aliases/$name"
        [ -e "$aliases/$stem.so" ] || ln -s "$file" "$aliases/$stem.so"
    done
    for stem in "${!here[@]}"; do claimed[$stem]=1; done
    unset here
done

joined=$aliases
for dir in "$@"; do joined=$joined:$dir; done
echo "TANDEM_CUDA_LIBRARY_PATH=$joined"
echo "LD_LIBRARY_PATH=$joined${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
