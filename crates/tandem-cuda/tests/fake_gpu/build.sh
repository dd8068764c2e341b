#!/usr/bin/env bash
# Builds the fake GPU into FOLDER (see fake_cuda.cpp): libcuda.so.1, libcublas.so.13,
# libcudnn.so.9 and libnccl.so.2 (each with its unversioned name beside it, which cudarc asks
# for) for TANDEM_CUDA_LIBRARY_PATH and LD_LIBRARY_PATH, and FOLDER/kernels/*.so, our kernel
# files compiled for the CPU with tests/common/cuda_on_cpu.h, for TANDEM_FAKE_GPU_KERNELS.
# usage: build.sh FOLDER   (CXX picks the C++ compiler, default c++)
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 FOLDER" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
crate=$(dirname "$(dirname "$here")")
out=$1
cxx=${CXX:-c++}
mkdir -p "$out/kernels"
flags=(-std=c++17 -O2 -ffp-contract=off -fno-fast-math -fPIC -shared -pthread)

# One library per kernel file: the built-ins, the prelude every file shares, the file, one
# export per kernel; a kernel whose body (up to the `}` that closes it in column 0) declares
# __shared__ memory runs its blocks as teams of threads.
exports() {
    awk '
        /^extern "C" __global__ void / {
            if (name != "") {
                print "build.sh: kernel " name " has no } in column 0 to end it" > "/dev/stderr"
                exit 1
            }
            name = $0
            sub(/^extern "C" __global__ void /, "", name)
            sub(/\(.*/, "", name)
            team = 0
        }
        name != "" && /__shared__/ { team = 1 }
        name != "" && /^}/ { printf "EXPORT_LAUNCH(%s, %d)\n", name, team; name = "" }
    ' "$1"
}
for source in "$crate"/kernels/*.cu; do
    name=$(basename "$source" .cu)
    wrapper="$out/kernels/$name.cpp"
    {
        cat "$crate/tests/common/cuda_on_cpu.h"
        echo "#line 1 \"activations.cuh\""
        cat "$crate/kernels/activations.cuh"
        echo "#line 1 \"$name.cu\""
        cat "$source"
        exports "$source"
    } >"$wrapper"
    "$cxx" "${flags[@]}" -o "$out/kernels/$name.so" "$wrapper" &
done
wait
rm -f "$out"/kernels/*.cpp

"$cxx" "${flags[@]}" -Wl,-soname,libcuda.so.1 -o "$out/libcuda.so.1" "$here/fake_cuda.cpp" -ldl
ln -sf libcuda.so.1 "$out/libcuda.so"
for library in cublas:libcublas.so.13 cudnn:libcudnn.so.9 nccl:libnccl.so.2; do
    source=${library%%:*}
    file=${library#*:}
    "$cxx" "${flags[@]}" -fopenmp -Wl,-soname,"$file" -o "$out/$file" "$here/fake_$source.cpp" \
        "$out/libcuda.so.1" -Wl,-rpath,'$ORIGIN'
    ln -sf "$file" "$out/${file%.so.*}.so"
done
