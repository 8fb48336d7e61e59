#!/usr/bin/env python3
"""Show that the test accelerator catches deleted stream waits: mutate a copy, run the tests.

Each mutation deletes one kind of ordering from a temporary copy of the working tree and runs
the given tests there on the test accelerator (``SWAP_PASS_TEST_ACCELERATOR=1``: the CPU-backed
PrivateUse1 device of ``swap_pass.testing.load_test_accelerator``, whose side-stream copies really
run later and whose order check counts every unordered read, write or free); only the tests that
run on the device (marked ``accelerator``, not ``slow``), by default those of
``tests/accelerator tests/runtime``. The tests must then fail. ``none`` runs the same tests
unmutated (they must pass).

    python3 scripts/stream_mutations.py [MUTATION ...] [--tests PATH ...]

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
  entry_stream    the eager layer protocol no longer reads the compute stream at the layer's
                  entry: each swap takes the stream current when it begins (the copy again,
                  after the forward, of an input the layer wrote in place)
``--device`` is accepted and changes nothing: the device is the only mode (the CPU stream model
these runs once also used is retired; docs/reliability.md, section 8).
Prints one line per mutation: the pytest summary and whether it failed as it must.
Exit status: 0 when every mutation failed its tests and ``none`` passed.
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
ST = "swap_pass/runtime/group.py"
STORAGES = "swap_pass/runtime/storages.py"
OPS = "swap_pass/graph/ops.py"
PROTOCOL = "swap_pass/eager/_protocol.py"

# (file, text, replacement, count): each must match exactly ``count`` times.
MUTATIONS: dict[str, list[tuple[str, str, str, int]]] = {
    "none": [],
    "producer_waits": [
        (STORAGES, "        ds.wait(stream, ds.record_event(compute))\n", "        pass\n", 1),
        (OPS, "    ds.wait(stream, ready)\n", "", 2),
    ],
    "h2d_producer_wait": [
        (STORAGES,
         "    if stream is not None:\n        ds.wait(stream, ds.record_event(compute))\n",
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
        (ST, "            self._wait_on_compute(self._event)\n"
             "        self._release_host_buffers(self._event)\n",
         "            pass\n        self._release_host_buffers(self._event)\n", 1),
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
DEFAULT_TESTS = ["tests/accelerator", "tests/runtime"]


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


def run(mutation: str, tests: list[str]) -> tuple[bool, str]:
    """Run the device tests among ``tests`` on a mutated copy of the tree; return (as expected,
    pytest's summary line)."""
    with tempfile.TemporaryDirectory(prefix="swap_pass_mutation_") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        _mutate(tree, MUTATIONS[mutation])
        env = {**os.environ, "PYTHONPATH": str(tree), "SWAP_PASS_TEST_ACCELERATOR": "1"}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m",
                               "accelerator and not slow", "-p", "no:cacheprovider", *tests],
                              cwd=tree, env=env, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if re.search(r"\d+ (passed|failed)", ln)]
    summary = lines[-1].strip("= ") if lines else proc.stdout[-300:] + proc.stderr[-300:]
    expected = proc.returncode == 0 if mutation == "none" else proc.returncode == 1
    return expected, summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mutations", nargs="*", help=f"some of {list(MUTATIONS)}; default: all")
    parser.add_argument("--tests", nargs="+", default=DEFAULT_TESTS,
                        help=f"test paths (default: {' '.join(DEFAULT_TESTS)})")
    parser.add_argument("--device", action="store_true",
                        help="accepted for old command lines; the device is the only mode")
    args = parser.parse_args()
    unknown = set(args.mutations) - set(MUTATIONS)
    if unknown:
        parser.error(f"unknown mutation(s) {sorted(unknown)}; choose from {list(MUTATIONS)}")
    ok = True
    for mutation in args.mutations or list(MUTATIONS):
        expected, summary = run(mutation, args.tests)
        ok &= expected
        print(f"{mutation}: {summary} ({'as it must' if expected else 'NOT AS IT MUST'})",
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
