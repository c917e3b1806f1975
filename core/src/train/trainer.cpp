// The training loop, top to bottom: pick the device, load or create the model, open the data,
// then for each optimizer step: gather grad_accum sequences, run forward+backward on each with
// the step's mean-loss scale, check for non-finite values, clip, AdamW, log, checkpoint.
#include "train/trainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>

#include "data/dataset.h"
#include "dist/launcher.h"
#include "dist/sharded_params.h"
#include "lcx/comm.h"
#include "plan/plan.h"
#include "plan/timeline.h"
#include "data/tokenizer.h"
#include "lcx/log.h"
#include "train/checkpoint.h"
#include "train/optimizer.h"
#include "train/profile.h"
#include "train/progress.h"
#include "train/run_folder.h"
#include "train/schedule.h"
#include "train/step.h"
#include "train/stop_signal.h"
#ifdef LCX_HAVE_CUDA
#include "dist/nccl_comm.h"
#endif

namespace lcx {
namespace {

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

namespace {

// ZeRO-3 around the step: non-layer weights (embedding, final norm, head) are gathered for the
// whole step; each layer's weights are gathered before its forward and again before its recompute,
// the next layer's gather overlapping this one's compute; each layer's gradients are
// reduce-scattered as soon as its backward is done.
class ShardingHooks final : public StepHooks {
 public:
  ShardingHooks(ShardedParams& sp, int layers) : sp_(sp) {
    for (int l = 0; l < layers; ++l) layer_names_.push_back(sp.names_with_prefix(str("model.layers.", l, ".")));
    std::vector<std::string> all = sp.names_with_prefix("");
    for (const auto& n : all)
      if (!n.starts_with("model.layers.")) other_.push_back(n);
  }
  void begin_step() override {
    sp_.gather(other_, true);
    if (!layer_names_.empty()) sp_.prefetch(layer_names_[0]);
  }
  void before_layer_forward(int l) override {
    sp_.gather(layer(l));
    if (l + 1 < static_cast<int>(layer_names_.size())) sp_.prefetch(layer(l + 1));
  }
  void after_layer_forward(int l) override {
    // The last layer is the first one backward needs: keep it.
    if (l + 1 < static_cast<int>(layer_names_.size())) sp_.release(layer(l));
  }
  void before_layer_backward(int l) override {
    sp_.gather(layer(l), true);
    if (l > 0) sp_.prefetch(layer(l - 1));
  }
  void after_layer_backward(int l) override {
    sp_.reduce_grads_async(layer(l));
    sp_.release(layer(l));
  }
  void end_step() override {
    sp_.reduce_grads(other_);
    sp_.release(other_);
  }
  // Every full value, for the whole-model HF export.
  void gather_all() { sp_.gather(sp_.names_with_prefix("")); }
  void release_all() { sp_.release(sp_.names_with_prefix("")); }

 private:
  const std::vector<std::string>& layer(int l) const { return layer_names_[static_cast<size_t>(l)]; }
  ShardedParams& sp_;
  std::vector<std::vector<std::string>> layer_names_;
  std::vector<std::string> other_;
};

struct RankSetup {
  Communicator* world = nullptr;  // null: one rank
  Mesh* mesh = nullptr;
};

int train_rank(const CoreConfig& cfg, const Manifest& manifest, const SlotFactory& make_slots,
               const TrainOptions& opts, Device device, RankSetup rs) {
  const int rank = rs.world ? rs.world->rank() : 0;
  const int world = rs.world ? rs.world->size() : 1;
  const bool lead = rank == 0;
  const MeshShape shape = rs.mesh ? rs.mesh->shape() : MeshShape{};
  const MeshCoord coord = rs.mesh ? rs.mesh->coord() : MeshCoord{};
  const int seq_ranks = shape.cp * shape.sp;
  const int seq_rank = coord.cp * shape.sp + coord.sp;

  SlotSet slots = make_slots(device);
  if (!slots.model)
    throw Error("the manifest names no model module", "model.module", "add `module = \"qwen3\"` to [model]");
  if (slots.parallel->size() != seq_ranks)
    throw Error(str("the parallelism plugin splits a sequence over ", slots.parallel->size(), " ranks but the mesh has cp x sp = ",
                    seq_ranks),
                "distributed.cp", "make [distributed] cp / sp match the plugin's size");
  const DType dtype = dtype_from_name(cfg.model.dtype);
  Model& model = *slots.model;
  if (lead) log::info(str("device ", device_name(device), ", weights ", dtype_name(dtype), ", ", world, world == 1 ? " rank" : " ranks",
                          rs.mesh ? str(" (dp ", shape.dp, " x cp ", shape.cp, " x sp ", shape.sp, ")") : ""));

  if (cfg.data.tokenizer.empty()) throw Error("[data] tokenizer is not set", "data.tokenizer", "give the path of a tokenizer.json");
  Tokenizer tokenizer = Tokenizer::load(cfg.data.tokenizer);
  Dataset::Options dopt;
  dopt.seed = cfg.run.seed;
  dopt.progress = lead;
  Dataset data = Dataset::open(cfg.data, tokenizer, dopt);
  // A length the parallelism cannot split fails here, before any weight is loaded.
  if (data.num_sequences() > 0) slots.parallel->shard(data.get(0), seq_rank);

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
  step_slots.mlp = slots.mlp.get();
  step_slots.activation_dtype = dtype;
  step_slots.mesh = rs.mesh;
  configure_slots(step_slots);
  const ModelConfig& mc = model.config();

  const bool sharded = rs.world && cfg.distributed.shard_parameters && world > 1;
  std::unique_ptr<ShardedParams> shards;
  std::unique_ptr<ShardingHooks> hooks;
  if (sharded) {
    shards = std::make_unique<ShardedParams>(model.parameters(), *rs.world);
    hooks = std::make_unique<ShardingHooks>(*shards, static_cast<int>(mc.num_layers));
    step_slots.hooks = hooks.get();
  }

  const int64_t per_epoch = data.num_sequences();
  const int64_t seq_len = data.seq_len();

  // GEMM weights' gradients in the weights' dtype where nothing needs fp32 (train.grad_dtype).
  const DType grad_dtype = grad_dtype_for(cfg.train, dtype, world);
  if (grad_dtype != DType::f32 && !sharded)
    for (Parameter* p : model.parameters())
      if (p->gemm_grad) p->grad = Tensor::zeros(p->value.shape(), grad_dtype, device, MemoryCategory::gradients);
  // The plan's recipe: the fastest choices that fit this GPU and host (keys in the manifest win).
  PlanInputs planned = plan_inputs(cfg, mc, seq_len);
  if (device.is_cuda()) {
    const std::optional<int64_t> gpu = local_gpu_memory();
    const int64_t budget = cfg.run.gpu_memory == "auto" ? (gpu ? *gpu : 0) : parse_memory_size(cfg.run.gpu_memory, "run.gpu_memory");
    planned.recipe = choose_recipe(planned, PlanSlots::of(slots), budget, host_memory_available());
  } else {
    planned.recipe.keep_attention = true;  // host memory is the only budget: keep what saves work
  }
  step_slots.recipe = planned.recipe;
  if (lead)
    log::info(str("recipe: ", recipe_name(planned.recipe), ", ", dtype_name(grad_dtype), " GEMM gradients",
                  device.is_cuda() ? str("; predicted step ", predicted_step_seconds(build_plan(planned, PlanSlots::of(slots)).work), " s")
                                   : std::string()));
  if (lead && seq_len > slots.rope->effective_max_positions())
    log::warn(str("sequences of ", seq_len, " tokens go beyond the ", slots.rope->effective_max_positions(),
                  " positions this model places correctly: expect a loss near 10 instead of ~4. Load a YaRN "
                  "PositionalEncoding plugin with factor = ", std::ceil(static_cast<double>(seq_len) / static_cast<double>(mc.max_position_embeddings)),
                  " and original_max_position_embeddings = ", mc.max_position_embeddings));

  // One step: grad_accum sequences for each data-parallel rank.
  const int64_t accum = cfg.train.grad_accum;
  const int64_t per_step = accum * shape.dp;
  const int64_t steps_per_epoch = data.steps_per_epoch(per_step);
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
  AdamW opt(sharded ? shards->shards() : model.parameters(), ocfg);

  TrainerState state;
  state.seed = static_cast<uint64_t>(cfg.run.seed);
  const RankIO io{rank, world, rs.world, sharded};
  if (!resume_dir.empty()) {
    load_optimizer_state(resume_dir, opt, io);
    state = load_trainer_state(resume_dir);
    if (lead) log::info(str("resumed from ", resume_dir, " at step ", state.step, " (", state.sequences_done, " sequences done)"));
  }

  CheckpointContents contents;
  contents.manifest_toml = manifest.to_toml();
  contents.tokenizer_path = cfg.data.tokenizer;
  contents.rope_parameters_json = slots.rope->hf_rope_parameters();
  contents.model_dtype = dtype;
  auto save = [&] {
    if (hooks) hooks->gather_all();
    std::string dir = save_checkpoint(cfg.run.output_dir, model, opt, state, contents, cfg.train.keep_checkpoints, io);
    if (hooks) hooks->release_all();
    StopSignals::saved(state.step);
    if (lead) log::info(str("saved ", dir));
  };

  const int64_t first_step = state.step;
  MetricsLog metrics = lead ? MetricsLog(cfg.run.output_dir, first_step) : MetricsLog();
  StopSignals::saved(first_step);
  ProgressBar bar(total_steps, lead && isatty(STDERR_FILENO) != 0);
  const double run_start = now_s();
  constexpr int64_t kMaxNonfiniteInRow = 3;
  if (lead)
    log::info(str(total_steps, " steps of ", per_step, " sequence(s) of ", seq_len, " tokens; ", per_epoch,
                  " sequences per epoch"));

  if (lead && cfg.run.profile && first_step + cfg.run.profile_step > total_steps)
    log::warn(str("run.profile_step = ", cfg.run.profile_step, " is past this run's last step (", total_steps - first_step,
                  " to take): no step will be profiled"));

  while (state.step < total_steps) {
    const double t0 = now_s();
    // One step of the run, when asked (profile_step): every op of it timed, for the trace.
    std::unique_ptr<StepProfiler> profiler;
    if (cfg.run.profile && lead && state.step == first_step + cfg.run.profile_step - 1)
      profiler = std::make_unique<StepProfiler>(device, state.step + 1);
    StopSignals::step_running(state.step + 1);
    if (sharded)
      shards->zero_grads();
    else
      model.zero_grad();
    if (device.is_cuda()) allocator_for(device).reset_peak();

    // Every sequence of the step is known before the first forward, so the mean over the
    // step's valid targets is exact from the start (transformers' num_items_in_batch).
    const Batch batch = data.batch(state.step, per_step);
    const int64_t valid_total = batch.valid_labels, tokens = batch.tokens;
    const size_t mine_begin = std::min(batch.sequences.size(), static_cast<size_t>(coord.dp * accum));
    const size_t mine_end = std::min(batch.sequences.size(), mine_begin + static_cast<size_t>(accum));

    double loss_sum = 0, forward_s = 0, backward_s = 0, memory_wait_s = 0;
    // One step of the run, when asked (memory_timeline_step): every allocation of it, for the timeline.
    std::unique_ptr<StepTimeline> timeline;
    if (cfg.run.memory_timeline && lead && state.step == first_step + cfg.run.memory_timeline_step - 1) timeline = std::make_unique<StepTimeline>(device);
    try {
      if (valid_total > 0) {
        for (size_t j = mine_begin; j < mine_end; ++j) {
          Shard shard = slots.parallel->shard(batch.sequences[j], seq_rank);
          StepResult r = train_step(step_slots, shard, 1.0 / static_cast<double>(valid_total), device);
          loss_sum += r.loss_sum;
          forward_s += r.forward_s;
          backward_s += r.backward_s;
          memory_wait_s += slots.memory->wait_seconds();  // per train_step, so summed over the step's sequences
        }
      }
    } catch (const Error& e) {
      // Out of memory: say where the memory goes for this run and which setting makes it fit.
      if (device.is_cuda() && std::string(e.what()).find("out of memory") != std::string::npos)
        throw Error(format_out_of_memory(cfg, slots, mc, 0, e.what()), "data.seq_len");
      throw;
    }
    if (timeline) {
      TimelineFiles f = timeline->write(cfg.run.output_dir,
                                        build_plan(planned, PlanSlots::of(slots)).peak(false).bytes);
      log::info(str("memory timeline of step ", state.step + 1, ": ", f.svg, " and ", f.json));
    }
    const double t_comm = now_s();
    // Sums over ranks: the loss, and whether any rank was asked to stop (so all stop together).
    double sums[2] = {loss_sum, static_cast<double>(StopSignals::requested() != 0)};
    if (rs.world) {
      ProfilePhase phase(StepPhase::communication);
      rs.world->all_reduce(std::span<double>(sums, 2));
      if (!sharded)
        for (Parameter* p : model.parameters()) rs.world->all_reduce(p->grad);
    }
    loss_sum = sums[0];
    const bool stop = sums[1] > 0;
    const double loss = valid_total > 0 ? loss_sum / static_cast<double>(valid_total) : std::nan("");
    const double t_opt = now_s();
    std::optional<ProfilePhase> opt_phase(std::in_place, StepPhase::optimizer);
    const double norm = sharded ? shards->grad_norm() : opt.grad_norm();
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
      if (lead)
        log::warn(str("step ", state.step + 1, ": loss ", loss, ", grad norm ", norm, " is not finite; update skipped (",
                      state.nonfinite_in_row, " in a row)"));
    }
    opt_phase.reset();
    if (device.is_cuda()) backend_for(device)->synchronize();
    const double t_end = now_s();
    if (profiler) {
      for (const std::string& line : profiler->finish(cfg.run.output_dir).table) log::info(line);
      profiler.reset();
    }

    ++state.step;
    state.sequences_done += static_cast<int64_t>(batch.sequences.size());
    state.num_tokens += static_cast<double>(tokens);
    const double epoch = static_cast<double>(state.step) / static_cast<double>(steps_per_epoch);

    const double step_s = t_end - t0;
    double flops = 0;
    for (const Sequence& seq : batch.sequences) flops += step_flops(mc, static_cast<double>(seq.tokens.numel()));
    if (lead) {
      if (state.step % std::max<int64_t>(1, cfg.train.log_every) == 0 || state.step == total_steps)
        bar.message(step_dict({{"loss", python_round(loss, 4)},
                               {"grad_norm", norm},
                               {"learning_rate", lr},
                               {"num_tokens", state.num_tokens},
                               {"epoch", python_round(epoch, 4)}}));
      bar.update(state.step, now_s() - run_start, state.step - first_step);
      nlohmann::json m = {{"step", state.step},
                          {"loss", loss},
                          {"grad_norm", norm},
                          {"learning_rate", lr},
                          {"num_tokens", state.num_tokens},
                          {"epoch", epoch},
                          {"ranks", world},
                          {"step_s", step_s},
                          {"tokens_per_s", static_cast<double>(tokens) / step_s},
                          {"flops", flops},
                          {"time_forward_s", forward_s},
                          {"time_backward_s", backward_s},
                          {"time_optimizer_s", t_end - t_opt},
                          {"time_communication_s", t_opt - t_comm},
                          {"time_memory_wait_s", memory_wait_s},
                          {"peak_host_bytes", host_peak_bytes()},
                          {"skipped", !finite}};
      if (device.is_cuda()) {
        m["peak_gpu_bytes"] = allocator_for(device).stats().peak_bytes;
        m["mfu"] = flops / step_s / kGpuPeakFlops / world;
      }
      metrics.append(std::move(m));
    }

    if (state.nonfinite_in_row >= kMaxNonfiniteInRow) {
      bar.finish();
      throw Error(str(kMaxNonfiniteInRow, " steps in a row had a non-finite loss or gradient; stopping at step ", state.step),
                  "train", str("the optimizer ran with lr = ", cfg.train.lr, ", beta1 = ", cfg.train.beta1, ", beta2 = ",
                               cfg.train.beta2, ", eps = ", cfg.train.eps, ", weight_decay = ", cfg.train.weight_decay,
                               ", max_grad_norm = ", cfg.train.max_grad_norm, ", master_dtype = \"", cfg.train.master_dtype,
                               "\": lower lr, check these and the data, or use master_dtype = \"fp32\""));
    }
    const bool due = cfg.train.save_steps > 0 && state.step % cfg.train.save_steps == 0;
    if (due || (state.step == total_steps && cfg.train.save_final) || stop) save();
    if (stop) {
      bar.finish();
      if (lead)
        log::warn(str("stopped by a signal after step ", state.step, "; resume with: lcx-train --config ", manifest.source(),
                      " --resume latest"));
      return 130;
    }
  }
  bar.finish();
  if (lead) log::info(str("finished ", total_steps, " steps in ", tqdm_time(now_s() - run_start)));
  return 0;
}

MeshShape mesh_shape(const DistributedConfig& d, int world) {
  MeshShape s{static_cast<int>(d.dp), static_cast<int>(d.cp), static_cast<int>(d.sp)};
  // dp left at 1 takes the ranks that cp and sp leave.
  if (s.dp == 1 && s.cp * s.sp > 0 && world % (s.cp * s.sp) == 0) s.dp = world / (s.cp * s.sp);
  Mesh::validate(s, world);
  return s;
}

}  // namespace

int run_training(const CoreConfig& cfg, const Manifest& manifest, const SlotFactory& make_slots,
                 const TrainOptions& opts) {
  const Device device = pick_device(cfg.run.device);
  StopSignals signals;
  const int nproc = static_cast<int>(cfg.distributed.nproc_per_node);
  const EnvMap env = process_env();
  const LaunchRole role = launch_role(nproc, env);
  // Once per job: in the process that starts it, or in rank 0 when torchrun or srun started each worker.
  const bool job_rank0 = role != LaunchRole::worker || read_dist_env(env).rank == 0;
  StopSignals::speak(job_rank0);
  if (job_rank0 && !env.contains("LCX_WORKER")) open_run_folder(cfg, opts.resume, opts.overwrite);
  CommOptions copt;
  copt.timeout_s = cfg.distributed.timeout_s;

  // Thread-ranks: the CPU, or several virtual ranks sharing one GPU.
  if (nproc > 1 && (!device.is_cuda() || cfg.distributed.virtual_ranks)) {
    const MeshShape shape = mesh_shape(cfg.distributed, nproc);
    std::vector<int> codes(static_cast<size_t>(nproc), 0);
    run_in_process(
        nproc,
        [&](Communicator& world) {
          Mesh mesh(world, shape);
          codes[static_cast<size_t>(world.rank())] =
              train_rank(cfg, manifest, make_slots, opts, device, RankSetup{&world, &mesh});
        },
        copt);
    return codes[0];
  }

  if (role == LaunchRole::single) return train_rank(cfg, manifest, make_slots, opts, device, RankSetup{});
  if (role == LaunchRole::launcher) {
    std::vector<std::string> argv = opts.argv;
    if (argv.empty()) throw Error("the launcher needs the command line to start its workers");
    argv[0] = self_executable();
    return launch_workers(nproc, argv, env);
  }
#ifdef LCX_HAVE_CUDA
  const DistEnv denv = read_dist_env(env);
  if (!device.is_cuda())
    throw Error("worker processes need one GPU each", "run.device",
                "use [distributed] virtual_ranks = true to run ranks as threads on the CPU or one GPU");
  const Device mine = Device::cuda(denv.local_rank);
  std::unique_ptr<Communicator> world = make_nccl_world(denv, denv.local_rank, copt);
  const MeshShape shape = mesh_shape(cfg.distributed, world->size());
  Mesh mesh(*world, shape);
  return train_rank(cfg, manifest, make_slots, opts, mine, RankSetup{world.get(), &mesh});
#else
  throw Error("this lcx was built without CUDA, so it has no NCCL workers", "distributed.nproc_per_node",
              "on the CPU, nproc_per_node > 1 runs thread-ranks; build with CUDA for one process per GPU");
#endif
}

}  // namespace lcx
