"""Measurements of the runtime on the test accelerator, recorded in ``docs/results.md``
("The runtime on the test accelerator"). Not a test: run it as a module.

``python3 -m tests.accelerator.pool_measurements lengths``: the host pool's reserved bytes and
the pinned allocator's reserved bytes after each of eight steps of changing sequence lengths
(four layer inputs of ``seq x 1024`` fp32 on the host at once).

``python3 -m tests.accelerator.pool_measurements reserved {on,off} {compute,producer}``: the
device allocator's reserved bytes over five steps of eight 4 MiB layer inputs, each freed one
layer later (the next copy out already queued), with the copy stream recorded on each storage
(``on``, the runtime's rule) or not (``off``); the inputs produced on the compute stream or on
another stream. See Note: [Frees on the allocating stream] in ``swap_pass/runtime/device.py``.
"""

from __future__ import annotations

import sys

import torch

import swap_pass
from swap_pass import SwapTensors
from swap_pass.runtime.device import DeviceStreams
from swap_pass.runtime.host_pool import host_pool
from swap_pass.testing import accelerator as device_knobs
from swap_pass.testing import load_test_accelerator

MIB = 1 << 20


def lengths(dev: torch.device) -> None:
    device_knobs.set_delay(False)
    hidden, layers = 1024, 4
    print("| seq | one step needs | pool reserved | allocator pinned reserved | pool bound |")
    print("|---|---|---|---|---|")
    for seq in [500, 512, 530, 541, 600, 613, 700, 777]:
        xs = [torch.randn(seq, hidden, device=dev) for _ in range(layers)]
        groups = [SwapTensors([x]) for x in xs]
        for g in groups:
            g.swap_to_host()
            g.wait_d2h()
        for g in reversed(groups):
            g.swap_to_device()
            g.wait_h2d()
        del groups, xs
        device_knobs.synchronize()
        bound = getattr(swap_pass.swap_stats(), "host_pool_bound_bytes", None)
        print(f"| {seq} | {layers * seq * hidden * 4 / MIB:.1f} MiB | "
              f"{host_pool().bytes_reserved // MIB} MiB | "
              f"{device_knobs.pinned_stats()['pinned_bytes_reserved'] // MIB} MiB | "
              f"{'-' if bound is None else f'{bound // MIB} MiB'} |")
    swap_pass.reset()


def reserved(dev: torch.device, record: bool, producer: bool) -> None:
    device_knobs.set_delay(True, 1.0, 3.0)
    if not record:
        DeviceStreams.keep_for_copy = staticmethod(lambda tensor, stream: None)
    hidden, seq, layers, steps = 1024, 1024, 8, 5
    compute, side = torch.accelerator.current_stream(dev), torch.Stream(device=dev)
    w = torch.randn(hidden, hidden, device=dev) / 32
    for step in range(steps):
        x = torch.randn(seq, hidden, device=dev)
        groups, prev = [], None
        for _ in range(layers):
            if producer:
                side.wait_stream(compute)
                with side:
                    x = torch.tanh(x @ w)
                compute.wait_stream(side)
            else:
                x = torch.tanh(x @ w)
            group = SwapTensors([x])
            group.swap_to_host()
            if prev is not None:
                prev.wait_d2h()  # freed one layer later: the next copy out is queued
            torch.empty(seq, hidden, device=dev).fill_(1.0)  # the layer's own allocation
            groups.append(group)
            prev = group
        prev.wait_d2h()
        for group in reversed(groups):
            group.swap_to_device()
            group.wait_h2d()
        del groups, group, prev, x
        device_knobs.synchronize()
        s = device_knobs.memory_stats()
        print(f"record_stream {'on' if record else 'off'}, inputs from the "
              f"{'producer' if producer else 'compute'} stream, step {step}: reserved "
              f"{s['reserved_bytes'] // MIB} MiB, fresh blocks {s['fresh_blocks']}, "
              f"unordered_frees {s.get('unordered_frees', 0)}")
    swap_pass.reset()


if __name__ == "__main__":
    device = torch.device(load_test_accelerator(), 0)
    if sys.argv[1] == "lengths":
        lengths(device)
    else:
        reserved(device, sys.argv[2] == "on", sys.argv[3] == "producer")
