"""Inductor for the test accelerator: its C++ (CPU) code generation, run in stream order.

The device's memory is host RAM, so Inductor's C++ kernels (``CppScheduling``) can read and write
it directly. They do not go through the dispatcher, so the generated wrapper calls
:func:`kernel_barrier` before each one, with the kernel's pointer arguments by role (a
``const T*`` is read, any other pointer written): the C++ side drains the current stream, checks
each read against its block's last write (an unordered one reads poison and counts in
``memory_stats()["unordered_reads"]``, as an eager op's read would) and notes the writes. Extern
kernels (``mm``, SDPA, the ``swap_pass`` ops) dispatch to the device as eager ops do.

What is registered (as PyTorch's own out-of-tree backend test does):

* a device interface for Dynamo (a :class:`~torch._dynamo.device_interface.CpuInterface` that
  answers with the device's index, count and synchronize);
* device op overrides for the wrapper (stream and guard lines; the raw stream is 0: C++ kernels
  take none);
* ``CppScheduling`` with :class:`_Wrapper`, a ``PythonWrapperCodegen`` that writes the barrier.

Inductor decides two things by ``device.type == "cpu"`` that must hold for this device too:
``BaseSchedulerNode.is_cpu`` (the CPU-only fusion and loop reindexing its C++ kernels need) and
``utils.get_current_backend`` (which answers ``config.cuda_backend`` for any unknown device). Both
are wrapped, for this device type only, in every Inductor module that imported them; every other
device gets the original answer.
"""

from __future__ import annotations

import hashlib
import pathlib
import re
import sys

import torch

__all__ = ["install", "kernel_barrier"]

_barrier = None  # the extension's kernel_barrier, set by install()
_installed = False


def kernel_barrier(reads: list, writes: list) -> None:
    """Order the next C++ kernel after its arguments' streams; check its reads, note its writes.

    Called by the generated wrapper code with the kernel's tensor arguments (scalars are
    dropped here).
    """
    _barrier([t for t in reads if isinstance(t, torch.Tensor)],
             [t for t in writes if isinstance(t, torch.Tensor)])


def _op_overrides(device_type: str):
    from torch._inductor.codegen.common import DeviceOpOverrides

    class Overrides(DeviceOpOverrides):
        def import_get_raw_stream_as(self, name: str) -> str:
            return f"def {name}(_): return 0"

        def set_device(self, device_idx: int) -> str:
            return f"torch.accelerator.set_device_index({device_idx})"

        def synchronize(self) -> str:
            return "torch.accelerator.synchronize()"

        def device_guard(self, device_idx: int) -> str:
            return f"torch.accelerator.device_index({device_idx})"

        def current_stream(self) -> str:
            return "torch.accelerator.current_stream()"

        def cpp_kernel_type(self) -> str:
            return "void*"

    return Overrides()


_ARG_TYPES = re.compile(r"cpp_pybinding\(\[([^\]]*)\]")


def _wrapper_class(device_type: str):
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen, SubgraphPythonWrapperCodegen
    from torch._inductor.virtualized import V

    class Wrapper(PythonWrapperCodegen):
        """Calls each C++ kernel as on CPU, after a ``kernel_barrier`` line with its arguments
        by role (read from the kernel's ``cpp_pybinding`` signature)."""

        @staticmethod
        def create(is_subgraph, subgraph_name, parent_wrapper, partition_signatures=None):
            if is_subgraph:
                return SubgraphPythonWrapperCodegen(subgraph_name, parent_wrapper,
                                                    partition_signatures)
            return Wrapper()

        def write_header(self) -> None:
            super().write_header()
            self.imports.writeline(f"from {__name__} import kernel_barrier")

        def define_kernel(self, kernel_name, kernel_body, *args, **kwargs):
            found = _ARG_TYPES.search(kernel_body)
            if found:
                types = [t.strip().strip("'\"") for t in found.group(1).split(",")]
                self.__dict__.setdefault("_arg_types", {})[kernel_name] = types
            return super().define_kernel(kernel_name, kernel_body, *args, **kwargs)

        def _generate_kernel_call_helper(self, kernel_name, call_args, *, device=None, **kwargs):
            device = device or V.graph.get_current_device_or_throw()
            if device.type == device_type:
                self.writeline(self._barrier_line(kernel_name, call_args))
                device = torch.device("cpu")
            super()._generate_kernel_call_helper(kernel_name, call_args, device=device, **kwargs)

        def _barrier_line(self, kernel_name: str, call_args) -> str:
            types = self.__dict__.get("_arg_types", {}).get(kernel_name)
            names = [str(a) for a in call_args]
            if types is None or len(types) != len(names):  # roles unknown: all read and written
                return f"kernel_barrier([{', '.join(names)}], [{', '.join(names)}])"
            reads = [a for a, t in zip(names, types, strict=True)
                     if t.endswith("*") and t.startswith("const")]
            writes = [a for a, t in zip(names, types, strict=True)
                      if t.endswith("*") and not t.startswith("const")]
            return f"kernel_barrier([{', '.join(reads)}], [{', '.join(writes)}])"

    return Wrapper


def _device_interface():
    from torch._dynamo.device_interface import CpuInterface

    class Interface(CpuInterface):
        @staticmethod
        def current_device() -> int:
            return torch.accelerator.current_device_index()

        @staticmethod
        def set_device(device) -> None:
            torch.accelerator.set_device_index(device)

        @staticmethod
        def device_count() -> int:
            return torch.accelerator.device_count()

        @staticmethod
        def synchronize(device=None) -> None:
            torch.accelerator.synchronize(device)

        @staticmethod
        def is_triton_capable(device=None) -> bool:
            return False

    return Interface


def _schedule_as_cpu(device_type: str) -> None:
    """``BaseSchedulerNode.is_cpu`` true for this device too (its kernels are C++ ones)."""
    from torch._inductor import scheduler

    original = scheduler.BaseSchedulerNode.is_cpu

    def is_cpu(self) -> bool:
        device = self.get_device()
        return (device is not None and device.type == device_type) or original(self)

    scheduler.BaseSchedulerNode.is_cpu = is_cpu


def _cpu_backend_for(device_type: str) -> None:
    """``get_current_backend`` answers ``config.cpu_backend`` for this device, wherever an
    Inductor module imported it."""
    from torch._inductor import config, utils
    from torch._inductor.virtualized import V

    original = utils.get_current_backend

    def get_current_backend(device: str | None = None) -> str:
        kind = device or V.graph.get_current_device_or_throw().type
        return config.cpu_backend if kind == device_type else original(device)

    for module in list(sys.modules.values()):
        if (getattr(module, "__name__", "").startswith("torch._inductor")
                and getattr(module, "get_current_backend", None) is original):
            module.get_current_backend = get_current_backend


def install(device_type: str, num_devices: int, barrier) -> None:
    """Register Inductor's C++ code generation for ``device_type`` (idempotent).

    Args:
        device_type: The PrivateUse1 name (``"swaptest"``).
        num_devices: How many devices it has (each gets the device interface).
        barrier: The extension's ``kernel_barrier(reads, writes)``.
    """
    global _barrier, _installed
    _barrier = barrier
    if _installed:
        return
    from torch._dynamo.device_interface import register_interface_for_device
    from torch._inductor.codegen.common import (
        register_backend_for_device,
        register_device_op_overrides,
    )
    from torch._inductor.codegen.cpp import CppScheduling

    interface = _device_interface()
    for name in (device_type, *(f"{device_type}:{i}" for i in range(num_devices))):
        register_interface_for_device(name, interface)
    _schedule_as_cpu(device_type)
    _cpu_backend_for(device_type)
    register_device_op_overrides(device_type, _op_overrides(device_type))
    register_backend_for_device(device_type, CppScheduling, _wrapper_class(device_type))
    _tag_compile_caches()
    _installed = True


def _tag_compile_caches() -> None:
    """Make torch.compile's on-disk caches (Inductor's FX graph cache, AOTAutograd's) tell this
    code generation apart: their keys know Inductor and the graph, not this module, so a module
    compiled for the device by an earlier version of it (which imported ``kernel_barrier`` from
    another module path, say) would be served again and fail to import. The module's name and
    source join ``torch.compiler.config.cache_key_tag``, which those keys include."""
    config = torch.compiler.config
    if not hasattr(config, "cache_key_tag"):
        return
    source = pathlib.Path(__file__).read_bytes()
    mine = f"{__name__}:{hashlib.sha256(source).hexdigest()[:16]}"
    if mine not in config.cache_key_tag:
        config.cache_key_tag = f"{config.cache_key_tag}+{mine}" if config.cache_key_tag else mine
