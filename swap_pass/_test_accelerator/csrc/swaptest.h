// A CPU-backed asynchronous test accelerator registered as PrivateUse1.
//
// Memory lives in host RAM. Each stream of a device is a FIFO of tasks run by a worker thread of
// its own; compute ops run on the calling thread once the current stream's queue is drained, so
// they run in stream order. Copies issued on a side stream are queued there and start after a
// seeded delay (cut short once the host waits for them), so a missing wait reads stale bytes.
#pragma once

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Storage.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>

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

void set_delay(bool enabled, double min_ms, double max_ms);
void set_seed(uint64_t seed);
std::unordered_map<std::string, double> delay_settings();

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

void fail_nth_resize(int64_t n);
int64_t resize_calls();
void mark_not_resizable(const c10::Storage& storage);
bool is_marked_not_resizable(const c10::Storage& storage);
std::unordered_map<std::string, int64_t> memory_stats(int device);
std::unordered_map<std::string, int64_t> pinned_stats();
void empty_device_cache();
void empty_pinned_cache();

}  // namespace swaptest
