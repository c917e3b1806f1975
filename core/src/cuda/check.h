// One check macro per library: a failed call becomes an lcx::Error naming the call, file and line.
#pragma once
#include <cuda_runtime.h>

#include "lcx/error.h"

#define LCX_CUDA_CHECK(call)                                                                  \
  do {                                                                                        \
    cudaError_t lcx_err_ = (call);                                                            \
    if (lcx_err_ != cudaSuccess)                                                              \
      throw ::lcx::Error(::lcx::str(#call " failed: ", cudaGetErrorString(lcx_err_), " at ", \
                                    __FILE__, ":", __LINE__));                                \
  } while (0)

// After a kernel launch: a bad configuration shows here, not at the next unrelated call.
#define LCX_CUDA_LAUNCH_CHECK() LCX_CUDA_CHECK(cudaGetLastError())
