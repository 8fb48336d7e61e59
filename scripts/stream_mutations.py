#!/usr/bin/env python3
"""Show that the stream-model checker catches deleted stream waits: mutate a copy, run the tests.

Each mutation deletes one kind of ordering from a temporary copy of the working tree and runs
the given tests there under the CPU stream model (``SWAP_PASS_STREAM_MODEL=1``); the swap tests
must then fail. ``none`` runs the same tests unmutated (they must pass).

    python3 scripts/stream_mutations.py [--tests PATH ...] [MUTATION ...]

Mutations (default: all):
  producer_waits  the side streams no longer wait on the compute stream before a copy
                  (SwapTensors' copies and the graph ops swap_out / prefetch)
  h2d_producer_wait  the copy-back side streams no longer wait on the compute stream, which
                  allocated the destination (SwapTensors' copies back and the graph op prefetch)
  release_events  host buffers go back to the pool without their last copy's event
                  (wait_h2d, discard, a dropped group, the graph wait, reset)
  abandon_wait    a copy out abandoned by restore() from "d2h" is not waited for by compute
  death_waits     a graph op's tensor that dies before its wait (a swap_out source, a prefetch
                  output) no longer orders compute after its copy
  given_compute_stream  SwapTensors ignores ``compute_stream=`` (the producer's stream a caller
                  names) and takes the stream current when the swap begins
  late_compute_stream   SwapTensors' compute stream waits go to the stream current at each wait,
                  not to the one fixed when the swap began
  entry_stream    (device only) the eager layer protocol no longer reads the compute stream at
                  the layer's entry: each swap takes the stream current when it begins (the
                  copy again, after the forward, of an input the layer wrote in place)
With ``--device`` the tests run on the test accelerator instead (``SWAP_PASS_TEST_ACCELERATOR=1``:
the CPU-backed PrivateUse1 device of ``swap_pass.testing.load_test_accelerator``, whose side-stream
copies really run later): only the tests that run on the device (marked ``accelerator``), by
default those of ``tests/accelerator tests/runtime``.
Device-only mutations run with ``--device`` only (unless named): the stream model cannot see
them, since it takes a block's allocating stream to be the compute stream current where the
storage first met it, which is the very stream such a mutation orders on.
Prints one line per mutation: the pytest summary and whether it failed as it must.
Exit status: 0 when every mutation failed its tests and ``none`` passed (a device-only mutation
named under the model is reported, not judged).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ST = "swap_pass/runtime/swap_tensors.py"
OPS = "swap_pass/graph/ops.py"
PROTOCOL = "swap_pass/eager/_protocol.py"

# (file, text, replacement, count): each must match exactly ``count`` times.
MUTATIONS: dict[str, list[tuple[str, str, str, int]]] = {
    "none": [],
    "producer_waits": [
        (ST, "        ds.wait(stream, ds.record_event(compute))\n", "        pass\n", 1),
        (OPS, "    ds.wait(stream, ready)\n", "", 2),
    ],
    "h2d_producer_wait": [
        (ST, "    if stream is not None:\n        ds.wait(stream, ds.record_event(compute))\n",
         "    if stream is not None and to_host:\n"
         "        ds.wait(stream, ds.record_event(compute))\n", 1),
        (OPS, "    stream = ds.h2d_stream()\n    ds.wait(stream, ready)\n",
         "    stream = ds.h2d_stream()\n", 1),
    ],
    "release_events": [
        (ST, "self._release_host_buffers(event)  #", "self._release_host_buffers()  #", 1),
        (ST, "self._release_host_buffers(self._event)  # the buffers' last copy",
         "self._release_host_buffers()", 1),
        (ST, "bufs, event=self._event,", "bufs, event=None,", 1),
        (OPS, "release_when_unread(transfer.release, transfer.event)",
         "release_when_unread(transfer.release)", 2),
        (OPS, "host_pool().release(buf, event)", "host_pool().release(buf)", 1),
    ],
    "abandon_wait": [
        (ST, "        self._wait_on_compute(self._event)\n"
             "        self._release_host_buffers(self._event)\n",
         "        self._release_host_buffers(self._event)\n", 1),
    ],
    "death_waits": [
        (OPS, "    if not transfer.ordered:\n        _order_compute_after(transfer)\n",
         "    return None\n", 1),
        (OPS, "        del _transfers[key]\n    _order_compute_after(transfer)\n",
         "        del _transfers[key]\n", 1),
    ],
    "given_compute_stream": [
        (ST, "        self._compute = compute_stream  # None:",
         "        self._compute = None  #", 1),
    ],
    "late_compute_stream": [
        (ST, "(self._ds or self._streams()).wait(self._compute, event)",
         "(self._ds or self._streams()).wait(self._ds.compute_stream(), event)", 1),
    ],
    "entry_stream": [
        (PROTOCOL, "entry_stream = entry_compute_stream(hidden_states) if claimed else None",
         "entry_stream = None", 1),
    ],
}
DEVICE_ONLY = {"entry_stream"}
DEFAULT_TESTS = ["tests/runtime", "tests/graph/test_ops.py"]
DEVICE_TESTS = ["tests/accelerator", "tests/runtime"]


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


def _mutate(tree: Path, edits: list[tuple[str, str, str, int]]) -> None:
    for name, text, replacement, count in edits:
        path = tree / name
        source = path.read_text()
        found = source.count(text)
        if found != count:
            sys.exit(f"stream_mutations: {name}: expected {count} match(es) of {text!r}, "
                     f"found {found}")
        path.write_text(source.replace(text, replacement))


def run(mutation: str, tests: list[str], device: bool = False) -> tuple[bool | None, str]:
    """Run ``tests`` on a mutated copy (under the stream model, or on the test accelerator when
    ``device``); return (as expected, or None when not judged; pytest's summary line)."""
    with tempfile.TemporaryDirectory(prefix="swap_pass_mutation_") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        _mutate(tree, MUTATIONS[mutation])
        mode = "SWAP_PASS_TEST_ACCELERATOR" if device else "SWAP_PASS_STREAM_MODEL"
        env = {**os.environ, "PYTHONPATH": str(tree), mode: "1"}
        marks = "accelerator and not slow" if device else "not slow"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", marks, "-p",
                               "no:cacheprovider", *tests], cwd=tree, env=env, capture_output=True,
                              text=True)
    lines = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    summary = lines[-1].strip("= ") if lines else proc.stdout[-300:] + proc.stderr[-300:]
    if mutation in DEVICE_ONLY and not device:
        return None, summary
    expected = proc.returncode == 0 if mutation == "none" else proc.returncode == 1
    return expected, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mutations", nargs="*", help=f"some of {list(MUTATIONS)}; default: all")
    parser.add_argument("--tests", nargs="+", default=None)
    parser.add_argument("--device", action="store_true",
                        help="run on the test accelerator instead of the stream model")
    args = parser.parse_args()
    args.tests = args.tests or (DEVICE_TESTS if args.device else DEFAULT_TESTS)
    unknown = set(args.mutations) - set(MUTATIONS)
    if unknown:
        parser.error(f"unknown mutation(s) {sorted(unknown)}; choose from {list(MUTATIONS)}")
    args.mutations = args.mutations or [m for m in MUTATIONS
                                        if args.device or m not in DEVICE_ONLY]
    ok = True
    for mutation in args.mutations:
        expected, summary = run(mutation, args.tests, args.device)
        ok &= expected is not False
        verdict = ("device only: not judged under the model" if expected is None
                   else "as it must" if expected else "NOT AS IT MUST")
        print(f"{mutation}: {summary} ({verdict})", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
