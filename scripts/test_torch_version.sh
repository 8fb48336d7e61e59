#!/usr/bin/env bash
# Run the test suite under another torch release, in its own venv, on this machine.
#
#   scripts/test_torch_version.sh 2.11.0 [VENV_DIR] [pytest args...]
#
# CI runs torch 2.13.0 only (the README's command); the GPU check box has torch 2.11, the
# floor in pyproject. Run this before relying on another release: torch 2.11 (its CUDA wheel
# imports on a CPU-only machine) found three incompatibilities on 2026-11-29, torch 2.6 many
# more (swap_pass/_version_check.py names them), which is why the floor is 2.11 (swap_pass
# refuses to import below it).
# The venv is reused when it exists.
set -euo pipefail
version="${1:?usage: $0 TORCH_VERSION [VENV_DIR] [pytest args...]}"
venv="${2:-/tmp/swap_pass-torch-$version}"
shift $(( $# >= 2 ? 2 : 1 ))
root="$(cd "$(dirname "$0")/.." && pwd)"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "torch==$version"
  "$venv/bin/pip" install --quiet --disable-pip-version-check pytest pytest-timeout hypothesis \
    "transformers>=4.45" tqdm matplotlib
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps -e "$root"
"$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
cd "$root"
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
