// Allocators, their statistics, and the event recorder behind the memory timeline. Every byte a
// tensor holds comes from an Allocator and is tagged with a category, so a plan and a timeline can
// say where memory went (weights, optimizer state, saved activations, transient work).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace lcx {

enum class DeviceType : uint8_t { cpu, cuda };

struct Device {
  DeviceType type = DeviceType::cpu;
  int index = 0;
  static Device cpu() { return {DeviceType::cpu, 0}; }
  static Device cuda(int i = 0) { return {DeviceType::cuda, i}; }
  bool is_cuda() const { return type == DeviceType::cuda; }
  bool operator==(const Device&) const = default;
};
std::string device_name(Device d);

enum class MemoryCategory : uint8_t {
  weights,
  gradients,
  master_weights,
  optimizer,
  activations,  // checkpointed layer inputs kept for backward
  transient,    // work buffers inside one layer or the loss
  communication,
  other,
};
constexpr int kMemoryCategories = 8;
const char* memory_category_name(MemoryCategory c);

struct AllocatorStats {
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t reserved_bytes = 0;  // held from the system, live or cached
  int64_t allocations = 0;
  int64_t frees = 0;
  int64_t live_by_category[kMemoryCategories] = {};
};

struct MemoryEvent {
  double time_s;       // since the recorder was enabled
  int64_t delta;       // +bytes on allocate, -bytes on free
  int64_t live_after;  // allocator's live bytes after the event
  uint64_t address;
  MemoryCategory category;
  std::string tag;  // the phase or layer that was current (see MemoryRecorder::set_tag)
};

// Off by default, so recording costs one branch per allocation until a timeline is asked for.
class MemoryRecorder {
 public:
  void enable(bool on);
  bool enabled() const { return enabled_; }
  void set_tag(std::string tag);
  void record(int64_t delta, int64_t live_after, uint64_t address, MemoryCategory c);
  std::vector<MemoryEvent> events() const;
  void clear();

 private:
  mutable std::mutex mu_;
  bool enabled_ = false;
  double start_s_ = 0;
  std::string tag_;
  std::vector<MemoryEvent> events_;
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual Device device() const = 0;
  void* allocate(size_t bytes, MemoryCategory c);
  void deallocate(void* p, size_t bytes, MemoryCategory c);
  AllocatorStats stats() const;
  void reset_peak();
  MemoryRecorder& recorder() { return recorder_; }

 protected:
  // Implementations supply raw memory; accounting and recording live in the base so every
  // allocator reports the same way. reserved() is what the implementation holds from the system.
  virtual void* raw_allocate(size_t bytes) = 0;
  virtual void raw_deallocate(void* p, size_t bytes) = 0;
  virtual int64_t reserved() const = 0;

 private:
  mutable std::mutex mu_;
  AllocatorStats stats_;
  MemoryRecorder recorder_;
};

// The process-wide allocator of a device. The CPU one always exists; the CUDA backend installs
// its own when a GPU is present. Plugins allocate through tensors, which ask here.
Allocator& allocator_for(Device d);
void install_allocator(Device d, std::shared_ptr<Allocator> a);

}  // namespace lcx
