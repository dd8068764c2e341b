# Sourced by .ci/run: defines python_with_pip, which makes sure a python3 with pip is there
# (installed from the system's packages when missing) for the scripts that fetch from PyPI.

# python_with_pip WHY: returns 0 once `python3 -m pip` works; WHY ends its messages.
python_with_pip() {
    if command -v python3 >/dev/null && python3 -m pip --version >/dev/null 2>&1; then
        return
    fi
    echo "ci: installing python3-pip $1" >&2
    if command -v apt-get >/dev/null; then
        sudo_if_needed=""
        if [ "$(id -u)" != 0 ]; then sudo_if_needed=sudo; fi
        $sudo_if_needed apt-get update -qq
        $sudo_if_needed apt-get install -y -qq python3 python3-pip >/dev/null
    fi
    python3 -m pip --version >/dev/null || {
        echo "ci: no python3 with pip, and none could be installed: cannot go on $1" >&2
        return 1
    }
}
