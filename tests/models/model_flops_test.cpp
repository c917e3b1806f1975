// Model::step_flops, which the trainer's MFU divides by the step's time: a dense Qwen3 reports what
// the dense SwiGLU accounting gives (6 per matmul weight per token, the head included, plus 6 L Hq d
// per (query, key) pair of the causal square, each document's own with bounds); Llama derives its
// head_dim from the shape; Qwen2 counts its q/k/v biases; a mixture of experts counts the router
// and the top-k experts a token takes, not a dense MLP.
#include <gtest/gtest.h>

#include <vector>

#include "decoder_config.h"
#include "lcx/slots/model.h"
#include "support/test_util.h"

namespace lcx {
namespace {

// The dense SwiGLU decoder's step FLOPs: 6 x (the layers' q, k, v, o, gate, up, down weights and
// the head) per token, 6 x layers x heads x head_dim per square of each document.
double dense_swiglu(const ModelConfig& c, double T, const std::vector<int64_t>& bounds) {
  const double h = static_cast<double>(c.hidden_size), d = static_cast<double>(c.head_dim);
  const double q = static_cast<double>(c.num_heads) * d, kv = static_cast<double>(c.num_kv_heads) * d;
  const double layer = h * q + 2 * h * kv + q * h + 3 * h * static_cast<double>(c.intermediate_size);
  const double weights = static_cast<double>(c.num_layers) * layer + static_cast<double>(c.vocab_size) * h;
  double squares = T * T;
  if (!bounds.empty()) {
    squares = 0;
    for (size_t i = 1; i < bounds.size(); ++i) squares += static_cast<double>((bounds[i] - bounds[i - 1]) * (bounds[i] - bounds[i - 1]));
  }
  return 6 * weights * T + 6 * static_cast<double>(c.num_layers) * static_cast<double>(c.num_heads) * d * squares;
}

std::shared_ptr<Model> built(const std::string& module, const std::string& spec) {
  auto m = test::make_plugin<Model>(module);
  m->init_random(spec, 1, Device::cpu(), DType::f32);
  return m;
}

// A shape where head_dim x heads differs from hidden_size, untied, three layers.
constexpr const char* kShape = R"("hidden_size": 48, "intermediate_size": 100, "num_hidden_layers": 3,
    "num_attention_heads": 6, "num_key_value_heads": 2, "vocab_size": 70, "tie_word_embeddings": false)";

TEST(ModelFlops, Qwen3EqualsTheDenseSwigluAccounting) {
  auto m = built("qwen3", std::string("{") + kShape + R"(, "head_dim": 10})");
  ASSERT_EQ(m->config().head_dim, 10);
  const std::vector<int64_t> none, docs = {0, 300, 700, 1000};
  EXPECT_DOUBLE_EQ(m->step_flops(1000, none), dense_swiglu(m->config(), 1000, none));
  EXPECT_DOUBLE_EQ(m->step_flops(1000, docs), dense_swiglu(m->config(), 1000, docs));
  // Documents attend to themselves only: fewer pairs than the whole square.
  EXPECT_LT(m->step_flops(1000, docs), m->step_flops(1000, none));
}

TEST(ModelFlops, LlamaDerivesHeadDimAndQwen2CountsItsBiases) {
  auto llama = built("llama", std::string("{") + kShape + "}");
  auto qwen2 = built("qwen2", std::string("{") + kShape + "}");
  ASSERT_EQ(llama->config().head_dim, 8);  // hidden_size / heads
  const std::vector<int64_t> none;
  EXPECT_DOUBLE_EQ(llama->step_flops(512, none), dense_swiglu(llama->config(), 512, none));
  // q, k and v biases: (6 x 8) + 2 x (2 x 8) = 80 more weights a layer, 6 FLOPs each per token.
  EXPECT_DOUBLE_EQ(qwen2->step_flops(512, none) - llama->step_flops(512, none), 6.0 * 512 * 3 * (6 * 8 + 2 * 2 * 8));
}

TEST(ModelFlops, MixtureOfExpertsCountsTheExpertsATokenTakes) {
  auto m = built("qwen3", std::string("{") + kShape + R"(, "head_dim": 10, "model_type": "qwen3_moe", "num_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 12, "mlp_only_layers": [0]})");
  const ModelConfig& c = m->config();
  ASSERT_EQ(decoder::sparse_layers(c), 2);
  const double T = 256, H = 48;
  // Layers 1 and 2 run the router [4, H] and 2 of 4 experts' gate, up and down instead of the dense MLP.
  const double sparse_less = 2 * (3 * H * 100 - (4 * H + 2 * 3 * 12 * H));
  EXPECT_DOUBLE_EQ(m->step_flops(256, {}), dense_swiglu(c, T, {}) - 6 * T * sparse_less);
}

}  // namespace
}  // namespace lcx
