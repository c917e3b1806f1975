#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "lcx/error.h"

namespace lcx {

double schedule_factor(const std::string& kind, int64_t step, int64_t warmup, int64_t total) {
  if (step < warmup) return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
  if (kind == "constant") return 1.0;
  if (kind == "linear")
    return std::max(0.0, static_cast<double>(total - step) / static_cast<double>(std::max<int64_t>(1, total - warmup)));
  if (kind == "cosine") {
    double progress = static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, total - warmup));
    return std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
  }
  throw Error(str("unknown schedule '", kind, "'"), "train.schedule", "use constant, linear or cosine");
}

}  // namespace lcx
