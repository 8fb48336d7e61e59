#!/usr/bin/env bash
# Download the pure-Python wheels the test suite needs beyond what a bare GPU box has
# (torch, transformers, tqdm, matplotlib), for scripts/gpu_check.sh's offline install:
#
#   scripts/fetch_test_wheels.sh [DIR]      # default DIR: .whl (git-ignored)
#   scripts/gpu_check.sh .whl               # on the GPU machine
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
mkdir -p "$DIR"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation py --abi none --platform any -d "$DIR" \
  pytest pluggy iniconfig packaging pytest-timeout hypothesis sortedcontainers attrs
# megatron-core (the bench's Megatron rows) ships a compiled wheel per Python version.
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d "$DIR" megatron-core==0.16.1
ls "$DIR"
