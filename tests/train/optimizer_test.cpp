#include <gtest/gtest.h>

#include <cmath>

#include "slots/adamw.h"

namespace lcx {
namespace {

Parameter make_param(const std::string& name, std::vector<float> w, std::vector<float> g, DType dtype, bool decay) {
  Parameter p;
  p.name = name;
  int64_t n = static_cast<int64_t>(w.size());
  p.value = Tensor::from_floats(w, {n}, dtype);
  p.grad = Tensor::from_floats(g, {n}, DType::f32);
  p.decay = decay;
  return p;
}

// Adam's first step moves each weight by lr * g / (|g| + eps) after decoupled decay: a property
// of the update rule, independent of how it is coded.
TEST(AdamW, FirstStepIsSignedLearningRate) {
  Parameter w = make_param("w", {1.0f, -2.0f, 0.5f}, {0.3f, -4.0f, 0.0f}, DType::f32, true);
  Parameter n = make_param("norm", {1.0f}, {2.0f}, DType::f32, false);
  OptimizerConfig cfg;
  cfg.weight_decay = 0.1;
  AdamW opt({&w, &n}, cfg);
  const double lr = 0.01;
  opt.step(lr);
  auto v = w.value.to_floats();
  EXPECT_NEAR(v[0], 1.0 * (1 - lr * 0.1) - lr * 0.3 / (0.3 + 1e-8), 1e-6);
  EXPECT_NEAR(v[1], -2.0 * (1 - lr * 0.1) + lr, 1e-6);
  EXPECT_NEAR(v[2], 0.5 * (1 - lr * 0.1), 1e-7);       // zero gradient: decay only
  EXPECT_NEAR(n.value.to_floats()[0], 1.0 - lr, 1e-6);  // norms are not decayed
}

TEST(AdamW, ConstantGradientKeepsUnitSteps) {
  Parameter w = make_param("w", {0.0f}, {0.5f}, DType::f32, true);
  AdamW opt({&w}, OptimizerConfig{});
  for (int i = 0; i < 5; ++i) opt.step(0.1);
  // Bias correction makes m_hat = g and v_hat = g^2 exactly for a constant gradient.
  EXPECT_NEAR(w.value.to_floats()[0], -0.5, 1e-5);
  EXPECT_EQ(opt.steps(), 5);
}

TEST(AdamW, MasterWeightsKeepPrecisionThatBf16Loses) {
  // An update far below bf16's resolution at 1.0 is lost without a master copy, kept with one.
  Parameter a = make_param("a", {1.0f}, {1.0f}, DType::bf16, false);
  Parameter b = make_param("b", {1.0f}, {1.0f}, DType::bf16, false);
  OptimizerConfig with_master, no_master;
  no_master.master_dtype = "bf16";
  AdamW oa({&a}, with_master), ob({&b}, no_master);
  for (int i = 0; i < 8; ++i) oa.step(1e-3), ob.step(1e-3);
  EXPECT_EQ(b.value.to_floats()[0], 1.0f);  // each 1e-3 step rounds back to 1.0 in bf16
  EXPECT_NEAR(oa.state().tensors[0].second.to_floats()[0], 1.0 - 8e-3, 1e-6);
  EXPECT_EQ(a.value.to_floats()[0], bf16_to_float(float_to_bf16(1.0f - 8e-3f)));
}

TEST(AdamW, GradNormClipAndStateRoundTrip) {
  Parameter w = make_param("w", {1.0f, 2.0f}, {3.0f, 4.0f}, DType::f32, true);
  AdamW opt({&w}, OptimizerConfig{});
  EXPECT_DOUBLE_EQ(opt.grad_norm(), 5.0);
  opt.scale_grads(0.2);
  EXPECT_NEAR(opt.grad_norm(), 1.0, 1e-6);
  opt.step(0.01);
  OptimizerState st = opt.state();
  Parameter w2 = make_param("w", {9.0f, 9.0f}, {3.0f, 4.0f}, DType::f32, true);
  AdamW opt2({&w2}, OptimizerConfig{});
  opt2.load_state(st);
  EXPECT_EQ(w2.value.to_floats(), w.value.to_floats());
  w2.grad.copy_from(w.grad);
  opt.step(0.01);
  opt2.step(0.01);
  EXPECT_EQ(w2.value.to_floats(), w.value.to_floats());  // bit for bit after resume
  OptimizerState bad = st;
  bad.tensors.pop_back();
  EXPECT_THROW(opt2.load_state(bad), Error);
}

}  // namespace
}  // namespace lcx
