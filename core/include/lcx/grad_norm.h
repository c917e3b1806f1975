// The gradient norm's reduction as core's AdamW computes it, for optimizer plugins that read
// gradients where they are (its own header: the op table's, lcx/ops.h, is in every kernel's
// translation unit).
#pragma once
#include "lcx/tensor.h"

namespace lcx::ops {

// The sum of x's squares in fp64 (on the GPU fp32 sums per block, added in fp64, on the compute
// stream); the host waits for it.
double sum_squares(const Tensor& x);

}  // namespace lcx::ops
