// The loop over one rank's optimizer steps: this rank's grad_accum sequences forward and backward
// with the step's mean-loss scale, the sums over ranks, clip and AdamW (or a skipped update when
// not finite), the log line and metrics row, a checkpoint when due.
#include "train/trainer_loop.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <memory>
#include <nlohmann/json.hpp>
#include <span>

#include "data/dataset.h"
#include "lcx/clock.h"
#include "lcx/comm.h"
#include "lcx/log.h"
#include "log/detail.h"
#include "lcx/pinned.h"
#include "lcx/slots/adapter.h"
#include "plan/plan.h"
#include "plan/timeline.h"
#include "train/checkpoint.h"
#include "profile/step_profiler.h"
#include "train/progress.h"
#include "train/run.h"
#include "train/run_folder.h"
#include "train/schedule.h"
#include "train/step.h"
#include "train/stop_signal.h"

namespace lcx {
namespace {

int64_t host_peak_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

}  // namespace

int64_t host_optimizer_bytes(Device device) {
  if (!device.is_cuda()) return 0;
  const AllocatorStats s = allocator_for(Device::cpu()).stats();
  return s.live_by_category[static_cast<int>(MemoryCategory::master_weights)] +
         s.live_by_category[static_cast<int>(MemoryCategory::optimizer)];
}

RunLength run_length(const Run& run) {
  const TrainConfig& t = run.cfg().train;
  RunLength n;
  n.per_step = t.grad_accum * run.mesh_shape().dp;
  // A step draws from one epoch: one that asks for more sequences than an epoch holds would
  // train fewer than it says, every step.
  const int64_t in_epoch = run.data().num_sequences();
  if (n.per_step > in_epoch)
    throw Error(str("a step takes ", n.per_step, " sequences (train.grad_accum = ", t.grad_accum,
                    run.mesh_shape().dp > 1 ? str(" x dp ", run.mesh_shape().dp) : std::string(), "), but an epoch of ",
                    run.data().seq_len(), "-token sequences holds ", in_epoch),
                "train.grad_accum",
                str("set train.grad_accum <= ", std::max<int64_t>(1, in_epoch / std::max(1, run.mesh_shape().dp)),
                    ", a shorter data.seq_len, or add data"));
  n.steps_per_epoch = run.data().steps_per_epoch(n.per_step);
  const double epoch_steps = std::ceil(t.epochs * static_cast<double>(n.steps_per_epoch));
  // More steps than any run takes, and past what the step counters hold exactly.
  if (t.max_steps <= 0 && epoch_steps > std::ldexp(1.0, 40))
    throw Error(str("train.epochs = ", t.epochs, " is ", epoch_steps, " steps of ", n.per_step, " sequence(s)"),
                "train.epochs", "give a number of passes over the data a run can take (e.g. epochs = 3), or set max_steps");
  n.total_steps = t.max_steps > 0 ? t.max_steps : static_cast<int64_t>(epoch_steps);
  if (n.total_steps < 1) throw Error("the run has no step to take", "train.epochs", "raise epochs or set max_steps");
  return n;
}

constexpr int64_t kMaxNonfiniteInRow = 3;

std::string resume_command(const std::vector<std::string>& argv) {
  auto quoted = [](const std::string& a) {
    const bool plain = !a.empty() && std::all_of(a.begin(), a.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("-_./=:,+@%", c) != nullptr;
    });
    if (plain) return a;
    std::string q = "'";
    for (char c : a) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  std::string out;
  for (size_t i = 0; i < argv.size(); ++i) {
    const std::string& a = argv[i];
    if (a == "--overwrite" || a.starts_with("--resume=")) continue;
    if (a == "--resume") {
      ++i;
      continue;
    }
    out += (out.empty() ? "" : " ") + quoted(a);
  }
  return out.empty() ? out : out + " --resume latest";
}

Trainer::Trainer(Run& run, const Manifest& manifest, RunLength length, const std::string& resume_dir,
                 std::string resume_command)
    : run_(run),
      cfg_(run.cfg()),
      manifest_(manifest),
      length_(length),
      state_(start_state(run, resume_dir)),
      first_step_(state_.step),
      metrics_(run.lead() && !cfg_.run.rehearse ? MetricsLog(cfg_.run.output_dir, first_step_) : MetricsLog()),
      bar_(length.total_steps, run.lead() && isatty(STDERR_FILENO) != 0),
      resume_command_(std::move(resume_command)) {
  contents_.manifest_toml = manifest.to_toml();
  contents_.tokenizer_path = cfg_.data.tokenizer;
  contents_.model_dir = cfg_.model.path;
  contents_.tokenizer_dir = std::filesystem::path(cfg_.data.tokenizer).parent_path().string();
  contents_.chat_template_path = cfg_.data.chat_template;
  contents_.rope_parameters_json = run.slots().positional->hf_rope_parameters();
  contents_.model_dtype = run.dtype();
  if (!resume_dir.empty()) {
    contents_.rotation_keeps = resume_dir;
    resumed_loss_max_ = state_.recent_loss_max;
  }
  state_.recent_loss_max = std::nan("");
  // A resume toward another length stretches or squeezes a decaying schedule: said, with the rate
  // of the next step before and now.
  const TrainConfig& t = cfg_.train;
  if (run.lead() && state_.total_steps > 0 && state_.total_steps != length.total_steps && t.schedule != "constant")
    log::warn(str("the checkpoint was trained toward ", state_.total_steps, " steps, this run goes to ", length.total_steps,
                  ": the ", t.schedule, " schedule is recomputed for ", length.total_steps, " steps (the learning rate of step ",
                  first_step_ + 1, " is ",
                  t.lr * schedule_factor(t.schedule, first_step_, t.warmup_steps, length.total_steps), ", it was to be ",
                  t.lr * schedule_factor(t.schedule, first_step_, t.warmup_steps, state_.total_steps),
                  "); to keep the old schedule, resume with train.max_steps = ", state_.total_steps));
  state_.total_steps = length.total_steps;
  StopSignals::saved(first_step_);
  run_start_ = now_s();
  if (run.lead() && !cfg_.run.rehearse)
    log::detail(str(length.total_steps, " steps of ", length.per_step, " sequence(s) of ", run.data().seq_len(), " tokens; ",
                  run.data().num_sequences(), " sequences per epoch"));
  if (run.lead() && cfg_.run.profile && first_step_ + cfg_.run.profile_step > length.total_steps)
    log::warn(str("run.profile_step = ", cfg_.run.profile_step, " is past this run's last step (",
                  length.total_steps - first_step_, " to take): no step will be profiled"));
  if (run.lead() && cfg_.run.memory_timeline && first_step_ + cfg_.run.memory_timeline_step > length.total_steps)
    log::warn(str("run.memory_timeline_step = ", cfg_.run.memory_timeline_step, " is past this run's last step (",
                  length.total_steps - first_step_, " to take): no memory timeline will be recorded"));
}

TrainerState Trainer::start_state(const Run& run, const std::string& resume_dir) {
  TrainerState state;
  state.seed = static_cast<uint64_t>(run.cfg().run.seed);
  if (resume_dir.empty()) return state;
  state = load_trainer_state(resume_dir);
  if (run.lead())
    log::info(str("resumed from ", resume_dir, " at step ", state.step, " (", state.sequences_done, " sequences done)"));
  return state;
}

int Trainer::train() {
  if (const std::optional<EvalTotals> e = maybe_evaluate(true)) {
    const double epoch = static_cast<double>(state_.step) / static_cast<double>(length_.steps_per_epoch);
    if (run_.lead()) bar_.message(step_dict({{"eval_loss", python_round(e->loss(), 4)}, {"epoch", python_round(epoch, 4)}}));
    log_eval(*e);
  }
  while (state_.step < length_.total_steps) {
    const StepRecord r = train_step();
    watch_losses(r);
    log_step(r, maybe_evaluate(false));
    stop_if_diverged();
    maybe_save(r.stop);
    if (r.stop) {
      bar_.finish();
      if (run_.lead())
        log::warn(str("stopped by a signal after step ", state_.step, "; resume with: ",
                      resume_command_.empty() ? str("lcx-train --config ", manifest_.source(), " --resume latest")
                                              : resume_command_));
      return 130;
    }
  }
  bar_.finish();
  if (run_.lead()) log::info(str("finished ", length_.total_steps, " steps in ", tqdm_time(now_s() - run_start_)));
  return 0;
}

Trainer::StepRecord Trainer::train_step() {
  const Device device = run_.device();
  StepRecord r;
  r.t_start = now_s();
  // One step of the run, when asked (profile_step): every op of it timed, for the trace.
  std::unique_ptr<StepProfiler> profiler;
  if (cfg_.run.profile && run_.lead() && state_.step == first_step_ + cfg_.run.profile_step - 1)
    profiler = std::make_unique<StepProfiler>(device, state_.step + 1);
  StopSignals::step_running(state_.step + 1);
  run_.zero_grads();
  if (device.is_cuda()) allocator_for(device).reset_peak();
  pinned_allocator().reset_peak();

  const Batch batch = run_.data().batch(state_.step, length_.per_step);
  r.valid = batch.valid_labels;
  r.tokens = batch.tokens;
  cut_ahead(batch);
  forward_backward_step(batch, r);
  reduce_across_ranks(r);
  optimizer_step(r);
  if (timeline_) {  // the whole step: forward, loss, backward and the update
    TimelineFiles f = timeline_->write(cfg_.run.output_dir, build_plan(run_.planned(), run_.plan_slots()).peak(false).bytes);
    timeline_.reset();
    log::info(str("memory timeline of step ", state_.step + 1, ": ", f.svg, " and ", f.json));
  }
  if (device.is_cuda()) backend_for(device)->synchronize();
  r.t_end = now_s();
  if (profiler) {
    for (const std::string& line : profiler->finish(cfg_.run.output_dir).table) log::info(line);
    profiler.reset();
  }

  ++state_.step;
  state_.sequences_done += static_cast<int64_t>(batch.sequences.size());
  state_.num_tokens += static_cast<double>(r.tokens);
  for (const Sequence& seq : batch.sequences) {
    r.flops += run_.model().step_flops(seq.tokens.numel(), seq.document_bounds);
    r.documents += seq.document_count;
  }
  return r;
}

// This rank's sequences of the step: the batch's [first, last) for its dp coordinate.
std::pair<size_t, size_t> Trainer::my_sequences(const Batch& batch) const {
  const size_t accum = static_cast<size_t>(cfg_.train.grad_accum);
  const size_t first = std::min(batch.sequences.size(), static_cast<size_t>(run_.mesh_coord().dp) * accum);
  return {first, std::min(batch.sequences.size(), first + accum)};
}

// Cutting a sequence over ranks can take host time: a Parallelism provider that lays packed
// documents out by their work takes up to 0.3 s at 131,072 tokens on 8 ranks and 1.0 s at a
// million on one core, more with every rank's thread at it at once (docs/PERF.md), on the step's
// thread before its first kernel. The slot keeps its last answers, and shard() is const and may
// run on another thread, so a worker cuts this rank's later sequences of this step and its
// sequences of the next step while the GPU runs this one; shard() then finds their layouts ready.
// The worker's shards are dropped, and so are its errors: the step's own shard() of the same
// sequence raises them where they belong. One rank alone cuts nothing worth it.
void Trainer::cut_ahead(const Batch& batch) {
  if (ahead_.valid()) ahead_.wait();  // it was cutting this step's sequences: done before they are needed
  if (run_.slots().parallel->size() <= 1 || batch.valid_labels <= 0 || cfg_.run.rehearse) return;
  const auto [first, last] = my_sequences(batch);
  std::vector<Sequence> later(batch.sequences.begin() + static_cast<std::ptrdiff_t>(std::min(first + 1, last)),
                              batch.sequences.begin() + static_cast<std::ptrdiff_t>(last));
  const int64_t next = state_.step + 1;
  ahead_ = std::async(std::launch::async, [this, later = std::move(later), next] {
    try {
      const Parallelism& parallel = *run_.slots().parallel;
      const int rank = run_.seq_rank();
      for (const Sequence& seq : later) parallel.shard(seq, rank);
      if (next >= length_.total_steps) return;
      const Batch b = run_.data().batch(next, length_.per_step);
      const auto [f, l] = my_sequences(b);
      for (size_t j = f; j < l; ++j) parallel.shard(b.sequences[j], rank);
    } catch (const std::exception&) {
      // The step's own shard() of this sequence says what went wrong.
    }
  });
}

// Every sequence of the step is known before the first forward, so the mean over the step's
// valid targets is exact from the start (transformers' num_items_in_batch).
void Trainer::forward_backward_step(const Batch& batch, StepRecord& r) {
  const Device device = run_.device();
  const auto [mine_begin, mine_end] = my_sequences(batch);
  // One step of the run, when asked (memory_timeline_step): every allocation of it, for the timeline.
  if (cfg_.run.memory_timeline && run_.lead() && state_.step == first_step_ + cfg_.run.memory_timeline_step - 1)
    timeline_ = std::make_unique<StepTimeline>(device);
  try {
    if (r.valid > 0) {
      // The step trains the mean of its sequences' auxiliary losses.
      const double aux_weight = 1.0 / static_cast<double>(batch.sequences.size());
      // Every rank of the model's partition (StepContext::partition) takes part in each pass's
      // exchanges, so a rank with fewer of the step's sequences than another of its partition (an
      // epoch's short last step) runs the difference as passes over the step's first sequence
      // that weigh nothing (loss and auxiliary weights 0: their gradients are zeros, their losses
      // not counted).
      size_t passes = mine_end - mine_begin;
      if (Communicator* group = run_.mesh() ? run_.mesh()->partition() : nullptr) {
        std::vector<double> counts(static_cast<size_t>(group->size()), 0.0);
        counts[static_cast<size_t>(group->rank())] = static_cast<double>(passes);
        group->all_reduce(std::span<double>(counts));
        passes = static_cast<size_t>(*std::max_element(counts.begin(), counts.end()));
      }
      // The adapter's dropout masks are drawn per pass: keyed by the step and the sequence's place
      // in the step's batch (and by each element's row in the sequence), so neither the
      // data-parallel layout (dp ranks or gradient accumulation) nor cp and sp change a mask.
      Adapter& adapter = *run_.slots().adapter;
      for (size_t j = mine_end; j < mine_begin + passes; ++j) {
        adapter.begin_pass(state_.step + 1, static_cast<int64_t>(batch.sequences.size() + j), true);
        lcx::train_step(run_.step(), run_.slots().parallel->shard(batch.sequences[0], run_.seq_rank()), 0.0, device, 0.0);
      }
      for (size_t j = mine_begin; j < mine_end; ++j) {
        adapter.begin_pass(state_.step + 1, static_cast<int64_t>(j), true);
        const double t0 = now_s();
        Shard shard = run_.slots().parallel->shard(batch.sequences[j], run_.seq_rank());
        r.shard_s += now_s() - t0;
        StepResult s = lcx::train_step(run_.step(), shard, 1.0 / static_cast<double>(r.valid), device, aux_weight);
        r.loss_sum += s.loss_sum;
        if (s.aux.present) {
          r.aux.present = true;
          r.aux.coef = s.aux.coef;
          r.aux.value += s.aux.value * aux_weight;
          for (const AuxStat& stat : s.aux.stats) {
            auto it = std::find_if(r.aux.stats.begin(), r.aux.stats.end(), [&](const AuxStat& a) { return a.name == stat.name; });
            if (it == r.aux.stats.end()) r.aux.stats.push_back(stat);
            else if (std::isnan(it->value) || std::isnan(stat.value)) it->value = std::numeric_limits<double>::quiet_NaN();
            else it->value = stat.combine == AuxStat::Combine::min ? std::min(it->value, stat.value) : std::max(it->value, stat.value);
          }
        }
        r.forward_s += s.forward_s;
        r.backward_s += s.backward_s;
        r.memory_wait_s += run_.slots().memory->wait_seconds();  // per train_step, so summed over the step's sequences
      }
      r.weights_wait_s = run_.optimizer().wait_seconds();  // over the train_steps since the last update
      adapter.begin_pass(state_.step + 1, 0, false);  // evaluation drops nothing
    }
  } catch (const Error& e) {
    // Out of memory: say where the memory goes for this run and which setting makes it fit.
    if (device.is_cuda() && std::string(e.what()).find("out of memory") != std::string::npos)
      throw Error(format_out_of_memory(cfg_, run_.slots(), run_.model().config(), 0, e.what()), "data.seq_len");
    throw;
  }
}

// Sums over ranks: the loss, whether any rank was asked to stop (so all stop together) and,
// without sharding (whose hooks reduce-scatter them), the gradients.
void Trainer::reduce_across_ranks(StepRecord& r) {
  r.t_communication = now_s();
  // The auxiliary loss is each rank's mean over its own sequences' share: summed once per
  // data-parallel replica (the sequence ranks of one replica computed the same value).
  const double seq_ranks = static_cast<double>(run_.world_size() / std::max(1, run_.mesh_shape().dp));
  double sums[3] = {r.loss_sum, static_cast<double>(StopSignals::requested() != 0), r.aux.value / seq_ranks};
  if (Communicator* world = run_.world()) {
    ProfilePhase phase(StepPhase::communication);
    allocator_for(run_.device()).recorder().set_tag("communication");
    world->all_reduce(std::span<double>(sums, 3));
    // Each gradient over the ranks its parameter names (Parameter::grad_group).
    Communicator* replicas = run_.mesh() ? run_.mesh()->partition_replicas() : nullptr;
    if (!run_.sharded())
      for (Parameter* p : run_.trainable_parameters())
        (p->grad_group == GradGroup::partition_replicas && replicas ? *replicas : *world).all_reduce(p->grad);
  }
  StopSignals::request_read(state_.step + 1);
  r.loss_sum = sums[0];
  r.stop = sums[1] > 0;
  r.aux.value = sums[2];
  // The loss transformers reports: the LM loss, plus the auxiliary loss where it trains.
  // A step with no target that trains (every label -100) sums nothing over nothing: its loss is 0,
  // not 0/0, and optimizer_step makes no update of it.
  r.loss = r.valid > 0 ? r.loss_sum / static_cast<double>(r.valid) + r.aux.coef * r.aux.value : 0.0;
}

// Clip by the global norm, then AdamW; a step whose loss or norm is not finite is skipped.
void Trainer::optimizer_step(StepRecord& r) {
  r.t_optimizer = now_s();
  ProfilePhase phase(StepPhase::optimizer);
  allocator_for(run_.device()).recorder().set_tag("optimizer");
  r.grad_norm = run_.grad_norm();
  r.lr = cfg_.train.lr * schedule_factor(cfg_.train.schedule, state_.step, cfg_.train.warmup_steps, length_.total_steps);
  r.finite = std::isfinite(r.loss) && std::isfinite(r.grad_norm);
  if (r.valid == 0) {
    // No gradient to follow, and AdamW's momentum and decay would still move the weights: the
    // step passes without an update, and is no sign of divergence.
    if (run_.lead() && !told_untrained_)
      log::info(str("step ", state_.step + 1, ": no target of its sequences trains (every label is -100: a conversation "
                    "with no assistant token within data.seq_len); such steps make no update (valid_targets 0 in "
                    "metrics.jsonl)"));
    told_untrained_ = true;
    return;
  }
  if (r.finite) {
    if (cfg_.train.max_grad_norm > 0 && r.grad_norm > cfg_.train.max_grad_norm)
      run_.optimizer().scale_grads(cfg_.train.max_grad_norm / (r.grad_norm + 1e-6));  // torch's clip_grad_norm_
    run_.optimizer().step(r.lr);
    state_.nonfinite_in_row = 0;
  } else {
    ++state_.nonfinite_in_row;
    ++state_.nonfinite_total;
    if (run_.lead())
      log::warn(str("step ", state_.step + 1, ": loss ", r.loss, ", grad norm ", r.grad_norm, " is not finite; update skipped (",
                    state_.nonfinite_in_row, " in a row)"));
  }
}

// An evaluation before the first step of a run (at_start; a resumed run's first step is the
// checkpoint's, whose evaluation, when `every` asked for one there, is already in metrics.jsonl),
// and after every `every` steps. Every rank decides alike: evaluate() is a collective.
std::optional<EvalTotals> Trainer::maybe_evaluate(bool at_start) {
  const EvalConfig& e = cfg_.eval;
  const Dataset* data = run_.eval_data();
  if (!data || cfg_.run.rehearse) return std::nullopt;
  const bool on_every = e.every > 0 && state_.step > 0 && state_.step % e.every == 0;
  const bool due = at_start ? e.at_start && !on_every : on_every;
  if (!due) return std::nullopt;
  return evaluate(run_, *data, e.max_sequences);
}

void Trainer::log_eval(const EvalTotals& e) {
  metrics_.append({{"step", state_.step},
                   {"eval_loss", e.loss()},
                   {"eval_tokens", e.valid},
                   {"eval_sequences", e.sequences},
                   {"eval_s", e.seconds}});
}

// The reference's step dict every log_every steps (and at each evaluation, with its loss), the
// progress bar, and a metrics row; the evaluation's own row after it.
void Trainer::log_step(const StepRecord& r, const std::optional<EvalTotals>& eval) {
  if (!run_.lead()) return;
  const Device device = run_.device();
  const double epoch = static_cast<double>(state_.step) / static_cast<double>(length_.steps_per_epoch);
  const double step_s = r.t_end - r.t_start;
  if (state_.step % std::max<int64_t>(1, cfg_.train.log_every) == 0 || state_.step == length_.total_steps || eval) {
    std::vector<std::pair<std::string, double>> dict = {{"loss", python_round(r.loss, 4)},
                                                        {"grad_norm", r.grad_norm},
                                                        {"learning_rate", r.lr},
                                                        {"num_tokens", state_.num_tokens},
                                                        {"epoch", python_round(epoch, 4)}};
    if (eval) dict.insert(dict.begin() + 1, {"eval_loss", python_round(eval->loss(), 4)});
    if (r.aux.present) dict.insert(dict.begin() + 1, {"aux_loss", python_round(r.aux.value, 4)});
    bar_.message(step_dict(dict));
  }
  nlohmann::json m = {{"step", state_.step},
                      {"loss", r.loss},
                      {"grad_norm", r.grad_norm},
                      {"learning_rate", r.lr},
                      {"num_tokens", state_.num_tokens},
                      {"epoch", epoch},
                      {"ranks", run_.world_size()},
                      {"step_s", step_s},
                      {"tokens_per_s", static_cast<double>(r.tokens) / step_s},
                      {"flops", r.flops},
                      {"documents", r.documents},
                      {"valid_targets", r.valid},
                      {"time_forward_s", r.forward_s},
                      {"time_backward_s", r.backward_s},
                      {"time_optimizer_s", r.t_end - r.t_optimizer},
                      {"time_communication_s", r.t_optimizer - r.t_communication},
                      {"time_memory_wait_s", r.memory_wait_s},
                      {"time_weights_wait_s", r.weights_wait_s},
                      {"time_shard_s", r.shard_s},
                      {"peak_host_bytes", host_peak_bytes()},
                      {"peak_pinned_bytes", pinned_allocator().stats().peak_bytes},
                      {"host_optimizer_bytes", host_optimizer_bytes(device)},
                      {"skipped", !r.finite || r.valid == 0}};
  if (r.aux.present) {
    m["aux_loss"] = r.aux.value;
    for (const AuxStat& stat : r.aux.stats) {  // counts as integers, NaN as null
      const double v = stat.value;
      if (std::isnan(v)) m[stat.name] = nullptr;
      else if (v == std::floor(v) && std::abs(v) < 9.0e15) m[stat.name] = static_cast<int64_t>(v);
      else m[stat.name] = v;
    }
  }
  if (device.is_cuda()) {
    m["peak_gpu_bytes"] = allocator_for(device).stats().peak_bytes;
    // MFU on GPUs only, against [run] peak_tflops or the rates row's peak.
    if (const double peak = mfu_peak_flops(cfg_.run.peak_tflops); peak > 0) m["mfu"] = r.flops / step_s / peak / run_.world_size();
  }
  bar_.update(state_.step, now_s() - run_start_, state_.step - first_step_,
              step_postfix(static_cast<double>(r.tokens) / step_s, m.value("mfu", -1.0), device.is_cuda() ? "GPU" : "host",
                           m.value(device.is_cuda() ? "peak_gpu_bytes" : "peak_host_bytes", int64_t{0})));
  metrics_.append(std::move(m));
  if (eval) log_eval(*eval);
}

void Trainer::stop_if_diverged() {
  if (state_.nonfinite_in_row < kMaxNonfiniteInRow) return;
  bar_.finish();
  const TrainConfig& t = cfg_.train;
  throw Error(str(kMaxNonfiniteInRow, " steps in a row had a non-finite loss or gradient; stopping at step ", state_.step),
              "train", str("the optimizer ran with lr = ", t.lr, ", beta1 = ", t.beta1, ", beta2 = ", t.beta2, ", eps = ", t.eps,
                           ", weight_decay = ", t.weight_decay, ", max_grad_norm = ", t.max_grad_norm, ", master_dtype = \"",
                           t.master_dtype, "\": lower lr, check these and the data, or use master_dtype = \"fp32\""));
}

// Every save_steps, at the end when save_final, and whenever a signal stops the run.
void Trainer::maybe_save(bool stop) {
  const bool due = cfg_.train.save_steps > 0 && state_.step % cfg_.train.save_steps == 0;
  if (due || (state_.step == length_.total_steps && cfg_.train.save_final) || stop) save();
}

// A state damaged in a way no check sees (a checkpoint of an older lcx, without checksums) shows
// as losses far above those before the checkpoint. Until the run has trained past the checkpoint
// it resumed from with losses in their range (at most 1.5 x their highest + 1), rotation keeps it:
// deleting it would leave no good checkpoint.
void Trainer::watch_losses(const StepRecord& r) {
  if (r.valid <= 0) return;
  if (std::isfinite(r.loss))
    state_.recent_loss_max = std::isnan(state_.recent_loss_max) ? r.loss : std::max(state_.recent_loss_max, r.loss);
  if (contents_.rotation_keeps.empty() || !resumed_healthy_) return;
  const bool in_range = std::isfinite(r.loss) && (std::isnan(resumed_loss_max_) || r.loss <= 1.5 * resumed_loss_max_ + 1);
  if (in_range) return;
  resumed_healthy_ = false;
  if (run_.lead())
    log::warn(str("step ", state_.step, ": loss ", r.loss, " is far above the losses before ", contents_.rotation_keeps,
                  std::isnan(resumed_loss_max_) ? std::string() : str(" (at most ", resumed_loss_max_, ")"),
                  ": checkpoint rotation keeps that checkpoint; if this run's state is damaged, resume from it"));
}

void Trainer::save() {
  // A resumed run's first save with every loss in range is a good checkpoint past the one it
  // resumed from, which rotation may delete from then on.
  if (resumed_healthy_) contents_.rotation_keeps.clear();
  const std::string dir = run_.save(state_, contents_);
  state_.recent_loss_max = std::nan("");
  StopSignals::saved(state_.step);
  if (run_.lead()) log::info(str("saved ", dir));
}

}  // namespace lcx
