#include <chrono>
#include <cstdlib>
#include <map>

#include "lcx/clock.h"
#include "lcx/error.h"
#include "lcx/memory.h"
#include "lcx/tensor.h"

namespace lcx {

std::string device_name(Device d) {
  return d.is_cuda() ? str("cuda:", d.index) : std::string("cpu");
}

const char* memory_category_name(MemoryCategory c) {
  switch (c) {
    case MemoryCategory::weights: return "weights";
    case MemoryCategory::gradients: return "gradients";
    case MemoryCategory::master_weights: return "master_weights";
    case MemoryCategory::optimizer: return "optimizer";
    case MemoryCategory::activations: return "activations";
    case MemoryCategory::transient: return "transient";
    case MemoryCategory::communication: return "communication";
    case MemoryCategory::other: return "other";
  }
  return "?";
}

void MemoryRecorder::enable(bool on) {
  std::lock_guard lock(mu_);
  if (on && !enabled_) start_s_ = now_s();
  enabled_ = on;
}

void MemoryRecorder::set_tag(std::string tag) {
  std::lock_guard lock(mu_);
  tag_ = std::move(tag);
}

void MemoryRecorder::record(int64_t delta, int64_t live_after, uint64_t address, MemoryCategory c) {
  std::lock_guard lock(mu_);
  if (!enabled_) return;
  events_.push_back({now_s() - start_s_, delta, live_after, address, c, tag_});
}

std::vector<MemoryEvent> MemoryRecorder::events() const {
  std::lock_guard lock(mu_);
  return events_;
}

void MemoryRecorder::clear() {
  std::lock_guard lock(mu_);
  events_.clear();
}

void* Allocator::allocate(size_t bytes, MemoryCategory c) {
  if (bytes == 0) return nullptr;
  void* p = raw_allocate(bytes);
  int64_t live;
  {
    std::lock_guard lock(mu_);
    stats_.live_bytes += static_cast<int64_t>(bytes);
    stats_.live_by_category[static_cast<int>(c)] += static_cast<int64_t>(bytes);
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.live_bytes);
    ++stats_.allocations;
    live = stats_.live_bytes;
  }
  if (recorder_.enabled()) recorder_.record(static_cast<int64_t>(bytes), live, reinterpret_cast<uint64_t>(p), c);
  return p;
}

void Allocator::deallocate(void* p, size_t bytes, MemoryCategory c) {
  if (!p) return;
  raw_deallocate(p, bytes);
  int64_t live;
  {
    std::lock_guard lock(mu_);
    stats_.live_bytes -= static_cast<int64_t>(bytes);
    stats_.live_by_category[static_cast<int>(c)] -= static_cast<int64_t>(bytes);
    ++stats_.frees;
    live = stats_.live_bytes;
  }
  if (recorder_.enabled()) recorder_.record(-static_cast<int64_t>(bytes), live, reinterpret_cast<uint64_t>(p), c);
}

AllocatorStats Allocator::stats() const {
  std::lock_guard lock(mu_);
  AllocatorStats s = stats_;
  s.reserved_bytes = reserved();
  return s;
}

void Allocator::reset_peak() {
  std::lock_guard lock(mu_);
  stats_.peak_bytes = stats_.live_bytes;
}

namespace {

// Host memory straight from the C heap, 64-byte aligned for vector loads; the OS caches pages.
class CpuAllocator final : public Allocator {
 public:
  Device device() const override { return Device::cpu(); }

 protected:
  void* raw_allocate(size_t bytes) override {
    size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p) throw Error(str("host out of memory allocating ", bytes, " bytes"));
    std::lock_guard lock(mu_);
    held_ += static_cast<int64_t>(bytes);
    return p;
  }
  void raw_deallocate(void* p, size_t bytes) override {
    std::free(p);
    std::lock_guard lock(mu_);
    held_ -= static_cast<int64_t>(bytes);
  }
  int64_t reserved() const override {
    std::lock_guard lock(mu_);
    return held_;
  }

 private:
  mutable std::mutex mu_;
  int64_t held_ = 0;
};

struct Registry {
  std::mutex mu;
  std::shared_ptr<Allocator> cpu = std::make_shared<CpuAllocator>();
  std::map<int, std::shared_ptr<Allocator>> cuda;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

Allocator& allocator_for(Device d) {
  auto& r = registry();
  if (d.is_cuda()) cuda_available();  // installs the CUDA allocators on first use
  std::lock_guard lock(r.mu);
  if (!d.is_cuda()) return *r.cpu;
  auto it = r.cuda.find(d.index);
  if (it == r.cuda.end())
    throw Error(str("no allocator for ", device_name(d), ": this build or machine has no CUDA device"));
  return *it->second;
}

void install_allocator(Device d, std::shared_ptr<Allocator> a) {
  auto& r = registry();
  std::lock_guard lock(r.mu);
  if (d.is_cuda())
    r.cuda[d.index] = std::move(a);
  else
    r.cpu = std::move(a);
}

}  // namespace lcx
