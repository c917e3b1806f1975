// The start of a run on the terminal: a few lines a user reads at a glance (model, devices and
// mesh, the plugins, the recipe in users' words such as gradient checkpointing, memory in GiB,
// data, steps). The details behind them (hashes, the config, bytes) go to log.jsonl (log/detail.h).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lcx {

class Run;

std::vector<std::string> run_summary(const Run& run, int64_t total_steps, int64_t sequences_per_step,
                                     int64_t steps_per_epoch);

}  // namespace lcx
