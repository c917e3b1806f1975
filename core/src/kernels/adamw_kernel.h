// The AdamW update of one parameter, on the CPU or the GPU (adamw_kernel.cpp / adamw_kernel.cu).
// Math in fp32 in torch's order; see optimizer.h for the master/moment dtypes.
#pragma once
#include "lcx/tensor.h"

namespace lcx::adamw {

struct Hyper {
  float lr, beta1, beta2, eps, weight_decay;
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};

// master fp32 (or undefined: then `value` is updated in place, in its own dtype); value is the
// compute copy rounded from master; grad fp32; m, v moments.
void update(Tensor& master, Tensor& value, const Tensor& grad, Tensor& m, Tensor& v, const Hyper& h);
double sum_squares(const Tensor& grad);

#ifdef LCX_HAVE_CUDA
void update_cuda(Tensor& master, Tensor& value, const Tensor& grad, Tensor& m, Tensor& v, const Hyper& h);
double sum_squares_cuda(const Tensor& grad);
#endif

}  // namespace lcx::adamw
