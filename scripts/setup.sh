#!/usr/bin/env bash
# Set up everything on a fresh machine, idempotently; later runs take a second or two.
#  1. a Python 3.12 virtual environment OUTSIDE the clone ($MEGATRON_OPERATOR_CACHE/venv), holding
#     the dependencies named in pyproject.toml (torch is a few GB: downloaded once, reused by CI);
#  2. the pinned Kubernetes control-plane binaries (and kwok, helm, Prometheus, Kueue), built from
#     their Go modules and cached.
# The project itself is not installed into the shared venv: the Makefile puts the clone's source
# folders on PYTHONPATH, so several clones can share one venv.
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE="${MEGATRON_OPERATOR_CACHE:-$HOME/.cache/megatron-operator}"
VENV="$CACHE/venv"
mkdir -p "$CACHE"

find_python312() {
    for cand in "${PYTHON:-}" python3.12 "$HOME/.pyenv/versions/"3.12*/bin/python3.12 /usr/bin/python3.12 /usr/local/bin/python3.12; do
        [ -n "$cand" ] || continue
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
            command -v "$cand"; return 0
        fi
    done
    return 1
}

if [ ! -x "$VENV/bin/python" ]; then
    PY=$(find_python312) || { echo "setup: Python 3.12 is needed (megatron-core 0.19 ships cp312 wheels only); set PYTHON=/path/to/python3.12" >&2; exit 1; }
    echo "setup: creating $VENV with $PY"
    "$PY" -m venv "$VENV"
fi

# Install the dependencies when pyproject.toml's dependency lists or constraints.txt change.
REQS=$("$VENV/bin/python" - <<'PY'
import tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
deps = list(p["dependencies"])
for extra in ("trainer", "dev"):
    deps += p["optional-dependencies"][extra]
print("\n".join(deps))
PY
)
STAMP="$VENV/.megatron-operator-deps"
WANT="$REQS
$(cat constraints.txt)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "setup: installing Python dependencies into $VENV (first run downloads torch, a few GB)"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    printf '%s\n' "$REQS" > "$CACHE/requirements.txt"
    # pipefail keeps pip's exit status; grep only trims the noise.
    "$VENV/bin/python" -m pip install --progress-bar off -r "$CACHE/requirements.txt" -c constraints.txt \
        | { grep -v "^Requirement already satisfied" || true; }
    printf '%s' "$WANT" > "$STAMP"
fi

# Control plane, kwok, helm, helm-docs, Prometheus, promtool and Kueue (first run builds them from Go
# modules: ~20 minutes on 2 cores). Built here, not on first use, so no test waits for (or skips
# for want of) a binary.
PYTHONPATH=localcluster "$VENV/bin/python" -m localcluster.build >/dev/null
if ! command -v kubectl >/dev/null 2>&1; then
    echo "setup: kubectl not found; installing Debian's package" >&2
    if command -v apt-get >/dev/null 2>&1; then
        (apt-get install -y -qq kubectl >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq kubectl)) \
            || { echo "setup: could not install kubectl" >&2; exit 1; }
    else
        echo "setup: install kubectl (any version within one minor of Kubernetes 1.33)" >&2; exit 1
    fi
fi
echo "setup: ready (venv $VENV)"
