// The training run: model and data in, steps of AdamW out, with the reference's step log, a
// metrics line per step, checkpoints, exact resume, and a clean stop on SIGINT/SIGTERM.
#pragma once
#include <functional>
#include <string>
#include <vector>

#include "config/core_config.h"
#include "config/manifest.h"
#include "slots/resolve.h"

namespace lcx {

struct TrainOptions {
  std::string resume;  // "", "latest" or a checkpoint folder
  bool overwrite = false;  // a fresh run may replace the checkpoints and metrics in output_dir
  bool force = false;  // --force: run a plan that does not fit the GPU (check_gpu_memory)
  // argv of this process, for the launcher to start its workers with the same arguments.
  std::vector<std::string> argv;
};

// The command that continues a run started by `argv`: its own arguments (the --set overrides
// too), --resume latest in place of a --resume or --overwrite it had, each quoted for a shell
// where it needs to be.
std::string resume_command(const std::vector<std::string>& argv);

// Each rank creates its own slot objects (a plugin may hold per-rank state), after its mesh is
// bound, so a Parallelism plugin finds its communicators; `rank` is its world rank (a model that
// partitions parameters over [distributed] ep ranks builds only its part).
using SlotFactory = std::function<SlotSet(Device, int rank)>;

// Returns the process exit code: 0 when the run finished, 130 when it stopped on a signal after
// saving (a second signal ends the process at once: see stop_signal.h). Prepares the run folder
// first (run_folder.h). Throws lcx::Error for configuration and data problems.
// With [distributed] nproc_per_node = N > 1: on GPUs, N worker processes (one per GPU) joined by
// NCCL; on the CPU, or with [distributed] virtual_ranks = true on one GPU, N thread-ranks.
int run_training(const CoreConfig& cfg, const Manifest& manifest, const SlotFactory& make_slots,
                 const TrainOptions& opts);

}  // namespace lcx
