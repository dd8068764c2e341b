# Sourced by .ci/run: makes NVRTC available so that the tests compile every CUDA kernel
# (NVRTC needs no GPU). It comes from NVIDIA's `nvidia-cuda-nvrtc` wheel on PyPI, fetched once
# into a cache folder outside the checkout, and only its two libraries are unpacked.
# Exports TANDEM_CUDA_LIBRARY_PATH (where tandem-cuda's probe finds it) and
# TANDEM_REQUIRE_NVRTC=1 (a missing NVRTC fails the kernel tests instead of skipping them).

# CUDA 13.0, the version of cudarc's bindings (feature cuda-13000).
nvrtc_wheel_version=13.0.88
nvrtc_dir="${XDG_CACHE_HOME:-$HOME/.cache}/tandem-ci/nvrtc-$nvrtc_wheel_version"

if [ ! -f "$nvrtc_dir/libnvrtc.so.13" ]; then
    python_with_pip "to fetch NVRTC"
    nvrtc_download=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        "nvidia-cuda-nvrtc==$nvrtc_wheel_version" -d "$nvrtc_download"
    # Unpacked beside the final folder, then renamed into place, so an interrupted run never
    # leaves a half-filled cache.
    mkdir -p "$(dirname "$nvrtc_dir")"
    nvrtc_partial=$(mktemp -d "$nvrtc_dir.partial.XXXXXX")
    python3 - "$nvrtc_download" "$nvrtc_partial" <<'PYTHON'
import pathlib, sys, zipfile
download, target = map(pathlib.Path, sys.argv[1:])
(wheel,) = download.glob("nvidia_cuda_nvrtc-*.whl")
wanted = ("libnvrtc.so.13", "libnvrtc-builtins.so.13.0")
with zipfile.ZipFile(wheel) as archive:
    for member in archive.namelist():
        name = member.rsplit("/", 1)[-1]
        if name in wanted:
            (target / name).write_bytes(archive.read(member))
missing = [name for name in wanted if not (target / name).is_file()]
if missing:
    sys.exit(f"ci: {wheel.name} lacks {missing}")
PYTHON
    rm -rf "$nvrtc_download"
    rm -rf "$nvrtc_dir"
    mv "$nvrtc_partial" "$nvrtc_dir"
fi
export TANDEM_CUDA_LIBRARY_PATH="$nvrtc_dir${TANDEM_CUDA_LIBRARY_PATH:+:$TANDEM_CUDA_LIBRARY_PATH}"
export TANDEM_REQUIRE_NVRTC=1
echo "ci: NVRTC from $nvrtc_dir"
