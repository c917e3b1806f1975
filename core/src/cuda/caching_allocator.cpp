// The expandable-segment caching allocator (see caching_allocator.h for the design) and the plain
// fallback. Driver entry points (cuMem*) are fetched through the runtime at first use, so
// liblcx_core has no link-time dependency on libcuda and still loads on machines without a driver.
#include "cuda/caching_allocator.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <vector>

#include "cuda/check.h"
#include "lcx/log.h"
#include "lcx/tensor.h"

// The driver API's check macro: a failed cuMem* call names the call, its CUresult, file and line.
#define LCX_CU_CHECK(call)                                                                          \
  do {                                                                                              \
    CUresult lcx_res_ = (call);                                                                     \
    if (lcx_res_ != CUDA_SUCCESS)                                                                   \
      throw ::lcx::Error(::lcx::str(#call " failed: CUresult ", static_cast<int>(lcx_res_), " at ", \
                                    __FILE__, ":", __LINE__));                                      \
  } while (0)

namespace lcx::cuda {
namespace {

constexpr size_t kBlockAlign = 512;       // every block starts and ends on this boundary
constexpr size_t kChunkBytes = 32u << 20;  // largest physical chunk mapped at once

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

struct Driver {
  decltype(&cuMemAddressReserve) address_reserve = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuDeviceGetAttribute) attribute = nullptr;
};

// nullptr when the driver lacks any of the entry points.
const Driver* driver() {
  static const Driver* d = []() -> const Driver* {
    static Driver drv;
    auto get = [](const char* name, auto& fn) {
      void* p = nullptr;
      cudaDriverEntryPointQueryResult status{};
      if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &status) != cudaSuccess ||
          status != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        return false;
      }
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
      return true;
    };
    const bool ok = get("cuMemAddressReserve", drv.address_reserve) && get("cuMemCreate", drv.create) &&
                    get("cuMemRelease", drv.release) && get("cuMemMap", drv.map) && get("cuMemUnmap", drv.unmap) &&
                    get("cuMemSetAccess", drv.set_access) &&
                    get("cuMemGetAllocationGranularity", drv.granularity) &&
                    get("cuDeviceGetAttribute", drv.attribute);
    return ok ? &drv : nullptr;
  }();
  return d;
}

void use_device(int device) {
  int cur = -1;
  LCX_CUDA_CHECK(cudaGetDevice(&cur));
  if (cur != device) LCX_CUDA_CHECK(cudaSetDevice(device));
}

std::string out_of_memory(size_t bytes, int device, const AllocatorStats& s, const char* why) {
  size_t free_b = 0, total_b = 0;
  cudaMemGetInfo(&free_b, &total_b);
  cudaGetLastError();
  return str("GPU out of memory: ", bytes, " bytes requested on cuda:", device, " (", why, "); ", s.live_bytes,
             " bytes live, ", s.reserved_bytes, " mapped by lcx, ", free_b, " free of ", total_b,
             " on the device");
}

class VmmAllocator final : public Allocator {
 public:
  // Nothing touches the device until the first allocation, so a process that uses one GPU of
  // several creates no context on the others.
  VmmAllocator(int device, const Driver& drv) : device_(device), drv_(drv) {}
  // The address range and its mappings live until the process ends: tearing them down from a
  // static destructor would race the CUDA runtime's own teardown, and the driver reclaims all.
  ~VmmAllocator() override = default;

  Device device() const override { return Device::cuda(device_); }

  size_t release_cached() {
    std::lock_guard lock(mu_);
    return release_free_chunks();
  }

 protected:
  void* raw_allocate(size_t bytes) override {
    const size_t size = round_up(bytes, kBlockAlign);
    const char* failure = nullptr;
    uintptr_t addr = 0;
    {
      std::lock_guard lock(mu_);
      use_device(device_);
      if (!base_) init();
      auto it = free_.lower_bound({size, 0});
      if (it == free_.end()) {
        failure = "no free address range is large enough";
      } else {
        addr = it->second;
        const size_t have = it->first;
        free_.erase(it);
        blocks_[addr] = {size, false};
        if (have > size) {
          blocks_[addr + size] = {have - size, true};
          free_.insert({have - size, addr + size});
        }
        bool mapped = false;
        try {
          mapped = map_range(addr, addr + size);
        } catch (...) {
          free_block(addr);
          throw;
        }
        if (!mapped) {  // give back what the failed block had mapped so far
          free_block(addr);
          release_free_chunks();
          failure = "physical memory exhausted after releasing the cache";
        }
      }
    }
    if (failure)
      throw Error(out_of_memory(bytes, device_, stats(), failure), {},
                  "shorten the sequence, or keep saved activations on the host (lcx-train --plan names what fits)");
    return reinterpret_cast<void*>(addr);
  }

  void raw_deallocate(void* p, size_t) override {
    std::lock_guard lock(mu_);
    free_block(reinterpret_cast<uintptr_t>(p));
  }

  int64_t reserved() const override {
    std::lock_guard lock(mu_);
    return static_cast<int64_t>(mapped_);
  }

 private:
  struct Block {
    size_t size;
    bool free;
  };
  struct Chunk {
    size_t pages;
    CUmemGenericAllocationHandle handle;
  };

  // Reserves the address range; under mu_, on the first allocation.
  void init() {
    const int device = device_;
    LCX_CUDA_CHECK(cudaFree(nullptr));  // creates the primary context the driver calls use
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = device;
    LCX_CU_CHECK(drv_.granularity(&page_, &prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
    size_t free_b = 0, total_b = 0;
    LCX_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    // Address space is cheap: four times the device's memory leaves room for any fragmentation
    // of addresses while physical memory stays fully usable.
    for (size_t factor : {4, 2, 1}) {
      va_bytes_ = round_up(total_b * factor, page_);
      if (drv_.address_reserve(&base_, va_bytes_, 0, 0, 0) == CUDA_SUCCESS) break;
      base_ = 0;
    }
    if (!base_) throw Error(str("cannot reserve GPU address space on cuda:", device));
    page_chunk_.assign(va_bytes_ / page_, -1);
    blocks_[base_] = {va_bytes_, true};
    free_.insert({va_bytes_, base_});
  }

  // Marks the block at addr free and merges it with free neighbours.
  void free_block(uintptr_t addr) {
    auto it = blocks_.find(addr);
    LCX_CHECK(it != blocks_.end() && !it->second.free, "freeing ", addr, ", which this allocator did not hand out");
    it->second.free = true;
    auto next = std::next(it);
    if (next != blocks_.end() && next->second.free) {
      free_.erase({next->second.size, next->first});
      it->second.size += next->second.size;
      blocks_.erase(next);
    }
    if (it != blocks_.begin()) {
      auto prev = std::prev(it);
      if (prev->second.free) {
        free_.erase({prev->second.size, prev->first});
        prev->second.size += it->second.size;
        blocks_.erase(it);
        it = prev;
      }
    }
    free_.insert({it->second.size, it->first});
  }

  // Maps physical memory under every unmapped page of [begin, end). False when the device is
  // out of memory even after the cache was released.
  bool map_range(uintptr_t begin, uintptr_t end) {
    const size_t p0 = (begin - base_) / page_, p1 = (end - base_ + page_ - 1) / page_;
    const size_t max_pages = std::max<size_t>(1, kChunkBytes / page_);
    for (size_t p = p0; p < p1;) {
      if (page_chunk_[p] >= 0) {
        ++p;
        continue;
      }
      size_t n = 0;
      while (p + n < p1 && page_chunk_[p + n] < 0 && n < max_pages) ++n;
      if (!map_chunk(p, n)) {
        release_free_chunks();
        if (!map_chunk(p, n)) return false;
      }
      p += n;
    }
    return true;
  }

  bool map_chunk(size_t first, size_t pages) {
    const size_t bytes = pages * page_;
    CUmemGenericAllocationHandle h{};
    const CUresult r = drv_.create(&h, bytes, &prop_, 0);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return false;
    LCX_CU_CHECK(r);
    const CUdeviceptr ptr = base_ + first * page_;
    CUresult m = drv_.map(ptr, bytes, 0, h, 0);
    if (m == CUDA_SUCCESS) {
      CUmemAccessDesc access{};
      access.location = prop_.location;
      access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      m = drv_.set_access(ptr, bytes, &access, 1);
      if (m != CUDA_SUCCESS) drv_.unmap(ptr, bytes);
    }
    if (m != CUDA_SUCCESS) {
      drv_.release(h);
      if (m == CUDA_ERROR_OUT_OF_MEMORY) return false;
      LCX_CU_CHECK(m);
    }
    chunks_[first] = {pages, h};
    for (size_t p = first; p < first + pages; ++p) page_chunk_[p] = static_cast<int64_t>(first);
    mapped_ += bytes;
    return true;
  }

  // Unmaps every chunk that lies wholly inside one free block (free blocks are coalesced, so a
  // chunk under free space only is always inside one).
  size_t release_free_chunks() {
    if (chunks_.empty()) return 0;
    // A kernel queued before a free may still touch the pages.
    use_device(device_);
    LCX_CUDA_CHECK(cudaDeviceSynchronize());
    size_t released = 0;
    for (auto it = chunks_.begin(); it != chunks_.end();) {
      const uintptr_t start = base_ + it->first * page_, bytes = it->second.pages * page_;
      auto blk = std::prev(blocks_.upper_bound(start));
      if (blk->second.free && blk->first + blk->second.size >= start + bytes) {
        LCX_CU_CHECK(drv_.unmap(start, bytes));
        LCX_CU_CHECK(drv_.release(it->second.handle));
        for (size_t p = it->first; p < it->first + it->second.pages; ++p) page_chunk_[p] = -1;
        mapped_ -= bytes;
        released += bytes;
        it = chunks_.erase(it);
      } else {
        ++it;
      }
    }
    return released;
  }

  int device_;
  const Driver& drv_;
  CUmemAllocationProp prop_{};
  size_t page_ = 0;
  CUdeviceptr base_ = 0;
  size_t va_bytes_ = 0;
  mutable std::mutex mu_;
  std::map<uintptr_t, Block> blocks_;            // tiles [base_, base_ + va_bytes_)
  std::set<std::pair<size_t, uintptr_t>> free_;  // free blocks by (size, address): best fit
  std::vector<int64_t> page_chunk_;              // page -> first page of its chunk, -1 unmapped
  std::map<size_t, Chunk> chunks_;               // by first page
  size_t mapped_ = 0;
};

// cudaMalloc per allocation, for devices without virtual memory management.
class PlainAllocator final : public Allocator {
 public:
  explicit PlainAllocator(int device) : device_(device) {}
  Device device() const override { return Device::cuda(device_); }

 protected:
  void* raw_allocate(size_t bytes) override {
    use_device(device_);
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw Error(out_of_memory(bytes, device_, stats(), cudaGetErrorString(err)), {},
                  "shorten the sequence, or keep saved activations on the host (lcx-train --plan names what fits)");
    }
    std::lock_guard lock(mu_);
    held_ += static_cast<int64_t>(bytes);
    return p;
  }
  void raw_deallocate(void* p, size_t bytes) override {
    LCX_CUDA_CHECK(cudaFree(p));
    std::lock_guard lock(mu_);
    held_ -= static_cast<int64_t>(bytes);
  }
  int64_t reserved() const override {
    std::lock_guard lock(mu_);
    return held_;
  }

 private:
  int device_;
  mutable std::mutex mu_;
  int64_t held_ = 0;
};

}  // namespace

std::shared_ptr<Allocator> make_device_allocator(int device) {
  const Driver* drv = driver();
  int vmm = 0;
  if (drv) {
    CUdevice dev = device;
    if (drv->attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) != CUDA_SUCCESS) vmm = 0;
  }
  if (!vmm) {
    log::warn(str("cuda:", device, " has no virtual memory management: plain cudaMalloc allocator, "
                  "large tensors may fail for fragmentation"));
    return std::make_shared<PlainAllocator>(device);
  }
  return std::make_shared<VmmAllocator>(device, *drv);
}

size_t release_cached(int device) {
  auto* vmm = dynamic_cast<VmmAllocator*>(&allocator_for(Device::cuda(device)));
  return vmm ? vmm->release_cached() : 0;
}

}  // namespace lcx::cuda
