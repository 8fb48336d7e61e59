// Streams, events, the device guard and the PrivateUse1 hooks of the test accelerator.
#include "swaptest.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>

namespace swaptest {
namespace {

using Clock = std::chrono::steady_clock;

// --- one stream: a FIFO of tasks and the worker thread that runs them --------------------------

struct Task {
  uint64_t seq;
  Clock::time_point not_before;
  std::function<void()> fn;
};

class Worker {
 public:
  Worker() : thread_([this] { run(); }) { thread_.detach(); }

  uint64_t push(std::function<void()> fn, Clock::time_point not_before) {
    std::lock_guard<std::mutex> lock(mutex_);
    uint64_t seq = ++pushed_;
    queue_.push_back(Task{seq, not_before, std::move(fn)});
    cv_.notify_all();
    return seq;
  }

  bool done(uint64_t seq) {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_ >= seq;
  }

  // Waiting for a task cancels the delays of everything up to it.
  void wait(uint64_t seq) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (hurry_ < seq) {
      hurry_ = seq;
      cv_.notify_all();
    }
    cv_.wait(lock, [&] { return completed_ >= seq; });
  }

  // Wait up to `timeout` for the task at `seq`, without cancelling any delay.
  bool wait_for(uint64_t seq, std::chrono::microseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, timeout, [&] { return completed_ >= seq; });
  }

  // True when someone waits for the task this worker is running now.
  bool hurried() {
    std::lock_guard<std::mutex> lock(mutex_);
    return hurry_ >= running_;
  }

  uint64_t last() {
    std::lock_guard<std::mutex> lock(mutex_);
    return pushed_;
  }

  // A position for work done now on the calling thread: the next seq, completed at once when the
  // stream is idle (else a no-op task after what is queued).
  uint64_t mark() {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t seq = ++pushed_;
    if (completed_ + 1 == seq) {
      completed_ = seq;
    } else {
      queue_.push_back(Task{seq, Clock::now(), [] {}});
    }
    cv_.notify_all();
    return seq;
  }

 private:
  void run() {
    for (;;) {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return !queue_.empty(); });
      const uint64_t seq = queue_.front().seq;
      const auto not_before = queue_.front().not_before;
      cv_.wait_until(lock, not_before, [&] { return hurry_ >= seq; });
      Task task = std::move(queue_.front());
      queue_.pop_front();
      running_ = task.seq;
      lock.unlock();
      try {
        task.fn();
      } catch (const std::exception& e) {
        std::cerr << "swaptest: a queued task failed: " << e.what() << std::endl;
      }
      lock.lock();
      completed_ = task.seq;
      cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  uint64_t pushed_ = 0;
  uint64_t completed_ = 0;
  uint64_t hurry_ = 0;
  uint64_t running_ = 0;
  std::thread thread_;
};

// Workers are made on first use and live as long as the process (threads are never joined).
std::mutex workers_mutex;
std::array<std::array<std::atomic<Worker*>, kSideStreams + 1>, kNumDevices> workers{};

void check_stream(int device, StreamId stream) {
  TORCH_CHECK(device >= 0 && device < kNumDevices, "swaptest: no device ", device, " (",
              kNumDevices, " devices). A device index must be in [0, ", kNumDevices, ").");
  TORCH_CHECK(stream >= 0 && stream <= kSideStreams, "swaptest: unknown stream id ", stream,
              " on device ", device, ". Streams come from torch.Stream(device=...).");
}

Worker& worker(int device, StreamId stream) {
  check_stream(device, stream);
  auto& slot = workers[device][stream];
  Worker* w = slot.load();
  if (w == nullptr) {
    std::lock_guard<std::mutex> lock(workers_mutex);
    w = slot.load();
    if (w == nullptr) {
      w = new Worker();
      slot.store(w);
    }
  }
  return *w;
}

// --- the copy delay ----------------------------------------------------------------------------

struct DelaySettings {
  std::mutex mutex;
  bool enabled = true;
  double min_ms = 200.0;
  double max_ms = 400.0;
  uint64_t seed = 0;
  std::mt19937_64 rng{0};
};
DelaySettings delay_settings_;

Clock::time_point draw_not_before() {
  std::lock_guard<std::mutex> lock(delay_settings_.mutex);
  auto now = Clock::now();
  if (!delay_settings_.enabled) return now;
  std::uniform_real_distribution<double> dist(delay_settings_.min_ms, delay_settings_.max_ms);
  auto us = static_cast<int64_t>(dist(delay_settings_.rng) * 1000.0);
  return now + std::chrono::microseconds(us);
}

// --- current device and streams (per thread) ---------------------------------------------------

thread_local int tls_device = 0;
thread_local std::array<StreamId, kNumDevices> tls_streams{};
std::array<std::atomic<int>, kNumDevices> next_side{};

int resolve(int device) { return device < 0 ? tls_device : device; }

}  // namespace

uint64_t enqueue(int device, StreamId stream, std::function<void()> fn, bool delayed) {
  auto not_before = delayed ? draw_not_before() : Clock::now();
  return worker(device, stream).push(std::move(fn), not_before);
}

bool is_done(int device, StreamId stream, uint64_t seq) { return worker(device, stream).done(seq); }

void wait_done(int device, StreamId stream, uint64_t seq) { worker(device, stream).wait(seq); }

// A stream waiting on another stream's event does not make that stream's delayed copies start:
// only a host that waits (for this stream, directly or through others) does.
void wait_on_behalf(int device, StreamId stream, int src_device, StreamId src, uint64_t seq) {
  Worker& self = worker(device, stream);
  Worker& other = worker(src_device, src);
  while (!other.wait_for(seq, std::chrono::microseconds(500))) {
    if (self.hurried()) {
      other.wait(seq);
      return;
    }
  }
}

void drain(int device, StreamId stream) {
  Worker& w = worker(device, stream);
  w.wait(w.last());
}

void drain_device(int device) {
  count(device, "host_syncs");  // one device synchronize, however many streams it waits for
  for (StreamId s = 0; s <= kSideStreams; ++s) {
    if (workers[device][s].load() != nullptr) wait_as_host(device, s);
  }
}

Position mark(int device, StreamId stream) {
  return Position{device, stream, worker(device, stream).mark()};
}

// --- the order of work: vector clocks ----------------------------------------------------------
//
// Compute runs on the host, so it always ran before a copy queued after it: the device cannot
// let a copy race its producer for real. It checks the order instead, as a happens-before
// checker: each stream carries a vector clock (the last seq of every stream its next work is
// ordered after), an event the clock of its stream at the record, a wait merges the event's clock
// into the waiting stream's, and a host synchronize merges into the host's clock, which every
// stream's later work is ordered after. ops.cpp asks it before each read of a device block.

namespace {

constexpr int kSlots = kNumDevices * (kSideStreams + 1);
using VectorClock = std::array<uint64_t, kSlots>;

int slot(int device, StreamId stream) { return device * (kSideStreams + 1) + stream; }

void merge(VectorClock& into, const VectorClock& from) {
  for (int i = 0; i < kSlots; ++i) into[i] = std::max(into[i], from[i]);
}

struct OrderState {
  std::mutex mutex;
  std::array<VectorClock, kSlots> streams{};
  VectorClock host{};
  std::atomic<bool> enabled{true};
};
OrderState order_;

// The clock of work at `seq` of the stream: its stream's clock now, and itself.
VectorClock clock_at(int device, StreamId stream, uint64_t seq) {
  std::lock_guard<std::mutex> lock(order_.mutex);
  VectorClock c = order_.streams[slot(device, stream)];
  c[slot(device, stream)] = std::max(c[slot(device, stream)], seq);
  return c;
}

void stream_waits(int device, StreamId stream, const VectorClock& c) {
  std::lock_guard<std::mutex> lock(order_.mutex);
  merge(order_.streams[slot(device, stream)], c);
}

// --- copy windows: the compute that ran while a side-stream copy could run ---------------------
//
// Each stream counts the compute issued on it (ops, bytes its operands span). A copy queued on a
// side stream opens a window; the first stream made to wait for it (an event covering it,
// waited on) closes the window with the compute issued on that stream since the copy was
// queued: what the copy can hide behind. A host wait covering it closes it with the compute
// of every stream of the device.

struct ComputeCount {
  std::atomic<uint64_t> ops{0};
  std::atomic<uint64_t> bytes{0};
};
std::array<ComputeCount, kSlots> compute_;

struct Window {
  int direction;  // 0: device to host, 1: host to device, 2: device to device
  uint64_t nbytes;
  int device;
  StreamId stream;
  uint64_t seq;
  std::array<uint64_t, kSlots> ops_at{}, bytes_at{};  // each stream's count when queued
  int closed_by = -2;  // -2: open; -1: the host; else the waiting stream's slot
  uint64_t ops = 0, bytes = 0;
};

struct Windows {
  std::mutex mutex;
  std::atomic<bool> recording{false};
  std::vector<Window> all;
  size_t first_open = 0;
};
Windows windows_;

void close_windows(const VectorClock& c, int waiter) {
  if (!windows_.recording.load()) return;
  std::lock_guard<std::mutex> lock(windows_.mutex);
  for (size_t i = windows_.first_open; i < windows_.all.size(); ++i) {
    Window& w = windows_.all[i];
    if (w.closed_by != -2 || c[slot(w.device, w.stream)] < w.seq) continue;
    if (waiter == slot(w.device, w.stream)) continue;
    w.closed_by = waiter;
    const int first = waiter >= 0 ? waiter : slot(w.device, 0);
    const int last = waiter >= 0 ? waiter : slot(w.device, kSideStreams);
    for (int s = first; s <= last; ++s) {
      w.ops += compute_[s].ops.load() - w.ops_at[s];
      w.bytes += compute_[s].bytes.load() - w.bytes_at[s];
    }
  }
  while (windows_.first_open < windows_.all.size() &&
         windows_.all[windows_.first_open].closed_by != -2) {
    ++windows_.first_open;
  }
}

void host_waited(const VectorClock& c) {
  {
    std::lock_guard<std::mutex> lock(order_.mutex);
    merge(order_.host, c);
  }
  close_windows(c, -1);
}

}  // namespace

void stream_waits_for(int device, StreamId waiter, const Position& p) {
  if (p.device < 0 || (p.device == device && p.stream == waiter)) return;
  const int src_dev = p.device;
  const StreamId src = p.stream;
  const uint64_t seq = p.seq;
  enqueue(device, waiter, [=] { wait_on_behalf(device, waiter, src_dev, src, seq); }, false);
  stream_waits(device, waiter, clock_at(src_dev, src, seq));
}

bool is_ordered(const Position& p, int device, StreamId reader) {
  if (!order_.enabled.load() || p.device < 0) return true;
  if (p.device == device && p.stream == reader) return true;
  const int s = slot(p.device, p.stream);
  std::lock_guard<std::mutex> lock(order_.mutex);
  return order_.streams[slot(device, reader)][s] >= p.seq || order_.host[s] >= p.seq;
}

void count_compute(int device, StreamId stream, uint64_t bytes) {
  ComputeCount& c = compute_[slot(device, stream)];
  c.ops.fetch_add(1);
  c.bytes.fetch_add(bytes);
}

void open_window(int direction, uint64_t nbytes, int device, StreamId stream, uint64_t seq) {
  if (!windows_.recording.load() || stream == 0) return;
  Window w{direction, nbytes, device, stream, seq};
  for (int s = 0; s < kSlots; ++s) {
    w.ops_at[s] = compute_[s].ops.load();
    w.bytes_at[s] = compute_[s].bytes.load();
  }
  std::lock_guard<std::mutex> lock(windows_.mutex);
  windows_.all.push_back(w);
}

void record_windows(bool enabled) {
  std::lock_guard<std::mutex> lock(windows_.mutex);
  windows_.all.clear();
  windows_.first_open = 0;
  windows_.recording.store(enabled);
}

std::vector<std::unordered_map<std::string, int64_t>> copy_windows() {
  std::lock_guard<std::mutex> lock(windows_.mutex);
  std::vector<std::unordered_map<std::string, int64_t>> out;
  for (const auto& w : windows_.all) {
    out.push_back({{"direction", w.direction},
                   {"bytes", static_cast<int64_t>(w.nbytes)},
                   {"device", w.device},
                   {"stream", w.stream},
                   {"queued_at_ops", static_cast<int64_t>(w.ops_at[slot(w.device, 0)])},
                   {"closed_by", w.closed_by},
                   {"ops", static_cast<int64_t>(w.ops)},
                   {"compute_bytes", static_cast<int64_t>(w.bytes)}});
  }
  return out;
}

std::unordered_map<std::string, int64_t> compute_counts(int device, StreamId stream) {
  const ComputeCount& c = compute_[slot(device, stream)];
  return {{"ops", static_cast<int64_t>(c.ops.load())},
          {"bytes", static_cast<int64_t>(c.bytes.load())}};
}

void set_order_check(bool enabled) { order_.enabled.store(enabled); }
bool order_check() { return order_.enabled.load(); }

void wait_as_host(int device, StreamId stream) {
  Worker& w = worker(device, stream);
  const uint64_t seq = w.last();
  w.wait(seq);
  host_waited(clock_at(device, stream, seq));
}

void host_sync(int device, StreamId stream) {
  count(device, "host_syncs");
  wait_as_host(device, stream);
}

void host_synced(int device, StreamId stream, uint64_t seq) {
  count(device, "host_syncs");
  host_waited(clock_at(device, stream, seq));
}

void drain_all() {
  for (int d = 0; d < kNumDevices; ++d) drain_device(d);
}

int current_device() { return tls_device; }

void set_current_device(int device) {
  check_stream(device, 0);
  tls_device = device;
}

StreamId current_stream_id(int device) { return tls_streams[resolve(device)]; }

c10::Stream make_stream(int device, StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE,
                     c10::Device(c10::DeviceType::PrivateUse1, static_cast<int8_t>(device)), id);
}

void set_delay(bool enabled, double min_ms, double max_ms) {
  TORCH_CHECK(min_ms >= 0 && max_ms >= min_ms, "swaptest.set_delay: bad range (min_ms=", min_ms,
              ", max_ms=", max_ms, "). 0 <= min_ms <= max_ms must hold.");
  std::lock_guard<std::mutex> lock(delay_settings_.mutex);
  delay_settings_.enabled = enabled;
  delay_settings_.min_ms = min_ms;
  delay_settings_.max_ms = max_ms;
}

void set_seed(uint64_t seed) {
  std::lock_guard<std::mutex> lock(delay_settings_.mutex);
  delay_settings_.seed = seed;
  delay_settings_.rng.seed(seed);
}

std::unordered_map<std::string, double> delay_settings() {
  std::lock_guard<std::mutex> lock(delay_settings_.mutex);
  return {{"enabled", delay_settings_.enabled ? 1.0 : 0.0},
          {"min_ms", delay_settings_.min_ms},
          {"max_ms", delay_settings_.max_ms},
          {"seed", static_cast<double>(delay_settings_.seed)}};
}

namespace {

// --- events ------------------------------------------------------------------------------------

struct Event {
  int device = -1;  // -1: never recorded
  StreamId stream = 0;
  uint64_t seq = 0;
  std::shared_ptr<std::atomic<int64_t>> time_ns;
  VectorClock clock{};  // what its stream was ordered after at the record, itself included
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// --- the device guard --------------------------------------------------------------------------

struct Guard final : c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;

  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old = getDevice();
    setDevice(d);
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kType, tls_device); }
  void setDevice(c10::Device d) const override { set_current_device(resolve(d.index())); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    int idx = resolve(d.index());
    if (idx >= 0 && idx < kNumDevices) tls_device = idx;
  }
  c10::Stream getStream(c10::Device d) const override {
    int dev = resolve(d.index());
    return make_stream(dev, tls_streams[dev]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return make_stream(resolve(d.index()), 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    return getNewStream(d, 0);
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    int dev = resolve(d.index());
    StreamId id = 1 + (next_side[dev].fetch_add(1) % kSideStreams);
    return make_stream(dev, id);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    int dev = resolve(s.device_index());
    check_stream(dev, s.id());
    c10::Stream old = make_stream(dev, tls_streams[dev]);
    tls_streams[dev] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return kNumDevices; }

  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag) const override {
    int dev = resolve(stream.device_index());
    TORCH_CHECK(device_index < 0 || device_index == dev, "swaptest: an event of device ",
                device_index, " recorded on a stream of device ", dev,
                ". An event records on streams of its own device.");
    if (*event == nullptr) *event = new Event();
    auto* e = static_cast<Event*>(*event);
    auto stamp = std::make_shared<std::atomic<int64_t>>(0);
    e->seq = enqueue(dev, stream.id(), [stamp] { stamp->store(now_ns()); }, false);
    e->clock = clock_at(dev, stream.id(), e->seq);
    e->device = dev;
    e->stream = stream.id();
    e->time_ns = stamp;
  }
  void block(void* event, const c10::Stream& stream) const override {
    auto* e = static_cast<Event*>(event);
    if (e == nullptr || e->device < 0) return;
    int dev = resolve(stream.device_index());
    if (dev == e->device && stream.id() == e->stream) return;
    int src_dev = e->device;
    StreamId src = e->stream;
    uint64_t seq = e->seq;
    StreamId waiter = stream.id();
    enqueue(dev, waiter, [=] { wait_on_behalf(dev, waiter, src_dev, src, seq); }, false);
    stream_waits(dev, waiter, e->clock);
    close_windows(e->clock, slot(dev, waiter));
  }
  // A query that answers True orders the host after the event, as on CUDA: work the host
  // queues afterwards is ordered after it.
  bool queryEvent(void* event) const override {
    auto* e = static_cast<Event*>(event);
    if (e == nullptr || e->device < 0) return true;
    if (!is_done(e->device, e->stream, e->seq)) return false;
    host_waited(e->clock);
    return true;
  }
  void synchronizeEvent(void* event) const override {
    auto* e = static_cast<Event*>(event);
    if (e == nullptr || e->device < 0) return;
    count(e->device, "host_syncs");
    wait_done(e->device, e->stream, e->seq);
    host_waited(e->clock);
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    auto* a = static_cast<Event*>(start);
    auto* b = static_cast<Event*>(end);
    TORCH_CHECK(a && b && a->device >= 0 && b->device >= 0,
                "swaptest: elapsed_time of an event never recorded. Record both events first.");
    // torch_npu's elapsed_time flushes every task queue and synchronizes both events: the
    // device counts each call as such a wait (the sync spy of swap_pass.testing reads it).
    count(a->device, "elapsed_time_calls");
    TORCH_CHECK(queryEvent(a) && queryEvent(b),
                "swaptest: elapsed_time of an event not completed yet. Synchronize both first.");
    return static_cast<double>(b->time_ns->load() - a->time_ns->load()) / 1e6;
  }
  bool queryStream(const c10::Stream& stream) const override {
    int dev = resolve(stream.device_index());
    Worker& w = worker(dev, stream.id());
    const uint64_t seq = w.last();
    if (!w.done(seq)) return false;
    host_waited(clock_at(dev, stream.id(), seq));
    return true;
  }
  void synchronizeStream(const c10::Stream& stream) const override {
    host_sync(resolve(stream.device_index()), stream.id());
  }
  void synchronizeDevice(const c10::DeviceIndex device_index) const override {
    drain_device(resolve(device_index));
  }
  void recordDataPtrOnStream(const c10::DataPtr& data_ptr,
                             const c10::Stream& stream) const override {
    record_stream(data_ptr, stream);
  }
};

// --- PrivateUse1 hooks -------------------------------------------------------------------------

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kNumDevices; }
  void setCurrentDevice(c10::DeviceIndex d) const override { set_current_device(d); }
  c10::DeviceIndex getCurrentDevice() const override { return tls_device; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    c10::DeviceIndex old = tls_device;
    set_current_device(resolve(d));
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override {
    return exchangeDevice(d);
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned_ptr(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return host_allocator(); }
  c10::Device getDeviceFromPtr(void*) const override {
    return c10::Device(c10::DeviceType::PrivateUse1, 0);
  }
  // Random numbers of device tensors come from the CPU generator (ops run on CPU).
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Generator getNewGenerator(c10::DeviceIndex) const override {
    return at::detail::createCPUGenerator();
  }
  void init() const override {}
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage, newsize);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard)

struct RegisterHooks {
  RegisterHooks() { at::RegisterPrivateUse1HooksInterface(new Hooks()); }
};
RegisterHooks register_hooks_;

}  // namespace
}  // namespace swaptest

