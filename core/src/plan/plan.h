// The memory planner: asks each slot provider for its terms (lcx/plan.h), adds the step's own
// buffers and the reserve, and turns the sums into the `--plan` breakdown, the longest sequence
// that fits, and the out-of-memory report with the knob that would make the run fit.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "config/core_config.h"
#include "config/manifest.h"
#include "lcx/plan.h"
#include "lcx/size_math.h"
#include "plan/rates.h"
#include "loader/plugin_loader.h"
#include "slots/resolve.h"

namespace lcx {

// The providers a plan asks for terms (one pointer per slot, lcx/slots.h), with the names the
// manifest gives them: <member>_name, the slot's default provider's name (the model's: "model")
// until set. A null slot is planned by core's default; a null model plans nothing.
struct PlanSlots : SlotTuple<ConstSlotPtr> {
#define LCX_PLAN_SLOT_NAME_(ID, NUMBER, TYPE, MEMBER, NAME, DEFAULT_NAME, DEFAULT_FACTORY) \
  std::string MEMBER##_name = plan_slot_label(DEFAULT_NAME, NAME);
  LCX_SLOTS(LCX_PLAN_SLOT_NAME_)
#undef LCX_PLAN_SLOT_NAME_

  // The name of interface T's provider.
  template <class T>
  const std::string& name_of() const {
#define LCX_PLAN_SLOT_NAME_OF_(ID, NUMBER, TYPE, MEMBER, NAME, DEFAULT_NAME, DEFAULT_FACTORY) \
  if constexpr (std::is_same_v<T, TYPE>) return MEMBER##_name; else
    LCX_SLOTS(LCX_PLAN_SLOT_NAME_OF_)
#undef LCX_PLAN_SLOT_NAME_OF_
    static_assert(sizeof(T) == 0, "not a slot interface (LCX_SLOTS, lcx/abi.h)");
  }
  template <class T>
  std::string& name_of() {
    return const_cast<std::string&>(static_cast<const PlanSlots*>(this)->name_of<T>());
  }

  // The mesh axis of the Parallelism the slot's provider stacks over (SlotSet::parallel_inner);
  // empty without one. A stacked pair grows along it as loaded.
  std::string parallel_inner_axis;

  static PlanSlots of(const SlotSet& s);

 private:
  static const char* plan_slot_label(const char* default_name, const char* slot_name) {
    return default_name ? default_name : slot_name;
  }
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

// Every provider's terms, in the slot table's order (the model first), core's step buffers and
// the reserve.
MemoryPlan build_plan(const PlanInputs& in, const PlanSlots& slots);

// The longest sequence (a multiple of `unit`) whose planned peak, reserve included, fits in
// gpu_bytes; 0 when not even one unit fits.
int64_t longest_fitting_seq(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t unit);
// The longest sequence (a multiple of `unit`) for which `fits` holds, `in` planned at that length
// (fits is taken to hold at every shorter one); 0 when not even one unit fits.
int64_t longest_seq_where(const PlanInputs& in, int64_t unit, const std::function<bool(const PlanInputs&)>& fits);

// The recipe candidates (plan/recipe.cpp), fastest first by the cost model, each planned: its GPU peak (reserve
// included), its pinned host bytes, and whether both fit (host_bytes < 0: the host is not checked).
struct RecipeOption {
  Recipe recipe;
  int64_t gpu_peak = 0;
  int64_t host_peak = 0;  // one rank's
  int64_t host_node = 0;  // host_peak x the node's local ranks, what host_bytes is compared to
  bool fits = false;
  double seconds = 0;  // the cost model's step time
};
// checkpoint_every: the spacing train.checkpoint_every sets, or 0 ("auto") to search 1, 2, 3, 4,
// 6, ... (plan/recipe.cpp); the providers' knobs as each declares them (Plugin::knobs).
std::vector<RecipeOption> rank_recipes(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes,
                                       int64_t host_bytes, int64_t checkpoint_every = 0);
// The first candidate that fits, or the leanest when none does.
Recipe choose_recipe(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t host_bytes,
                     int64_t checkpoint_every = 0);
// The longest sequence (a multiple of `unit`) at which some candidate of rank_recipes fits both
// budgets (host_bytes < 0: the GPU's alone): the machine's longest for this model, mesh and providers.
int64_t longest_fitting_seq(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t host_bytes,
                            int64_t unit, int64_t checkpoint_every);
// A knob with the name of the provider that declared it ("train" for core's own).
struct DeclaredKnob {
  std::string provider;
  Knob knob;
};
// Core's own knob (train.checkpoint_every: `checkpoint_every`, or the spacings the search tries
// where it is 0) and every slot's provider's, in the slot table's order, for a step of `in`.
std::vector<DeclaredKnob> declared_knobs(const PlanInputs& in, const PlanSlots& slots, int64_t checkpoint_every);
// The recipe of a run whose memory the plan does not size (on the host): every knob at its
// default_value.
Recipe unplanned_recipe(const PlanInputs& in, const PlanSlots& slots, int64_t checkpoint_every);
// "train.checkpoint_every = 2, <provider>.<knob> = <value>, ...": each value by its provider's name.
std::string recipe_name(const Recipe& r);
std::string knob_value_text(int64_t value, bool boolean);  // "12", or "true" / "false"

// The breakdown `--plan` prints. gpu_bytes <= 0 leaves out the GPU's fit lines, host_bytes < 0
// the host's; terms: the per-phase sums and the table of every term behind them.
std::string format_plan(const MemoryPlan& plan, const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes,
                        int64_t host_bytes = -1, bool terms = true);

// What would make a plan fit: each knob with the peak it gives. `loader` (may be null) finds the
// installed plugins; each that offers itself (Plugin::plan_offer) for a slot that runs core's
// default is created with its defaults and planned in its place, alone and all together; a
// Parallelism that offers itself has its mesh axis raised; and a shorter sequence.
struct PlanKnob {
  std::string action;  // "load <plugin> (<its offer>)", "raise distributed.cp to 16 (...)", "lower data.seq_len to 65536"
  std::vector<std::string> loads;                          // the plugins it adds to [plugins] load
  std::vector<std::pair<std::string, std::string>> sets;  // the keys it sets: {"data.seq_len", "65536"}
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

// The host memory a node's ranks may pin together: `text` (--host-memory) when given, else
// [run] host_memory, else what this host leaves (host_memory_available: MemAvailable and the
// cgroup's room); -1 when unknown.
int64_t host_memory_budget(const std::string& text, const RunConfig& run);
// Where host_memory_budget's figure comes from, in words ("--host-memory", "run.host_memory", or
// this machine's available memory).
std::string host_memory_source(const std::string& text, const RunConfig& run);
// The pinned host bytes of a node: one rank's host peak x the node's local ranks.
int64_t node_host_bytes(const MemoryPlan& plan, const PlanInputs& in);
// The fix for a step whose pinned host bytes pass the host's memory.
extern const char* const kHostMemoryFix;
// Refuses (key run.host_memory, kHostMemoryFix) a plan whose node's pinned bytes pass host_bytes
// (< 0: unknown, not checked), before anything is pinned.
void check_host_memory(const MemoryPlan& plan, const PlanInputs& in, int64_t host_bytes);
// On the CPU every byte of the plan is host memory, each thread-rank's own: refuses a plan whose
// bytes and `rank_extra_bytes` (what each rank holds beside its tensors), all local ranks counted,
// pass host_bytes (< 0: unknown, not checked), before any rank allocates.
void check_cpu_memory(const MemoryPlan& plan, const PlanInputs& in, int64_t host_bytes, int64_t rank_extra_bytes = 0);
// Total memory of GPU 0, or nullopt without a usable GPU.
std::optional<int64_t> local_gpu_memory();
std::string with_commas(int64_t v);       // "1,048,576"

// The model's shape without its weights, as the model module describes it: config.json under
// [model] path when it exists, else [model] init (a preset or a JSON object of config.json keys),
// else a missing folder named after a preset (models/Qwen3-8B). `source` says which.
ModelConfig plan_model_config(const ModelSection& model, const Model& module, std::string* source = nullptr);

}  // namespace lcx
