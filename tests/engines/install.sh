#!/usr/bin/env bash
# Installs an engine's real classes for the engine tests (issue 15) into a directory of its own,
# --no-deps, from tests/engines/requirements-ENGINE.txt; the project's environment is untouched.
#   bash tests/engines/install.sh vllm [DIR]      (DIR: .engines/vllm)
# Then: PYTHONPATH=DIR python -m pytest tests/engines/test_vllm_*.py
set -euo pipefail
engine="${1:?usage: install.sh vllm|sglang [DIR]}"
here="$(cd "$(dirname "$0")" && pwd)"
dir="${2:-$here/../../.engines/$engine}"
if [ -f "$dir/.installed" ] && cmp -s "$dir/.installed" "$here/requirements-$engine.txt"; then
    exit 0  # installed from these very pins already
fi
rm -rf "$dir"
mkdir -p "$dir"
python -m pip install -q --no-deps --no-compile --target "$dir" -r "$here/requirements-$engine.txt"
cp "$here/requirements-$engine.txt" "$dir/.installed"
