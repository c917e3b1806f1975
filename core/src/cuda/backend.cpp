// The CUDA device backend: installed on first use when a GPU is visible. Copies run on the
// default stream and synchronize, which is what the host-facing Tensor API promises; the step's
// own streams and events live with the kernels.
#include <cuda_runtime.h>

#include <memory>
#include <mutex>

#include "cuda/check.h"
#include "lcx/tensor.h"

namespace lcx {
namespace {

// Plain cudaMalloc with no caching: correct everywhere, replaced by the expandable-segment
// allocator of the CUDA backend issue.
class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int index) : index_(index) {}
  Device device() const override { return Device::cuda(index_); }

 protected:
  void* raw_allocate(size_t bytes) override {
    LCX_CUDA_CHECK(cudaSetDevice(index_));
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess)
      throw Error(str("GPU out of memory: cudaMalloc of ", bytes, " bytes on cuda:", index_, " failed (",
                      cudaGetErrorString(err), ")"));
    std::lock_guard lock(mu_);
    held_ += static_cast<int64_t>(bytes);
    return p;
  }
  void raw_deallocate(void* p, size_t bytes) override {
    cudaFree(p);
    std::lock_guard lock(mu_);
    held_ -= static_cast<int64_t>(bytes);
  }
  int64_t reserved() const override {
    std::lock_guard lock(mu_);
    return held_;
  }

 private:
  int index_;
  mutable std::mutex mu_;
  int64_t held_ = 0;
};

class CudaBackend final : public DeviceBackend {
 public:
  void copy(void* dst, Device, const void* src, Device, size_t bytes) override {
    LCX_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  }
  void fill_zero(void* dst, size_t bytes) override { LCX_CUDA_CHECK(cudaMemset(dst, 0, bytes)); }
  void synchronize() override { LCX_CUDA_CHECK(cudaDeviceSynchronize()); }
};

}  // namespace

bool cuda_available() {
  static std::once_flag once;
  static bool ok = false;
  std::call_once(once, [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
      cudaGetLastError();
      return;
    }
    for (int i = 0; i < n; ++i) install_allocator(Device::cuda(i), std::make_shared<CudaAllocator>(i));
    install_backend(DeviceType::cuda, std::make_shared<CudaBackend>());
    ok = true;
  });
  return ok;
}

}  // namespace lcx
