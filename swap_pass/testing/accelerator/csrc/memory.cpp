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
constexpr int64_t kTotalBytes = int64_t{16} << 30;  // each device's memory, as reported

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

// --- the order of a block's accesses ----------------------------------------------------------

struct Access {
  size_t begin, end;  // bytes of the block
  Position at;
};

bool overlaps(const Access& a, const Span& span) { return a.begin < span.end && span.begin < a.end; }

// Who last wrote each byte range of a block (the allocation first: a write on the allocating
// stream, as a stream-ordered allocator hands out memory its previous user may still touch) and
// who read it since. A read must be ordered after the last write of every byte it reads (RAW); a
// write after the last write and every read since of every byte it writes (WAW, WAR). Ranges, not
// whole blocks: two streams may write disjoint halves of one block.
class AccessLog {
 public:
  void reset(size_t size, const Position& allocation) {
    writes_.assign(1, Access{0, size, allocation});
    reads_.clear();
  }

  bool read_ordered(const Span& span, int dev, StreamId stream) const {
    for (const auto& w : writes_) {
      if (overlaps(w, span) && !is_ordered(w.at, dev, stream)) return false;
    }
    return true;
  }

  bool write_ordered(const Span& span, int dev, StreamId stream) const {
    if (!read_ordered(span, dev, stream)) return false;
    for (const auto& r : reads_) {
      if (overlaps(r, span) && !is_ordered(r.at, dev, stream)) return false;
    }
    return true;
  }

  void note_read(const Span& span, const Position& at) {
    if (reads_.size() >= kMaxReads) reads_.erase(reads_.begin());
    reads_.push_back(Access{span.begin, span.end, at});
  }

  // The write is the last write of its bytes: older writes keep the bytes outside it; reads
  // inside it were checked against it (a later write is ordered after them through it).
  void note_write(const Span& span, const Position& at) {
    std::vector<Access> kept;
    for (const auto& w : writes_) {
      if (!overlaps(w, span)) {
        kept.push_back(w);
        continue;
      }
      if (w.begin < span.begin) kept.push_back(Access{w.begin, span.begin, w.at});
      if (span.end < w.end) kept.push_back(Access{span.end, w.end, w.at});
    }
    kept.push_back(Access{span.begin, span.end, at});
    writes_ = std::move(kept);
    std::vector<Access> reads;
    for (const auto& r : reads_) {
      if (r.begin < span.begin || span.end < r.end) reads.push_back(r);
    }
    reads_ = std::move(reads);
  }

 private:
  static constexpr size_t kMaxReads = 64;
  std::vector<Access> writes_;  // disjoint ranges
  std::vector<Access> reads_;
};

Span clamp(const Span& span, size_t size) {
  return Span{std::min(span.begin, size), std::min(span.end, size)};
}

// --- the device allocator ----------------------------------------------------------------------

struct Block {
  void* ptr;
  size_t size;
  int device;
  StreamId stream;                 // the allocating stream: the pool the block returns to
  std::vector<c10::Stream> uses;   // streams named by record_stream
  bool not_resizable = false;
  AccessLog log;                   // reset when the block is handed out
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
      reserve(dev, nbytes, size);
      block = new Block{host_alloc(size), size, dev, stream};
      std::memset(block->ptr, kPoison, size);
      stats_[dev].reserved_bytes[kAggregate].increase(size);
      stats_[dev].segment[kAggregate].increase(1);
      counters_[dev]["fresh_blocks"]++;
    } else {
      counters_[dev]["reused_blocks"]++;
    }
    block->log.reset(block->size, mark(dev, stream));
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

  // A read of `span` by work on (dev, stream): false (counted as unordered_reads) when it is not
  // ordered after the last write of each byte it reads.
  bool check_read(Block* block, const Span& span, int dev, StreamId stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (block->log.read_ordered(clamp(span, block->size), dev, stream)) return true;
    counters_[dev]["unordered_reads"]++;
    return false;
  }

  void note_read(Block* block, const Span& span, const Position& at, bool copy) {
    std::lock_guard<std::mutex> lock(mutex_);
    block->log.note_read(clamp(span, block->size), at);
    if (copy) note_copy(block, at);
  }

  // A write not ordered after the allocation, the last write and every read since of the bytes
  // it writes (write-after-write, write-after-read): on a device the old access may see the new
  // data or overwrite it. Counted as unordered_writes; timing alone shows it only when the
  // other access happens to run late.
  void note_write(Block* block, const Span& span, const Position& at, bool copy) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Span bytes = clamp(span, block->size);
    if (!block->log.write_ordered(bytes, at.device, at.stream)) {
      counters_[at.device]["unordered_writes"]++;
    }
    block->log.note_write(bytes, at);
    if (copy) note_copy(block, at);
  }

  // The memory cap (set_per_process_memory_fraction) and the device's total memory.
  void set_memory_fraction(int dev, double fraction) {
    std::lock_guard<std::mutex> lock(mutex_);
    limit_[dev] = static_cast<int64_t>(fraction * static_cast<double>(kTotalBytes));
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(mutex_);
    const int dev = device < 0 ? current_device() : device;
    const int64_t reserved = stats_[dev].reserved_bytes[kAggregate].current;
    return {static_cast<size_t>(kTotalBytes - reserved), static_cast<size_t>(kTotalBytes)};
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
  // Room for a fresh block of `size` bytes under the device's cap: past it, the cached blocks of
  // every pool of the device are freed (once their streams ran what was queued) and the
  // allocation retried, as CUDA's allocator does; still past it, torch.OutOfMemoryError.
  void reserve(int dev, size_t nbytes, size_t size) {
    const auto reserved = [&] { return stats_[dev].reserved_bytes[kAggregate].current; };
    if (reserved() + static_cast<int64_t>(size) <= limit_[dev]) return;
    release_cached(dev);
    TORCH_CHECK_WITH(OutOfMemoryError, reserved() + static_cast<int64_t>(size) <= limit_[dev],
                     "swaptest: out of memory allocating ", nbytes, " bytes on device ", dev,
                     ": ", reserved(), " bytes are reserved, ",
                     stats_[dev].allocated_bytes[kAggregate].current, " allocated, and the cap "
                     "is ", limit_[dev], " of ", kTotalBytes, " bytes "
                     "(set_per_process_memory_fraction). Free tensors or raise the cap.");
  }

  // As CUDA's allocator on out of memory: wait for the streams the freed blocks wait on (blocks
  // held by record_stream, the poison fills), then free every cached block of the device.
  void release_cached(int dev) {
    for (const auto& [block, tickets] : pending_) {
      if (block->device != dev) continue;
      for (const auto& [d, stream, seq] : tickets) wait_done(d, stream, seq);
    }
    process_pending();
    for (auto& [key, pool] : pools_) {
      if (key.first != dev || pool.empty()) continue;
      drain(dev, key.second);  // the poison fills of its freed blocks ran
      for (auto& [size, block] : pool) {
        stats_[dev].reserved_bytes[kAggregate].decrease(size);
        stats_[dev].segment[kAggregate].decrease(1);
        std::free(block->ptr);
        delete block;
      }
      pool.clear();
    }
  }

  void note_copy(Block* block, const Position& at) {
    if (block->copies.size() >= 64) forget_ordered_copies(block);
    block->copies.push_back(at);
  }

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
  int64_t limit_[kNumDevices] = {kTotalBytes, kTotalBytes};
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
  AccessLog log;             // the copies' order (the host's own reads and writes are not seen)
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
    block->log.reset(size, Position{});
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

  // A copy's read of pinned bytes must be ordered after the copy that last wrote them (a host
  // buffer a copy out filled and a copy back reads: a race through host memory otherwise).
  bool check_read(const void* ptr, size_t nbytes, int dev, StreamId stream) {
    std::lock_guard<std::mutex> lock(mutex_);
    HostBlock* block = find(ptr);
    if (block == nullptr || block->log.read_ordered(span_in(block, ptr, nbytes), dev, stream)) {
      return true;
    }
    device_allocator_.count(dev, "unordered_reads");
    return false;
  }

  void note_access(const void* ptr, size_t nbytes, const Position& at, bool write) {
    std::lock_guard<std::mutex> lock(mutex_);
    HostBlock* block = find(ptr);
    if (block == nullptr) return;
    const Span span = span_in(block, ptr, nbytes);
    if (!write) {
      block->log.note_read(span, at);
      return;
    }
    if (!block->log.write_ordered(span, at.device, at.stream)) {
      device_allocator_.count(at.device, "unordered_writes");
    }
    block->log.note_write(span, at);
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
      std::memset(block->ptr, kPoison, block->size);  // no stale data from its last user
      return block;
    }
    return nullptr;
  }

  static Span span_in(const HostBlock* block, const void* ptr, size_t nbytes) {
    const size_t begin = reinterpret_cast<uintptr_t>(ptr) - reinterpret_cast<uintptr_t>(block->ptr);
    return clamp(Span{begin, begin + nbytes}, block->size);
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

bool check_read(const c10::Storage& storage, const Span& span, int device, StreamId stream) {
  Block* block = block_of(storage.data_ptr());
  return block == nullptr || device_allocator_.check_read(block, span, device, stream);
}

void note_read(const c10::Storage& storage, const Span& span, const Position& at, bool copy) {
  Block* block = block_of(storage.data_ptr());
  if (block != nullptr) device_allocator_.note_read(block, span, at, copy);
}

void note_write(const c10::Storage& storage, const Span& span, const Position& at, bool copy) {
  Block* block = block_of(storage.data_ptr());
  if (block != nullptr) device_allocator_.note_write(block, span, at, copy);
}

bool check_host_read(const void* ptr, size_t nbytes, int device, StreamId stream) {
  return host_allocator_.check_read(ptr, nbytes, device, stream);
}

void note_host_access(const void* ptr, size_t nbytes, const Position& at, bool write) {
  host_allocator_.note_access(ptr, nbytes, at, write);
}

void check_device_index(int device, const char* api) {
  TORCH_CHECK(device >= 0 && device < kNumDevices, "swaptest.", api, ": no device ", device,
              " (", kNumDevices, " devices). A device index must be in [0, ", kNumDevices, ").");
}

void set_memory_fraction(int device, double fraction) {
  check_device_index(device, "set_per_process_memory_fraction");
  TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "swaptest.set_per_process_memory_fraction: "
              "fraction must be in [0, 1] (got ", fraction, ").");
  device_allocator_.set_memory_fraction(device, fraction);
}

int64_t total_memory() { return kTotalBytes; }

std::pair<size_t, size_t> memory_info(int device) {
  check_device_index(device, "mem_get_info");
  return device_allocator_.getMemoryInfo(static_cast<c10::DeviceIndex>(device));
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
  if (keep > 0) note_write(storage, Span{0, keep}, mark(dev, current_stream_id(dev)), false);
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
