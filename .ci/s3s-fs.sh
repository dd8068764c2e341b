# Sourced by .ci/run: makes the S3 server the object-storage tests start (s3s-fs, which checks
# request signatures) available. Built once with cargo into a cache folder outside the
# checkout (about 3 minutes of CPU on a fresh machine), then reused.
# Exports TANDEM_S3S_FS, where the tests find it.

s3s_fs_version=0.14.1
s3s_fs_root="${XDG_CACHE_HOME:-$HOME/.cache}/tandem-ci/s3s-fs-$s3s_fs_version"
if [ ! -x "$s3s_fs_root/bin/s3s-fs" ]; then
    echo "ci: building s3s-fs $s3s_fs_version for the object-storage tests" >&2
    cargo install --quiet --locked "s3s-fs@$s3s_fs_version" --features binary --root "$s3s_fs_root"
fi
export TANDEM_S3S_FS="$s3s_fs_root/bin/s3s-fs"
