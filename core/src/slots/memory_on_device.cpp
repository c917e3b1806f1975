#include <vector>

#include "lcx/defaults.h"
#include "lcx/plan.h"

namespace lcx {
namespace {

class OnDeviceMemory final : public MemoryStrategy {
 public:
  void begin_step(int num_layers) override {
    saved_.assign(static_cast<size_t>(num_layers), Tensor());
    kept_.assign(static_cast<size_t>(num_layers), {});
  }
  void save(int layer, const Tensor& input) override { saved_.at(static_cast<size_t>(layer)) = input; }
  Tensor fetch(int layer) override {
    const Tensor& t = saved_.at(static_cast<size_t>(layer));
    LCX_CHECK(t.numel() > 0, "layer ", layer, " input was never saved");
    return t;
  }
  void keep(int layer, const Tensor& t) override { kept_.at(static_cast<size_t>(layer)).push_back(t); }
  std::vector<Tensor> kept(int layer) override { return kept_.at(static_cast<size_t>(layer)); }
  void release(int layer) override {
    saved_.at(static_cast<size_t>(layer)) = Tensor();
    kept_.at(static_cast<size_t>(layer)).clear();
  }
  void end_step() override {
    saved_.clear();
    kept_.clear();
  }
  // Every saved layer's input [T,H] (every one, or every checkpoint_every-th) stays on the GPU
  // from its forward until its backward; the peak sees all of them (the last layer's backward runs
  // before any is released).
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const int64_t each = in.tokens_per_rank * in.model.hidden_size * static_cast<int64_t>(dtype_size(in.weight_dtype));
    const int64_t saved = in.recipe.saved_layers(in.model.num_layers);
    plan.add("saved_inputs", str("saved layer inputs ", saved, " x [T,H]"), PlanCategory::activations_gpu, saved * each,
             plan_phase::step);
    if (plan.kept_bytes_per_layer > 0)
      plan.add("kept_attention", str("kept attention outputs and LSE ", saved, " layers"),
               PlanCategory::activations_gpu, saved * plan.kept_bytes_per_layer, plan_phase::step);
  }

 private:
  std::vector<Tensor> saved_;
  std::vector<std::vector<Tensor>> kept_;
};

}  // namespace

std::unique_ptr<MemoryStrategy> make_on_device_memory() { return std::make_unique<OnDeviceMemory>(); }

}  // namespace lcx
