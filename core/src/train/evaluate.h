// Evaluation during training ([eval]): the loss of held-out sequences with the run's current
// weights, forward only through the very slots the step uses (no second model; under ZeRO-3 the
// step's hooks gather each layer as the forward does, without gradients).
//
// Which ranks count what: sequence i of the eval data goes to data-parallel rank i % dp; the
// ranks of one cp x sp group cut it with the Parallelism slot as the step does, and each Loss sum
// covers only its own shard's targets, so summing loss and count over the whole world counts every
// target exactly once: under cp and sp the loss equals one rank's (never scaled by cp, never a
// row per rank). The count is checked against the data's own count of valid targets.
#pragma once
#include <cstdint>

namespace lcx {

class Dataset;
class Run;

struct EvalTotals {
  double loss_sum = 0;    // over every evaluated target, all ranks
  int64_t valid = 0;      // the targets counted (targets != -100, as the data's masks leave them)
  int64_t sequences = 0;  // evaluated
  double seconds = 0;     // the evaluation's wall time on this rank
  double loss() const;    // loss_sum / valid; NaN with no valid target
};

// The first `max_sequences` sequences of `data` (0: all), in corpus order. A collective: every
// rank of the run calls it together (each makes the same number of forward passes, so ZeRO-3's
// gathers pair up; a data-parallel rank left without a sequence repeats one and counts nothing).
EvalTotals evaluate(Run& run, const Dataset& data, int64_t max_sequences);

}  // namespace lcx
