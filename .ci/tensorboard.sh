# Sourced by .ci/run (after python.sh): installs Python's tensorboard package, with whose own
# EventAccumulator crates/tandem/tests/run_folder.rs reads a resumed run's event files (where
# CI is set, that test fails without it).
if ! python3 -c 'import tensorboard' 2>/dev/null; then
    python_with_pip "to install tensorboard"
    echo "ci: installing Python's tensorboard package" >&2
    python3 -m pip install --quiet tensorboard ||
        python3 -m pip install --quiet --break-system-packages tensorboard
fi
