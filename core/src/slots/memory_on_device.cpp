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
  // Every layer's input [T,H] stays on the GPU from its forward until its backward; the peak sees
  // all of them (the last layer's backward runs before any is released).
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const int64_t each = in.tokens_per_rank * in.model.hidden_size * static_cast<int64_t>(dtype_size(in.weight_dtype));
    plan.add(str("saved layer inputs ", in.model.num_layers, " x [T,H]"), PlanCategory::activations_gpu,
             in.model.num_layers * each, plan_phase::step);
    if (plan.kept_bytes_per_layer > 0)
      plan.add(str("kept attention outputs and LSE ", in.model.num_layers, " layers"), PlanCategory::activations_gpu,
               in.model.num_layers * plan.kept_bytes_per_layer, plan_phase::step);
  }

 private:
  std::vector<Tensor> saved_;
  std::vector<std::vector<Tensor>> kept_;
};

}  // namespace

std::unique_ptr<MemoryStrategy> make_on_device_memory() { return std::make_unique<OnDeviceMemory>(); }

}  // namespace lcx
