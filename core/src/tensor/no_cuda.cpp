// A build without the CUDA backend: there is never a GPU to find.
#ifndef LCX_HAVE_CUDA
#include "lcx/tensor.h"

namespace lcx {
bool cuda_available() { return false; }
int cuda_device_count() { return 0; }
}  // namespace lcx
#endif
