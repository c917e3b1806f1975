#include "lcx/defaults.h"
#include "train/optimizer.h"

namespace lcx {

std::unique_ptr<Optimizer> make_adamw_optimizer() { return std::make_unique<AdamW>(); }

}  // namespace lcx
