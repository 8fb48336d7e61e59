"""Start a worker's ranks as spawned processes, killed when they outlive a deadline.

A rank stuck in a collective (its peer failed) would outlive the test's timeout, and pytest's
exit waits for non-daemon children: the whole run would hang, not fail.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn, nprocs: int, out: Path, *args, seconds: float = 600) -> list[dict]:
    """Run ``fn(rank, nprocs, port, str(out), *args)`` on ``nprocs`` ranks; each writes
    ``out/rank<r>.json``, returned in rank order."""
    spawn_with_deadline(fn, (nprocs, free_port(), str(out), *args), nprocs, seconds)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nprocs)]


def spawn_with_deadline(fn, args: tuple, nprocs: int, seconds: float) -> None:
    """``mp.spawn`` of ``fn(rank, *args)`` that kills the ranks when they outlive ``seconds``."""
    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + seconds
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {seconds} s; killed")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
                proc.join()
