// The per-step scalars of AdamW as torch.optim.AdamW computes them, shared by every Optimizer
// provider so their updates agree: torch takes the bias corrections in fp64 (Python floats) and
// hands fp32-rounded scalars to its element loop.
#pragma once
#include <cmath>
#include <cstdint>

#include "lcx/slots/optimizer.h"

namespace lcx {

struct AdamWScalars {
  float lr, beta1, beta2, eps;
  float step_size;              // lr / (1 - beta1^t)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t)
};

// `step` counts from 1 (the update being made).
inline AdamWScalars adamw_scalars(const OptimizerConfig& c, double lr, int64_t step) {
  const double t = static_cast<double>(step);
  return {static_cast<float>(lr),
          static_cast<float>(c.beta1),
          static_cast<float>(c.beta2),
          static_cast<float>(c.eps),
          static_cast<float>(lr / (1.0 - std::pow(c.beta1, t))),
          static_cast<float>(std::sqrt(1.0 - std::pow(c.beta2, t)))};
}

}  // namespace lcx
