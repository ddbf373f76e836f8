#!/usr/bin/env bash
# Build a virtual environment holding kvfuzz and one third-party engine, keeping the CPU build of torch.
#
# usage: scripts/third_party_env.sh ENGINE [VENV_DIR]
#   ENGINE is the name of a recipe in scripts/third_party/ (ENGINE.sh); VENV_DIR defaults to .venv-ENGINE.
#   KVFUZZ_EDITABLE=1 installs kvfuzz in editable mode (for development).
#
# Engines pin torch versions whose wheels are multi-GB CUDA builds. Every install here runs under a constraint that
# holds torch at 2.13.0, and a recipe installs the engine itself with --no-deps, naming its real needs by hand.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
recipes="$root/scripts/third_party"
if [ $# -lt 1 ] || [ ! -f "$recipes/$1.sh" ]; then
    echo "usage: $0 ENGINE [VENV_DIR]; engines: $(cd "$recipes" && ls *.sh | sed 's/\.sh$//' | tr '\n' ' ')" >&2
    exit 2
fi
engine="$1"
venv="${2:-.venv-$engine}"

python3 -m venv "$venv"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==2.13.0" > "$constraints"

pip_install() {
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c "$constraints" "$@"
}

pip_install --upgrade pip
pip_install torch==2.13.0
# kvfuzz with its plot extra (kvfuzz show --png of the engine's scheduler traces) and the test runner only: the
# engine's recipe chooses the versions of what it shares with kvfuzz's test extra (transformers above all), as the
# engine pins them.
if [ "${KVFUZZ_EDITABLE:-0}" = 1 ]; then
    pip_install -e "$root[plot]" "pytest-timeout>=2.2"
else
    pip_install "$root[plot]" "pytest-timeout>=2.2"
fi

# The recipe installs the engine with pip_install (and may write files into "$venv").
. "$recipes/$engine.sh"

"$venv/bin/python" - <<'PY'
import torch
assert torch.__version__.split("+")[0] == "2.13.0", f"the engine's install replaced torch: {torch.__version__}"
PY
echo "$engine environment ready in $venv"
