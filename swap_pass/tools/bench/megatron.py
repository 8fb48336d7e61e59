"""Megatron rows of ``swap-pass bench --megatron``: swap_pass against Megatron's own choices.

One megatron-core ``GPTModel`` (local layer spec), trained through Megatron's own
``get_forward_backward_func()`` on one rank, four ways:

* ``none``: no recompute (the reference of every ratio);
* ``recompute``: full recompute, ``uniform``, one layer per checkpoint;
* ``swap_pass``: the same full recompute plus ``swap_pass.integrations.megatron.enable``;
* ``megatron_offload``: Megatron's fine-grained activation offloading
  (``fine_grained_activation_offloading``, every ``offload_modules`` choice a dense layer has).

Each row: peak memory above the step's start (``swap_pass.tools.bench.measure.profile_step``),
median step time, both as ratios to ``none``, and whether the losses and gradients are bitwise equal
to the row's reference (``swap_pass`` against ``recompute``, the others against ``none``).

megatron-core is imported only here, and only when the rows run. Its RNG tracker and schedules
need CUDA: on other devices :func:`megatron_section` says so instead of running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from swap_pass.tools.bench.measure import profile_step, synchronize

__all__ = ["MegatronBenchSizes", "format_megatron", "forward_step", "megatron_rows",
           "megatron_section"]

METHODS = ("none", "recompute", "swap_pass", "megatron_offload")
_REFERENCE = {"none": "none", "recompute": "none", "swap_pass": "recompute",
              "megatron_offload": "none"}
_OFFLOAD_MODULES = ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm"]


@dataclasses.dataclass(frozen=True)
class MegatronBenchSizes:
    """The model and step measured. Default: an 8-layer 2048-wide GPT, 4096 tokens, fp32."""

    num_layers: int = 8
    hidden: int = 2048
    heads: int = 16
    ffn: int = 8192
    vocab: int = 32000
    seq: int = 4096
    micro_batch: int = 1
    micro_batches: int = 1
    steps: int = 3


# --- setup ----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _single_rank(device: torch.device) -> Iterator[None]:
    """A one-rank process group and Megatron's parallel state (made here, torn down after)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    made_group = not dist.is_initialized()
    if made_group:
        backend = dist.Backend.default_device_backend_map.get(device.type, "gloo")
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
    made_state = not parallel_state.model_parallel_is_initialized()
    if made_state:
        parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if made_state:
            parallel_state.destroy_model_parallel()
        if made_group:
            dist.destroy_process_group()


def _config(method: str, sizes: MegatronBenchSizes):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict = {}
    if method in ("recompute", "swap_pass"):
        kw = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif method == "megatron_offload":
        kw = dict(fine_grained_activation_offloading=True, offload_modules=list(_OFFLOAD_MODULES))
    return TransformerConfig(
        num_layers=sizes.num_layers, hidden_size=sizes.hidden, num_attention_heads=sizes.heads,
        ffn_hidden_size=sizes.ffn, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        **kw)


def _model(method: str, sizes: MegatronBenchSizes, device: torch.device, seed: int):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    model = GPTModel(config=_config(method, sizes),
                     transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=sizes.vocab, max_sequence_length=sizes.seq,
                     position_embedding_type="rope")
    return model.to(device)


def _batches(sizes: MegatronBenchSizes, device: torch.device, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(sizes.micro_batches):
        tokens = torch.randint(0, sizes.vocab, (sizes.micro_batch, sizes.seq + 1), generator=gen)
        out.append({
            "input_ids": tokens[:, :-1].to(device), "labels": tokens[:, 1:].to(device),
            "position_ids": torch.arange(sizes.seq, device=device).expand(sizes.micro_batch, -1),
            "attention_mask": torch.triu(torch.ones(1, 1, sizes.seq, sizes.seq, dtype=torch.bool,
                                                    device=device), 1)})
    return out


# --- one step -------------------------------------------------------------------------------


def forward_step(data_iterator, model):
    """Megatron's ``forward_step_func``: one micro-batch's loss (mean over tokens)."""
    batch = next(data_iterator)
    out = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                labels=batch["labels"])

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}
    return out, loss_func


def _stepper(model, sizes: MegatronBenchSizes, batches: list[dict],
             seed: int) -> Callable[[], list[torch.Tensor]]:
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    run = get_forward_backward_func()

    def step() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        losses = run(forward_step_func=forward_step, data_iterator=iter(batches), model=model,
                     num_microbatches=sizes.micro_batches, seq_length=sizes.seq,
                     micro_batch_size=sizes.micro_batch, forward_only=False)
        return [out["loss"] for out in losses]
    return step


def _run_method(method: str, sizes: MegatronBenchSizes, device: torch.device, seed: int) -> dict:
    import swap_pass
    from swap_pass.integrations import megatron as sp_megatron

    model = _model(method, sizes, device, seed)
    step = _stepper(model, sizes, _batches(sizes, device, seed), seed)
    swap_pass.reset()
    handle = sp_megatron.enable(model) if method == "swap_pass" else None
    try:
        losses = step()  # warm-up (host pools, allocator); its losses and grads are compared
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}
        peak = profile_step(device, step).peak_bytes
        times = []
        for _ in range(sizes.steps):
            synchronize(device)
            t0 = time.perf_counter()
            step()
            synchronize(device)
            times.append(time.perf_counter() - t0)
        swapped = swap_pass.swap_stats().swapped_out_bytes
    finally:
        if handle is not None:
            handle.remove()
    return {"method": method, "status": "ok", "peak_bytes": peak,
            "step_s": statistics.median(times), "swapped_out_bytes": swapped,
            "_losses": losses, "_grads": grads}


# --- rows -----------------------------------------------------------------------------------


def _exact(row: dict, ref: dict) -> bool | None:
    if row.get("status") != "ok" or ref.get("status") != "ok":
        return None
    return (all(torch.equal(a, b) for a, b in zip(row["_losses"], ref["_losses"], strict=True))
            and row["_grads"].keys() == ref["_grads"].keys()
            and all(torch.equal(row["_grads"][n], ref["_grads"][n]) for n in ref["_grads"]))


def _finish(rows: dict[str, dict]) -> list[dict]:
    base = rows.get("none", {})
    out = []
    for method, row in rows.items():
        ref = rows.get(_REFERENCE[method], {})
        if row["status"] == "ok":
            row["exact_vs"] = _REFERENCE[method]
            row["exact"] = _exact(row, ref) if method != "none" else True
            if base.get("status") == "ok":
                row["memory_ratio"] = row["peak_bytes"] / base["peak_bytes"]
                row["time_ratio"] = row["step_s"] / base["step_s"]
        out.append({k: v for k, v in row.items() if not k.startswith("_")})
    return out


def megatron_rows(device: torch.device, sizes: MegatronBenchSizes = MegatronBenchSizes(), *,
                  methods: tuple[str, ...] = METHODS, seed: int = 0) -> list[dict]:
    """Run the Megatron rows on ``device`` (megatron-core must import and run there).

    A method that raises becomes a row with ``status`` ``"failed: <error>"``.
    """
    rows: dict[str, dict] = {}
    with _single_rank(device):
        for method in methods:
            try:
                rows[method] = _run_method(method, sizes, device, seed)
            except Exception as err:  # noqa: BLE001 - one failed peer must not hide the others
                rows[method] = {"method": method, "status": f"failed: {type(err).__name__}: {err}"}
    return _finish(rows)


def megatron_section(device: torch.device, sizes: MegatronBenchSizes = MegatronBenchSizes(),
                     ) -> dict:
    """The rows, or why they did not run: ``{"status", "reason", "rows"}``."""
    if importlib.util.find_spec("megatron") is None or \
            importlib.util.find_spec("megatron.core") is None:
        return {"status": "skipped", "rows": [],
                "reason": "megatron-core is not installed (pip install 'swap-pass[megatron]')"}
    if device.type != "cuda":
        return {"status": "skipped", "rows": [],
                "reason": f"megatron-core's RNG tracker and schedules need CUDA; device is "
                          f"{device.type}"}
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's own requirement
    return {"status": "ok", "reason": "", "rows": megatron_rows(device, sizes)}


def format_megatron(section: dict) -> list[str]:
    """The section as text lines (a table, or one line saying why it did not run)."""
    if section["status"] != "ok":
        return [f"Megatron rows: SKIPPED: {section['reason']}"]
    lines = ["Megatron GPTModel (get_forward_backward_func, one rank):",
             f"{'method':<18}{'peak MiB':>10}{'mem x':>8}{'step s':>9}{'time x':>8}"
             f"{'swapped MiB':>13}  exact"]
    for r in section["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['method']:<18}{r['status']}")
            continue
        exact = {True: "yes", False: "NO", None: "-"}[r.get("exact")]
        lines.append(f"{r['method']:<18}{r['peak_bytes'] / 2**20:>10.1f}"
                     f"{r.get('memory_ratio', float('nan')):>8.2f}{r['step_s']:>9.3f}"
                     f"{r.get('time_ratio', float('nan')):>8.2f}"
                     f"{r['swapped_out_bytes'] / 2**20:>13.1f}  {exact} (vs {r['exact_vs']})")
    return lines
