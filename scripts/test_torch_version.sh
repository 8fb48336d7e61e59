#!/usr/bin/env bash
# Run the test suite under another torch release, in its own venv, on this machine.
#
#   scripts/test_torch_version.sh 2.15.0 [VENV_DIR] [pytest args...]
#
# CI runs torch 2.13.0 only (the README's command); the GPU check box has torch 2.11, the
# floor in pyproject. Run this before relying on another release: torch 2.11 (its CUDA wheel
# imports on a CPU-only machine) found three incompatibilities on 2026-11-29, torch 2.6 many
# more (swap_pass/_version_check.py names them), which is why the floor is 2.11 (swap_pass
# refuses to import below it).
# The venv is reused when it exists.
#
# A pip constraints file on the machine may cap torch (PIP_CONSTRAINT / pip.conf); the install
# lifts it for the torch release asked for. The venv's bin/ goes first on PATH so that tests which
# start `python3` (the GPU-check dry run, the examples) run the venv's torch, not the system's.
set -euo pipefail
version="${1:?usage: $0 TORCH_VERSION [VENV_DIR] [pytest args...]}"
venv="${2:-/tmp/swap_pass-torch-$version}"
shift $(( $# >= 2 ? 2 : 1 ))
root="$(cd "$(dirname "$0")/.." && pwd)"
pip_install() {
  PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install --quiet --disable-pip-version-check "$@"
}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  pip_install "torch==$version"
fi
# The test extra's pins, as CI installs them (transformers below 5.25 among them); a reused venv
# that strays from them is brought back. torch already satisfies the floor and stays as it is.
pip_install -e "$root[test]"
export PATH="$venv/bin:$PATH"
unset PYTHONPATH
python -c "
import torch, swap_pass, transformers
assert torch.__version__.split('+')[0] == '$version', f'venv has torch {torch.__version__}, not $version'
print('torch', torch.__version__, 'transformers', transformers.__version__,
      'swap_pass from', swap_pass.__file__)"
cd "$root"
exec python -m pytest -q -p no:cacheprovider "$@"
