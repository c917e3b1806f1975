// Learning-rate schedules with warmup, by transformers' formulas (get_*_schedule_with_warmup).
#pragma once
#include <cstdint>
#include <string>

namespace lcx {

// The multiplier of the base learning rate at optimizer step `step` (0-based: the first update
// uses step 0), for `total` steps.
double schedule_factor(const std::string& kind, int64_t step, int64_t warmup, int64_t total);

}  // namespace lcx
