// The pinned host memory pool behind lcx/pinned.h: cudaHostAlloc'ed blocks cached by size and
// reused best-fit (a block serves requests down to half its size, so a large buffer is not tied
// up by a small one). Without CUDA, or without a visible GPU, blocks are ordinary aligned host
// memory with the same caching and statistics.
#include "lcx/pinned.h"
#include "lcx/size_math.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>

#ifdef LCX_HAVE_CUDA
#include <cuda_runtime.h>
#endif

#include "lcx/error.h"

namespace lcx {
namespace {

constexpr size_t kPinnedAlign = 4096;

class PinnedPool final : public Allocator {
 public:
  PinnedPool() : locked_(cuda_available()) {}
  Device device() const override { return Device::cpu(); }
  bool locked() const { return locked_; }

  size_t release() {
    std::lock_guard lock(mu_);
    size_t freed = 0;
    for (auto& [size, p] : free_) {
      unpin(p);
      sizes_.erase(p);
      held_ -= size;
      freed += size;
    }
    free_.clear();
    return freed;
  }

 protected:
  void* raw_allocate(size_t bytes) override {
    const size_t size = (bytes + kPinnedAlign - 1) / kPinnedAlign * kPinnedAlign;
    {
      std::lock_guard lock(mu_);
      auto it = free_.lower_bound(size);
      if (it != free_.end() && it->first <= 2 * size) {
        void* p = it->second;
        free_.erase(it);
        return p;
      }
    }
    void* p = pin(size);
    if (!p) {
      release();
      p = pin(size);
    }
    if (!p) {
      const int64_t available = host_memory_available();
      throw Error(str("cannot pin ", format_bytes(static_cast<int64_t>(size)), " (", size, " bytes) of host memory: ", format_bytes(static_cast<int64_t>(held_bytes())),
                      " pinned already, ", available < 0 ? std::string("unknown") : format_bytes(available),
                      " available to this process"),
                  "pinned memory",
                  "lower data.seq_len, keep fewer layers' inputs in host memory, or run where the host has more memory "
                  "(lcx-train --plan --host-memory SIZE shows what a step pins)");
    }
    std::lock_guard lock(mu_);
    sizes_[p] = size;
    held_ += size;
    return p;
  }

  void raw_deallocate(void* p, size_t) override {
    std::lock_guard lock(mu_);
    free_.emplace(sizes_.at(p), p);
  }

  int64_t reserved() const override { return static_cast<int64_t>(held_bytes()); }

 private:
  size_t held_bytes() const {
    std::lock_guard lock(mu_);
    return held_;
  }
  void* pin(size_t size) const {
#ifdef LCX_HAVE_CUDA
    if (locked_) {
      void* p = nullptr;
      if (cudaHostAlloc(&p, size, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
      }
      return p;
    }
#endif
    return std::aligned_alloc(kPinnedAlign, size);
  }
  void unpin(void* p) const {
#ifdef LCX_HAVE_CUDA
    if (locked_) {
      cudaFreeHost(p);
      return;
    }
#endif
    std::free(p);
  }

  const bool locked_;
  mutable std::mutex mu_;
  std::multimap<size_t, void*> free_;         // cached blocks by size
  std::unordered_map<void*, size_t> sizes_;  // every block's rounded size
  size_t held_ = 0;
};

// Never destroyed: buffers may be returned from other static destructors at exit.
PinnedPool& pool() {
  static PinnedPool* p = new PinnedPool();
  return *p;
}

}  // namespace

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)), category_(o.category_) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) pool().deallocate(data_, bytes_, category_);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    category_ = o.category_;
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) pool().deallocate(data_, bytes_, category_);
}

Tensor PinnedBuffer::view(Shape shape, DType dtype) const {
  const size_t need = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  LCX_CHECK(need <= bytes_, "a ", dtype_name(dtype), shape_str(shape), " view needs ", need, " bytes of a ", bytes_,
            "-byte pinned buffer");
  return Tensor::borrow(data_, std::move(shape), dtype, Device::cpu());
}

PinnedBuffer pinned_alloc(size_t bytes, MemoryCategory c) {
  PinnedBuffer b;
  b.data_ = pool().allocate(bytes, c);
  b.bytes_ = bytes;
  b.category_ = c;
  return b;
}

Allocator& pinned_allocator() { return pool(); }
size_t release_cached_pinned() { return pool().release(); }
bool pinned_is_page_locked() { return pool().locked(); }

namespace {

// The first whitespace-separated field of a file as a byte count; -1 when absent, unreadable or
// not a number (cgroup v2 writes "max" for no limit).
int64_t read_count(const std::string& path) {
  std::ifstream in(path);
  int64_t n = -1;
  if (!(in >> n) || n < 0) return -1;
  return n;
}

int64_t meminfo_available(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    int64_t kib = -1;
    fields >> kib;
    return kib < 0 ? -1 : kib * 1024;
  }
  return -1;
}

// The limit less the usage of the cgroup, v2 first; -1 without a limit. A v1 group without a
// limit reports a number near 2^63, which the minimum with MemAvailable ignores.
int64_t cgroup_room(const std::string& root) {
  for (const auto& [limit_file, usage_file] : {std::pair<std::string, std::string>{"/memory.max", "/memory.current"},
                                               {"/memory/memory.limit_in_bytes", "/memory/memory.usage_in_bytes"}}) {
    const int64_t limit = read_count(root + limit_file), usage = read_count(root + usage_file);
    if (limit >= 0 && usage >= 0) return std::max<int64_t>(limit - usage, 0);
  }
  return -1;
}

}  // namespace

int64_t host_memory_available(const std::string& meminfo, const std::string& cgroup_root) {
  const int64_t machine = meminfo_available(meminfo), group = cgroup_room(cgroup_root);
  if (machine < 0) return group;
  if (group < 0) return machine;
  return std::min(machine, group);
}

int64_t host_memory_available() { return host_memory_available("/proc/meminfo", "/sys/fs/cgroup"); }

}  // namespace lcx
