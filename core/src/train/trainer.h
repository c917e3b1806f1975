// The training run: model and data in, steps of AdamW out, with the reference's step log, a
// metrics line per step, checkpoints, exact resume, and a clean stop on SIGINT/SIGTERM.
#pragma once
#include <string>

#include "config/core_config.h"
#include "config/manifest.h"
#include "slots/resolve.h"

namespace lcx {

struct TrainOptions {
  std::string resume;  // "", "latest" or a checkpoint folder
};

// [run] device: "cpu", "cuda" (refused without a GPU) or "auto" (the first GPU when there is one).
Device pick_device(const std::string& want);

// Returns the process exit code: 0 when the run finished, 130 when it stopped on a signal after
// saving. Throws lcx::Error for configuration and data problems.
int run_training(const CoreConfig& cfg, const Manifest& manifest, SlotSet& slots, const TrainOptions& opts);

}  // namespace lcx
