#!/usr/bin/env bash
# One check on a CUDA machine: install swap_pass, run the accelerator-only tests, the stream
# races with slowed side streams and one step of each path under TORCH_CUDA_SANITIZER=1, and the
# llama-8b-layer bench. Finishes in under 17 minutes (each stage has its own time limit).
#
#   scripts/gpu_check.sh [WHEEL_DIR]
#
# WHEEL_DIR (or $WHEEL_DIR): a folder of wheels to install test dependencies from, offline;
# scripts/fetch_test_wheels.sh fills one (run it where pip reaches PyPI).
# Outputs go under $OUT when it is set, else ./gpu_check_out:
#   env.txt, pytest-accelerator.txt, accelerator-junit.xml, pytest-races.txt, races-junit.xml,
#   pinned.txt (pinned host bytes after 3 steps and after swap_pass.reset()),
#   pytest-expandable.txt, expandable-junit.xml,
#   bench.txt, bench-<preset>.json (+ .png), bench-<preset>-compile.json (+ .png),
#   bench-megatron.txt, bench-megatron.json, capacity.txt, capacity-<preset>.json,
#   summary.txt
# Exit status: 0 when every stage passed, else the number of stages that failed.
# Dry run on a CPU machine (no install, small preset):
#   GPU_CHECK_NO_INSTALL=1 GPU_CHECK_PRESET=tiny OUT=/tmp/gc scripts/gpu_check.sh
# GPU_CHECK_BENCH_ARGS adds bench flags (e.g. "--layers 2 --steps 1").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
WHEELS="${1:-${WHEEL_DIR:-}}"
PRESET="${GPU_CHECK_PRESET:-llama-8b-layer}"
mkdir -p "$OUT"
failed=0
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

# --- 1. environment -----------------------------------------------------------------------
python3 - > "$OUT/env.txt" 2>&1 <<'PY'
import os, platform, torch
print("torch", torch.__version__, "| python", platform.python_version(), "|", os.cpu_count(), "CPU cores")
print("accelerator:", torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None)
if torch.accelerator.is_available():
    acc = torch.accelerator.current_accelerator()
    print("device:", torch.get_device_module(acc.type).get_device_name(0))
PY
cat "$OUT/env.txt"

# --- 2. install (offline) -----------------------------------------------------------------
if [ -n "${GPU_CHECK_NO_INSTALL:-}" ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  summary "install: skipped (GPU_CHECK_NO_INSTALL); using PYTHONPATH=$PWD"
elif [ -n "$WHEELS" ]; then
  python3 -m pip install --no-index --find-links "$WHEELS" pytest pytest-timeout hypothesis \
    >> "$OUT/install.txt" 2>&1 || summary "install: some wheels from $WHEELS did not install (see install.txt)"
  python3 -m pip install --no-index --no-deps --find-links "$WHEELS" megatron-core==0.16.1 \
    >> "$OUT/install.txt" 2>&1 || summary "install: megatron-core not in $WHEELS (Megatron rows skip)"
fi
if [ -z "${GPU_CHECK_NO_INSTALL:-}" ]; then
  if python3 -m pip install --no-deps --no-build-isolation -e . >> "$OUT/install.txt" 2>&1; then
    summary "install: pip install -e . ok"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    summary "install: pip install -e . failed; using PYTHONPATH=$PWD"
  fi
fi
python3 -c "import swap_pass" || { summary "FAIL: swap_pass does not import"; exit 99; }

# --- 3. accelerator-only tests (<= 140 s) -------------------------------------------------
RACES=tests/reliability/test_cuda_races.py
timeout 140 python3 -m pytest -q -m accelerator -p no:cacheprovider --continue-on-collection-errors \
  --ignore "$RACES" --junitxml "$OUT/accelerator-junit.xml" > "$OUT/pytest-accelerator.txt" 2>&1
rc=$?
tail -n 15 "$OUT/pytest-accelerator.txt"
if [ "$rc" -eq 0 ]; then summary "pytest -m accelerator: passed"
else summary "pytest -m accelerator: FAILED (exit $rc; 124 = time limit)"; failed=$((failed + 1)); fi

# --- 3b. stream races: torch.cuda._sleep on the side streams before each copy (or on the compute
# stream before each producer), 64 MiB layer inputs, 3 steps with and without a synchronize
# between them, a second stream, two devices interleaved where present, one reduce-overhead
# compile, pinned bytes after reset(); one step of eager, graph and SmartSwap under the
# sanitizer (<= 300 s)
OUT="$OUT" timeout 300 python3 -m pytest -q -p no:cacheprovider -rs "$RACES" \
  --junitxml "$OUT/races-junit.xml" > "$OUT/pytest-races.txt" 2>&1
rc=$?
tail -n 15 "$OUT/pytest-races.txt"
if [ "$rc" -eq 0 ]; then summary "stream races (slowed side streams, TORCH_CUDA_SANITIZER=1): passed"
else summary "stream races: FAILED (exit $rc; 124 = time limit)"; failed=$((failed + 1)); fi
[ -f "$OUT/pinned.txt" ] && summary "$(cat "$OUT/pinned.txt")"

# --- 3c. the same races with expandable segments, where a freed block can be unmapped (<= 150 s)
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 150 python3 -m pytest -q -p no:cacheprovider \
  -rs "$RACES" -k "plain or per_step or interleaved" --junitxml "$OUT/expandable-junit.xml" \
  > "$OUT/pytest-expandable.txt" 2>&1
rc=$?
tail -n 5 "$OUT/pytest-expandable.txt"
if [ "$rc" -eq 0 ]; then summary "stream races (expandable_segments:True): passed"
else summary "stream races (expandable_segments:True): FAILED (exit $rc)"; failed=$((failed + 1)); fi

# --- 4. bench, eager rows then compile rows (<= 170 s + 140 s) ----------------------------------
plot() { python3 -c "import matplotlib" 2>/dev/null && echo "--plot $OUT/$1.png"; }
bench() {  # name, time limit, methods
  # shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of extra flags
  timeout "$2" python3 -m swap_pass bench --preset "$PRESET" --methods "$3" ${GPU_CHECK_BENCH_ARGS:-} \
    --json "$OUT/$1.json" $(plot "$1") >> "$OUT/bench.txt" 2>&1
  local rc=$?
  if [ "$rc" -eq 0 ]; then summary "bench $1: ok"
  else summary "bench $1: FAILED (exit $rc; 124 = time limit)"; failed=$((failed + 1)); fi
}
bench "bench-$PRESET" 170 no_swap,recompute,eager_swap,save_on_cpu,smartswap,torchtune
GPU_CHECK_BENCH_ARGS="${GPU_CHECK_BENCH_ARGS:-} --no-smart-rows" bench "bench-$PRESET-compile" 140 compile,compile_swap
cat "$OUT/bench.txt"

# --- 5. Megatron rows: swap_pass vs Megatron's offloading vs recompute vs none (<= 150 s) ----
# Without megatron-core the rows say so and the stage passes.
timeout 150 python3 -m swap_pass bench --preset "$PRESET" --methods no_swap --no-smart-rows \
  --steps 1 --warmup 1 --megatron --json "$OUT/bench-megatron.json" > "$OUT/bench-megatron.txt" 2>&1
rc=$?
tail -n 8 "$OUT/bench-megatron.txt"
if [ "$rc" -eq 0 ]; then summary "bench megatron: ok ($(grep -c '^Megatron rows: SKIPPED' "$OUT/bench-megatron.txt") skipped)"
else summary "bench megatron: FAILED (exit $rc; 124 = time limit)"; failed=$((failed + 1)); fi

# --- 6. capacity: largest batch per method under a REAL device-memory cap (<= 240 s) --------
# swap-pass capacity caps the allocator with set_per_process_memory_fraction, searches each
# method's largest batch (an out-of-memory error is "does not fit") and prints the planner's peak
# beside the measured one. Host memory for the swapping methods is capped too (SmartSwap keeps
# every saved tensor of its warm-up steps in host buffers). GPU_CHECK_CAPACITY_CAP,
# GPU_CHECK_CAPACITY_HOST and GPU_CHECK_CAPACITY_ARGS (e.g. "--seq 64 --search-max 12") change it.
# shellcheck disable=SC2086  # GPU_CHECK_CAPACITY_ARGS is a list of extra flags
timeout 240 python3 -m swap_pass capacity --preset "$PRESET" --device-memory "${GPU_CHECK_CAPACITY_CAP:-24GiB}" \
  --max-host-bytes "${GPU_CHECK_CAPACITY_HOST:-48GiB}" ${GPU_CHECK_CAPACITY_ARGS:-} \
  --json "$OUT/capacity-$PRESET.json" > "$OUT/capacity.txt" 2>&1
rc=$?
grep -v '^\.\.\. ' "$OUT/capacity.txt" | tail -n 12
if [ "$rc" -eq 0 ]; then summary "capacity (real cap): ok"
else summary "capacity (real cap): FAILED (exit $rc; 124 = time limit)"; failed=$((failed + 1)); fi

summary "gpu_check: $failed stage(s) failed; outputs in $OUT"
exit "$failed"
