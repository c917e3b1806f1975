// The start's GPU check: the device's name and compute capability against lcx's floor and against
// the targets this build carries code for (LCX_CUDA_TARGETS, set by core/CMakeLists.txt). Read from
// the device properties alone, so the check creates no context: a launcher that starts one worker
// per GPU holds no memory on any of them.
#include "cuda/gpu_check.h"

#include "cuda/check.h"
#include "lcx/error.h"
#include "util/gpu_support.h"

#ifndef LCX_CUDA_TARGETS
#define LCX_CUDA_TARGETS "unknown"
#endif

namespace lcx::cuda {

void check_gpu_supported(int device) {
  cudaDeviceProp prop{};
  LCX_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  if (const std::string why = gpu_refusal(prop.name, prop.major, prop.minor); !why.empty())
    throw Error(why, "run.device", "run on an A100, L40S, RTX 30xx/40xx, H100, H200, B200 or newer GPU, or device = \"cpu\"");
  if (const std::string why = gpu_build_refusal(prop.name, prop.major, prop.minor, LCX_CUDA_TARGETS); !why.empty())
    throw Error(why, {}, "rebuild lcx with -DLCX_CUDA_ARCHS=all (every GPU from sm_80) or -DLCX_CUDA_ARCHS=native on this machine");
}

}  // namespace lcx::cuda
