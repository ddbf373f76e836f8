#!/usr/bin/env bash
# Build a virtual environment holding kvfuzz and one third-party engine, keeping the CPU build of torch.
#
# usage: scripts/third_party_env.sh ENGINE[@VERSION] [VENV_DIR]
#   ENGINE is the name of a recipe in scripts/third_party/ (ENGINE.sh); VERSION one the recipe supports (its
#   VERSIONS, the first the default: vllm@0.34.0, sglang@0.5.22); VENV_DIR defaults to .venv-ENGINE (.venv-ENGINE@VERSION
#   with a version). KVFUZZ_EDITABLE=1 installs kvfuzz in editable mode (for development).
#
# Engines pin torch versions whose wheels are multi-GB CUDA builds. Every install here runs under a constraint that
# holds torch at 2.13.0, and a recipe installs the engine itself with --no-deps, naming its real needs by hand.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
recipes="$root/scripts/third_party"
engine="${1%%@*}"
if [ $# -lt 1 ] || [ ! -f "$recipes/$engine.sh" ]; then
    echo "usage: $0 ENGINE[@VERSION] [VENV_DIR]; engines: $(cd "$recipes" && ls *.sh | sed 's/\.sh$//' | tr '\n' ' ')" >&2
    exit 2
fi
# The recipe defines VERSIONS (the engine versions it installs, the first the default) and install_engine VERSION,
# which installs the engine with pip_install (and may write files into "$venv").
. "$recipes/$engine.sh"
version="${VERSIONS[0]}"
if [ "$1" != "$engine" ]; then
    version="${1#*@}"
fi
if [[ ! " ${VERSIONS[*]} " == *" $version "* ]]; then
    echo "$0: $engine $version is not a version the recipe installs (it installs: ${VERSIONS[*]})" >&2
    exit 2
fi
venv="${2:-.venv-$1}"

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

install_engine "$version"

"$venv/bin/python" - <<'PY'
import torch
assert torch.__version__.split("+")[0] == "2.13.0", f"the engine's install replaced torch: {torch.__version__}"
PY
echo "$engine $version environment ready in $venv"
