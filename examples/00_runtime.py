"""The runtime by hand: swap one activation autograd saved, free it, bring it back, check gradients.

This is what every way into swap_pass does for you, one group at a time::

    python examples/00_runtime.py
"""

from __future__ import annotations

import torch

import swap_pass
from swap_pass import SwapTensors, swap_stats


def grads(swap: bool) -> torch.Tensor:
    """Gradient of ``sum(tanh(x) * w)``; with ``swap``, tanh's saved output spends backward's
    wait on the host."""
    torch.manual_seed(0)
    x = torch.randn(512, 512, requires_grad=True)
    w = torch.randn(512, 512)
    h = torch.tanh(x)  # autograd saves h for tanh's backward
    loss = (h * w).sum()
    if swap:
        group = SwapTensors([h])
        group.swap_to_host()
        group.wait_d2h()  # h's storage is freed: reading h now would be an error
        assert h.untyped_storage().nbytes() == 0 and group.stat == "host"
        group.swap_to_device()
        group.wait_h2d()  # restored in place, before backward reads it
        assert group.stat == "device"
    loss.backward()
    return x.grad


def main() -> int:
    swap_pass.reset()
    # Warm-up: on CPU with several threads, the first torch.tanh of a process can differ from
    # every later one (a torch first-call effect, not swap_pass); compare steady-state calls.
    grads(swap=False)
    expected, got = grads(swap=False), grads(swap=True)
    stats = swap_stats()
    assert torch.equal(expected, got), "gradients differ"
    assert stats.swapped_out_bytes == stats.swapped_in_bytes == 512 * 512 * 4
    assert stats.host_bytes_in_use == 0
    print(f"swapped out {stats.swapped_out_bytes} bytes and back; "
          f"host bytes in use now: {stats.host_bytes_in_use}")
    print("OK: gradients bitwise equal with and without the swap")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
