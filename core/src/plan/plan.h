// The memory planner: asks each slot provider for its terms (lcx/plan.h), adds the step's own
// buffers and the reserve, and turns the sums into the `--plan` breakdown, the longest sequence
// that fits, and the out-of-memory report with the knob that would make the run fit.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "config/core_config.h"
#include "config/manifest.h"
#include "lcx/plan.h"
#include "plugin/loader.h"
#include "slots/resolve.h"

namespace lcx {

// The providers a plan asks for terms, with the names the manifest gives them.
struct PlanSlots {
  const Loss* loss = nullptr;
  std::string loss_name = "nll";
  const PositionalEncoding* rope = nullptr;
  std::string rope_name = "rope";
  const MemoryStrategy* memory = nullptr;
  std::string memory_name = "on_device";
  const Parallelism* parallel = nullptr;
  std::string parallel_name = "single";
  const Model* model = nullptr;  // may be null: core's dense-decoder arithmetic plans the model
  std::string model_name = "model";
  const MlpStrategy* mlp = nullptr;
  std::string mlp_name = "whole";

  static PlanSlots of(const SlotSet& s);
};

// Inputs from the core config and a model shape. seq_len is padded as a run pads it: to
// pad_to_multiple_of and, with cp, to a multiple of 2 x cp x sp (zigzag sharding).
PlanInputs plan_inputs(const CoreConfig& cfg, const ModelConfig& model, int64_t seq_len);
// The dtype of the GEMM weights' gradients ([train] grad_dtype resolved): the weights' where no
// fp32 master, no accumulation over sequences and no second rank needs fp32; refuses bf16 where
// they do.
DType grad_dtype_for(const TrainConfig& train, DType weights, int64_t world_size);
// The sequence-length unit plan_inputs pads to.
int64_t plan_seq_unit(const PlanInputs& in, int64_t pad_to_multiple_of);

// Every provider's terms, core's step buffers and the reserve. A provider that adds no terms is
// planned by core where core knows how: a model by the dense-decoder arithmetic, a memory
// strategy by its device_bytes()/host_bytes(), cp/sp communication by an estimate.
MemoryPlan build_plan(const PlanInputs& in, const PlanSlots& slots);

// The longest sequence (a multiple of `unit`) whose planned peak, reserve included, fits in
// gpu_bytes; 0 when not even one unit fits.
int64_t longest_fitting_seq(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t unit);

// The recipe candidates (plan/recipe.cpp), fastest first, each planned: its GPU peak (reserve
// included), its pinned host bytes, and whether both fit (host_bytes < 0: the host is not checked).
struct RecipeOption {
  Recipe recipe;
  int64_t gpu_peak = 0;
  int64_t host_peak = 0;
  bool fits = false;
};
std::vector<RecipeOption> rank_recipes(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes,
                                       int64_t host_bytes);
// The first candidate that fits, or the leanest when none does.
Recipe choose_recipe(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t host_bytes);
std::string recipe_name(const Recipe& r);
// MemAvailable of /proc/meminfo in bytes; -1 where it cannot be read.
int64_t host_memory_available();

// The breakdown `--plan` prints. gpu_bytes <= 0 leaves out the fit lines.
std::string format_plan(const MemoryPlan& plan, const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes,
                        int64_t unit);

// What would make a plan fit: each knob with the peak it gives. `loader` (may be null) creates
// the plugins a knob names (loss_chunked, offload) so they plan themselves.
struct PlanKnob {
  std::string action;  // "load loss_chunked", "raise distributed.cp to 16", "lower data.seq_len to 65536"
  int64_t peak = 0;    // planned peak with the knob, reserve included
  bool fits = false;
};
std::vector<PlanKnob> plan_knobs(const PlanInputs& in, const PlanSlots& slots, const PluginLoader* loader,
                                 int64_t gpu_bytes, int64_t unit);

// For the trainer when a GPU allocation fails: the plan's breakdown for this run and the knobs
// that would make it fit. `failure` is the allocator's message; gpu_bytes <= 0 means the local
// GPU's total memory.
std::string format_out_of_memory(const CoreConfig& cfg, const SlotSet& slots, const ModelConfig& model,
                                 int64_t gpu_bytes, const std::string& failure);

// "80GB", "141GiB", "81920MiB", "85899345920": GB and GiB both mean 2^30 bytes, as GPU memory is
// quoted. Throws naming the option on anything else.
int64_t parse_memory_size(const std::string& text, const std::string& option = "--gpu-memory");
// Total memory of GPU 0, or nullopt without a usable GPU.
std::optional<int64_t> local_gpu_memory();
std::string format_bytes(int64_t bytes);  // "12.34 GiB"

// The model's shape without its weights, as the model module describes it: config.json under
// [model] path when it exists, else [model] init (a preset or a JSON object of config.json keys),
// else a missing folder named after a preset (models/Qwen3-8B). `source` says which.
ModelConfig plan_model_config(const ModelSection& model, const Model& module, std::string* source = nullptr);

// lcx-train --plan: resolves the slots without GPU work (a provider that refuses its table is
// planned by its slot's default, with a warning), prints the breakdown and the longest sequence
// that fits. gpu_memory: the --gpu-memory text, "" for the local GPU's. Returns the exit code.
int run_plan_command(const Manifest& m, const CoreConfig& cfg, const PluginLoader& loader,
                     const std::vector<std::string>& disabled, const std::string& gpu_memory);

}  // namespace lcx
