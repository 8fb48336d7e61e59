#!/usr/bin/env bash
# The check to run on a CUDA machine. It finishes within 8 minutes: each stage runs under
# `timeout` with its own limit, and the limits add up to 480 s (`scripts/gpu_check.sh --limits`
# prints them). Every stage writes its files as it finishes, so a run killed part-way keeps what
# ran before. In order:
#
#   headline     135 s  swap-pass bench (preset llama-8b-layer on an accelerator, tiny on CPU):
#                       no swap, full recompute, recompute + swap (eager), torch save_on_cpu, HF
#                       checkpointing + offload (transformers' activation_checkpointing_enable(
#                       offload=True); a row with its reason where transformers or pinned memory
#                       lacks it): peak, step time against full recompute, D2H/H2D GB/s against a
#                       plain pinned copy of the same bytes -> headline.json (+ .png), headline.txt
#   tools         45 s  swap-pass bench --layers 2: the fine-tuning tools' offloading against HF
#                       checkpointing of the same model (TRL's, torchtune's, accelerate's
#                       offload_wrapper; each flag served by swap_pass): peak, freed bytes, step
#                       and CPU time over HF checkpointing's, exactness -> tools.json, tools.txt
#   setup         15 s  env.txt (torch, device, transformers, pytest, hypothesis); pytest from
#                       WHEEL_DIR when it is missing -> env.txt, setup.txt
#   races         90 s  tests/reliability/test_cuda_races.py: torch.cuda._sleep queued on the side
#                       streams before every copy (or on the compute stream before every producer),
#                       64 MiB layer inputs, several steps with and without a synchronize, a second
#                       compute stream, eager and compiled (swap_backend with Inductor, aot_eager
#                       on a retained graph) paths run for real, each side-stream copy from pinned
#                       memory; compile_layers(mode="reduce-overhead") refused with swap,
#                       pinned bytes after reset() -> pytest-races.txt, races-junit.xml, pinned.txt
#   sanitizer     30 s  one eager step under TORCH_CUDA_SANITIZER=1 that must swap (swap_outs > 0).
#                       Under the sanitizer torch.compile runs the model eagerly, so no compiled
#                       swap op would execute there, and the sanitizer does not check a free
#                       against a pending side-stream read: the races stage covers both
#                       -> pytest-sanitizer.txt, sanitizer-junit.xml
#   expandable    30 s  three eager races again with
#                       PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#                       -> pytest-expandable.txt, expandable-junit.xml
#   accelerator   80 s  pytest -m accelerator over the rest of the suite (without the modules that
#                       need hypothesis where it is missing; the aot_eager graph tests and the
#                       HF tiny models included; -v streams each result, so a stage cut by its
#                       limit still shows what ran); the compiled forward's
#                       peak allocated and reserved -> pytest-accelerator.txt,
#                       accelerator-junit.xml, accelerator-peaks.json
#   capacity      55 s  swap-pass capacity under a REAL device-memory cap (24 GiB, 48 GiB of host
#                       memory, no swap / full recompute / recompute + swap); each probe's line is
#                       in capacity.txt as it runs -> capacity.txt, capacity.json
#
# Each stage appends one line to stages.jsonl (name, limit, seconds, exit status, when it
# finished, the files it wrote) and to summary.txt. Exit status: the number of stages that did
# not pass (a pytest stage without pytest counts as not passed).
#
#   scripts/gpu_check.sh [WHEEL_DIR]     outputs under $OUT, else ./gpu_check_out
#   scripts/gpu_check.sh --limits        the stages and their limits, then the total
#
# swap_pass is imported from this checkout (PYTHONPATH); nothing is installed but pytest (and
# what it needs) from WHEEL_DIR (or $WHEEL_DIR) when the machine lacks it:
# scripts/fetch_test_wheels.sh fills one where pip reaches PyPI.
# On a machine without an accelerator the same command is a dry run of every stage: the bench
# runs the tiny preset (the HF offload row is skipped: it needs pinned memory), the CUDA tests
# skip, and capacity searches a 3 MiB virtual cap at seq 64. Options, by environment:
#   GPU_CHECK_PRESET         bench and capacity preset (default: the device's, as swap-pass picks)
#   GPU_CHECK_BENCH_ARGS     more bench flags (e.g. "--layers 2 --steps 1 --warmup 1")
#   GPU_CHECK_CAPACITY_CAP   the cap (default: 24GiB on an accelerator, 3MiB on CPU)
#   GPU_CHECK_CAPACITY_HOST  host memory the swapping methods may hold (default: 48GiB, 1GiB)
#   GPU_CHECK_CAPACITY_ARGS  more capacity flags (default on an accelerator:
#                            "--methods no_swap,recompute,eager_swap"; on CPU: "--seq 64
#                            --search-max 12")
#   GPU_CHECK_LIMITS         "stage=seconds ..." replacing those stages' limits above (for a
#                            machine with more or less time; --limits shows the result)
# Then: PYTHONPATH=. python3 scripts/results_page.py --gpu-check "$OUT" writes the GPU tables of
# docs/results.md.
set -uo pipefail
cd "$(dirname "$0")/.."

STAGES=(headline=135 tools=45 setup=15 races=90 sanitizer=30 expandable=30 accelerator=80
        capacity=55)
KILL_GRACE=5  # seconds between SIGTERM and SIGKILL, inside each stage's limit
RACES=tests/reliability/test_cuda_races.py

limit_of() {  # the last of STAGES and GPU_CHECK_LIMITS that names the stage
  local kv limit=""
  # shellcheck disable=SC2206  # GPU_CHECK_LIMITS is a list of name=seconds words
  for kv in "${STAGES[@]}" ${GPU_CHECK_LIMITS:-}; do
    [ "${kv%%=*}" = "$1" ] && limit=${kv#*=}
  done
  echo "$limit"
}

if [ "${1:-}" = "--limits" ]; then
  total=0
  for kv in "${STAGES[@]}"; do
    limit=$(limit_of "${kv%%=*}")
    echo "${kv%%=*} $limit"
    total=$((total + limit))
  done
  echo "total $total"
  exit 0
fi

if [ "${1:-}" = "--setup" ]; then  # the setup stage, run under its limit: --setup OUT WHEELS
  python3 - > "$2/env.txt" 2>&1 <<'PY'
import os, platform, torch
print("torch", torch.__version__, "| python", platform.python_version(), "|", os.cpu_count(),
      "CPU cores")
acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
print("accelerator:", acc.type if acc is not None else "cpu")
if acc is not None:
    print("device:", torch.get_device_module(acc.type).get_device_name(0))
for name in ("transformers", "pytest", "hypothesis"):
    try:
        print(f"{name}:", __import__(name).__version__)
    except ImportError:
        print(f"{name}: missing")
PY
  if grep -q '^pytest: missing' "$2/env.txt" && [ -n "$3" ]; then
    python3 -m pip install --no-index --find-links "$3" pytest pytest-timeout hypothesis &&
      version=$(python3 -c 'import pytest; print(pytest.__version__)') &&
      sed -i "s/^pytest: missing/pytest: $version/" "$2/env.txt"
  fi
  exit 0
fi

for kv in "${STAGES[@]}"; do
  limit=$(limit_of "${kv%%=*}")
  if ! [[ "$limit" =~ ^[0-9]+$ ]] || [ "$limit" -le "$KILL_GRACE" ]; then
    echo "gpu_check.sh: the ${kv%%=*} stage's limit is '$limit'. It must be a whole number of" \
      "seconds above $KILL_GRACE (GPU_CHECK_LIMITS='${GPU_CHECK_LIMITS:-}')." >&2
    exit 99
  fi
done

OUT="${OUT:-$PWD/gpu_check_out}"
WHEELS="${1:-${WHEEL_DIR:-}}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
: > "$OUT/summary.txt"
: > "$OUT/stages.jsonl"
failed=0

summary() { echo "$*" | tee -a "$OUT/summary.txt"; }

record() {  # name, limit, exit status ("" when not run), seconds, files it writes
  local status=passed files="" f
  case "$3" in
    0) ;; "") status="not run" ;; 124|137) status="time limit" ;; *) status=failed ;;
  esac
  [ "$status" = passed ] || failed=$((failed + 1))
  for f in $5; do [ -e "$OUT/$f" ] && files="$files${files:+, }\"$f\""; done
  local fmt='{"stage": "%s", "limit_s": %s, "seconds": %s, "exit": %s, "status": "%s", '
  fmt+='"finished": "%s", "files": [%s]}\n'
  # shellcheck disable=SC2059  # the format is the variable above
  printf "$fmt" "$1" "$2" "$4" "${3:-null}" "$status" "$(date -u '+%Y-%m-%d %H:%M UTC')" \
    "$files" >> "$OUT/stages.jsonl"
  summary "$1: $status (exit ${3:-none}, ${4} s of ${2} s)"
}

run_stage() {  # name, log file, files it writes, command...
  local name=$1 log=$2 files=$3 limit start rc
  shift 3
  limit=$(limit_of "$name")
  start=$SECONDS
  timeout --kill-after="$KILL_GRACE" $((limit - KILL_GRACE)) "$@" > "$OUT/$log" 2>&1
  rc=$?
  record "$name" "$limit" "$rc" $((SECONDS - start)) "$log $files"
}

pytest_stage() {  # like run_stage; not run (and counted) where pytest is missing
  if grep -q '^pytest: missing' "$OUT/env.txt" 2>/dev/null; then
    record "$1" "$(limit_of "$1")" "" 0 ""
    summary "  pytest is not installed: give WHEEL_DIR (scripts/fetch_test_wheels.sh fills one)"
    return
  fi
  run_stage "$@"
}

# --- headline: the table first, before anything else --------------------------------------
preset=()
[ -n "${GPU_CHECK_PRESET:-}" ] && preset=(--preset "$GPU_CHECK_PRESET")
# shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of extra flags
run_stage headline headline.txt "headline.json headline.png" \
  python3 -m swap_pass bench ${preset[@]+"${preset[@]}"} \
  --methods no_swap,recompute,eager_swap,save_on_cpu,hf_offload --no-smart-rows --no-host-rows \
  ${GPU_CHECK_BENCH_ARGS:-} --json "$OUT/headline.json"
sed -n '/^against full recompute/,/^$/p' "$OUT/headline.txt"
grep -E '^(bandwidth anchor|.*: SKIPPED: |.*: FAILED: )' "$OUT/headline.txt"

# --- tools: TRL's, torchtune's and accelerate's offloading beside the flags swap_pass serves ---
# shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of extra flags
run_stage tools tools.txt "tools.json tools.png" \
  python3 -m swap_pass bench ${preset[@]+"${preset[@]}"} --layers 2 --steps 3 --warmup 1 \
  --methods hf_recompute,trl_offload,trl_offload_all,trl_swap,torchtune_offload,torchtune_swap,accelerate_offload,accelerate_swap \
  --no-smart-rows --no-host-rows ${GPU_CHECK_BENCH_ARGS:-} --json "$OUT/tools.json"
sed -n "/^fine-tuning tools' offloading/,/^\$/p" "$OUT/tools.txt"
grep -E '^.*: (SKIPPED|FAILED): ' "$OUT/tools.txt"

# --- setup ------------------------------------------------------------------------------------
run_stage setup setup.txt env.txt bash "$0" --setup "$OUT" "$WHEELS"
cat "$OUT/env.txt"
accelerator=$(sed -n 's/^accelerator: //p' "$OUT/env.txt")

# --- races, sanitizer, expandable segments, the other accelerator tests -----------------------
pytest_stage races pytest-races.txt "races-junit.xml pinned.txt" \
  env OUT="$OUT" python3 -m pytest -v -p no:cacheprovider -rs "$RACES" -k "not sanitizer" \
  --junitxml "$OUT/races-junit.xml"
tail -n 5 "$OUT/pytest-races.txt"
[ -f "$OUT/pinned.txt" ] && summary "  $(cat "$OUT/pinned.txt")"

pytest_stage sanitizer pytest-sanitizer.txt sanitizer-junit.xml \
  python3 -m pytest -v -p no:cacheprovider -rs "$RACES" -k sanitizer \
  --junitxml "$OUT/sanitizer-junit.xml"
tail -n 3 "$OUT/pytest-sanitizer.txt"

pytest_stage expandable pytest-expandable.txt expandable-junit.xml \
  env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 -m pytest -v -p no:cacheprovider \
  -rs "$RACES" -k "(eager_exact and plain) or (per_step and not compute)" \
  --junitxml "$OUT/expandable-junit.xml"
tail -n 3 "$OUT/pytest-expandable.txt"

ignore=(--ignore "$RACES" --ignore tests/integrations)  # the frameworks are not installed there
if grep -q '^hypothesis: missing' "$OUT/env.txt"; then  # modules that cannot be collected
  for f in $(grep -rlE '^(from|import) hypothesis' tests); do ignore+=(--ignore "$f"); done
fi
pytest_stage accelerator pytest-accelerator.txt "accelerator-junit.xml accelerator-peaks.json" \
  env OUT="$OUT" python3 -m pytest -v -p no:cacheprovider -rs -m accelerator "${ignore[@]}" \
  --junitxml "$OUT/accelerator-junit.xml"
tail -n 3 "$OUT/pytest-accelerator.txt"

# --- capacity under a real cap, last ----------------------------------------------------------
# Without an accelerator (or without env.txt to say) a virtual cap this machine can hold.
if [ "${accelerator:-cpu}" = "cpu" ]; then
  cap=${GPU_CHECK_CAPACITY_CAP:-3MiB} host=${GPU_CHECK_CAPACITY_HOST:-1GiB}
  cap_args=${GPU_CHECK_CAPACITY_ARGS:---seq 64 --search-max 12}
else
  cap=${GPU_CHECK_CAPACITY_CAP:-24GiB} host=${GPU_CHECK_CAPACITY_HOST:-48GiB}
  cap_args=${GPU_CHECK_CAPACITY_ARGS:---methods no_swap,recompute,eager_swap}
fi
# shellcheck disable=SC2086  # cap_args is a list of extra flags
run_stage capacity capacity.txt capacity.json \
  python3 -m swap_pass capacity ${preset[@]+"${preset[@]}"} --device-memory "$cap" \
  --max-host-bytes "$host" $cap_args --json "$OUT/capacity.json"
grep -v '^\.\.\. ' "$OUT/capacity.txt" | tail -n 10

summary "gpu_check: $failed stage(s) did not pass; outputs in $OUT"
exit "$failed"
