// LoRA on every linear projection of a family's model against the base with W + (alpha / r) B A
// merged: with B drawn at random the two losses agree, the base stays frozen and every factor gets
// a gradient. The families' and Gemma 3's tests hold their fixtures to it.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "lcx/ops.h"
#include "lcx/slots/adapter.h"
#include "models/model_util.h"

namespace lcx::test {

inline void expect_lora_equals_merged_model(const std::function<std::shared_ptr<Model>()>& load, const Shard& shard,
                                            const std::string& what) {
  const int64_t valid = count_valid(shard);
  auto adapted = load();
  auto lora = make_plugin<Adapter>("lora", "r = 4\nalpha = 8\ntarget_modules = \"all-linear\"");
  lora->attach(*adapted, AdapterContext{Device::cpu(), DType::f32, 5, ""});
  uint32_t seed = 40;
  for (Parameter* p : lora->parameters())
    if (p->name.find("lora_B") != std::string::npos) fill_normal(p->value, seed++, 0.1f);
  DefaultSlots sa(*adapted);
  sa.slots.adapter = lora.get();
  const StepResult ra = mean_loss_step(sa, shard, valid);
  for (Parameter* p : adapted->parameters()) EXPECT_TRUE(p->frozen && !p->grad.defined()) << what << ": " << p->name;
  for (Parameter* p : lora->parameters()) {
    double sq = 0;
    for (float g : p->grad.to_floats()) sq += static_cast<double>(g) * g;
    EXPECT_GT(sq, 0) << what << ": " << p->name << " got no gradient";
  }

  auto merged = load();
  std::map<std::string, Parameter*> base;
  for (Parameter* p : merged->parameters()) base[p->name] = p;
  std::map<std::string, Parameter*> factors;
  for (Parameter* p : lora->parameters()) factors[p->name] = p;
  int merges = 0;
  for (const auto& [fname, a] : factors) {
    const size_t at = fname.find(".lora_A.weight");
    if (at == std::string::npos) continue;
    const std::string stem = fname.substr(0, at);
    Parameter* b = factors.at(stem + ".lora_B.weight");
    Parameter* w = base.at(stem + ".weight");
    ops::matmul(b->value, false, a->value, false, w->value, 2.f, 1.f);  // W += (alpha / r) B A
    ++merges;
  }
  EXPECT_EQ(merges, 7 * static_cast<int>(merged->config().num_layers)) << what;
  DefaultSlots sm(*merged);
  const StepResult rm = mean_loss_step(sm, shard, valid);
  EXPECT_NEAR(ra.loss_sum, rm.loss_sum, 1e-5 * std::abs(rm.loss_sum)) << what;
}

}  // namespace lcx::test
