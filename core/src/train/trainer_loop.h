// The loop over one rank's optimizer steps (trainer.cpp), and the rehearsal of one step
// (rehearsal.cpp): the Trainer a built Run is handed to by train/launch.cpp.
#pragma once
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "config/manifest.h"
#include "data/dataset.h"
#include "plan/timeline.h"
#include "train/checkpoint.h"
#include "train/evaluate.h"
#include "train/progress.h"
#include "train/run.h"
#include "train/run_folder.h"

namespace lcx {

// How long the run is: each step takes grad_accum sequences for each data-parallel rank.
struct RunLength {
  int64_t per_step = 0;
  int64_t steps_per_epoch = 0;
  int64_t total_steps = 0;
};

RunLength run_length(const Run& run);

// The plan's host figure holds the pinned pool and an optimizer's state kept in ordinary host
// memory (an Optimizer provider's host-side master and moments); on a GPU run, host tensors of
// those categories are exactly that state (core's own optimizer keeps its state on the device).
// On the CPU every tensor is a host tensor and the plan is the GPU's, so nothing is added there.
int64_t host_optimizer_bytes(Device device);

// The loop over optimizer steps of a built Run, in the manner of torchtitan's Trainer: each step
// is train_step (forward_backward_step over this rank's sequences, the sums over ranks,
// optimizer_step), then log_step, the divergence check and maybe_save.
class Trainer {
 public:
  // `resume_command`: what the stop by a signal prints to go on ("" prints the manifest's plain one).
  Trainer(Run& run, const Manifest& manifest, RunLength length, const std::string& resume_dir,
          std::string resume_command = {});
  // The process exit code: 0 when every step is done, 130 when stopped by a signal after saving.
  int train();
  // [run] rehearse: one step with the attention math cut, its measured peaks against the plan's;
  // 0 when they agree (kRehearsalTolerance), 1 when not. Saves nothing, appends no metrics.
  int rehearse();

 private:
  // What one step did, for its log line and metrics row.
  struct StepRecord {
    int64_t valid = 0;  // targets of the whole step, across ranks, that are not -100
    int64_t tokens = 0;
    int64_t documents = 0;  // in the step's sequences; one cut by a sequence's end counts in both
    double flops = 0;
    double loss_sum = 0, loss = 0, grad_norm = 0, lr = 0;
    // The model's auxiliary loss (a load-balancing loss, say): the mean over the step's
    // sequences, its coefficient (0 when it is logged, not trained), the model's stats of it.
    AuxLoss aux;
    bool finite = true;
    bool stop = false;  // some rank was asked to stop
    double forward_s = 0, backward_s = 0, memory_wait_s = 0, weights_wait_s = 0;
    double shard_s = 0;  // the step's thread in Parallelism::shard()
    double t_start = 0, t_communication = 0, t_optimizer = 0, t_end = 0;
  };

  static TrainerState start_state(const Run& run, const std::string& resume_dir);
  StepRecord train_step();
  void cut_ahead(const Batch& batch);
  std::pair<size_t, size_t> my_sequences(const Batch& batch) const;
  void forward_backward_step(const Batch& batch, StepRecord& r);
  void reduce_across_ranks(StepRecord& r);
  void optimizer_step(StepRecord& r);
  // [eval] due after the steps done (state_.step): at the start with at_start, then every `every`.
  std::optional<EvalTotals> maybe_evaluate(bool at_start);
  // The step's log line (with eval_loss when it evaluated) and metrics row, then the eval's row.
  void log_step(const StepRecord& r, const std::optional<EvalTotals>& eval);
  void log_eval(const EvalTotals& e);
  // The losses since the last save (state_.recent_loss_max), and a resumed run's against those
  // before its checkpoint (contents_.rotation_keeps).
  void watch_losses(const StepRecord& r);
  void stop_if_diverged();
  void maybe_save(bool stop);
  void save();

  Run& run_;
  const CoreConfig& cfg_;
  const Manifest& manifest_;
  const RunLength length_;
  TrainerState state_;
  const int64_t first_step_;
  CheckpointContents contents_;
  MetricsLog metrics_;
  ProgressBar bar_;
  // The step memory_timeline_step asks for, recorded from its forward through its update.
  std::unique_ptr<StepTimeline> timeline_;
  std::string resume_command_;
  double run_start_ = 0;
  bool told_untrained_ = false;  // a step with no trained target was reported
  double resumed_loss_max_ = 0;  // the resumed checkpoint's recent_loss_max
  bool resumed_healthy_ = true;  // every loss since the resume finite and in its range
  // The worker cutting the sequences ahead of the one in hand (cut_ahead); declared last, so it is
  // waited for before the members it reads go.
  std::future<void> ahead_;
};

}  // namespace lcx
