// A kernel that does nothing, built for every target like every other: whether the driver finds
// code of it for a GPU says whether this build runs there at all.
#include "cuda/check.h"
#include "cuda/gpu_check.h"
#include "lcx/error.h"
#include "util/gpu_support.h"

#ifndef LCX_CUDA_TARGETS
#define LCX_CUDA_TARGETS "unknown"
#endif

namespace lcx::cuda {
namespace {
__global__ void probe_kernel() {}
}  // namespace

void check_gpu_supported(int device) {
  cudaDeviceProp prop{};
  LCX_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (const std::string why = gpu_refusal(prop.name, prop.major, prop.minor); !why.empty())
    throw Error(why, "run.device", "run on an A100, L40S, RTX 30xx/40xx, H100, H200, B200 or newer GPU, or device = \"cpu\"");
  int current = 0;
  LCX_CUDA_CHECK(cudaGetDevice(&current));
  if (current != device) LCX_CUDA_CHECK(cudaSetDevice(device));
  cudaFuncAttributes attr{};
  const cudaError_t err = cudaFuncGetAttributes(&attr, probe_kernel);
  if (current != device) LCX_CUDA_CHECK(cudaSetDevice(current));
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction ||
      err == cudaErrorUnsupportedPtxVersion) {
    cudaGetLastError();
    throw Error(gpu_build_refusal(prop.name, prop.major, prop.minor, LCX_CUDA_TARGETS), {},
                "rebuild lcx with -DLCX_CUDA_ARCHS=all (every GPU from sm_80) or -DLCX_CUDA_ARCHS=native on this machine");
  }
  LCX_CUDA_CHECK(err);
}

}  // namespace lcx::cuda
