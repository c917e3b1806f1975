// The check macros of the CUDA libraries beside the runtime's LCX_CUDA_CHECK (cuda/check.h):
// a failed cuBLAS(Lt) or cuDNN call becomes an lcx::Error naming the call, file and line.
#pragma once
#include <cublasLt.h>
#include <cudnn_graph.h>

#include <string>

#include "cuda/check.h"

namespace lcx::cuda {
// cuDNN is loaded at run time (kernels/attention/cudnn/attention_cudnn.cpp), so its messages come through
// the loaded library: the status name plus cuDNN's last error message.
std::string cudnn_error_string(cudnnStatus_t status);
}  // namespace lcx::cuda

#define LCX_CUBLAS_CHECK(call)                                                                     \
  do {                                                                                             \
    cublasStatus_t lcx_st_ = (call);                                                               \
    if (lcx_st_ != CUBLAS_STATUS_SUCCESS)                                                          \
      throw ::lcx::Error(::lcx::str(#call " failed: ", cublasLtGetStatusString(lcx_st_), " at ",   \
                                    __FILE__, ":", __LINE__));                                     \
  } while (0)

#define LCX_CUDNN_CHECK(call)                                                                      \
  do {                                                                                             \
    cudnnStatus_t lcx_st_ = (call);                                                                \
    if (lcx_st_ != CUDNN_STATUS_SUCCESS)                                                           \
      throw ::lcx::Error(::lcx::str(#call " failed: ", ::lcx::cuda::cudnn_error_string(lcx_st_),  \
                                    " at ", __FILE__, ":", __LINE__));                             \
  } while (0)
