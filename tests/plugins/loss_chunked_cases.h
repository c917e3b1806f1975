// The cases loss_chunked is held to, shared by its CPU suite and its GPU suite: random inputs of a
// given shape (hidden, head tied to an embedding or not, targets with chosen rows ignored), and a
// runner that feeds one Loss on one device and brings every output back to the host.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "lcx/slots/loss.h"
#include "support/test_util.h"

namespace lcx::test {

inline std::shared_ptr<Loss> load_chunked(int64_t chunk_rows, Device device = Device::cpu()) {
  PluginInfo info;
  auto loss = make_plugin<Loss>("loss_chunked", str("chunk_rows = ", chunk_rows), device, &info);
  EXPECT_EQ(info.status, "ready");
  return loss;
}

inline Tensor random_tensor(Shape shape, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (auto& x : v) x = dist(rng);
  return Tensor::from_floats(v, std::move(shape), DType::f32);
}

// Targets in [0,V), with every position in `ignored` set to -100.
inline Tensor make_targets(int64_t T, int64_t V, std::mt19937& rng,
                           const std::vector<std::pair<int64_t, int64_t>>& ignored, double ignore_rate = 0.1) {
  Tensor t = Tensor::empty({T}, DType::i64);
  std::uniform_int_distribution<int64_t> tok(0, V - 1);
  std::bernoulli_distribution drop(ignore_rate);
  int64_t* p = t.data_as<int64_t>();
  for (int64_t i = 0; i < T; ++i) p[i] = drop(rng) ? -100 : tok(rng);
  for (auto [b, e] : ignored)
    for (int64_t i = b; i < e; ++i) p[i] = -100;
  return t;
}

struct LossCase {
  int64_t T, H, V, chunk_rows;
  bool tied;
  std::vector<std::pair<int64_t, int64_t>> ignored;  // row ranges whose labels are all -100
  DType dtype = DType::f32;  // of hidden, head and grad_hidden (bf16 is what the GPU stores)
};

// Host tensors of a case, hidden and head already rounded to its dtype. The head gradient starts
// non-zero to check that a loss accumulates into it; with a tied head it is the embedding's
// gradient, which already holds the embedding's contribution.
struct LossInputs {
  Tensor hidden, head, targets, grad_head0;
};

inline LossInputs make_inputs(const LossCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  LossInputs in;
  in.hidden = random_tensor({c.T, c.H}, rng, 1.f).to(c.dtype);
  Tensor embed = random_tensor({c.V, c.H}, rng, 0.5f).to(c.dtype);
  in.head = c.tied ? embed : random_tensor({c.V, c.H}, rng, 0.5f).to(c.dtype);
  in.targets = make_targets(c.T, c.V, rng, c.ignored);
  in.grad_head0 = random_tensor({c.V, c.H}, rng, 0.1f);
  return in;
}

struct LossOutputs {
  LossResult result, forward_only;
  Tensor grad_hidden, grad_head;  // on the host
};

// forward_backward and forward of `loss` on `device`, inputs in `dtype` (fp32 math either way).
// grad_hidden starts as garbage: the loss must write every row, skipped chunks included.
inline LossOutputs run_loss(Loss& loss, const LossInputs& in, Device device, DType dtype, double grad_scale) {
  const Tensor hidden = in.hidden.to(dtype).to(device), head = in.head.to(dtype).to(device);
  const Tensor targets = in.targets.to(device);
  const int64_t T = hidden.size(0), H = hidden.size(1);
  Tensor gh = Tensor::from_floats(std::vector<float>(static_cast<size_t>(T * H), 1e3f), {T, H}, dtype, device);
  Tensor gw = in.grad_head0.to(device);
  LossOutputs out;
  out.result = loss.forward_backward(hidden, head, targets, grad_scale, gh, gw);
  out.forward_only = loss.forward(hidden, head, targets);
  out.grad_hidden = gh.to(Device::cpu());
  out.grad_head = gw.to(Device::cpu());
  return out;
}

// The chunks of `chunk_rows` rows whose targets are all ignored; their grad_hidden rows must be 0.
inline int64_t expect_skipped_rows_zero(const Tensor& grad_hidden, const Tensor& targets, int64_t chunk_rows) {
  const auto g = grad_hidden.to_floats();
  const int64_t T = grad_hidden.size(0), H = grad_hidden.size(1);
  const int64_t* t = targets.data_as<const int64_t>();
  int64_t skipped = 0;
  for (int64_t b = 0; b < T; b += chunk_rows) {
    const int64_t e = std::min(T, b + chunk_rows);
    if (std::any_of(t + b, t + e, [](int64_t x) { return x != -100; })) continue;
    ++skipped;
    for (int64_t i = b * H; i < e * H; ++i) {
      EXPECT_EQ(g[static_cast<size_t>(i)], 0.f) << "row " << i / H;
      if (g[static_cast<size_t>(i)] != 0.f) break;
    }
  }
  return skipped;
}


// The case's shapes as a line for failure messages.
inline std::string describe(const LossCase& c) {
  return str("T=", c.T, " H=", c.H, " V=", c.V, " chunk_rows=", c.chunk_rows, c.tied ? " tied" : " untied", " ",
             dtype_name(c.dtype), c.ignored.empty() ? "" : " with ignored chunks");
}

// The chunked loss's cases: tied and untied heads, chunks with every label ignored, T not
// a multiple of chunk_rows, T smaller than chunk_rows, odd V (and one-row chunks, and chunks cut
// into slices of logits).
inline std::vector<LossCase> issue_cases(DType dtype) {
  return {
      {300, 32, 257, 64, false, {}, dtype},
      {300, 32, 257, 64, true, {}, dtype},
      {290, 24, 101, 64, false, {{64, 128}, {192, 256}, {256, 290}}, dtype},
      {290, 24, 101, 64, true, {{60, 200}}, dtype},
      {257, 16, 64, 32, false, {}, dtype},
      {1000, 16, 64, 256, true, {}, dtype},
      {7, 16, 33, 256, false, {}, dtype},
      {1, 8, 33, 256, true, {}, dtype},
      {128, 20, 1, 32, false, {}, dtype},
      {128, 20, 997, 48, true, {}, dtype},
      {37, 8, 19, 1, false, {{5, 9}}, dtype},
      // Chunks above 256 rows: with a bf16 head their fp32 logits come 256 rows at a time.
      {1000, 16, 97, 600, false, {}, dtype},
      {700, 16, 64, 512, true, {{512, 700}}, dtype},
  };
}

}  // namespace lcx::test
