#include "slots/adamw.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "lcx/adamw_scalars.h"
#include "lcx/defaults.h"
#include "lcx/error.h"
#include "lcx/ops.h"
#include "lcx/plan.h"
#include "lcx/profile.h"
#include "kernels/adamw_kernel.h"

namespace lcx {

void AdamW::configure(std::vector<Parameter*> params, const OptimizerConfig& cfg, const OptimizerScope& /*scope*/) {
  cfg_ = cfg;
  params_.clear();
  step_ = 0;
  const bool bf16_master = cfg_.master_dtype == "bf16";
  for (Parameter* p : params) {
    ParamState s{p, {}, {}, {}};
    Device d = p->value.device();
    if (!bf16_master) {
      s.master = Tensor::empty(p->value.shape(), DType::f32, d, MemoryCategory::master_weights);
      ops::cast(p->value, s.master);
    }
    DType moment = bf16_master ? p->value.dtype() : DType::f32;
    s.m = Tensor::zeros(p->value.shape(), moment, d, MemoryCategory::optimizer);
    s.v = Tensor::zeros(p->value.shape(), moment, d, MemoryCategory::optimizer);
    params_.push_back(std::move(s));
  }
}

double AdamW::grad_norm() {
  ProfileScope scope(OpKind::optimizer, "grad_norm");
  double sq = 0;
  for (const auto& s : params_) sq += adamw::sum_squares(s.p->grad);
  return std::sqrt(sq);
}

void AdamW::scale_grads(double scale) {
  ProfileScope scope(OpKind::optimizer, "clip_grads");
  for (auto& s : params_) ops::scale_inplace(s.p->grad, static_cast<float>(scale));
}

void AdamW::step(double lr) {
  ++step_;
  const AdamWScalars a = adamw_scalars(cfg_, lr, step_);
  adamw::Hyper h{a.lr, a.beta1, a.beta2, a.eps, 0.0f, a.step_size, a.bias_correction2_sqrt};
  ProfileScope scope(OpKind::optimizer, "adamw_step");
  for (auto& s : params_) {
    h.weight_decay = s.p->decay ? static_cast<float>(cfg_.weight_decay) : 0.0f;
    adamw::update(s.master, s.p->value, s.p->grad, s.m, s.v, h);
  }
}

OptimizerState AdamW::state() const {
  OptimizerState st;
  st.step = step_;
  for (const auto& s : params_) {
    if (s.master.defined()) st.tensors.emplace_back(s.p->name + ".master", s.master.to(Device::cpu()));
    st.tensors.emplace_back(s.p->name + ".exp_avg", s.m.to(Device::cpu()));
    st.tensors.emplace_back(s.p->name + ".exp_avg_sq", s.v.to(Device::cpu()));
  }
  return st;
}

void AdamW::load_state(const OptimizerState& st) {
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [n, t] : st.tensors) by_name[n] = &t;
  auto restore = [&](const std::string& name, Tensor& dst) {
    auto it = by_name.find(name);
    if (it == by_name.end())
      throw Error(str("optimizer state has no tensor '", name, "'"), {}, "resume from a checkpoint of the same model and master_dtype");
    const Tensor& src = *it->second;
    if (src.shape() != dst.shape())
      throw Error(str("optimizer state '", name, "' has shape ", shape_str(src.shape()), ", the run needs ",
                      shape_str(dst.shape())), {}, "resume from a checkpoint of the same model");
    // Checkpoints store fp32; bf16 moments round-trip exactly through it.
    Tensor host = src.dtype() == dst.dtype() ? src : src.to(dst.dtype());
    dst.copy_from(host);  // across devices when the run is on a GPU
  };
  for (auto& s : params_) {
    if (s.master.defined()) {
      restore(s.p->name + ".master", s.master);
      ops::cast(s.master, s.p->value);
    }
    restore(s.p->name + ".exp_avg", s.m);
    restore(s.p->name + ".exp_avg_sq", s.v);
  }
  step_ = st.step;
}

void AdamW::plan(const PlanInputs& in, MemoryPlan& plan) const {
  if (plan.parameters == 0) return;  // no model planned
  const int64_t shards = parameter_shards(in);
  const int64_t per_rank = (plan.parameters + shards - 1) / shards;
  const bool master = in.master_dtype == DType::f32;
  const int64_t moment = master ? 4 : static_cast<int64_t>(dtype_size(in.weight_dtype));
  if (master)
    plan.add("master_weights", "fp32 master copy", PlanCategory::master_weights, per_rank * 4, plan_phase::always);
  plan.add("adamw_moments", master ? "AdamW moments m, v (fp32)" : "AdamW moments m, v (weight dtype)",
           PlanCategory::optimizer, 2 * per_rank * moment, plan_phase::always);
  // Every parameter's value, grad, master and moments read and written once.
  plan.work.memory_bytes += static_cast<double>(plan.parameters) * (master ? 24.0 : 12.0);
}

std::unique_ptr<Optimizer> make_adamw_optimizer() { return std::make_unique<AdamW>(); }

}  // namespace lcx
