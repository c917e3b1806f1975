// The training loop, top to bottom: pick the device, load or create the model, open the data,
// then for each optimizer step: gather grad_accum sequences, run forward+backward on each with
// the step's mean-loss scale, check for non-finite values, clip, AdamW, log, checkpoint.
#include "train/trainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "data/dataset.h"
#include "data/tokenizer.h"
#include "lcx/log.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "train/progress.h"
#include "train/schedule.h"
#include "train/step.h"

namespace fs = std::filesystem;

namespace lcx {
namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

// Restores the previous handlers when the run ends, so a library user keeps theirs.
struct SignalGuard {
  struct sigaction old_int {}, old_term {};
  SignalGuard() {
    g_stop_signal.store(0);
    struct sigaction sa {};
    sa.sa_handler = on_stop_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
  }
  ~SignalGuard() {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
  }
};

double now_s() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

}  // namespace

Device pick_device(const std::string& want) {
  if (want == "cpu") return Device::cpu();
  if (want == "cuda") {
    if (!cuda_available())
      throw Error("run.device = \"cuda\" but no GPU is visible to this build", "run.device",
                  "use device = \"auto\" or \"cpu\"");
    return Device::cuda(0);
  }
  return cuda_available() ? Device::cuda(0) : Device::cpu();
}

namespace {

// Model FLOPs of one step (forward + backward = 3x forward), per the usual accounting: 6 per
// matmul parameter per token (layers and the head, not the embedding lookup) plus causal attention
// counted once: 6 * layers * heads * head_dim * T^2 (QK^T and PV, half the square, times 3).
double step_flops(const ModelConfig& c, double tokens) {
  const double h = static_cast<double>(c.hidden_size), d = static_cast<double>(c.head_dim);
  const double q = static_cast<double>(c.num_heads) * d, kv = static_cast<double>(c.num_kv_heads) * d;
  const double layer = h * q + 2 * h * kv + q * h + 3 * h * static_cast<double>(c.intermediate_size);
  const double matmul_params = static_cast<double>(c.num_layers) * layer + static_cast<double>(c.vocab_size) * h;
  return 6 * matmul_params * tokens + 6 * static_cast<double>(c.num_layers) * static_cast<double>(c.num_heads) * d * tokens * tokens;
}

// Dense bf16 peak of the GPUs lcx targets (H100/H200 SXM); MFU is reported on GPUs only.
constexpr double kGpuPeakFlops = 989.4e12;

int64_t host_peak_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

}  // namespace

int run_training(const CoreConfig& cfg, const Manifest& manifest, SlotSet& slots, const TrainOptions& opts) {
  if (!slots.model)
    throw Error("the manifest names no model module", "model.module", "add `module = \"qwen3\"` to [model]");
  if (slots.parallel->size() != 1)
    throw Error(str("parallelism of ", slots.parallel->size(), " ranks needs the distributed launcher"),
                "distributed.nproc_per_node", "run with one rank until the launcher lands");
  const Device device = pick_device(cfg.run.device);
  const DType dtype = dtype_from_name(cfg.model.dtype);
  Model& model = *slots.model;
  log::info(str("device ", device_name(device), ", weights ", dtype_name(dtype)));

  std::string resume_dir;
  if (!opts.resume.empty()) resume_dir = resolve_checkpoint(cfg.run.output_dir, opts.resume);
  if (!resume_dir.empty()) {
    model.load_hf(resume_dir, device, dtype);
  } else if (!cfg.model.path.empty()) {
    model.load_hf(cfg.model.path, device, dtype);
  } else if (!cfg.model.init.empty()) {
    model.init_random(cfg.model.init, static_cast<uint64_t>(cfg.run.seed), device, dtype);
  } else {
    throw Error("[model] gives neither `path` nor `init`", "model.path",
                "set path = \"<HF folder>\" or init = \"qwen3-0.6b\" (or a JSON object of config keys)");
  }
  StepSlots step_slots{model, *slots.loss, *slots.rope, *slots.memory, *slots.parallel};
  configure_slots(step_slots);
  const ModelConfig& mc = model.config();

  if (cfg.data.tokenizer.empty()) throw Error("[data] tokenizer is not set", "data.tokenizer", "give the path of a tokenizer.json");
  Tokenizer tokenizer = Tokenizer::load(cfg.data.tokenizer);
  Dataset::Options dopt;
  dopt.seed = cfg.run.seed;
  Dataset data = Dataset::open(cfg.data, tokenizer, dopt);
  const int64_t per_epoch = data.num_sequences();
  const int64_t seq_len = data.seq_len();
  if (seq_len > slots.rope->effective_max_positions())
    log::warn(str("sequences of ", seq_len, " tokens go beyond the ", slots.rope->effective_max_positions(),
                  " positions this model places correctly: expect a loss near 10 instead of ~4. Load rope_yarn with "
                  "factor = ", std::ceil(static_cast<double>(seq_len) / static_cast<double>(mc.max_position_embeddings)),
                  " and original_max_position_embeddings = ", mc.max_position_embeddings));

  const int64_t accum = cfg.train.grad_accum;
  const int64_t steps_per_epoch = data.steps_per_epoch(accum);
  const int64_t total_steps =
      cfg.train.max_steps > 0 ? cfg.train.max_steps
                              : static_cast<int64_t>(std::ceil(cfg.train.epochs * static_cast<double>(steps_per_epoch)));
  if (total_steps < 1) throw Error("the run has no step to take", "train.epochs", "raise epochs or set max_steps");

  AdamWConfig ocfg;
  ocfg.beta1 = cfg.train.beta1;
  ocfg.beta2 = cfg.train.beta2;
  ocfg.eps = cfg.train.eps;
  ocfg.weight_decay = cfg.train.weight_decay;
  ocfg.master_dtype = cfg.train.master_dtype;
  AdamW opt(model.parameters(), ocfg);

  TrainerState state;
  state.seed = static_cast<uint64_t>(cfg.run.seed);
  if (!resume_dir.empty()) {
    load_optimizer_state(resume_dir, opt);
    state = load_trainer_state(resume_dir);
    log::info(str("resumed from ", resume_dir, " at step ", state.step, " (", state.sequences_done, " sequences done)"));
  }

  CheckpointContents contents;
  contents.manifest_toml = manifest.to_toml();
  contents.tokenizer_path = cfg.data.tokenizer;
  contents.rope_parameters_json = slots.rope->hf_rope_parameters();
  contents.model_dtype = dtype;

  fs::create_directories(cfg.run.output_dir);
  std::ofstream metrics(fs::path(cfg.run.output_dir) / "metrics.jsonl", std::ios::app);
  SignalGuard signals;
  ProgressBar bar(total_steps, isatty(STDERR_FILENO) != 0);
  const double run_start = now_s();
  const int64_t first_step = state.step;
  constexpr int64_t kMaxNonfiniteInRow = 3;
  log::info(str(total_steps, " steps of ", accum, " sequence(s) of ", seq_len, " tokens; ", per_epoch,
                " sequences per epoch"));

  while (state.step < total_steps) {
    const double t0 = now_s();
    model.zero_grad();
    if (device.is_cuda()) allocator_for(device).reset_peak();

    // Every sequence of the step is known before the first forward, so the mean over the
    // step's valid targets is exact from the start (transformers' num_items_in_batch).
    const Batch batch = data.batch(state.step, accum);
    const int64_t valid_total = batch.valid_labels, tokens = batch.tokens;

    double loss_sum = 0, forward_s = 0, backward_s = 0;
    if (valid_total > 0) {
      for (const Sequence& seq : batch.sequences) {
        Shard shard = slots.parallel->shard(seq, 0);
        StepResult r = train_step(step_slots, shard, 1.0 / static_cast<double>(valid_total), device);
        loss_sum += r.loss_sum;
        forward_s += r.forward_s;
        backward_s += r.backward_s;
      }
    }
    const double loss = valid_total > 0 ? loss_sum / static_cast<double>(valid_total) : std::nan("");
    const double t_opt = now_s();
    const double norm = opt.grad_norm();
    const double lr = cfg.train.lr * schedule_factor(cfg.train.schedule, state.step, cfg.train.warmup_steps, total_steps);
    const bool finite = std::isfinite(loss) && std::isfinite(norm);
    if (finite) {
      if (cfg.train.max_grad_norm > 0 && norm > cfg.train.max_grad_norm)
        opt.scale_grads(cfg.train.max_grad_norm / (norm + 1e-6));  // torch's clip_grad_norm_
      opt.step(lr);
      state.nonfinite_in_row = 0;
    } else {
      ++state.nonfinite_in_row;
      ++state.nonfinite_total;
      log::warn(str("step ", state.step + 1, ": loss ", loss, ", grad norm ", norm, " is not finite; update skipped (",
                    state.nonfinite_in_row, " in a row)"));
    }
    if (device.is_cuda()) backend_for(device)->synchronize();
    const double t_end = now_s();

    ++state.step;
    state.sequences_done += static_cast<int64_t>(batch.sequences.size());
    state.num_tokens += static_cast<double>(tokens);
    const double epoch = static_cast<double>(state.step) / static_cast<double>(steps_per_epoch);

    if (state.step % std::max<int64_t>(1, cfg.train.log_every) == 0 || state.step == total_steps)
      bar.message(step_dict({{"loss", python_round(loss, 4)},
                             {"grad_norm", norm},
                             {"learning_rate", lr},
                             {"num_tokens", state.num_tokens},
                             {"epoch", python_round(epoch, 4)}}));
    bar.update(state.step, now_s() - run_start, state.step - first_step);

    const double step_s = t_end - t0;
    double flops = 0;
    for (const Sequence& seq : batch.sequences) flops += step_flops(mc, static_cast<double>(seq.tokens.numel()));
    nlohmann::json m = {{"step", state.step},
                        {"loss", loss},
                        {"grad_norm", norm},
                        {"learning_rate", lr},
                        {"num_tokens", state.num_tokens},
                        {"epoch", epoch},
                        {"step_s", step_s},
                        {"tokens_per_s", static_cast<double>(tokens) / step_s},
                        {"flops", flops},
                        {"time_forward_s", forward_s},
                        {"time_backward_s", backward_s},
                        {"time_optimizer_s", t_end - t_opt},
                        {"time_communication_s", 0.0},
                        {"time_memory_wait_s", 0.0},
                        {"peak_host_bytes", host_peak_bytes()},
                        {"skipped", !finite}};
    if (device.is_cuda()) {
      m["peak_gpu_bytes"] = allocator_for(device).stats().peak_bytes;
      m["mfu"] = flops / step_s / kGpuPeakFlops;
    }
    metrics << m.dump() << "\n";
    metrics.flush();

    if (state.nonfinite_in_row >= kMaxNonfiniteInRow) {
      bar.finish();
      throw Error(str(kMaxNonfiniteInRow, " steps in a row had a non-finite loss or gradient; stopping at step ", state.step),
                  "train.lr", "lower the learning rate, check the data, or use master_dtype = \"fp32\"");
    }
    const bool due = cfg.train.save_steps > 0 && state.step % cfg.train.save_steps == 0;
    const int sig = g_stop_signal.load();
    if (due || state.step == total_steps || sig) {
      std::string dir = save_checkpoint(cfg.run.output_dir, model, opt, state, contents, cfg.train.keep_checkpoints);
      log::info(str("saved ", dir));
    }
    if (sig) {
      bar.finish();
      log::warn(str("stopped by ", sig == SIGINT ? "SIGINT" : "SIGTERM", " after step ", state.step, "; resume with: lcx-train --config ",
                    manifest.source(), " --resume latest"));
      return 130;
    }
  }
  bar.finish();
  log::info(str("finished ", total_steps, " steps in ", tqdm_time(now_s() - run_start)));
  return 0;
}

}  // namespace lcx
