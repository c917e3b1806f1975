// The linear modules each family lists for adapters (ModelConfig::linear_modules): their paths as
// transformers and PEFT name them, shapes, biases and experts, the same from describe() (no
// weight made) as from a built model, and each backed by the parameters the model holds.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "lcx/slots/model.h"
#include "models/model_util.h"

namespace lcx {
namespace {

struct Want {
  std::string path;
  int64_t in, out;
  bool bias = false;
  int64_t experts = 0;
  bool parameter = false;
};

// Layer `layer`'s modules are `want`, in order; ids are unique in the layer; and a model built from
// `spec` lists the same and holds each module's weight (and bias) in the shape it says.
void expect_modules(const std::string& module, const std::string& spec, int64_t layer, const std::vector<Want>& want) {
  SCOPED_TRACE(module + " layer " + std::to_string(layer));
  auto model = test::make_plugin<Model>(module);
  const ModelConfig described = model->describe(spec);
  ASSERT_EQ(static_cast<int64_t>(described.linear_modules.size()), described.num_layers);
  const auto& got = described.linear_modules.at(static_cast<size_t>(layer));
  ASSERT_EQ(got.size(), want.size());
  std::map<int, std::string> ids;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i].path, want[i].path);
    EXPECT_EQ(got[i].in_features, want[i].in) << want[i].path;
    EXPECT_EQ(got[i].out_features, want[i].out) << want[i].path;
    EXPECT_EQ(got[i].bias, want[i].bias) << want[i].path;
    EXPECT_EQ(got[i].experts, want[i].experts) << want[i].path;
    EXPECT_EQ(got[i].parameter, want[i].parameter) << want[i].path;
    EXPECT_TRUE(ids.emplace(got[i].id, got[i].path).second) << want[i].path << " shares its id with " << ids[got[i].id];
  }

  model->init_random(spec, 1, Device::cpu(), DType::f32);
  const auto& built = model->config().linear_modules.at(static_cast<size_t>(layer));
  ASSERT_EQ(built.size(), got.size());
  std::map<std::string, Shape> held;
  for (Parameter* p : model->parameters()) held[p->name] = p->value.shape();
  const std::string prefix = "model.layers." + std::to_string(layer) + ".";
  for (size_t i = 0; i < got.size(); ++i) {
    const LinearModule& m = got[i];
    EXPECT_EQ(built[i].path, m.path);
    EXPECT_EQ(built[i].id, m.id);
    const std::string weight = prefix + m.path + (m.parameter ? "" : ".weight");
    const Shape shape = m.parameter     ? Shape{m.experts, m.in_features, m.out_features}
                        : m.experts > 0 ? Shape{m.experts, m.out_features, m.in_features}
                                        : Shape{m.out_features, m.in_features};
    ASSERT_TRUE(held.count(weight)) << weight;
    EXPECT_EQ(held[weight], shape) << weight;
    const std::string bias = prefix + m.path + (m.parameter ? "_bias" : ".bias");
    EXPECT_EQ(held.count(bias) > 0, m.bias) << bias;
  }
}

const std::string kDense = R"({"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16)";

std::vector<Want> dense_layer(bool qkv_bias) {
  return {{"self_attn.q_proj", 32, 64, qkv_bias}, {"self_attn.k_proj", 32, 32, qkv_bias}, {"self_attn.v_proj", 32, 32, qkv_bias},
          {"self_attn.o_proj", 64, 32},           {"mlp.gate_proj", 32, 48},              {"mlp.up_proj", 32, 48},
          {"mlp.down_proj", 48, 32}};
}

TEST(LinearModules, Qwen3ListsItsSevenProjections) { expect_modules("qwen3", kDense + "}", 1, dense_layer(false)); }

TEST(LinearModules, LlamaListsItsSevenProjections) { expect_modules("llama", kDense + "}", 0, dense_layer(false)); }

TEST(LinearModules, Qwen2ListsBiasesOnQKV) { expect_modules("qwen2", kDense + "}", 1, dense_layer(true)); }

// A sparse layer's MLP is its experts, one nn.Linear each as PEFT sees them; a dense layer of the
// same model keeps its own MLP.
TEST(LinearModules, Qwen3MoeListsTheExpertsOfItsSparseLayers) {
  const std::string spec = kDense + R"(, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
      "moe_intermediate_size": 24, "mlp_only_layers": [0]})";
  expect_modules("qwen3", spec, 0, dense_layer(false));
  std::vector<Want> sparse = dense_layer(false);
  sparse.resize(4);
  sparse.push_back({"mlp.experts.gate_proj", 32, 24, false, 4});
  sparse.push_back({"mlp.experts.up_proj", 32, 24, false, 4});
  sparse.push_back({"mlp.experts.down_proj", 24, 32, false, 4});
  expect_modules("qwen3", spec, 1, sparse);
  EXPECT_EQ(test::make_plugin<Model>("qwen3")->describe(spec).linear_modules[1][4].experts_per_token, 2);
}

// GPT-OSS: biases on q, k, v and o, and its experts as two 3-D parameters (PEFT's
// target_parameters), gate and up fused.
TEST(LinearModules, GptOssListsItsFusedExpertsAsParameters) {
  const std::string spec = R"({"hidden_size": 64, "intermediate_size": 32, "num_local_experts": 4,
      "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})";
  expect_modules("gpt_oss", spec, 1,
                 {{"self_attn.q_proj", 64, 64, true},
                  {"self_attn.k_proj", 64, 32, true},
                  {"self_attn.v_proj", 64, 32, true},
                  {"self_attn.o_proj", 64, 64, true},
                  {"mlp.experts.gate_up_proj", 64, 64, true, 4, true},
                  {"mlp.experts.down_proj", 32, 64, true, 4, true}});
}

}  // namespace
}  // namespace lcx
