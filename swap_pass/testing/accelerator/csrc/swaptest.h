// A CPU-backed asynchronous test accelerator registered as PrivateUse1.
//
// Memory lives in host RAM. Each stream of a device is a FIFO of tasks run by a worker thread of
// its own; compute ops run on the calling thread once the current stream's queue is drained, so
// they run in stream order. Copies issued on a side stream are queued there and start after a
// seeded delay (cut short once the host waits for them), so a missing wait reads stale bytes.
// Compute is not asynchronous, so the device checks the order itself: each stream and the host
// carry a vector clock, each device block the position of its last write, and a copy (or a
// compute op's read) not ordered after that write reads poison, as it may on a real device.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

namespace swaptest {

constexpr int kNumDevices = 2;
// Stream ids per device: 0 is the default stream, 1..kSideStreams the pool of side streams that
// new streams are taken from round robin (as CUDA's stream pool does).
constexpr int kSideStreams = 32;

using c10::StreamId;

// --- streams (runtime.cpp) ---------------------------------------------------------------------

// Queue `fn` on a stream; returns its position. A `delayed` task starts after the copy delay,
// or once the host waits for it (directly, or through streams that wait on it).
uint64_t enqueue(int device, StreamId stream, std::function<void()> fn, bool delayed);
// True when the task at `seq` (and everything before it on that stream) has run.
bool is_done(int device, StreamId stream, uint64_t seq);
// Block the calling thread until the task at `seq` ran (skipping the delays before it).
void wait_done(int device, StreamId stream, uint64_t seq);
// Block until everything queued on the stream so far ran.
void drain(int device, StreamId stream);
void drain_device(int device);
void drain_all();

int current_device();
void set_current_device(int device);
StreamId current_stream_id(int device);
c10::Stream make_stream(int device, StreamId id);

// Block until everything queued on the stream so far ran: a host synchronize, after which work
// queued on any stream is ordered after it (unlike `drain`, the stream order of compute).
// Counted in memory_stats()["host_syncs"], as are host_synced, event and device synchronizes.
void host_sync(int device, StreamId stream);
// host_sync without the count (the streams of one device synchronize).
void wait_as_host(int device, StreamId stream);
// The host waited for the task at `seq` of the stream (a blocking copy): as `host_sync` up to it.
void host_synced(int device, StreamId stream, uint64_t seq);

void set_delay(bool enabled, double min_ms, double max_ms);
void set_seed(uint64_t seed);
std::unordered_map<std::string, double> delay_settings();

// --- the order of work (runtime.cpp) ----------------------------------------------------------

// A place in a stream's order: the task at `seq` of (device, stream). device < 0: nowhere.
struct Position {
  int device = -1;
  StreamId stream = 0;
  uint64_t seq = 0;
};
// A position on the stream for work the calling thread does now (compute writing a block).
Position mark(int device, StreamId stream);
// Whether work queued now on (device, reader) is ordered after `p`: the same stream, a chain of
// event waits from p's stream, or a host synchronize after it. Always true with the check off.
bool is_ordered(const Position& p, int device, StreamId reader);
// `waiter` waits, in its order, for the work at `p` (as an event recorded there and waited on).
void stream_waits_for(int device, StreamId waiter, const Position& p);
void set_order_check(bool enabled);

// --- copy windows (runtime.cpp) ---------------------------------------------------------------

// Compute issued on a stream (an op, a kernel, a copy between device blocks on it): one op and the
// bytes its operands span.
void count_compute(int device, StreamId stream, uint64_t bytes);
// A copy queued on a side stream at `seq` (direction 0: to the host, 1: to the device, 2: device
// to device): its window is the compute issued on the first stream made to wait for it, from
// now to that wait (or on every stream of the device, when the host waits first).
void open_window(int direction, uint64_t nbytes, int device, StreamId stream, uint64_t seq);
void record_windows(bool enabled);  // clears what was recorded
std::vector<std::unordered_map<std::string, int64_t>> copy_windows();
std::unordered_map<std::string, int64_t> compute_counts(int device, StreamId stream);
bool order_check();

// --- memory (memory.cpp) -----------------------------------------------------------------------

c10::Allocator* device_allocator();
c10::Allocator* host_allocator();
bool is_pinned_ptr(const void* ptr);
// Pinned host block of `ptr`: the copy just queued at (device, stream, seq) uses it, so the
// block is not handed out again before that copy ran (CUDA's record_event).
void pinned_record_use(const void* ptr, int device, StreamId stream, uint64_t seq);
// Tensor.record_stream: the block is not reused before `stream` ran what is queued at its free.
void record_stream(const c10::DataPtr& data_ptr, c10::Stream stream);
// Resize a device storage in place (the PrivateUse1 resize hook); failure injection applies.
void resize_storage_bytes(const c10::Storage& storage, size_t newsize);
// The fill every freed or fresh block gets (0xFF bytes: NaN in every floating dtype).
constexpr unsigned char kPoison = 0xFF;

// The order of each block's accesses (memory.cpp): per byte range, its last write (the allocation
// first, on the allocating stream) and the reads since. A read must be ordered after the last
// write of its bytes (else unordered_reads), a write after the last write and the reads since
// (else unordered_writes). A queued copy's access (`copy`) is also checked against the block's
// allocating stream when it is freed (else unordered_frees). Spans are bytes of the storage.
struct Span {
  size_t begin = 0;
  size_t end = 0;
};
bool check_read(const c10::Storage& storage, const Span& span, int device, StreamId stream);
void note_read(const c10::Storage& storage, const Span& span, const Position& at, bool copy);
void note_write(const c10::Storage& storage, const Span& span, const Position& at, bool copy);
// The same for the copies' accesses of a pinned host block (`ptr` anywhere inside it; nothing
// for other host memory). Counted on the copy's device.
bool check_host_read(const void* ptr, size_t nbytes, int device, StreamId stream);
void note_host_access(const void* ptr, size_t nbytes, const Position& at, bool write);
// The memory cap: past it an allocation frees the cached blocks and retries, then raises
// torch.OutOfMemoryError. total_memory() is what each device reports.
void set_memory_fraction(int device, double fraction);
int64_t total_memory();
std::pair<size_t, size_t> memory_info(int device);  // (free, total) bytes
// Add one to a counter of memory_stats(device).
void count(int device, const std::string& name);

void fail_nth_resize(int64_t n);
int64_t resize_calls();
void mark_not_resizable(const c10::Storage& storage);
bool is_marked_not_resizable(const c10::Storage& storage);
std::unordered_map<std::string, int64_t> memory_stats(int device);
std::unordered_map<std::string, int64_t> pinned_stats();
void empty_device_cache();
void empty_pinned_cache();

}  // namespace swaptest
