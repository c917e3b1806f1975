// One run, built once for every command that needs one: this rank's place in the job, its slots,
// the data, the model's weights (loaded, initialized or resumed), the step's slots with the
// plan's recipe, the gradients' dtype, ZeRO-3 hooks and the optimizer (the Optimizer slot). Each command builds the
// parts it uses, in the order they are declared: lcx-train all of them (train/trainer.cpp),
// `eval` the data, the weights and the step (app/eval_cmd.cpp), `--plan` the recipe from the
// model's shape alone (app/plan_cmd.cpp).
#pragma once
#include <memory>
#include <string>

#include "config/core_config.h"
#include "plan/plan.h"
#include "slots/resolve.h"
#include "train/checkpoint.h"
#include "train/step.h"

namespace lcx {

class Dataset;
class Tokenizer;
class ShardedParams;
class ShardingHooks;

// [run] device: "cpu", "cuda" (refused without a GPU) or "auto" (the first GPU when there is one).
Device pick_device(const std::string& want);
// The GPU attention's backends for this process ([run] attention, kernels/attention/dispatch.h).
void choose_attention(const RunConfig& run);

// What a run reads, looked at before any of it is read at length (the corpus tokenized, the
// weights loaded): [model] path and its config.json, described by the model module (which refuses
// a model it does not support), [data] tokenizer loaded, [data] source present, and [eval] source
// when it is set. Throws lcx::Error naming the key.
void check_run_inputs(const CoreConfig& cfg, const SlotSet& slots);
// [eval] source, when set, exists (key eval.source).
void check_eval_source(const CoreConfig& cfg);

// Refuses, before the first step, a plan whose GPU peak (reserve included) passes gpu_bytes, with
// the knobs that would make it fit; `force` (--force) warns and goes on.
void check_gpu_memory(const CoreConfig& cfg, const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, bool force);

// This rank in the job.
struct RankSetup {
  Communicator* world = nullptr;  // null: one rank
  Mesh* mesh = nullptr;
  int local_ranks = 0;  // ranks on this node (LOCAL_WORLD_SIZE); 0: [distributed] nproc_per_node
};

class Run {
 public:
  // `slots` are this rank's own (a plugin may hold per-rank state), created after its mesh is
  // bound. A manifest with no model module is refused; `model_needed_for` says what needs it
  // ("" for a run that loads weights).
  Run(const CoreConfig& cfg, SlotSet slots, Device device, RankSetup rank = {},
      const std::string& model_needed_for = "");
  ~Run();
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  // Refuses a Parallelism that splits a sequence over other than the mesh's cp x sp ranks.
  void check_parallelism() const;
  // `data` (its seq_len as given) tokenized with [data] tokenizer; progress: a bar while tokenizing.
  // `held_out`: the share of its sequences left to evaluation ([eval] split), not trained on.
  void open_data(const DataConfig& data, bool progress, double held_out = 0);
  // [eval] source, read as the training data is (eval_data_config), when [eval] asks for an
  // evaluation; the dataset `eval` evaluates. progress: a bar while tokenizing, and the log's
  // line of what is evaluated when.
  void open_eval_data(bool progress);
  // A length the parallelism cannot split, the first sequence's or the last's (the stream's
  // shorter remainder), of the data and of the eval data, fails here, before any weight is loaded.
  void check_sequence_split() const;
  // Weights from a Hugging Face folder: a model, or a checkpoint.
  void load_weights(const std::string& dir);
  // The weights a training run starts from: the checkpoint it resumes (resume_dir), else
  // [model] path, else [model] init.
  // Then the Adapter slot attaches (its checkpoint's factors when resume_dir holds them); the base
  // of a checkpoint that holds an adapter comes from [model]. ZeRO-3 with an adapter is refused.
  void load_or_init_weights(const std::string& resume_dir);
  // The step's slots over the loaded model, in the weights' dtype, told the model's shape and
  // this rank's mesh.
  void configure_step();
  // ZeRO-3 with [distributed] shard_parameters on more than one rank: each rank keeps its shard
  // of every parameter; the step's hooks gather and reduce-scatter around each layer.
  void shard_parameters();
  // The GEMM weights' gradients in [train] grad_dtype resolved (grad_dtype_for): the weights'
  // dtype where nothing needs fp32.
  void choose_grad_dtype();
  // The plan for sequences of seq_len tokens of a model of `shape`, and the step's recipe: the
  // fastest choices that fit gpu_bytes and host_bytes (keys in the manifest win).
  void plan_step(const ModelConfig& shape, int64_t seq_len, int64_t gpu_bytes, int64_t host_bytes);
  // plan_step for the loaded model and the data's sequences on this machine: the local GPU's
  // memory and the host's ([run] gpu_memory, host_memory). Refuses a recipe whose pinned bytes,
  // times the node's ranks, pass the host's memory, before anything is pinned, and one whose GPU
  // peak passes the GPU's budget unless `force` (check_gpu_memory).
  void plan_local_step(bool force = false);
  // The Optimizer slot's provider configured with [train] over the parameters, or this rank's
  // shards of them; with its state from resume_dir when set.
  void make_optimizer(const std::string& resume_dir);

  // What a training step uses.
  // The parameters the run trains: the model's that are not frozen, then the adapter's.
  std::vector<Parameter*> trainable_parameters() const;
  void zero_grads();
  double grad_norm();  // the whole gradient's, across ranks, before clipping
  // Writes checkpoint-<state.step> (the full model gathered around it when sharded); returns it.
  std::string save(const TrainerState& state, const CheckpointContents& contents);

  const CoreConfig& cfg() const { return cfg_; }
  Device device() const { return device_; }
  int rank() const;
  int world_size() const;
  bool lead() const { return rank() == 0; }
  Communicator* world() const { return rank_.world; }
  Mesh* mesh() const { return rank_.mesh; }
  MeshShape mesh_shape() const;
  MeshCoord mesh_coord() const;
  int seq_rank() const;  // this rank's place among those sharing one sequence (cp x sp)
  RankIO rank_io() const;

  SlotSet& slots() { return slots_; }
  const SlotSet& slots() const { return slots_; }
  Model& model() const { return *slots_.model; }
  DType dtype() const { return dtype_; }
  const Dataset& data() const { return *data_; }
  const Dataset* eval_data() const { return eval_data_.get(); }  // null: no evaluation
  StepSlots& step() { return step_; }
  bool sharded() const { return shards_ != nullptr; }
  DType grad_dtype() const { return grad_dtype_; }
  const PlanInputs& planned() const { return planned_; }
  PlanSlots plan_slots() const { return PlanSlots::of(slots_); }
  Optimizer& optimizer() { return *slots_.optimizer; }

 private:
  const Tokenizer& tokenizer();
  void load_base_weights(const std::string& resume_dir);
  const CoreConfig& cfg_;
  Device device_;
  RankSetup rank_;
  SlotSet slots_;
  DType dtype_;
  std::unique_ptr<Tokenizer> tokenizer_;  // [data] tokenizer, loaded once for the data and the eval data
  std::unique_ptr<Dataset> data_;
  std::unique_ptr<Dataset> eval_data_;
  StepSlots step_;
  std::unique_ptr<ShardedParams> shards_;
  std::unique_ptr<ShardingHooks> hooks_;
  DType grad_dtype_ = DType::f32;
  PlanInputs planned_;
};

}  // namespace lcx
