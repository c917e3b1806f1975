// The qwen3 model module: config.json in both transformers layouts and its refusals, random init,
// HF folders written and read back (tied, untied, sharded, broken), and the whole backward of the
// step driver against finite differences.
#include <gtest/gtest.h>

#include "support/test_util.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "lcx/safetensors.h"
#include "models/model_util.h"
#include "qwen3_config.h"
#include "slots/resolve.h"

namespace lcx {
namespace {

using test::error_of;

namespace fs = std::filesystem;

const char* kTiny = R"({"vocab_size":96,"hidden_size":32,"intermediate_size":48,"num_hidden_layers":2,
  "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"rope_theta":10000.0,"tie_word_embeddings":false})";

std::map<std::string, std::vector<float>> weights_of(Model& m) {
  std::map<std::string, std::vector<float>> out;
  for (Parameter* p : m.parameters()) out[p->name] = p->value.to_floats();
  return out;
}

TEST(Qwen3Config, ReadsTransformersFourConfig) {
  auto dir = test::temp_dir("q3-v4");
  // The shape of Qwen3-4B's published config.json (transformers 4.51), shrunk; weights follow.
  nlohmann::json c = {{"architectures", {"Qwen3ForCausalLM"}}, {"model_type", "qwen3"}, {"vocab_size", 64},
                      {"hidden_size", 16}, {"intermediate_size", 24}, {"num_hidden_layers", 2},
                      {"num_attention_heads", 4}, {"num_key_value_heads", 1}, {"head_dim", 8},
                      {"max_position_embeddings", 262144}, {"rms_norm_eps", 1e-06}, {"rope_scaling", nullptr},
                      {"rope_theta", 5000000}, {"sliding_window", nullptr}, {"use_sliding_window", false},
                      {"max_window_layers", 36}, {"tie_word_embeddings", true}, {"torch_dtype", "bfloat16"},
                      {"attention_bias", false}, {"attention_dropout", 0.0}, {"hidden_act", "silu"}};
  test::write_file(dir / "config.json", c.dump());
  auto src = test::make_qwen3();
  src->init_random(c.dump(), 1, Device::cpu(), DType::f32);
  std::vector<safetensors::NamedTensor> ts;
  for (Parameter* p : src->parameters()) ts.push_back({p->name, p->value});
  safetensors::write_checkpoint(dir.string(), ts, DType::bf16);
  auto m = test::make_qwen3();
  m->load_hf(dir.string(), Device::cpu(), DType::f32);
  const ModelConfig& mc = m->config();
  EXPECT_EQ(mc.num_kv_heads, 1);
  EXPECT_EQ(mc.head_dim, 8);
  EXPECT_DOUBLE_EQ(mc.rope_theta, 5e6);
  EXPECT_EQ(mc.rope_parameters_json, "{}");
  EXPECT_TRUE(mc.tie_word_embeddings);
  EXPECT_EQ(mc.torch_dtype, "bfloat16");
  EXPECT_EQ(mc.layer_types, (std::vector<std::string>{"full_attention", "full_attention"}));
  EXPECT_EQ(mc.max_position_embeddings, 262144);
  // bf16 on disk, fp32 asked: every weight is the bf16 rounding of the source.
  auto a = weights_of(*src), b = weights_of(*m);
  for (auto& [name, v] : a)
    for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(b[name][i], bf16_to_float(float_to_bf16(v[i]))) << name;
}

TEST(Qwen3Config, ReadsTransformersFiveConfigWithSlidingLayers) {
  auto m = test::make_qwen3();
  m->init_random(R"({"num_hidden_layers":3,"use_sliding_window":true,"sliding_window":128,"max_window_layers":1,
     "rope_parameters":{"rope_type":"yarn","rope_theta":1000000.0,"factor":4.0,"original_max_position_embeddings":40960}})",
                 0, Device::cpu(), DType::f32);
  const ModelConfig& c = m->config();
  EXPECT_EQ(c.layer_types, (std::vector<std::string>{"full_attention", "sliding_attention", "sliding_attention"}));
  EXPECT_EQ(nlohmann::json::parse(c.rope_parameters_json)["factor"], 4.0);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  // Core's plain rope refuses the checkpoint's YaRN rather than train on other positions.
  const test::Thrown refused = test::thrown_by([&] { test::DefaultSlots plain(*m); });
  EXPECT_EQ(refused.key, "rope_parameters.rope_type");
  EXPECT_NE(refused.fix.find("--list-plugins"), std::string::npos) << refused.fix;
  EXPECT_NE(refused.message.find("rope_type 'yarn'"), std::string::npos) << refused.message;
  // With the installed plugins offered (as the resolver offers the loader's), the fix names the
  // one whose summary speaks of the checkpoint's rope type.
  const test::Thrown named = test::thrown_by([&] {
    test::DefaultSlots offered(*m, make_default_rope_offering([] {
      return std::vector<std::pair<std::string, std::string>>{{"other_rope", "plain rotary"},
                                                             {"rope_yarn", "YaRN rescaled rotary positions"}};
    }));
  });
  EXPECT_EQ(named.key, "rope_parameters.rope_type");
  EXPECT_EQ(named.fix.rfind("add \"rope_yarn\" to [plugins] load", 0), 0u) << named.fix;
  // Sliding layers are recorded, then refused when computed: the module runs full attention only.
  test::DefaultSlots s(*m, make_default_rope_in_place_of("rope_yarn"));
  Shard shard = test::shard_from_labels({1, 2, 3, 4}, {1, 2, 3, 4});
  const test::Thrown e = test::thrown_by([&] { train_step(s.slots, shard, 1.0, Device::cpu()); });
  EXPECT_EQ(e.key, "layer_types");
  EXPECT_NE(e.message.find("layer 1 is sliding_attention"), std::string::npos) << e.message;
}

TEST(Qwen3Config, RefusesOtherModelsAndVariants) {
  auto dir = test::temp_dir("q3-refuse");
  auto m = test::make_qwen3();
  test::write_file(dir / "config.json", R"({"model_type":"llama","vocab_size":8})");
  test::Thrown e = test::thrown_by([&] { m->load_hf(dir.string(), Device::cpu(), DType::f32); });
  EXPECT_EQ(e.key, "model_type");
  EXPECT_NE(e.message.find((dir / "config.json").string()), std::string::npos) << e.message;
  EXPECT_NE(e.message.find("model_type is 'llama'"), std::string::npos) << e.message;
  // Each config.json field this module does not compute is refused by its name.
  for (const char* field : {R"("attention_bias":true)", R"("hidden_act":"gelu")", R"("mlp_bias":true)",
                            R"("partial_rotary_factor":0.5)", R"("attention_dropout":0.1)"}) {
    const std::string name = std::string(field).substr(1, std::string(field).find('"', 1) - 1);
    e = test::thrown_by([&] { m->init_random(str("{", field, "}"), 0, Device::cpu(), DType::f32); });
    EXPECT_EQ(e.key, name) << e.message;
  }
  nlohmann::json quantized = nlohmann::json::parse(kTiny);
  quantized["model_type"] = "qwen3";
  quantized["quantization_config"] = {{"quant_method", "fp8"}};
  test::write_file(dir / "config.json", quantized.dump());
  e = test::thrown_by([&] { m->load_hf(dir.string(), Device::cpu(), DType::f32); });
  EXPECT_EQ(e.key, "quantization_config") << e.message;
  e = test::thrown_by(
      [&] { m->init_random(R"({"num_attention_heads":6,"num_key_value_heads":4})", 0, Device::cpu(), DType::f32); });
  EXPECT_EQ(e.key, "num_key_value_heads") << e.message;
  e = test::thrown_by([&] { m->init_random(R"({"hiden_size":8})", 0, Device::cpu(), DType::f32); });
  EXPECT_EQ(e.key, "model.init");
  EXPECT_NE(e.message.find("unknown key 'hiden_size'"), std::string::npos) << e.message;
  e = test::thrown_by([&] { m->init_random("qwen3-70b", 0, Device::cpu(), DType::f32); });
  EXPECT_EQ(e.key, "model.init");
  EXPECT_NE(e.fix.find("qwen3-0.6b"), std::string::npos) << e.fix;
}

TEST(Qwen3Config, ScaledRopeOfAnHfFolderIsNeverIgnored) {
  // transformers 4's rope_scaling in a checkpoint folder: plain rotary refuses it, naming the fix;
  // the same with the plugin --disable'd (an ablation) runs, plain.
  auto dir = test::temp_dir("q3-yarn");
  nlohmann::json c = nlohmann::json::parse(kTiny);
  c["model_type"] = "qwen3";
  c["rope_scaling"] = {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 64}};
  test::write_file(dir / "config.json", c.dump());
  auto src = test::make_qwen3();
  src->init_random(kTiny, 1, Device::cpu(), DType::f32);
  std::vector<safetensors::NamedTensor> ts;
  for (Parameter* p : src->parameters()) ts.push_back({p->name, p->value});
  safetensors::write_checkpoint(dir.string(), ts, DType::f32);
  auto m = test::make_qwen3();
  m->load_hf(dir.string(), Device::cpu(), DType::f32);
  test::Thrown e = test::thrown_by([&] { test::DefaultSlots plain(*m); });
  EXPECT_EQ(e.key, "rope_parameters.rope_type");
  EXPECT_NE(e.message.find("rope_type 'yarn'"), std::string::npos) << e.message;
  EXPECT_FALSE(test::thrown_by([&] { test::DefaultSlots ablation(*m, make_default_rope_in_place_of("rope_yarn")); }).thrown);
  // Other scaling types have no provider at all: refused by name either way.
  c["rope_scaling"] = {{"type", "longrope"}, {"factor", 2.0}};
  test::write_file(dir / "config.json", c.dump());
  m->load_hf(dir.string(), Device::cpu(), DType::f32);
  e = test::thrown_by([&] { test::DefaultSlots plain(*m); });
  EXPECT_EQ(e.key, "rope_parameters.rope_type");
  EXPECT_NE(e.message.find("rope_type 'longrope'"), std::string::npos) << e.message;
  e = test::thrown_by([&] { test::DefaultSlots yarn(*m, test::make_plugin<PositionalEncoding>("rope_yarn")); });
  EXPECT_NE(e.message.find("rope_type 'longrope'"), std::string::npos) << e.message;
  // linear, dynamic and llama3 are core's own (families_test.cpp holds them against transformers).
  c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  test::write_file(dir / "config.json", c.dump());
  m->load_hf(dir.string(), Device::cpu(), DType::f32);
  EXPECT_FALSE(test::thrown_by([&] { test::DefaultSlots plain(*m); }).thrown);
}

TEST(Qwen3Config, PresetsHaveThePublishedShapes) {
  struct Want {
    const char* name;
    int64_t hidden, inter, layers, heads, kv;
    bool tied;
  };
  for (const Want& w : {Want{"qwen3-0.6b", 1024, 3072, 28, 16, 8, true}, Want{"qwen3-1.7b", 2048, 6144, 28, 16, 8, true},
                        Want{"qwen3-4b", 2560, 9728, 36, 32, 8, true}, Want{"qwen3-8b", 4096, 12288, 36, 32, 8, false}}) {
    ModelConfig c = qwen3::config_from_spec(w.name);
    EXPECT_EQ(c.vocab_size, 151936) << w.name;
    EXPECT_EQ(c.hidden_size, w.hidden) << w.name;
    EXPECT_EQ(c.intermediate_size, w.inter) << w.name;
    EXPECT_EQ(c.num_layers, w.layers) << w.name;
    EXPECT_EQ(c.num_heads, w.heads) << w.name;
    EXPECT_EQ(c.num_kv_heads, w.kv) << w.name;
    EXPECT_EQ(c.head_dim, 128) << w.name;
    EXPECT_EQ(c.tie_word_embeddings, w.tied) << w.name;
    EXPECT_DOUBLE_EQ(c.rope_theta, 1e6) << w.name;
    EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6) << w.name;
    EXPECT_EQ(c.max_position_embeddings, 40960) << w.name;
    EXPECT_EQ(c.layer_types.size(), static_cast<size_t>(w.layers)) << w.name;
  }
  // A preset with overrides, as a JSON spec; the layer types follow the new layer count.
  ModelConfig c = qwen3::config_from_spec(R"({"preset":"qwen3-4b","num_hidden_layers":4})");
  EXPECT_EQ(c.hidden_size, 2560);
  EXPECT_EQ(c.layer_types.size(), 4u);
  double std = 0;
  qwen3::config_from_spec(R"({"initializer_range":0.5})", &std);
  EXPECT_EQ(std, 0.5);
}

TEST(Qwen3Init, TransformersInitializerOnAPresetLayer) {
  auto m = test::make_qwen3();
  // One layer of the 0.6B shape with a short vocabulary: real layer shapes, small enough here.
  m->init_random(R"({"preset":"qwen3-0.6b","num_hidden_layers":1,"vocab_size":1000})", 7, Device::cpu(), DType::bf16);
  std::map<std::string, Shape> shapes;
  for (Parameter* p : m->parameters()) shapes[p->name] = p->value.shape();
  EXPECT_EQ(shapes.size(), 1u + 11u + 1u);  // embed, one layer, final norm; tied: no lm_head
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.q_proj.weight"), (Shape{2048, 1024}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.k_proj.weight"), (Shape{1024, 1024}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.o_proj.weight"), (Shape{1024, 2048}));
  EXPECT_EQ(shapes.at("model.layers.0.mlp.down_proj.weight"), (Shape{1024, 3072}));
  EXPECT_EQ(shapes.at("model.layers.0.self_attn.q_norm.weight"), (Shape{128}));
  EXPECT_EQ(m->head_weight().data(), m->parameters()[0]->value.data());  // tied head is the embedding
  EXPECT_EQ(m->head_grad().data(), m->parameters()[0]->grad.data());
  EXPECT_EQ(m->parameters()[2]->value.dtype(), DType::bf16);
  EXPECT_EQ(m->parameters()[2]->grad.dtype(), DType::f32);
  // N(0, 0.02) weights, norms 1, no decay on norms.
  std::vector<float> q = m->parameters()[2]->value.to_floats();
  double s = 0, ss = 0;
  for (float v : q) s += v, ss += static_cast<double>(v) * v;
  const double mean = s / static_cast<double>(q.size()), sd = std::sqrt(ss / static_cast<double>(q.size()) - mean * mean);
  EXPECT_NEAR(mean, 0, 1e-4);
  EXPECT_NEAR(sd, 0.02, 2e-4);
  for (float v : m->parameters()[1]->value.to_floats()) ASSERT_EQ(v, 1.f);
  EXPECT_FALSE(m->parameters()[1]->decay);
  EXPECT_TRUE(m->parameters()[2]->decay);
}

TEST(Qwen3Module, TableKeysAreChecked) {
  EXPECT_EQ(test::thrown_by([] { test::make_qwen3(R"(max_shard_size = "lots")"); }).key, "qwen3.max_shard_size");
  const test::Thrown negative = test::thrown_by([] { test::make_qwen3(R"(max_shard_size = "-1GB")"); });
  EXPECT_EQ(negative.key, "qwen3.max_shard_size");
  EXPECT_NE(negative.message.find("not a positive size"), std::string::npos) << negative.message;
  EXPECT_EQ(test::thrown_by([] { test::make_qwen3("check_finit = true"); }).key, "qwen3.check_finit");
  EXPECT_FALSE(test::thrown_by([] { test::make_qwen3(R"(max_shard_size = "500MB")"); }).thrown);
}

TEST(Qwen3Init, DeterministicBySeed) {
  auto a = test::make_qwen3(), b = test::make_qwen3(), c = test::make_qwen3();
  a->init_random(kTiny, 42, Device::cpu(), DType::f32);
  b->init_random(kTiny, 42, Device::cpu(), DType::f32);
  c->init_random(kTiny, 43, Device::cpu(), DType::f32);
  EXPECT_EQ(weights_of(*a), weights_of(*b));
  EXPECT_NE(weights_of(*a)["lm_head.weight"], weights_of(*c)["lm_head.weight"]);
  // Two parameters of one shape get different values (the name is part of the stream).
  EXPECT_NE(weights_of(*a)["model.layers.0.mlp.gate_proj.weight"], weights_of(*a)["model.layers.0.mlp.up_proj.weight"]);
}

TEST(Qwen3Io, SaveThenLoadIsExactAndWritesATransformersConfig) {
  for (bool tied : {false, true}) {
    auto dir = test::temp_dir("q3-save");
    auto a = test::make_qwen3();
    nlohmann::json spec = nlohmann::json::parse(kTiny);
    spec["tie_word_embeddings"] = tied;
    a->init_random(spec.dump(), 3, Device::cpu(), DType::f32);
    a->save_hf(dir.string(), DType::f32, R"({"rope_type":"default","rope_theta":10000.0})");
    nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir / "config.json"));
    EXPECT_EQ(cfg["model_type"], "qwen3");
    EXPECT_EQ(cfg["architectures"][0], "Qwen3ForCausalLM");
    EXPECT_EQ(cfg["rope_parameters"]["rope_theta"], 10000.0);
    EXPECT_EQ(cfg["rope_theta"], 10000.0);
    EXPECT_EQ(cfg["tie_word_embeddings"], tied);
    EXPECT_EQ(cfg["dtype"], "float32");
    EXPECT_EQ(cfg["layer_types"].size(), 2u);
    EXPECT_EQ(safetensors::Checkpoint::open(dir.string()).has("lm_head.weight"), !tied);
    auto b = test::make_qwen3();
    b->load_hf(dir.string(), Device::cpu(), DType::f32);
    EXPECT_EQ(weights_of(*a), weights_of(*b));
    EXPECT_EQ(b->config().tie_word_embeddings, tied);
  }
}

TEST(Qwen3Io, TiedCheckpointWithRedundantHeadAndShardedFolders) {
  auto dir = test::temp_dir("q3-tied");
  auto a = test::make_qwen3();
  // 1024 x 256 fp32 embedding is 1 MiB: with max_shard_size = "1MiB" the folder is sharded.
  a->init_random(R"({"vocab_size":1024,"hidden_size":256,"intermediate_size":64,"num_hidden_layers":1,
     "num_attention_heads":2,"num_key_value_heads":1,"head_dim":32})",
                 5, Device::cpu(), DType::f32);
  auto sharder = test::make_qwen3("max_shard_size = \"1MiB\"");
  sharder->init_random(R"({"vocab_size":1024,"hidden_size":256,"intermediate_size":64,"num_hidden_layers":1,
     "num_attention_heads":2,"num_key_value_heads":1,"head_dim":32})",
                       5, Device::cpu(), DType::f32);
  sharder->save_hf(dir.string(), DType::f32, "{}");
  EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(dir / "model-00002-of-00002.safetensors"));
  auto b = test::make_qwen3();
  b->load_hf(dir.string(), Device::cpu(), DType::f32);
  EXPECT_EQ(weights_of(*a), weights_of(*b));
  // transformers 4 also stored the tied head: accepted and ignored.
  auto dir2 = test::temp_dir("q3-tied-head");
  a->save_hf(dir2.string(), DType::bf16, "{}");
  safetensors::Checkpoint ck = safetensors::Checkpoint::open(dir2.string());
  std::vector<safetensors::NamedTensor> ts;
  for (const auto& n : ck.names()) ts.push_back({n, ck.load(n, DType::bf16)});
  ts.push_back({"lm_head.weight", ck.load("model.embed_tokens.weight", DType::bf16)});
  safetensors::write_checkpoint(dir2.string(), ts, DType::bf16);
  auto c = test::make_qwen3();
  c->load_hf(dir2.string(), Device::cpu(), DType::bf16);
  EXPECT_EQ(c->parameters().size(), a->parameters().size());
}

TEST(Qwen3Io, BrokenCheckpointsNameFileAndTensor) {
  auto dir = test::temp_dir("q3-broken");
  auto a = test::make_qwen3();
  a->init_random(kTiny, 9, Device::cpu(), DType::f32);
  a->save_hf(dir.string(), DType::f32, "{}");
  const std::string file = (dir / "model.safetensors").string();
  safetensors::Checkpoint ck = safetensors::Checkpoint::open(dir.string());
  std::vector<safetensors::NamedTensor> all;
  for (const auto& n : ck.names()) all.push_back({n, ck.load(n, DType::f32)});
  auto rewrite = [&](std::vector<safetensors::NamedTensor> ts) { safetensors::write_checkpoint(dir.string(), ts, DType::f32); };
  auto load_error = [&](const std::string& table = "") {
    return error_of([&] { test::make_qwen3(table)->load_hf(dir.string(), Device::cpu(), DType::f32); });
  };

  auto missing = all;
  std::erase_if(missing, [](const auto& t) { return t.name == "model.layers.1.self_attn.k_norm.weight"; });
  rewrite(missing);
  std::string e = load_error();
  EXPECT_NE(e.find("tensor 'model.layers.1.self_attn.k_norm.weight' is missing"), std::string::npos) << e;

  auto extra = all;
  extra.push_back({"model.layers.2.mlp.up_proj.weight", Tensor::zeros({4}, DType::f32)});
  rewrite(extra);
  e = load_error();
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("'model.layers.2.mlp.up_proj.weight' is unexpected"), std::string::npos) << e;

  auto reshaped = all;
  for (auto& t : reshaped)
    if (t.name == "model.norm.weight") t.value = Tensor::zeros({16}, DType::f32);
  rewrite(reshaped);
  e = load_error();
  EXPECT_NE(e.find("'model.norm.weight' has shape [16]"), std::string::npos) << e;

  auto nan = all;
  for (auto& t : nan)
    if (t.name == "model.layers.0.mlp.down_proj.weight") t.value.data_as<float>()[3] = NAN;
  rewrite(nan);
  e = load_error();
  EXPECT_NE(e.find("tensor 'model.layers.0.mlp.down_proj.weight': element 3"), std::string::npos) << e;
  EXPECT_EQ(load_error("check_finite = false"), "(no error)");

  // Truncated on disk: refused before anything is read.
  rewrite(all);
  fs::resize_file(file, fs::file_size(file) - 10);
  e = load_error();
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("run past the data section"), std::string::npos) << e;
}

// The whole backward (step driver, every layer op, loss, tied head) against central differences
// of the loss along random directions of all parameters at once, and of single elements.
TEST(Qwen3Step, GradientsMatchFiniteDifferences) {
  for (bool tied : {false, true}) {
    auto m = test::make_qwen3();
    nlohmann::json spec = nlohmann::json::parse(kTiny);
    spec["tie_word_embeddings"] = tied;
    spec["initializer_range"] = 0.3;  // large weights so every path carries signal
    m->init_random(spec.dump(), 11, Device::cpu(), DType::f32);
    test::DefaultSlots s(*m);
    std::vector<int64_t> ids, labels;
    std::mt19937 rng(5);
    for (int t = 0; t < 12; ++t) ids.push_back(static_cast<int64_t>(rng() % 96));
    labels = ids;
    labels[4] = -100;
    Shard shard = test::shard_from_labels(ids, labels);
    const int64_t valid = test::count_valid(shard);
    EXPECT_EQ(valid, 10);
    StepResult r = test::mean_loss_step(s, shard, valid);
    EXPECT_GT(r.loss_sum, 0);
    auto loss = [&] {
      EvalResult e = eval_step(s.slots, shard, Device::cpu());
      return e.loss_sum / static_cast<double>(e.valid);
    };
    EXPECT_NEAR(loss(), r.loss_sum / static_cast<double>(valid), 1e-6);
    std::vector<Parameter*> ps = m->parameters();
    for (int dir = 0; dir < 3; ++dir) {
      std::vector<std::vector<float>> u(ps.size());
      double analytic = 0;
      for (size_t i = 0; i < ps.size(); ++i) {
        std::vector<float> g = ps[i]->grad.to_floats();
        u[i].resize(g.size());
        std::normal_distribution<float> nd;
        for (size_t j = 0; j < g.size(); ++j) analytic += static_cast<double>(g[j]) * (u[i][j] = nd(rng));
      }
      // Each point is set from the saved weights, not shifted back and forth: float shifts do not
      // undo exactly, and the drift they leave moves later differences by as much as the tolerance.
      std::vector<std::vector<float>> saved(ps.size());
      for (size_t i = 0; i < ps.size(); ++i) saved[i] = ps[i]->value.to_floats();
      auto set_at = [&](float eps) {
        for (size_t i = 0; i < ps.size(); ++i) {
          float* v = ps[i]->value.data_as<float>();
          for (size_t j = 0; j < u[i].size(); ++j) v[j] = saved[i][j] + eps * u[i][j];
        }
      };
      auto central = [&](float h) {
        set_at(h);
        const double up = loss();
        set_at(-h);
        const double down = loss();
        set_at(0);
        return (up - down) / (2 * h);
      };
      // Richardson's extrapolation of two steps: the h^2 error term cancels, which along a direction
      // through every weight of size 0.3 is as large as the tolerance for some seeds.
      // The absolute part is the fp32 loss's rounding over 2h (about 1e-6 of a loss near 5, over 1e-3).
      const double numeric = (4 * central(5e-4f) - central(1e-3f)) / 3;
      EXPECT_NEAR(numeric, analytic, 2e-3 * std::abs(analytic) + 1e-3) << "direction " << dir << " tied " << tied;
    }
    // A few single elements, one from each kind of parameter.
    for (const char* name : {"model.embed_tokens.weight", "model.layers.0.self_attn.q_norm.weight",
                             "model.layers.1.self_attn.k_proj.weight", "model.layers.0.input_layernorm.weight",
                             "model.norm.weight"}) {
      Parameter* p = *std::find_if(ps.begin(), ps.end(), [&](Parameter* q) { return q->name == name; });
      const int64_t idx = p->value.numel() / 3;
      const float g = p->grad.to_floats()[static_cast<size_t>(idx)];
      float* v = p->value.data_as<float>() + idx;
      const float h = 1e-2f;
      *v += h;
      const double up = loss();
      *v -= 2 * h;
      const double down = loss();
      *v += h;
      EXPECT_NEAR((up - down) / (2 * h), g, 5e-3 * std::abs(g) + 2e-5) << name << " tied " << tied;
    }
  }
}

// A strategy that keeps copies (as an offload would) and records the step's calls.
class RecordingMemory final : public MemoryStrategy {
 public:
  std::vector<std::string> calls;
  void begin_step(int n) override {
    calls.push_back(str("begin ", n));
    saved_.assign(static_cast<size_t>(n), Tensor());
    kept_.assign(static_cast<size_t>(n), {});
  }
  void save(int l, const Tensor& x) override {
    calls.push_back(str("save ", l));
    saved_[static_cast<size_t>(l)] = x.clone();
  }
  Tensor fetch(int l) override {
    calls.push_back(str("fetch ", l));
    return saved_[static_cast<size_t>(l)];
  }
  void keep(int l, const Tensor& t) override {
    calls.push_back(str("keep ", l));
    kept_[static_cast<size_t>(l)].push_back(t.clone());
  }
  std::vector<Tensor> kept(int l) override {
    calls.push_back(str("kept ", l));
    return kept_[static_cast<size_t>(l)];
  }
  void prefetch(int l) override { calls.push_back(str("prefetch ", l)); }
  void release(int l) override {
    calls.push_back(str("release ", l));
    saved_[static_cast<size_t>(l)] = Tensor();
    kept_[static_cast<size_t>(l)].clear();
  }
  void end_step() override { calls.push_back("end"); }

 private:
  std::vector<Tensor> saved_;
  std::vector<std::vector<Tensor>> kept_;
};

TEST(Qwen3Step, MemoryStrategyIsCalledInStepOrder) {
  auto m = test::make_qwen3();
  m->init_random(kTiny, 8, Device::cpu(), DType::f32);
  test::DefaultSlots s(*m);
  Shard shard = test::shard_from_labels({3, 1, 4, 1, 5, 9, 2, 6}, {3, 1, 4, 1, 5, 9, 2, 6});
  test::mean_loss_step(s, shard, 7);
  std::vector<std::vector<float>> want;
  for (Parameter* p : m->parameters()) want.push_back(p->grad.to_floats());
  RecordingMemory rec;
  StepSlots slots{*m, *s.loss, *s.rope, rec, *s.parallel};
  m->zero_grad();
  train_step(slots, shard, 1.0 / 7, Device::cpu());
  EXPECT_EQ(rec.calls, (std::vector<std::string>{"begin 2", "save 0", "save 1", "fetch 1", "prefetch 0", "release 1",
                                                 "fetch 0", "release 0", "end"}));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(m->parameters()[i]->grad.to_floats(), want[i]);
}

// Selective recompute: with the attention outputs and LSE kept from the forward (through the
// memory strategy, as copies, the way offload holds them), the backward runs no attention forward,
// and since only what is recomputed changes, every gradient equals the recomputing step's bit for
// bit, with one head group and with one per kv head, in fp32 and bf16.
TEST(Qwen3Step, AttentionKeptFromTheForwardEqualsRecompute) {
  for (DType dt : {DType::f32, DType::bf16})
    for (int64_t groups : {1, 2}) {
      SCOPED_TRACE(str(dtype_name(dt), " groups ", groups));
      auto m = test::make_qwen3();
      m->init_random(kTiny, 8, Device::cpu(), dt);
      test::DefaultSlots s(*m);
      s.slots.recipe.set("qwen3", "attention_head_groups", groups);
      Shard shard = test::shard_from_labels({3, 1, 4, 1, 5, 9, 2, 6, 5, 3}, {3, 1, 4, 1, 5, 9, 2, 6, 5, 3});
      const StepResult base = test::mean_loss_step(s, shard, 9);
      std::vector<std::vector<float>> want;
      for (Parameter* p : m->parameters()) want.push_back(p->grad.to_floats());
      RecordingMemory rec;
      StepSlots slots{*m, *s.loss, *s.rope, rec, *s.parallel};
      slots.recipe = test::recipe_of({{"qwen3.keep_attention", 1}, {"qwen3.attention_head_groups", groups}});
      m->zero_grad();
      const StepResult kept = train_step(slots, shard, 1.0 / 9, Device::cpu());
      EXPECT_EQ(kept.loss_sum, base.loss_sum);
      // Each layer hands over every group's output and LSE in its forward and asks for them in its backward.
      EXPECT_EQ(std::count(rec.calls.begin(), rec.calls.end(), "keep 1"), 2 * groups);
      EXPECT_EQ(std::count(rec.calls.begin(), rec.calls.end(), "kept 1"), 1);
      for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(m->parameters()[i]->grad.to_floats(), want[i]) << m->parameters()[i]->name;
    }
}

// Deeper recompute (train.checkpoint_every = k): the step saves layers 0, k, 2k, ... and rebuilds
// the inputs in between from the nearest saved one; the rebuild is the forward's own arithmetic, so
// every gradient equals the step that saves each layer, bit for bit (fp32 and bf16), for k dividing
// the 7 layers or not, and past them. A recipe that keeps the attention keeps nothing with k > 1.
// train.rebuild_each rebuilds each input from the saved one again (its own chain of forwards): the
// same arithmetic, so the same bits, and the same calls to the memory strategy.
TEST(Qwen3Step, CheckpointEveryKLayersGivesTheSameGradients) {
  nlohmann::json spec = nlohmann::json::parse(kTiny);
  spec["num_hidden_layers"] = 7;
  for (DType dt : {DType::f32, DType::bf16}) {
    auto m = test::make_qwen3();
    m->init_random(spec.dump(), 9, Device::cpu(), dt);
    test::DefaultSlots s(*m);
    Shard shard = test::shard_from_labels({3, 1, 4, 1, 5, 9, 2, 6, 5, 3}, {3, 1, 4, 1, 5, 9, 2, 6, 5, 3});
    const StepResult base = test::mean_loss_step(s, shard, 9);
    std::vector<std::vector<float>> want;
    for (Parameter* p : m->parameters()) want.push_back(p->grad.to_floats());
    for (int64_t k : {2, 3, 4, 7, 9})
    for (int64_t each : {0, 1}) {
      SCOPED_TRACE(str(dtype_name(dt), " every ", k, each ? ", rebuild_each" : ""));
      RecordingMemory rec;
      StepSlots slots{*m, *s.loss, *s.rope, rec, *s.parallel};
      slots.recipe = test::recipe_of({{"qwen3.keep_attention", 1}, {"train.checkpoint_every", k}, {"train.rebuild_each", each}});
      m->zero_grad();
      const StepResult got = train_step(slots, shard, 1.0 / 9, Device::cpu());
      EXPECT_EQ(got.loss_sum, base.loss_sum);
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_EQ(m->parameters()[i]->grad.to_floats(), want[i]) << m->parameters()[i]->name;
      std::vector<std::string> calls{"begin 7"};
      for (int l = 0; l < 7; l += static_cast<int>(k)) calls.push_back(str("save ", l));
      for (int l = (6 / static_cast<int>(k)) * static_cast<int>(k); l >= 0; l -= static_cast<int>(k)) {
        calls.push_back(str("fetch ", l));
        if (l > 0) calls.push_back(str("prefetch ", l - k));
        calls.push_back(str("release ", l));
      }
      calls.push_back("end");
      EXPECT_EQ(rec.calls, calls);
    }
  }
}

// Gradients in the weights' dtype (train.grad_dtype): the GEMM weights' bf16 grads are the fp32
// grads rounded once, as GEMMs accumulate in fp32 and round on the way out.
TEST(Qwen3Step, Bf16GemmGradientsAreTheFp32OnesRounded) {
  auto m = test::make_qwen3();
  m->init_random(kTiny, 8, Device::cpu(), DType::bf16);
  test::DefaultSlots s(*m);
  Shard shard = test::shard_from_labels({3, 1, 4, 1, 5, 9, 2, 6}, {3, 1, 4, 1, 5, 9, 2, 6});
  test::mean_loss_step(s, shard, 7);
  std::vector<std::vector<float>> want;
  for (Parameter* p : m->parameters()) want.push_back(p->grad.to_floats());
  int gemm = 0;
  for (Parameter* p : m->parameters())
    if (p->gemm_grad) {
      p->grad = Tensor::zeros(p->value.shape(), DType::bf16, Device::cpu(), MemoryCategory::gradients);
      ++gemm;
    }
  EXPECT_EQ(gemm, 2 * 7);  // q, k, v, o, gate, up, down of both layers
  test::mean_loss_step(s, shard, 7);
  for (size_t i = 0; i < want.size(); ++i) {
    Parameter* p = m->parameters()[i];
    const std::vector<float> got = p->grad.to_floats();
    ASSERT_EQ(got.size(), want[i].size());
    for (size_t j = 0; j < got.size(); ++j)
      ASSERT_EQ(got[j], p->gemm_grad ? bf16_to_float(float_to_bf16(want[i][j])) : want[i][j]) << p->name << " " << j;
  }
}

// bf16 weights and activations (the GPU default) track the fp32 computation of the same model.
TEST(Qwen3Step, Bf16StepTracksFp32) {
  auto f = test::make_qwen3(), b = test::make_qwen3();
  f->init_random(kTiny, 21, Device::cpu(), DType::f32);
  b->init_random(kTiny, 21, Device::cpu(), DType::bf16);
  test::DefaultSlots sf(*f), sb(*b);
  std::vector<int64_t> ids;
  for (int t = 0; t < 16; ++t) ids.push_back((t * 37 + 5) % 96);
  Shard shard = test::shard_from_labels(ids, ids);
  StepResult rf = test::mean_loss_step(sf, shard, 15), rb = test::mean_loss_step(sb, shard, 15);
  EXPECT_EQ(b->parameters()[1]->value.dtype(), DType::bf16);
  EXPECT_NEAR(rb.loss_sum, rf.loss_sum, 1e-2 * rf.loss_sum);
  auto pf = f->parameters(), pb = b->parameters();
  for (size_t i = 0; i < pf.size(); ++i) {
    std::vector<float> gf = pf[i]->grad.to_floats(), gb = pb[i]->grad.to_floats();
    double dot = 0, nf = 0, nb = 0;
    for (size_t j = 0; j < gf.size(); ++j) dot += double(gf[j]) * gb[j], nf += double(gf[j]) * gf[j], nb += double(gb[j]) * gb[j];
    EXPECT_GT(dot / std::sqrt(nf * nb + 1e-300), 0.98) << pf[i]->name;
  }
}

TEST(Qwen3Step, EvaluationPerPositionAndAccumulation) {
  auto m = test::make_qwen3();
  m->init_random(kTiny, 2, Device::cpu(), DType::f32);
  test::DefaultSlots s(*m);
  Shard shard = test::shard_from_labels({5, 9, 1, 77, 3, 3, 40}, {5, 9, -100, 77, 3, 3, 40});
  EvalResult e = eval_step(s.slots, shard, Device::cpu(), true);
  EXPECT_EQ(e.valid, 5);
  ASSERT_EQ(e.per_position.size(), 7u);
  EXPECT_EQ(e.per_position[1], 0.f);  // its target (labels[2]) is ignored
  EXPECT_EQ(e.per_position[6], 0.f);  // the last position predicts nothing
  double sum = 0;
  for (float v : e.per_position) sum += v;
  EXPECT_NEAR(sum, e.loss_sum, 1e-5 * e.loss_sum);
  // Two steps without zero_grad accumulate exactly twice the gradient.
  m->zero_grad();
  StepResult r1 = train_step(s.slots, shard, 1.0, Device::cpu());
  std::vector<float> g1 = m->parameters()[3]->grad.to_floats();
  train_step(s.slots, shard, 1.0, Device::cpu());
  std::vector<float> g2 = m->parameters()[3]->grad.to_floats();
  for (size_t i = 0; i < g1.size(); ++i) ASSERT_NEAR(g2[i], 2 * g1[i], 1e-6f + 1e-5f * std::abs(g1[i]));
  EXPECT_NEAR(r1.loss_sum, e.loss_sum, 1e-6 * e.loss_sum);
  EXPECT_GE(r1.forward_s, 0);
  EXPECT_GT(r1.backward_s, 0);
}

}  // namespace
}  // namespace lcx
