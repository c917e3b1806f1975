#include "train/evaluate.h"

#include <algorithm>
#include <cmath>
#include <span>

#include "data/dataset.h"
#include "lcx/clock.h"
#include "lcx/comm.h"
#include "lcx/profile.h"
#include "train/run.h"
#include "train/step.h"

namespace lcx {

double EvalTotals::loss() const { return valid > 0 ? loss_sum / static_cast<double>(valid) : std::nan(""); }

EvalTotals evaluate(Run& run, const Dataset& data, int64_t max_sequences) {
  const double t0 = now_s();
  const Device device = run.device();
  const int64_t n = max_sequences > 0 ? std::min(max_sequences, data.num_sequences()) : data.num_sequences();
  const int64_t dp = run.mesh_shape().dp, mine = run.mesh_coord().dp;
  const bool group_lead = run.seq_rank() == 0;
  double sums[3] = {0, 0, 0};  // loss, targets the Loss slot counted, targets the data holds
  const int64_t passes = n > 0 ? (n + dp - 1) / dp : 0;
  for (int64_t k = 0; k < passes; ++k) {
    const int64_t i = k * dp + mine;
    const bool counted = i < n;
    const Shard shard = run.slots().parallel->shard(data.get(counted ? i : n - 1), run.seq_rank());
    const EvalResult r = eval_step(run.step(), shard, device);
    if (!counted) continue;
    sums[0] += r.loss_sum;
    sums[1] += static_cast<double>(r.valid);
    if (group_lead) sums[2] += static_cast<double>(data.valid_labels(i));
  }
  if (Communicator* world = run.world()) {
    ProfilePhase phase(StepPhase::communication);
    world->all_reduce(std::span<double>(sums, 3));
  }
  // Each target belongs to one rank's shard: a Parallelism provider whose shards overlap would
  // count a target twice (the loss scaled by cp), and is stopped here rather than logged.
  LCX_CHECK(sums[1] == sums[2], "the ranks' shards counted ", sums[1], " eval targets, the data holds ", sums[2]);
  EvalTotals t;
  t.loss_sum = sums[0];
  t.valid = static_cast<int64_t>(sums[1]);
  t.sequences = n;
  if (device.is_cuda()) backend_for(device)->synchronize();
  t.seconds = now_s() - t0;
  return t;
}

}  // namespace lcx
