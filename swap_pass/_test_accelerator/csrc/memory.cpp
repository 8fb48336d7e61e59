// Memory of the test accelerator: a caching device allocator with per-stream pools, the resize
// hook with failure injection, and a caching pinned host allocator that rounds blocks up to a
// power of two.
#include "swaptest.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace swaptest {
namespace {

using c10::CachingDeviceAllocator::DeviceStats;
using Ticket = std::tuple<int, StreamId, uint64_t>;  // (device, stream, seq): a queue position

constexpr size_t kDeviceRound = 512;  // device blocks are multiples of 512 bytes, as on CUDA
constexpr int kAggregate = 0;         // StatArray index of the aggregate statistic

bool all_done(const std::vector<Ticket>& tickets) {
  for (const auto& [d, s, seq] : tickets) {
    if (!is_done(d, s, seq)) return false;
  }
  return true;
}

void* host_alloc(size_t size) {
  void* ptr = std::aligned_alloc(64, (size + 63) / 64 * 64);
  TORCH_CHECK(ptr != nullptr, "swaptest: out of host memory allocating ", size, " bytes.");
  return ptr;
}

// --- the device allocator ----------------------------------------------------------------------

struct Block {
  void* ptr;
  size_t size;
  int device;
  StreamId stream;                 // the allocating stream: the pool the block returns to
  std::vector<c10::Stream> uses;   // streams named by record_stream
  bool not_resizable = false;
  Position last_write;             // nowhere: not written since it was handed out
  std::vector<Position> copies;    // queued copies that read or wrote it since
};

void free_device_block(void* ctx);

class DeviceAllocator final : public c10::DeviceAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    const int dev = current_device();
    const c10::Device device(c10::DeviceType::PrivateUse1, static_cast<int8_t>(dev));
    if (nbytes == 0) return c10::DataPtr(nullptr, nullptr, &free_device_block, device);
    const size_t size = (nbytes + kDeviceRound - 1) / kDeviceRound * kDeviceRound;
    const StreamId stream = current_stream_id(dev);
    std::lock_guard<std::mutex> lock(mutex_);
    process_pending();
    Block* block = take_cached(dev, stream, size);
    if (block == nullptr) {
      block = new Block{host_alloc(size), size, dev, stream};
      std::memset(block->ptr, kPoison, size);
      stats_[dev].reserved_bytes[kAggregate].increase(size);
      stats_[dev].segment[kAggregate].increase(1);
      counters_[dev]["fresh_blocks"]++;
    } else {
      counters_[dev]["reused_blocks"]++;
    }
    block->last_write = Position{};
    block->copies.clear();
    stats_[dev].allocated_bytes[kAggregate].increase(block->size);
    stats_[dev].allocation[kAggregate].increase(1);
    return c10::DataPtr(block->ptr, block, &free_device_block, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  // A freed block goes back to its allocating stream's pool at once; it is poisoned in that
  // stream's order. With record_stream uses it waits for those streams first.
  void free(Block* block) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_[block->device].allocated_bytes[kAggregate].decrease(block->size);
    stats_[block->device].allocation[kAggregate].decrease(1);
    block->not_resizable = false;
    check_free_order(block);
    if (!block->uses.empty()) {
      std::vector<Ticket> tickets;
      for (const auto& s : block->uses) {
        tickets.emplace_back(s.device_index(), s.id(), enqueue(s.device_index(), s.id(), [] {},
                                                                false));
      }
      block->uses.clear();
      pending_.emplace_back(block, std::move(tickets));
      return;
    }
    void* ptr = block->ptr;
    size_t size = block->size;
    enqueue(block->device, block->stream, [ptr, size] { std::memset(ptr, kPoison, size); },
            false);
    return_to_pool(block);
  }

  // A write over a block that a queued copy on another stream still reads or writes, not
  // ordered after that copy (write-after-read, write-after-write): on a device the copy may
  // read the new data or overwrite it. Counted as unordered_writes; timing alone shows it only
  // when the copy happens to run late.
  void note_write(Block* block, const Position& at) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& use : block->copies) {
      if (use.device == at.device && use.stream == at.stream) continue;
      if (!is_ordered(use, at.device, at.stream)) {
        counters_[at.device]["unordered_writes"]++;
        break;
      }
    }
    block->last_write = at;
  }

  Position last_write(Block* block) {
    std::lock_guard<std::mutex> lock(mutex_);
    return block->last_write;
  }

  void note_copy_use(Block* block, const Position& at) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (block->copies.size() >= 64) forget_ordered_copies(block);
    block->copies.push_back(at);
  }

  void count(int dev, const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex_);
    counters_[dev][name]++;
  }

  void record_stream(Block* block, c10::Stream stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stream.id() == block->stream && stream.device_index() == block->device) return;
    block->uses.push_back(stream);
  }

  bool initialized() override { return true; }

  void emptyCache(c10::MempoolId_t) override {
    drain_all();
    std::lock_guard<std::mutex> lock(mutex_);
    process_pending();
    for (auto& [key, pool] : pools_) {
      for (auto& [size, block] : pool) {
        stats_[block->device].reserved_bytes[kAggregate].decrease(size);
        stats_[block->device].segment[kAggregate].decrease(1);
        std::free(block->ptr);
        delete block;
      }
      pool.clear();
    }
  }

  void recordStream(const c10::DataPtr& ptr, c10::Stream stream) override {
    swaptest::record_stream(ptr, stream);
  }

  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_[device < 0 ? current_device() : device];
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& s = stats_[device < 0 ? current_device() : device];
    s.allocated_bytes[kAggregate].reset_accumulated();
    s.reserved_bytes[kAggregate].reset_accumulated();
    s.allocation[kAggregate].reset_accumulated();
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& s = stats_[device < 0 ? current_device() : device];
    s.allocated_bytes[kAggregate].reset_peak();
    s.reserved_bytes[kAggregate].reset_peak();
    s.allocation[kAggregate].reset_peak();
  }

  std::unordered_map<std::string, int64_t> stats(int dev) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto out = counters_[dev];
    out["allocated_bytes"] = stats_[dev].allocated_bytes[kAggregate].current;
    out["peak_allocated_bytes"] = stats_[dev].allocated_bytes[kAggregate].peak;
    out["reserved_bytes"] = stats_[dev].reserved_bytes[kAggregate].current;
    out["pending_blocks"] = static_cast<int64_t>(pending_.size());
    return out;
  }

 private:
  // The smallest cached block of this stream's pool that fits (at most twice the size).
  Block* take_cached(int dev, StreamId stream, size_t size) {
    auto& pool = pools_[{dev, stream}];
    auto it = pool.lower_bound(size);
    if (it == pool.end() || it->first > 2 * size) return nullptr;
    Block* block = it->second;
    pool.erase(it);
    return block;
  }

  // The block goes back to its allocating stream's pool, whose next allocation may take it at
  // once: every queued copy that read or wrote it must be ordered before that stream's next
  // work (or the stream named by record_stream). A free that is not counts as unordered_frees:
  // on a device the copy may read the next tensor's data, or fault on an unmapped block.
  void check_free_order(Block* block) {
    for (const auto& use : block->copies) {
      bool recorded = false;
      for (const auto& s : block->uses) {
        recorded |= s.device_index() == use.device && s.id() == use.stream;
      }
      if (!recorded && !is_ordered(use, block->device, block->stream)) {
        counters_[block->device]["unordered_frees"]++;
        break;
      }
    }
    block->copies.clear();
  }

  void forget_ordered_copies(Block* block) {
    std::vector<Position> kept;
    for (const auto& use : block->copies) {
      if (!is_ordered(use, block->device, block->stream)) kept.push_back(use);
    }
    block->copies = std::move(kept);
  }

  // First among blocks of its size: the next fitting allocation takes the block freed last.
  void return_to_pool(Block* block) {
    auto& pool = pools_[{block->device, block->stream}];
    pool.emplace_hint(pool.lower_bound(block->size), block->size, block);
  }

  void process_pending() {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (!all_done(it->second)) {
        ++it;
        continue;
      }
      Block* block = it->first;
      std::memset(block->ptr, kPoison, block->size);
      return_to_pool(block);
      it = pending_.erase(it);
    }
  }

  std::mutex mutex_;
  std::map<std::pair<int, StreamId>, std::multimap<size_t, Block*>> pools_;
  std::vector<std::pair<Block*, std::vector<Ticket>>> pending_;
  DeviceStats stats_[kNumDevices];
  std::unordered_map<std::string, int64_t> counters_[kNumDevices];
};

// Both allocators live as long as the process: tensors may be freed after static destructors ran.
DeviceAllocator& device_allocator_ = *new DeviceAllocator();

void free_device_block(void* ctx) {
  if (ctx != nullptr) device_allocator_.free(static_cast<Block*>(ctx));
}

Block* block_of(const c10::DataPtr& data_ptr) {
  if (data_ptr.get_deleter() != &free_device_block) return nullptr;
  return static_cast<Block*>(data_ptr.get_context());
}

// --- the pinned host allocator -----------------------------------------------------------------

struct HostBlock {
  void* ptr;
  size_t size;       // rounded up to a power of two
  size_t requested;  // bytes asked for
  bool in_use = true;
  std::vector<Ticket> uses;  // queued copies that read or write it
};

void free_host_block(void* ctx);

size_t round_pow2(size_t n) {
  size_t size = 1;
  while (size < n) size <<= 1;
  return size;
}

class HostAllocator final : public at::HostAllocator {
 public:
  c10::DataPtr allocate(size_t nbytes) override {
    if (nbytes == 0) return c10::DataPtr(nullptr, nullptr, &free_host_block, c10::Device("cpu"));
    const size_t size = round_pow2(nbytes);
    std::lock_guard<std::mutex> lock(mutex_);
    HostBlock* block = take_cached(size);
    if (block == nullptr) {
      block = new HostBlock{host_alloc(size), size, nbytes};
      std::memset(block->ptr, kPoison, size);
      blocks_[reinterpret_cast<uintptr_t>(block->ptr)] = block;
      reserved_ += static_cast<int64_t>(size);
      fresh_++;
    }
    block->in_use = true;
    block->requested = nbytes;
    in_use_ += static_cast<int64_t>(size);
    requested_ += static_cast<int64_t>(nbytes);
    peak_in_use_ = std::max(peak_in_use_, in_use_);
    return c10::DataPtr(block->ptr, block, &free_host_block, c10::Device("cpu"));
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  void free(HostBlock* block) {
    std::lock_guard<std::mutex> lock(mutex_);
    block->in_use = false;
    in_use_ -= static_cast<int64_t>(block->size);
    requested_ -= static_cast<int64_t>(block->requested);
    free_.emplace(block->size, block);
  }

  bool record_event(void* ptr, void* ctx, c10::Stream stream) override {
    const int dev = stream.device_index() < 0 ? current_device() : stream.device_index();
    record_use(ptr, dev, stream.id(), enqueue(dev, stream.id(), [] {}, false));
    return true;
  }

  void record_use(const void* ptr, int dev, StreamId stream, uint64_t seq) {
    std::lock_guard<std::mutex> lock(mutex_);
    HostBlock* block = find(ptr);
    if (block != nullptr) block->uses.emplace_back(dev, stream, seq);
  }

  bool is_pinned(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    return find(ptr) != nullptr;
  }

  void empty_cache() override {
    drain_all();
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [size, block] : free_) {
      blocks_.erase(reinterpret_cast<uintptr_t>(block->ptr));
      reserved_ -= static_cast<int64_t>(block->size);
      std::free(block->ptr);
      delete block;
    }
    free_.clear();
  }

  at::HostStats get_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    at::HostStats stats;
    stats.allocated_bytes.current = reserved_;
    stats.active_bytes.current = in_use_;
    stats.active_bytes.peak = peak_in_use_;
    stats.num_host_alloc = fresh_;
    return stats;
  }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {
    std::lock_guard<std::mutex> lock(mutex_);
    peak_in_use_ = in_use_;
  }

  std::unordered_map<std::string, int64_t> stats() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {{"pinned_bytes_in_use", in_use_},
            {"requested_bytes_in_use", requested_},
            {"peak_pinned_bytes_in_use", peak_in_use_},
            {"pinned_bytes_reserved", reserved_},
            {"fresh_blocks", fresh_}};
  }

 private:
  // A cached block of exactly this size whose queued copies all ran.
  HostBlock* take_cached(size_t size) {
    auto range = free_.equal_range(size);
    for (auto it = range.first; it != range.second; ++it) {
      HostBlock* block = it->second;
      if (!all_done(block->uses)) continue;
      block->uses.clear();
      free_.erase(it);
      return block;
    }
    return nullptr;
  }

  HostBlock* find(const void* ptr) {
    auto p = reinterpret_cast<uintptr_t>(ptr);
    auto it = blocks_.upper_bound(p);
    if (it == blocks_.begin()) return nullptr;
    --it;
    return p < it->first + it->second->size ? it->second : nullptr;
  }

  std::mutex mutex_;
  std::map<uintptr_t, HostBlock*> blocks_;
  std::multimap<size_t, HostBlock*> free_;
  int64_t in_use_ = 0, requested_ = 0, peak_in_use_ = 0, reserved_ = 0, fresh_ = 0;
};

HostAllocator& host_allocator_ = *new HostAllocator();

void free_host_block(void* ctx) {
  if (ctx != nullptr) host_allocator_.free(static_cast<HostBlock*>(ctx));
}

REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &device_allocator_)
REGISTER_HOST_ALLOCATOR(at::kPrivateUse1, &host_allocator_)

// --- resize failure injection ------------------------------------------------------------------

std::mutex resize_mutex;
int64_t resize_calls_ = 0;
int64_t fail_at_ = 0;  // 0: no failure armed

void check_resize_allowed(const c10::Storage& storage, size_t newsize) {
  std::lock_guard<std::mutex> lock(resize_mutex);
  ++resize_calls_;
  if (fail_at_ > 0 && resize_calls_ == fail_at_) {
    fail_at_ = 0;
    TORCH_CHECK(false, "swaptest: injected failure of resize call ", resize_calls_, " (",
                storage.nbytes(), " -> ", newsize, " bytes). Disarm with fail_nth_resize(0).");
  }
  Block* block = block_of(storage.data_ptr());
  TORCH_CHECK(block == nullptr || !block->not_resizable, "swaptest: this storage (",
              storage.nbytes(), " bytes) is marked not resizable; cannot resize it to ", newsize,
              " bytes. Keep it on the device.");
}

}  // namespace

c10::Allocator* device_allocator() { return &device_allocator_; }
c10::Allocator* host_allocator() { return &host_allocator_; }
bool is_pinned_ptr(const void* ptr) { return ptr != nullptr && host_allocator_.is_pinned(ptr); }

void pinned_record_use(const void* ptr, int device, StreamId stream, uint64_t seq) {
  host_allocator_.record_use(ptr, device, stream, seq);
}

void note_write(const c10::Storage& storage, const Position& at) {
  Block* block = block_of(storage.data_ptr());
  if (block != nullptr) device_allocator_.note_write(block, at);
}

Position last_write(const c10::Storage& storage) {
  Block* block = block_of(storage.data_ptr());
  return block == nullptr ? Position{} : device_allocator_.last_write(block);
}

void note_copy_use(const c10::Storage& storage, const Position& at) {
  Block* block = block_of(storage.data_ptr());
  if (block != nullptr) device_allocator_.note_copy_use(block, at);
}

void count(int device, const std::string& name) { device_allocator_.count(device, name); }

void record_stream(const c10::DataPtr& data_ptr, c10::Stream stream) {
  Block* block = block_of(data_ptr);
  if (block != nullptr) device_allocator_.record_stream(block, stream);
}

void resize_storage_bytes(const c10::Storage& storage, size_t newsize) {
  check_resize_allowed(storage, newsize);
  c10::DeviceGuard guard(storage.device());
  const int dev = storage.device().index();
  c10::DataPtr fresh = device_allocator_.allocate(newsize);
  const size_t keep = std::min(storage.nbytes(), newsize);
  if (keep > 0) {
    drain(dev, current_stream_id(dev));  // the copy runs in the current stream's order
    std::memcpy(fresh.get(), storage.data(), keep);
  }
  c10::DataPtr old = storage.unsafeGetStorageImpl()->set_data_ptr(std::move(fresh));
  storage.unsafeGetStorageImpl()->set_nbytes(newsize);
  if (keep > 0) note_write(storage, mark(dev, current_stream_id(dev)));
}

void fail_nth_resize(int64_t n) {
  TORCH_CHECK(n >= 0, "swaptest.fail_nth_resize: n must be >= 0 (got ", n, ").");
  std::lock_guard<std::mutex> lock(resize_mutex);
  fail_at_ = n == 0 ? 0 : resize_calls_ + n;
}

int64_t resize_calls() {
  std::lock_guard<std::mutex> lock(resize_mutex);
  return resize_calls_;
}

void mark_not_resizable(const c10::Storage& storage) {
  Block* block = block_of(storage.data_ptr());
  TORCH_CHECK(block != nullptr, "swaptest.mark_not_resizable: the storage (",
              storage.nbytes(), " bytes) has no device block. Mark a non-empty device storage.");
  block->not_resizable = true;
}

bool is_marked_not_resizable(const c10::Storage& storage) {
  Block* block = block_of(storage.data_ptr());
  return block != nullptr && block->not_resizable;
}

std::unordered_map<std::string, int64_t> memory_stats(int device) {
  return device_allocator_.stats(device);
}
std::unordered_map<std::string, int64_t> pinned_stats() { return host_allocator_.stats(); }
void empty_device_cache() { device_allocator_.emptyCache({0, 0}); }
void empty_pinned_cache() { host_allocator_.empty_cache(); }

}  // namespace swaptest
