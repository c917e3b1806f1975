// The ranks of a training run: the process's role (one rank, thread-ranks, a launcher of worker
// processes, or one NCCL worker), each rank's Run built part by part, then handed to the Trainer.
#include <algorithm>
#include <cmath>
#include <memory>

#include "distributed/launcher.h"
#include "lcx/comm.h"
#include "lcx/log.h"
#include "log/detail.h"
#include "plan/plan.h"
#include "train/run_summary.h"
#include "train/stop_signal.h"
#include "train/trainer.h"
#include "train/trainer_loop.h"
#ifdef LCX_HAVE_CUDA
#include "distributed/nccl_comm.h"
#include "kernels/attention/dispatch.h"
#include "kernels/cuda/cuda_ops.h"
#endif

namespace lcx {
namespace {

void log_device(const Run& run) {
  const MeshShape shape = run.mesh_shape();
  log::detail(str("device ", device_name(run.device()), ", weights ", dtype_name(run.dtype()), ", ", run.world_size(),
                run.world_size() == 1 ? " rank" : " ranks",
                run.mesh() ? str(" (dp ", shape.dp, " x cp ", shape.cp, " x sp ", shape.sp,
                                 shape.cp > 1 && shape.sp > 1 ? str(", ", mesh_order_name(shape.order)) : "", ")")
                           : ""));
}

// A GPU whose attention would run 7-8x under cuDNN's rate without a word is refused (dispatch.h).
void check_attention() {
#ifdef LCX_HAVE_CUDA
  ops::attention::check_fast_attention(ops::attention::choice(), ops::cuda::attention_device_caps());
#endif
}

// Which attention backend each kind of the run's calls takes on this GPU.
void log_attention(const Run& run) {
#ifdef LCX_HAVE_CUDA
  const PlanInputs& in = run.planned();
  const ops::attention::Choice choice = ops::attention::choice();
  const ops::attention::DeviceCaps caps = ops::cuda::attention_device_caps();
  const std::vector<std::string>& types = in.model.layer_types;
  const int64_t window =
      std::find(types.begin(), types.end(), "sliding_attention") != types.end() ? in.model.sliding_window : 0;
  for (const std::string& line : ops::attention::plan_lines(choice, in.weight_dtype, in.model.head_dim,
                                                            in.tokens_per_rank, caps, window))
    log::info(str("attention ([run] attention = ", ops::attention::name(choice), "): ", line));
#else
  (void)run;
#endif
}

// The recipe the plan chose, and a warning for sequences longer than the positions placed correctly.
void log_recipe(const Run& run) {
  const ModelConfig& mc = run.model().config();
  const int64_t seq_len = run.data().seq_len();
  const PositionalEncoding& rope = *run.slots().positional;
  const MemoryPlan plan = build_plan(run.planned(), run.plan_slots());
  log::detail(str("recipe: ", recipe_name(run.planned().recipe), ", ", dtype_name(run.grad_dtype()), " GEMM gradients",
                run.device().is_cuda() ? str("; predicted step ", predicted_step_seconds(plan.work), " s") : std::string()));
  // What the measured peaks (metrics' peak_gpu_bytes, peak_pinned_bytes) are to be compared with.
  log::detail(str("plan: GPU peak ", plan.peak(false).bytes, " B allocated (", plan.peak(true).bytes,
                " B with the reserve), pinned host ", plan.host_peak(),
                " B (the pinned pool's peak + host_optimizer_bytes)"));
  if (seq_len > rope.effective_max_positions())
    log::warn(str("sequences of ", seq_len, " tokens go beyond the ", rope.effective_max_positions(),
                  " positions this model places correctly: expect a loss near 10 instead of ~4. Load a YaRN "
                  "PositionalEncoding plugin with factor = ",
                  std::ceil(static_cast<double>(seq_len) / static_cast<double>(mc.max_position_embeddings)),
                  " and original_max_position_embeddings = ", mc.max_position_embeddings));
}

// One rank's run: the Run built part by part, in the order its refusals should come, then trained.
int train_rank(const CoreConfig& cfg, const Manifest& manifest, const SlotFactory& make_slots, const TrainOptions& opts,
               Device device, RankSetup rank) {
  Run run(cfg, make_slots(device, rank.world ? rank.world->rank() : 0), device, rank);
  run.check_parallelism();
  if (run.lead()) log_device(run);
  run.open_data(cfg.data, run.lead(), cfg.eval.split);
  run.open_eval_data(run.lead());
  run.check_sequence_split();
  const std::string resume_dir = opts.resume.empty() ? std::string() : resolve_checkpoint(cfg.run.output_dir, opts.resume);
  run.load_or_init_weights(resume_dir);
  run.configure_step();
  run.shard_parameters();
  run.choose_grad_dtype();
  const RatesTable::Choice rates = use_rates_for(cfg.run.gpu_name, local_gpu_memory().value_or(0));
  if (run.lead()) {
    log::info(str("rates: the '", rates.row.device, "' row (", rates.row.basis.empty() ? "" : rates.row.basis + ", ",
                  rates.row.source, ")", rates.note.empty() ? "" : "; ", rates.note));
    if (device.is_cuda() && mfu_peak_flops(cfg.run.peak_tflops) <= 0)
      log::warn(str("no MFU: the rates row '", rates.row.device,
                    "' has no peak_flops; set [run] peak_tflops to the GPU's dense bf16 peak"));
  }
  run.plan_local_step(opts.force);
  if (run.lead()) log_recipe(run);
  if (device.is_cuda()) check_attention();
  if (run.lead() && device.is_cuda()) log_attention(run);
  const RunLength length = run_length(run);
  if (run.lead())
    for (const std::string& line : run_summary(run, length.total_steps, length.per_step, length.steps_per_epoch))
      log::info(line);
  run.make_optimizer(resume_dir);
  Trainer trainer(run, manifest, length, resume_dir, resume_command(opts.argv));
  return cfg.run.rehearse ? trainer.rehearse() : trainer.train();
}

MeshShape mesh_shape(const DistributedConfig& d, int world) {
  MeshShape s = configured_mesh(d);
  // dp left at 1 takes the ranks that cp and sp leave.
  if (s.dp == 1 && s.cp * s.sp > 0 && world % (s.cp * s.sp) == 0) s.dp = world / (s.cp * s.sp);
  Mesh::validate(s, world);
  return s;
}

}  // namespace

int run_training(const CoreConfig& cfg, const Manifest& manifest, const SlotFactory& make_slots,
                 const TrainOptions& opts) {
  const Device device = pick_device(cfg.run.device);
  choose_attention(cfg.run);
  StopSignals signals;
  const int nproc = static_cast<int>(cfg.distributed.nproc_per_node);
  const EnvMap env = process_env();
  const LaunchRole role = launch_role(nproc, env);
  // Once per job: in the process that starts it, or in rank 0 when torchrun or srun started each worker.
  const bool job_rank0 = role != LaunchRole::worker || read_dist_env(env).rank == 0;
  StopSignals::speak(job_rank0);
  // A rehearsal leaves the run folder's checkpoints and metrics as they are.
  if (job_rank0 && !env.contains("LCX_WORKER") && !cfg.run.rehearse) open_run_folder(cfg, opts.resume, opts.overwrite);
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

  if (role == LaunchRole::single) {
    // One rank has no expert-parallel group to hand the other experts' rows to.
    if (cfg.distributed.ep > 1)
      throw Error(str("[distributed] ep = ", cfg.distributed.ep, " splits the experts over that many ranks, but this run has one"),
                  "distributed.ep", "set ep = 1, or nproc_per_node (or WORLD_SIZE) to a multiple of ep");
    return train_rank(cfg, manifest, make_slots, opts, device, RankSetup{});
  }
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
  return train_rank(cfg, manifest, make_slots, opts, mine, RankSetup{world.get(), &mesh, denv.local_world_size});
#else
  throw Error("this lcx was built without CUDA, so it has no NCCL workers", "distributed.nproc_per_node",
              "on the CPU, nproc_per_node > 1 runs thread-ranks; build with CUDA for one process per GPU");
#endif
}

}  // namespace lcx
