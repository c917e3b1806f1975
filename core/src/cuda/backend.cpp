// The CUDA device backend: installed on first use when a GPU is visible. Copies run on the
// default stream and synchronize, which is what the host-facing Tensor API promises; the step's
// own streams and events live with the kernels.
#include <cuda_runtime.h>

#include <memory>
#include <mutex>

#include "cuda/caching_allocator.h"
#include "cuda/check.h"
#include "lcx/tensor.h"

namespace lcx {
namespace {

class CudaBackend final : public DeviceBackend {
 public:
  void copy(void* dst, Device, const void* src, Device, size_t bytes) override {
    LCX_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));
  }
  void fill_zero(void* dst, size_t bytes) override { LCX_CUDA_CHECK(cudaMemset(dst, 0, bytes)); }
  void synchronize() override { LCX_CUDA_CHECK(cudaDeviceSynchronize()); }
};

}  // namespace

namespace {
int device_count = 0;
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
    device_count = n;
    for (int i = 0; i < n; ++i) install_allocator(Device::cuda(i), cuda::make_device_allocator(i));
    install_backend(DeviceType::cuda, std::make_shared<CudaBackend>());
    ok = true;
  });
  return ok;
}

int cuda_device_count() { return cuda_available() ? device_count : 0; }

}  // namespace lcx
