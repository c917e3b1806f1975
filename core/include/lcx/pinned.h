// Page-locked (pinned) host memory, for host<->device copies that overlap compute: where a memory
// strategy parks checkpointed activations. Pinning is slow (the OS locks every page),
// so buffers come from a caching pool: a returned buffer waits for the next request it fits (at
// most twice that request's size) and is unpinned only by release_cached_pinned() or when a new
// pin fails. The pool is an Allocator, so its bytes appear in the statistics and the memory
// timeline like the device's. In a build or on a machine without CUDA the pool hands out ordinary
// host memory, so the same code runs in CPU tests.
#pragma once
#include <cstddef>
#include <string>

#include "lcx/memory.h"
#include "lcx/tensor.h"

namespace lcx {

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();  // returns the memory to the pool

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  // A host tensor over the buffer's first bytes; valid while the buffer lives.
  Tensor view(Shape shape, DType dtype) const;

 private:
  friend PinnedBuffer pinned_alloc(size_t bytes, MemoryCategory c);
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemoryCategory category_ = MemoryCategory::activations;
};

PinnedBuffer pinned_alloc(size_t bytes, MemoryCategory c = MemoryCategory::activations);
// The pool, for its statistics and recorder.
Allocator& pinned_allocator();
// Unpins every cached buffer that is not in use; returns the bytes given back.
size_t release_cached_pinned();
// What the host can still give this process, in bytes: the smaller of MemAvailable in /proc/meminfo
// and the room left under the process's cgroup memory limit (a container's limit is reached long
// before the machine's memory: the OOM killer, not a failed allocation); -1 where neither is known.
int64_t host_memory_available();
// The same read from other files, for tests: `meminfo` as /proc/meminfo, `cgroup_root` as
// /sys/fs/cgroup (v2: memory.max and memory.current; v1: memory/memory.limit_in_bytes and
// memory/memory.usage_in_bytes).
int64_t host_memory_available(const std::string& meminfo, const std::string& cgroup_root);
// True when the pool's memory is page-locked (a CUDA build with a visible GPU).
bool pinned_is_page_locked();

}  // namespace lcx
