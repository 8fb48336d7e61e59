// ATen kernels of the test accelerator (allocation, views, copies), the CPU fallback for every
// other op, and the Python knobs.
#include "swaptest.h"

#include <ATen/EmptyTensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/DeviceGuard.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cstring>

namespace swaptest {
namespace {

constexpr auto kDevice = c10::DeviceType::PrivateUse1;

int device_index(const at::Tensor& t) {
  return t.device().has_index() ? t.device().index() : current_device();
}

// --- allocation --------------------------------------------------------------------------------

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<at::ScalarType> dtype,
                               std::optional<at::Layout>, std::optional<at::Device> device,
                               std::optional<bool>,
                               std::optional<at::MemoryFormat> memory_format) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_generic(size, device_allocator(), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<at::ScalarType> dtype, std::optional<at::Layout>,
                         std::optional<at::Device> device, std::optional<bool>) {
  c10::OptionalDeviceGuard guard(device);
  return at::detail::empty_strided_generic(size, stride, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// Resize a tensor; a larger storage goes through the resize hook (stream-ordered copy).
const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  auto* impl = self.unsafeGetTensorImpl();
  at::native::resize_impl_cpu_(impl, size, std::nullopt, /*resize_storage=*/false);
  if (memory_format.has_value() && *memory_format != at::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  const size_t needed = (self.storage_offset() + self.numel()) * self.itemsize();
  if (self.numel() > 0 && needed > self.storage().nbytes()) {
    resize_storage_bytes(self.storage(), needed);
  }
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source, int64_t offset,
                               c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::set_storage_cpu_(self, std::move(source), offset, size, stride);
}

at::Tensor& set_storage_only(at::Tensor& self, at::Storage source) {
  const int64_t numel = static_cast<int64_t>(source.nbytes() / self.itemsize());
  return at::native::set_storage_cpu_(self, std::move(source), 0, {numel}, {});
}

at::Tensor& set_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::DeviceGuard guard(self.device());
  auto storage = c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), 0, device_allocator(), /*resizable=*/true);
  return at::native::set_storage_cpu_(self, at::Storage(std::move(storage)), 0, {0}, {});
}

// --- copies ------------------------------------------------------------------------------------

// Inside the CPU fallback a copy is a compute op's own read or write (a kernel's, on a device),
// not the host waiting for data.
thread_local int fallback_depth = 0;

// The bytes of its storage a tensor reads or writes.
Span span_of(const at::Tensor& t) {
  if (t.numel() == 0) return Span{};
  int64_t last = 0;
  for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * std::abs(t.stride(d));
  const size_t begin = static_cast<size_t>(t.storage_offset()) * t.itemsize();
  return Span{begin, begin + static_cast<size_t>(last + 1) * t.itemsize()};
}

// A read of a device tensor by work on (dev, reader), checked now (see the order of work in
// runtime.cpp): one not ordered after the last write of its bytes is counted (the caller gives it
// poison, and notes the read for the write-after-read checks of later writes).
bool read_device(const at::Tensor& t, int dev, StreamId reader) {
  return check_read(t.storage(), span_of(t), dev, reader);
}

// The same for a copy's read of pinned host memory (`t`, the host side of the copy).
bool read_host(const at::Tensor& t, int dev, StreamId stream) {
  return check_host_read(t.data_ptr(), t.nbytes(), dev, stream);
}

// A CPU tensor over the same bytes (no copy): how host code reads device memory.
at::Tensor cpu_alias(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [](void*) {},
                       t.options().device(at::kCPU));
}

bool plain(const at::Tensor& src, const at::Tensor& dst) {
  return src.dtype() == dst.dtype() && src.sizes() == dst.sizes() && src.is_contiguous() &&
         dst.is_contiguous() && !src.is_conj() && !dst.is_conj() && !src.is_neg() &&
         !dst.is_neg();
}

// Copies with a layout or dtype change run on the host once the current streams drained.
void copy_on_host(const at::Tensor& src, const at::Tensor& dst) {
  for (const auto* t : {&src, &dst}) {
    if (t->device().type() == kDevice) drain(device_index(*t), current_stream_id(device_index(*t)));
  }
  const bool src_dev = src.device().type() == kDevice, dst_dev = dst.device().type() == kDevice;
  at::Tensor s = src_dev ? cpu_alias(src) : src;
  at::Tensor d = dst_dev ? cpu_alias(dst) : dst;
  if (src_dev) {
    const int sd = device_index(src);
    const StreamId stream = current_stream_id(sd);
    if (!read_device(src, sd, stream)) {
      s = at::empty(s.sizes(), s.options());
      std::memset(s.data_ptr(), kPoison, s.nbytes());
    }
    note_read(src.storage(), span_of(src), mark(sd, stream), false);
  }
  d.copy_(s);
  if (dst_dev) {
    const int dd = device_index(dst);
    note_write(dst.storage(), span_of(dst), mark(dd, current_stream_id(dd)), false);
  } else if (src_dev && fallback_depth == 0) {  // the host reads device memory: it waited
    host_sync(device_index(src), current_stream_id(device_index(src)));
  }
}

// A copy between the host and the device that leaves the host free to go on: non_blocking with
// the host side pinned, as PyTorch makes it asynchronous on every stream (not the CPU fallback's
// own copies, which are part of an op).
bool is_async(const at::Tensor& host, bool non_blocking) {
  return non_blocking && fallback_depth == 0 && is_pinned_ptr(host.data_ptr());
}

// Queue the copy on (dev, stream), delayed, and check its accesses at the place it is queued:
// a read of the device source or the pinned host source not ordered after its last write reads
// poison; a write not ordered after the destination's last accesses is counted.
uint64_t queue_copy(const at::Tensor& src, const at::Tensor& dst, int dev, StreamId stream) {
  const bool src_dev = src.device().type() == kDevice, dst_dev = dst.device().type() == kDevice;
  const bool poison = src_dev ? !read_device(src, dev, stream) : !read_host(src, dev, stream);
  void* out = dst.data_ptr();
  const void* in = src.data_ptr();
  const size_t n = src.nbytes();
  const uint64_t seq = enqueue(dev, stream, [out, in, n, poison] {
    if (poison) {
      std::memset(out, kPoison, n);
    } else {
      std::memcpy(out, in, n);
    }
  }, true);
  const Position at{dev, stream, seq};
  if (fallback_depth == 0) {  // a copy of its own, not part of a compute op on a side stream
    open_window(src_dev && dst_dev ? 2 : (src_dev ? 0 : 1), n, dev, stream, seq);
  }
  if (src_dev) {
    note_read(src.storage(), span_of(src), at, true);
  } else {
    note_host_access(in, n, at, false);
  }
  if (dst_dev) {
    note_write(dst.storage(), span_of(dst), at, true);
  } else {
    note_host_access(out, n, at, true);
  }
  return seq;
}

// A copy on the default stream runs now, in stream order, unless it is asynchronous (see
// is_async). On a side stream, or asynchronous, it is queued and starts after the copy delay;
// the host waits for it unless it is asynchronous, or both sides are on the device (as on CUDA).
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  if (self.numel() == 0) return dst;
  if (!plain(self, dst)) {
    copy_on_host(self, dst);
    return dst;
  }
  const bool src_dev = self.device().type() == kDevice, dst_dev = dst.device().type() == kDevice;
  const at::Tensor& dev_side = src_dev ? self : dst;
  const at::Tensor& host_side = src_dev ? dst : self;
  const int dev = device_index(dev_side);
  const StreamId stream = current_stream_id(dev);
  const bool d2d = src_dev && dst_dev;
  const bool async = !d2d && is_async(host_side, non_blocking);
  // Across devices, CUDA's two-way barrier: the copy waits for the destination device's current
  // stream, which then waits for the copy.
  const bool cross = d2d && device_index(dst) != dev;
  const int dd = device_index(dst);
  const StreamId dst_stream = current_stream_id(dd);
  if (cross) {
    drain(dd, dst_stream);
    stream_waits_for(dev, stream, mark(dd, dst_stream));
  }
  if (stream == 0 && !async) {
    drain(dev, 0);
    const Position read_at = mark(dev, 0);
    const bool ordered = src_dev ? read_device(self, dev, 0) : read_host(self, dev, 0);
    if (ordered) {
      std::memcpy(dst.data_ptr(), self.data_ptr(), self.nbytes());
    } else {
      std::memset(dst.data_ptr(), kPoison, self.nbytes());
    }
    if (d2d) count_compute(dev, 0, 2 * self.nbytes());  // a copy kernel on the stream
    if (src_dev) {
      note_read(self.storage(), span_of(self), read_at, false);
    } else {
      note_host_access(self.data_ptr(), self.nbytes(), read_at, false);
    }
    if (dst_dev) {  // in the order of the destination's current stream, as across devices
      note_write(dst.storage(), span_of(dst), mark(dd, dst_stream), false);
    } else {
      note_host_access(dst.data_ptr(), dst.nbytes(), read_at, true);
      if (fallback_depth == 0) host_sync(dev, 0);  // the host reads device memory: it waited
    }
    return dst;
  }
  const uint64_t seq = queue_copy(self, dst, dev, stream);
  if (cross) stream_waits_for(dd, dst_stream, Position{dev, stream, seq});
  if (d2d) return dst;
  if (async) {
    pinned_record_use(host_side.data_ptr(), dev, stream, seq);
    return dst;
  }
  wait_done(dev, stream, seq);
  if (fallback_depth == 0) host_synced(dev, stream, seq);  // a blocking copy: the host waited
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// .item(): the host waits for the current stream, then reads; a value written on another stream
// the current one did not wait for is counted as an unordered read.
at::Scalar local_scalar_dense(const at::Tensor& self) {
  const int dev = device_index(self);
  host_sync(dev, current_stream_id(dev));
  read_device(self, dev, current_stream_id(dev));
  return cpu_alias(self).item();
}

void record_stream_op(at::Tensor& self, c10::Stream stream) {
  record_stream(self.storage().data_ptr(), stream);
}

// --- everything else: the CPU kernel, on CPU copies of the arguments ---------------------------

// The op counts as compute on the current stream of its first device tensor (copy windows).
void count_op(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const size_t n = op.schema().arguments().size();
  uint64_t bytes = 0;
  int dev = -1;
  for (size_t i = stack.size() - std::min(n, stack.size()); i < stack.size(); ++i) {
    const auto& arg = stack[i];
    if (!arg.isTensor()) continue;
    const at::Tensor& t = arg.toTensor();
    if (!t.defined() || t.device().type() != kDevice) continue;
    if (dev < 0) dev = device_index(t);
    bytes += t.nbytes();
  }
  if (dev >= 0) count_compute(dev, current_stream_id(dev), bytes);
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  struct Depth {
    Depth() { ++fallback_depth; }
    ~Depth() { --fallback_depth; }
  } depth;
  if (fallback_depth == 1) count_op(op, *stack);
  at::native::cpu_fallback(op, stack);
}

// --- Inductor's C++ kernels -------------------------------------------------------------------

// Inductor's C++ kernels for the device (swap_pass/testing/accelerator/inductor.py) read and write
// device memory directly, outside the dispatcher. The generated code calls this before each one
// with the kernel's pointer arguments by role (a const pointer is read, any other written): it
// does for the kernel what the CPU fallback does for an eager op. The kernel runs in the order of
// each argument's current stream (drained first), a read not ordered after its block's last write
// gets poison in place and is counted, and every written block's last write is here.
void kernel_barrier(const std::vector<at::Tensor>& reads, const std::vector<at::Tensor>& writes) {
  uint64_t bytes = 0;
  int counted = -1;
  for (const auto* group : {&reads, &writes}) {
    for (const auto& t : *group) {
      if (t.device().type() != kDevice) continue;
      drain(device_index(t), current_stream_id(device_index(t)));
      if (counted < 0) counted = device_index(t);
      bytes += t.nbytes();
    }
  }
  if (counted >= 0) count_compute(counted, current_stream_id(counted), bytes);
  for (const auto& t : reads) {
    if (t.device().type() != kDevice || t.storage().nbytes() == 0) continue;
    const int dev = device_index(t);
    const StreamId stream = current_stream_id(dev);
    const Span span = span_of(t);
    if (!read_device(t, dev, stream) && span.end > span.begin) {
      auto* bytes = static_cast<unsigned char*>(t.storage().mutable_data());
      std::memset(bytes + span.begin, kPoison,
                  std::min(span.end, t.storage().nbytes()) - span.begin);
    }
    note_read(t.storage(), span, mark(dev, stream), false);
  }
  for (const auto& t : writes) {
    if (t.device().type() != kDevice || t.storage().nbytes() == 0) continue;
    const int dev = device_index(t);
    note_write(t.storage(), span_of(t), mark(dev, current_stream_id(dev)), false);
  }
}

}  // namespace
}  // namespace swaptest

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace swaptest;
  m.impl("empty.memory_format", &empty_memory_format);
  m.impl("empty_strided", &empty_strided);
  m.impl("resize_", &swaptest::resize_);
  m.impl("set_.source_Storage_storage_offset", &set_source_storage);
  m.impl("set_.source_Storage", &set_storage_only);
  m.impl("set_.source_Tensor", &set_tensor);
  m.impl("set_", &set_empty);
  m.impl("_copy_from", &copy_from);
  m.impl("_copy_from_and_resize", &copy_from_and_resize);
  m.impl("_local_scalar_dense", &local_scalar_dense);
  m.impl("record_stream", &record_stream_op);
  // Views alias their base: they must not go through the fallback (which copies).
  m.impl("as_strided", TORCH_FN(at::native::as_strided_tensorimpl));
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("alias", TORCH_FN(at::native::alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&swaptest::fallback>());
}

// --- Python knobs ------------------------------------------------------------------------------

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace swaptest;
  m.def("device_count", [] { return kNumDevices; });
  m.def("set_delay", &set_delay, py::arg("enabled"), py::arg("min_ms"), py::arg("max_ms"));
  m.def("set_seed", &set_seed, py::arg("seed"));
  m.def("delay_settings", &delay_settings);
  m.def("set_order_check", &set_order_check, py::arg("enabled"));
  m.def("order_check", &order_check);
  m.def("fail_nth_resize", &fail_nth_resize, py::arg("n"));
  m.def("resize_calls", &resize_calls);
  m.def("mark_not_resizable", [](const at::Tensor& t) { mark_not_resizable(t.storage()); });
  m.def("is_marked_not_resizable",
        [](const at::Tensor& t) { return is_marked_not_resizable(t.storage()); });
  m.def("memory_stats", &memory_stats, py::arg("device"));
  m.def("set_memory_fraction", &set_memory_fraction, py::arg("device"), py::arg("fraction"));
  m.def("record_windows", &record_windows, py::arg("enabled"));
  m.def("copy_windows", &copy_windows);
  m.def("compute_counts", &compute_counts, py::arg("device"), py::arg("stream"));
  m.def("total_memory", &total_memory);
  m.def("memory_info", &memory_info, py::arg("device"));
  m.def("pinned_stats", &pinned_stats);
  m.def("empty_cache", &empty_device_cache);
  m.def("empty_pinned_cache", &empty_pinned_cache);
  m.def("kernel_barrier", &kernel_barrier, py::arg("reads"), py::arg("writes"),
        py::call_guard<py::gil_scoped_release>());
  m.def("synchronize", [](int device) {
    py::gil_scoped_release no_gil;
    if (device < 0) drain_all(); else drain_device(device);
  }, py::arg("device") = -1);
}
