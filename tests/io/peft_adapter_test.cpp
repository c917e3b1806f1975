// PEFT LoRA adapter folders (lcx/peft.h): the files as PEFT names them, every refusal by key
// and fix, and the merge W + scale * B @ A on a tiny random Qwen3, checked element by element.
#include "lcx/peft.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>

#include "lcx/safetensors.h"
#include "support/test_util.h"

namespace fs = std::filesystem;

namespace lcx {
namespace {

constexpr int64_t kHidden = 32, kInter = 64, kLayers = 2, kVocab = 256, kHeads = 4, kKv = 2, kHeadDim = 8;

std::string read(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<float> uniform(int64_t n, std::mt19937& rng, float scale = 1.f) {
  std::uniform_real_distribution<float> d(-scale, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

Tensor random_tensor(Shape s, std::mt19937& rng, float scale = 1.f, DType dtype = DType::f32) {
  return Tensor::from_floats(uniform(shape_numel(s), rng, scale), s, dtype);
}

// [out, in] of a projection of the tiny Qwen3.
Shape projection_shape(const std::string& m) {
  if (m == "q_proj") return {kHeads * kHeadDim, kHidden};
  if (m == "k_proj" || m == "v_proj") return {kKv * kHeadDim, kHidden};
  if (m == "o_proj") return {kHidden, kHeads * kHeadDim};
  if (m == "down_proj") return {kHidden, kInter};
  return {kInter, kHidden};  // gate_proj, up_proj
}

// A random Qwen3 Hugging Face folder as transformers saves one: config.json, tokenizer files and
// model.safetensors in `dtype`.
fs::path tiny_base(const std::string& tag, DType dtype, std::mt19937& rng) {
  const fs::path dir = test::temp_dir(tag);
  nlohmann::ordered_json c = {{"architectures", {"Qwen3ForCausalLM"}}, {"model_type", "qwen3"},
                              {"vocab_size", kVocab}, {"hidden_size", kHidden}, {"intermediate_size", kInter},
                              {"num_hidden_layers", kLayers}, {"num_attention_heads", kHeads},
                              {"num_key_value_heads", kKv}, {"head_dim", kHeadDim}, {"rms_norm_eps", 1e-6},
                              {"max_position_embeddings", 128}, {"tie_word_embeddings", false},
                              {"rope_theta", 1000000.0}, {"hidden_act", "silu"},
                              {"dtype", dtype == DType::bf16 ? "bfloat16" : "float32"}};
  test::write_file(dir / "config.json", c.dump(2));
  test::write_file(dir / "generation_config.json", R"({"eos_token_id": 151645})");
  test::write_file(dir / "tokenizer.json", R"({"model": {"type": "BPE"}})");
  test::write_file(dir / "tokenizer_config.json", R"({"chat_template": "x"})");
  std::vector<safetensors::NamedTensor> t;
  t.push_back({"model.embed_tokens.weight", random_tensor({kVocab, kHidden}, rng)});
  t.push_back({"model.norm.weight", random_tensor({kHidden}, rng)});
  t.push_back({"lm_head.weight", random_tensor({kVocab, kHidden}, rng)});
  for (int64_t l = 0; l < kLayers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    t.push_back({p + "input_layernorm.weight", random_tensor({kHidden}, rng)});
    t.push_back({p + "post_attention_layernorm.weight", random_tensor({kHidden}, rng)});
    t.push_back({p + "self_attn.q_norm.weight", random_tensor({kHeadDim}, rng)});
    t.push_back({p + "self_attn.k_norm.weight", random_tensor({kHeadDim}, rng)});
    for (const auto& m : peft::lora_modules())
      t.push_back({peft::base_weight_name(l, m), random_tensor(projection_shape(m), rng)});
  }
  safetensors::write_checkpoint(dir.string(), t, dtype);
  return dir;
}

peft::Adapter random_adapter(int64_t r, double alpha, bool rslora, const std::vector<std::string>& modules,
                             std::mt19937& rng) {
  peft::Adapter a;
  a.config.r = r;
  a.config.lora_alpha = alpha;
  a.config.lora_dropout = 0.05;
  a.config.use_rslora = rslora;
  a.config.target_modules = modules;
  a.config.all_linear = modules == peft::lora_modules();
  a.config.base_model_name_or_path = "Qwen/Qwen3-tiny";
  for (int64_t l = 0; l < kLayers; ++l)
    for (const auto& m : modules) {
      const Shape s = projection_shape(m);
      a.pairs.push_back({l, m, random_tensor({r, s[1]}, rng, 0.5f), random_tensor({s[0], r}, rng, 0.5f)});
    }
  return a;
}

// The minimal adapter_config.json a refusal test edits.
nlohmann::json base_config() {
  return {{"peft_type", "LORA"}, {"task_type", "CAUSAL_LM"}, {"r", 8}, {"lora_alpha", 16}, {"lora_dropout", 0.0},
          {"target_modules", {"q_proj", "v_proj"}}, {"bias", "none"}, {"use_rslora", false},
          {"modules_to_save", nullptr}};
}

test::Thrown config_refusal(const std::string& key, const nlohmann::json& value) {
  nlohmann::json j = base_config();
  j[key] = value;
  return test::thrown_by([&] { peft::parse_config(j.dump(), "adapter_config.json"); });
}

TEST(PeftAdapter, RoundTripKeepsPeftNamesAndValues) {
  std::mt19937 rng(1);
  const peft::Adapter a = random_adapter(4, 8, false, {"q_proj", "v_proj", "down_proj"}, rng);
  const fs::path dir = test::temp_dir("peft-rt");
  peft::write_adapter(dir.string(), a);

  const auto j = nlohmann::json::parse(read(dir / "adapter_config.json"));
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["task_type"], "CAUSAL_LM");
  EXPECT_EQ(j["r"], 4);
  EXPECT_TRUE(j["lora_alpha"].is_number_integer());
  EXPECT_EQ(j["lora_alpha"], 8);
  EXPECT_DOUBLE_EQ(j["lora_dropout"].get<double>(), 0.05);
  EXPECT_EQ(j["target_modules"], nlohmann::json({"q_proj", "v_proj", "down_proj"}));
  EXPECT_EQ(j["use_rslora"], false);
  EXPECT_EQ(j["bias"], "none");
  EXPECT_EQ(j["base_model_name_or_path"], "Qwen/Qwen3-tiny");
  EXPECT_TRUE(j["modules_to_save"].is_null());

  const auto st = safetensors::Checkpoint::open((dir / "adapter_model.safetensors").string());
  std::set<std::string> want;
  for (const char* l : {"0", "1"}) {
    for (const char* m : {"self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"})
      for (const char* w : {"lora_A", "lora_B"})
        want.insert(std::string("base_model.model.model.layers.") + l + "." + m + "." + w + ".weight");
  }
  const auto names = st.names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), want);
  EXPECT_EQ(st.info("base_model.model.model.layers.1.mlp.down_proj.lora_A.weight").shape, (Shape{4, kInter}));
  EXPECT_EQ(st.info("base_model.model.model.layers.1.mlp.down_proj.lora_B.weight").shape, (Shape{kHidden, 4}));
  EXPECT_EQ(st.info("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight").shape,
            (Shape{kKv * kHeadDim, 4}));

  const peft::Adapter b = peft::read_adapter(dir.string());
  EXPECT_EQ(b.config.r, 4);
  EXPECT_EQ(b.config.target_modules, a.config.target_modules);
  EXPECT_FALSE(b.config.modules_to_save.has_value());
  ASSERT_EQ(b.pairs.size(), a.pairs.size());
  for (size_t i = 0; i < a.pairs.size(); ++i) {
    EXPECT_EQ(b.pairs[i].layer, a.pairs[i].layer);
    EXPECT_EQ(b.pairs[i].module, a.pairs[i].module);
    EXPECT_EQ(b.pairs[i].a.to_floats(), a.pairs[i].a.to_floats());
    EXPECT_EQ(b.pairs[i].b.to_floats(), a.pairs[i].b.to_floats());
  }
}

TEST(PeftAdapter, AllLinearReadsAsTheSevenProjectionsAndWritesBackAsAString) {
  const auto c = peft::parse_config(R"({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": "all-linear"})",
                                    "adapter_config.json");
  EXPECT_TRUE(c.all_linear);
  EXPECT_EQ(c.target_modules, peft::lora_modules());
  EXPECT_EQ(nlohmann::json::parse(peft::config_json(c))["target_modules"], "all-linear");
  // PEFT writes target_modules from a set, in any order.
  const auto d = peft::parse_config(R"({"peft_type": "LORA", "r": 2, "target_modules": ["v_proj", "q_proj"]})", "x");
  EXPECT_EQ(d.target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
}

TEST(PeftAdapter, ScaleIsAlphaOverROrOverSqrtRWithRslora) {
  peft::AdapterConfig c;
  c.r = 16;
  c.lora_alpha = 32;
  EXPECT_DOUBLE_EQ(c.scale(), 2.0);
  c.use_rslora = true;
  EXPECT_DOUBLE_EQ(c.scale(), 8.0);
  const auto j = peft::parse_config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 6, "use_rslora": true,
                                        "target_modules": ["q_proj"]})", "x");
  EXPECT_DOUBLE_EQ(j.scale(), 3.0);
}

TEST(PeftAdapter, RefusesConfigsByKeyAndFix) {
  auto t = config_refusal("r", 0);
  EXPECT_EQ(t.key, "r");
  EXPECT_EQ(t.fix, "set r to the adapter's rank, e.g. 16");
  t = config_refusal("r", 2.5);
  EXPECT_EQ(t.key, "r");
  t = config_refusal("target_modules", {"q_proj", "lm_head"});
  EXPECT_EQ(t.key, "target_modules");
  EXPECT_EQ(t.fix, "keep only the layers' linear modules, e.g. q_proj v_proj (the head trains whole through modules_to_save)");
  EXPECT_NE(t.message.find("\"lm_head\""), std::string::npos) << t.message;
  // A string is a regex of module names, as PEFT reads it; one that is none is refused.
  t = config_refusal("target_modules", "model.layers.(0");
  EXPECT_EQ(t.key, "target_modules");
  EXPECT_EQ(t.fix, "list the layers' linear modules, e.g. q_proj v_proj, give \"all-linear\", or a regex of module names");
  t = config_refusal("target_modules", nlohmann::json::array());
  EXPECT_EQ(t.key, "target_modules");
  t = config_refusal("bias", "lora");
  EXPECT_EQ(t.key, "bias");
  EXPECT_EQ(t.fix, "train the adapter with one of PEFT's bias settings");
  EXPECT_FALSE(config_refusal("bias", "lora_only").thrown);
  EXPECT_FALSE(config_refusal("bias", "all").thrown);
  t = config_refusal("peft_type", "PREFIX_TUNING");
  EXPECT_EQ(t.key, "peft_type");
  EXPECT_EQ(t.fix, "give a LoRA adapter (peft_type \"LORA\")");
  t = config_refusal("task_type", "SEQ_CLS");
  EXPECT_EQ(t.key, "task_type");
  t = config_refusal("use_dora", true);
  EXPECT_EQ(t.key, "use_dora");
  t = config_refusal("rank_pattern", {{"q_proj", 4}});
  EXPECT_EQ(t.key, "rank_pattern");
  t = config_refusal("lora_dropout", 1.5);
  EXPECT_EQ(t.key, "lora_dropout");
  t = test::thrown_by([] { peft::parse_config("{", "adapter_config.json"); });
  EXPECT_EQ(t.key, "adapter_config.json");
  EXPECT_FALSE(config_refusal("lora_alpha", 7.5).thrown);
}

// An adapter folder written by hand, as a foreign tool might: `tensors` under their own names.
fs::path handwritten_adapter(const std::string& tag, const nlohmann::json& config,
                             const std::vector<safetensors::NamedTensor>& tensors) {
  const fs::path dir = test::temp_dir(tag);
  test::write_file(dir / "adapter_config.json", config.dump());
  safetensors::write_file((dir / "adapter_model.safetensors").string(), tensors, DType::f32);
  return dir;
}

TEST(PeftAdapter, ARegexStringMatchesWholeModuleNamesAndWritesBackAsItself) {
  nlohmann::json j = base_config();
  j["target_modules"] = R"(model\.layers\.0\.self_attn\.q_proj)";
  const auto c = peft::parse_config(j.dump(), "adapter_config.json");
  EXPECT_EQ(c.target_pattern, R"(model\.layers\.0\.self_attn\.q_proj)");
  EXPECT_TRUE(c.target_modules.empty());
  EXPECT_EQ(nlohmann::json::parse(peft::config_json(c))["target_modules"], c.target_pattern);
  // Layer 0's q_proj is read; layer 1's is a module the pattern does not match.
  std::mt19937 rng(4);
  auto pair = [&](int layer) -> std::vector<safetensors::NamedTensor> {
    const std::string stem = "base_model.model.model.layers." + std::to_string(layer) + ".self_attn.q_proj.lora_";
    return {{stem + "A.weight", random_tensor({8, kHidden}, rng)}, {stem + "B.weight", random_tensor({kHidden, 8}, rng)}};
  };
  EXPECT_EQ(peft::read_adapter(handwritten_adapter("peft-re0", j, pair(0)).string()).pairs.size(), 1u);
  EXPECT_EQ(test::thrown_by([&] { peft::read_adapter(handwritten_adapter("peft-re1", j, pair(1)).string()); }).key,
            "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight");
}

TEST(PeftAdapter, RefusesTensorsThatDisagreeWithTheConfig) {
  std::mt19937 rng(2);
  const std::string a0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
  const std::string b0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";
  // r = 8 in the config, A has 3 rows.
  auto dir = handwritten_adapter("peft-r", base_config(), {{a0, random_tensor({3, kHidden}, rng)},
                                                          {b0, random_tensor({kHidden, 8}, rng)}});
  auto t = test::thrown_by([&] { peft::read_adapter(dir.string()); });
  EXPECT_EQ(t.key, a0);
  EXPECT_EQ(t.fix, "give the adapter_config.json saved with these weights (its r)");
  dir = handwritten_adapter("peft-rb", base_config(), {{a0, random_tensor({8, kHidden}, rng)},
                                                      {b0, random_tensor({kHidden, 3}, rng)}});
  EXPECT_EQ(test::thrown_by([&] { peft::read_adapter(dir.string()); }).key, b0);
  // A module outside target_modules.
  const std::string up = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight";
  dir = handwritten_adapter("peft-tm", base_config(), {{up, random_tensor({8, kHidden}, rng)}});
  t = test::thrown_by([&] { peft::read_adapter(dir.string()); });
  EXPECT_EQ(t.key, up);
  EXPECT_EQ(t.fix, "give the adapter_config.json saved with these weights");
  // A target module's name under another path: no expert has a q_proj.
  const std::string eq = "base_model.model.model.layers.0.mlp.experts.1.q_proj.lora_A.weight";
  dir = handwritten_adapter("peft-eq", base_config(), {{eq, random_tensor({8, kHidden}, rng)}});
  EXPECT_EQ(test::thrown_by([&] { peft::read_adapter(dir.string()); }).key, eq);
  // An expert's projection (a sparse layer's, "mlp.experts.M.v_proj" is none) read with its expert.
  nlohmann::json experts = base_config();
  experts["target_modules"] = {"q_proj", "gate_proj"};
  const std::string ea = "base_model.model.model.layers.0.mlp.experts.12.gate_proj.lora_A.weight";
  const std::string eb = "base_model.model.model.layers.0.mlp.experts.12.gate_proj.lora_B.weight";
  dir = handwritten_adapter("peft-expert", experts, {{ea, random_tensor({8, kHidden}, rng)}, {eb, random_tensor({kHidden, 8}, rng)}});
  const peft::Adapter read = peft::read_adapter(dir.string());
  ASSERT_EQ(read.pairs.size(), 1u);
  EXPECT_EQ(read.pairs[0].module, "gate_proj");
  EXPECT_EQ(read.pairs[0].expert, 12);
  EXPECT_EQ(peft::lora_key(0, "gate_proj", 'A', 12), ea);
  EXPECT_EQ(peft::base_weight_name(0, "gate_proj", 12), "model.layers.0.mlp.experts.12.gate_proj.weight");
  // A key that is no LoRA key.
  dir = handwritten_adapter("peft-key", base_config(), {{"model.layers.0.self_attn.q_proj.weight",
                                                         random_tensor({kHidden, kHidden}, rng)}});
  EXPECT_EQ(test::thrown_by([&] { peft::read_adapter(dir.string()); }).key, "model.layers.0.self_attn.q_proj.weight");
  // An A without its B.
  dir = handwritten_adapter("peft-half", base_config(), {{a0, random_tensor({8, kHidden}, rng)}});
  EXPECT_EQ(test::thrown_by([&] { peft::read_adapter(dir.string()); }).key, b0);
  // No adapter_config.json.
  const fs::path empty = test::temp_dir("peft-none");
  t = test::thrown_by([&] { peft::read_adapter(empty.string()); });
  EXPECT_EQ(t.key, "--adapter");
}

TEST(PeftAdapter, RefusesAnAdapterThatDoesNotFitTheBase) {
  std::mt19937 rng(3);
  auto shapes = [](const std::string& name) -> std::optional<Shape> {
    for (int64_t l = 0; l < kLayers; ++l)
      for (const auto& m : peft::lora_modules())
        if (name == peft::base_weight_name(l, m)) return projection_shape(m);
    return std::nullopt;
  };
  peft::Adapter a = random_adapter(4, 8, false, {"q_proj", "k_proj"}, rng);
  EXPECT_FALSE(test::thrown_by([&] { peft::check_against_base(a, kLayers, shapes); }).thrown);
  // A layer the base does not have.
  peft::Adapter deep = a;
  deep.pairs.push_back({5, "q_proj", random_tensor({4, kHidden}, rng), random_tensor({kHidden, 4}, rng)});
  auto t = test::thrown_by([&] { peft::check_against_base(deep, kLayers, shapes); });
  EXPECT_EQ(t.key, "base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(t.fix, "merge the adapter into the base it was trained on");
  // A's in features against the base's.
  peft::Adapter wide = a;
  wide.pairs[1].a = random_tensor({4, kHidden + 1}, rng);
  t = test::thrown_by([&] { peft::check_against_base(wide, kLayers, shapes); });
  EXPECT_EQ(t.key, "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight");
  // B's out features against the base's (k_proj is [16, 32], not [32, 32]).
  peft::Adapter tall = a;
  tall.pairs[1].b = random_tensor({kHidden, 4}, rng);
  t = test::thrown_by([&] { peft::check_against_base(tall, kLayers, shapes); });
  EXPECT_EQ(t.key, "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight");
  EXPECT_EQ(t.fix, "merge the adapter into the base it was trained on");
}

// W + scale * B @ A in double, from the tensors the test wrote.
std::vector<double> expected_merge(const Tensor& w, const Tensor& a, const Tensor& b, double scale) {
  const auto W = w.to_floats(), A = a.to_floats(), B = b.to_floats();
  const int64_t out = w.shape()[0], in = w.shape()[1], r = a.shape()[0];
  std::vector<double> e(W.size());
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) {
      double s = 0;
      for (int64_t k = 0; k < r; ++k) s += static_cast<double>(B[o * r + k]) * A[k * in + i];
      e[o * in + i] = W[o * in + i] + scale * s;
    }
  return e;
}

void check_merged(const fs::path& base, const fs::path& out, const peft::Adapter& a, DType dtype) {
  const auto in = safetensors::Checkpoint::open(base.string()), got = safetensors::Checkpoint::open(out.string());
  EXPECT_EQ(got.names(), in.names());
  std::set<std::string> adapted;
  int64_t checked = 0;
  for (const auto& p : a.pairs) {
    const std::string name = peft::base_weight_name(p.layer, p.module);
    adapted.insert(name);
    EXPECT_EQ(got.info(name).dtype, in.info(name).dtype) << name;
    const auto want = expected_merge(in.load(name, DType::f32), p.a, p.b, a.config.scale());
    const auto have = got.load(name, DType::f32).to_floats();
    ASSERT_EQ(have.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      // fp32: summation order only; bf16: the one rounding of the stored value.
      const double tol = dtype == DType::f32 ? 1e-6 * (1 + std::abs(want[i])) : std::abs(want[i]) * (1.0 / 256) + 1e-6;
      ASSERT_NEAR(have[i], want[i], tol) << name << " element " << i;
      ++checked;
    }
  }
  EXPECT_GT(checked, 0);
  for (const auto& name : in.names())
    if (!adapted.count(name)) {
      EXPECT_EQ(got.info(name).dtype, in.info(name).dtype) << name;
      EXPECT_EQ(got.load(name, DType::f32).to_floats(), in.load(name, DType::f32).to_floats()) << name;
    }
  for (const char* f : {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"})
    EXPECT_EQ(read(out / f), read(base / f)) << f;
}

// Trained biases (bias "all" / "lora_only") are stored under PEFT's keys, the base model's
// state_dict names: an adapted module's under its base_layer, another's under its own name; read
// back by the base's names; a base without them is refused by the key.
TEST(PeftAdapter, TrainedBiasesKeepPeftsKeysAndNeedABaseWithThem) {
  std::mt19937 rng(9);
  peft::Adapter a = random_adapter(4, 8, false, {"q_proj"}, rng);
  a.config.bias = "all";
  a.biases = {{"model.layers.0.self_attn.q_proj.bias", random_tensor({kHeads * kHeadDim}, rng)},
              {"model.layers.1.self_attn.k_proj.bias", random_tensor({kKv * kHeadDim}, rng)}};
  const fs::path dir = test::temp_dir("peft-bias");
  peft::write_adapter(dir.string(), a);
  EXPECT_EQ(nlohmann::json::parse(read(dir / "adapter_config.json"))["bias"], "all");
  const auto st = safetensors::Checkpoint::open((dir / "adapter_model.safetensors").string());
  EXPECT_TRUE(st.has("base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias"));
  EXPECT_TRUE(st.has("base_model.model.model.layers.1.self_attn.k_proj.bias"));
  const peft::Adapter b = peft::read_adapter(dir.string());
  ASSERT_EQ(b.biases.size(), 2u);
  std::map<std::string, std::vector<float>> got;
  for (const auto& [name, t] : b.biases) got[name] = t.to_floats();
  for (const auto& [name, t] : a.biases) EXPECT_EQ(got.at(name), t.to_floats()) << name;
  const fs::path base = tiny_base("peft-bias-base", DType::f32, rng);
  const auto t = test::thrown_by([&] {
    peft::merge(base.string(), dir.string(), (test::temp_dir("peft-bias-out") / "m").string(), {.progress = false});
  });
  EXPECT_TRUE(t.key == "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias" ||
              t.key == "base_model.model.model.layers.1.self_attn.k_proj.bias")
      << t.key;
  EXPECT_EQ(t.fix, "merge the adapter into the base it was trained on");
}

TEST(PeftMerge, AddsScaledLowRankProductToEveryAdaptedMatrix) {
  std::mt19937 rng(4);
  const fs::path base = tiny_base("peft-base", DType::f32, rng);
  const peft::Adapter a = random_adapter(4, 8, false, peft::lora_modules(), rng);
  const fs::path adapter = test::temp_dir("peft-ad");
  peft::write_adapter(adapter.string(), a);
  const fs::path out = test::temp_dir("peft-out") / "merged";
  peft::merge(base.string(), adapter.string(), out.string(), {.overwrite = false, .progress = false, .threads = 3});
  check_merged(base, out, a, DType::f32);
}

TEST(PeftMerge, RsloraScalesByAlphaOverSqrtR) {
  std::mt19937 rng(5);
  const fs::path base = tiny_base("peft-base", DType::f32, rng);
  const peft::Adapter a = random_adapter(16, 8, true, {"q_proj", "up_proj"}, rng);
  ASSERT_DOUBLE_EQ(a.config.scale(), 2.0);
  const fs::path adapter = test::temp_dir("peft-ad");
  peft::write_adapter(adapter.string(), a);
  const fs::path out = test::temp_dir("peft-out") / "merged";
  peft::merge(base.string(), adapter.string(), out.string(), {.progress = false});
  check_merged(base, out, a, DType::f32);
}

TEST(PeftMerge, Bf16BaseStaysBf16) {
  std::mt19937 rng(6);
  const fs::path base = tiny_base("peft-base", DType::bf16, rng);
  const peft::Adapter a = random_adapter(8, 16, false, {"k_proj", "o_proj", "down_proj"}, rng);
  const fs::path adapter = test::temp_dir("peft-ad");
  peft::write_adapter(adapter.string(), a, DType::bf16);
  // The adapter as stored (bf16) is what the merge adds.
  const peft::Adapter stored = peft::read_adapter(adapter.string());
  const fs::path out = test::temp_dir("peft-out") / "merged";
  peft::merge(base.string(), adapter.string(), out.string(), {.progress = false});
  const auto got = safetensors::Checkpoint::open(out.string());
  for (const auto& name : got.names()) EXPECT_EQ(got.info(name).dtype, "BF16") << name;
  check_merged(base, out, stored, DType::bf16);
}

TEST(PeftMerge, RefusesANonEmptyOutUnlessOverwrite) {
  std::mt19937 rng(7);
  const fs::path base = tiny_base("peft-base", DType::f32, rng);
  const peft::Adapter a = random_adapter(2, 4, false, {"v_proj"}, rng);
  const fs::path adapter = test::temp_dir("peft-ad");
  peft::write_adapter(adapter.string(), a);
  const fs::path out = test::temp_dir("peft-out");
  test::write_file(out / "notes.txt", "keep");
  auto t = test::thrown_by([&] { peft::merge(base.string(), adapter.string(), out.string(), {.progress = false}); });
  EXPECT_EQ(t.key, "--out");
  EXPECT_EQ(t.fix, "give a new or empty folder, or pass --overwrite");
  t = test::thrown_by([&] { peft::merge(base.string(), adapter.string(), base.string(), {.overwrite = true, .progress = false}); });
  EXPECT_EQ(t.key, "--out");
  EXPECT_EQ(t.fix, "write the merged model to another folder");
  peft::merge(base.string(), adapter.string(), out.string(), {.overwrite = true, .progress = false});
  check_merged(base, out, a, DType::f32);
  // An adapter trained on a deeper model.
  peft::Adapter deep = a;
  deep.pairs.push_back({kLayers, "v_proj", random_tensor({2, kHidden}, rng), random_tensor({kKv * kHeadDim, 2}, rng)});
  const fs::path deep_dir = test::temp_dir("peft-deep");
  peft::write_adapter(deep_dir.string(), deep);
  t = test::thrown_by([&] { peft::merge(base.string(), deep_dir.string(), (out / "x").string(), {.progress = false}); });
  EXPECT_EQ(t.key, "base_model.model.model.layers.2.self_attn.v_proj.lora_A.weight");
  EXPECT_FALSE(fs::exists(out / "x"));
}

// An adapter trained on a shallower model of the same widths covers only some
// of the base's layers; a merge of those alone would be neither model. PEFT's
// layers_to_transform is the one way an adapter adapts fewer layers, and it is held to them.
TEST(PeftMerge, RefusesAnAdapterThatMissesLayersOfTheBase) {
  std::mt19937 rng(9);
  const fs::path base = tiny_base("peft-base", DType::f32, rng);
  peft::Adapter shallow = random_adapter(2, 4, false, {"q_proj", "v_proj"}, rng);
  std::erase_if(shallow.pairs, [](const peft::LoraPair& p) { return p.layer == kLayers - 1; });
  const fs::path adapter = test::temp_dir("peft-ad");
  peft::write_adapter(adapter.string(), shallow);
  const fs::path out = test::temp_dir("peft-out") / "merged";
  auto t = test::thrown_by([&] { peft::merge(base.string(), adapter.string(), out.string(), {.progress = false}); });
  ASSERT_TRUE(t.thrown);
  EXPECT_EQ(t.key, "--base");
  EXPECT_NE(t.message.find("q_proj has LoRA weights for layers 0, but the base's 2 layers"), std::string::npos) << t.message;
  EXPECT_NE(t.message.find("holding it are 0-1: nothing is merged"), std::string::npos) << t.message;
  EXPECT_FALSE(fs::exists(out));

  // layers_to_transform = [0]: layer 0's pairs are the adapter, and they merge.
  nlohmann::json config = nlohmann::json::parse(read(adapter / "adapter_config.json"));
  config["layers_to_transform"] = {0};
  test::write_file(adapter / "adapter_config.json", config.dump());
  peft::merge(base.string(), adapter.string(), out.string(), {.progress = false});
  check_merged(base, out, shallow, DType::f32);
  // ... and weights of a layer it does not name are refused, not merged.
  config["layers_to_transform"] = {1};
  test::write_file(adapter / "adapter_config.json", config.dump());
  t = test::thrown_by([&] { peft::merge(base.string(), adapter.string(), (out / "x").string(), {.progress = false}); });
  EXPECT_NE(t.message.find("has LoRA weights for layers 0, but layers_to_transform of"), std::string::npos) << t.message;
}

// NaN in an adapter is refused when it is read (merge, init_from), by tensor and
// element, never written into a merged model.
TEST(PeftAdapter, RefusesWeightsThatAreNotFinite) {
  std::mt19937 rng(10);
  const fs::path base = tiny_base("peft-base", DType::f32, rng);
  peft::Adapter a = random_adapter(2, 4, false, {"v_proj"}, rng);
  a.pairs[1].b.data_as<float>()[3] = std::nanf("");
  const fs::path adapter = test::temp_dir("peft-ad");
  peft::write_adapter(adapter.string(), a);
  auto t = test::thrown_by([&] { peft::read_adapter(adapter.string()); });
  ASSERT_TRUE(t.thrown);
  EXPECT_EQ(t.key, "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight");
  EXPECT_NE(t.message.find("element 3 is nan: the adapter's weights are not finite"), std::string::npos) << t.message;
  const fs::path out = test::temp_dir("peft-out") / "merged";
  t = test::thrown_by([&] { peft::merge(base.string(), adapter.string(), out.string(), {.progress = false}); });
  EXPECT_TRUE(t.thrown);
  EXPECT_FALSE(fs::exists(out));
}

// `lcx-train merge` as a process: the progress lines, the result, and a refusal's exit and fix.
TEST(PeftMergeCli, MergesAndReportsEachLayer) {
  std::mt19937 rng(8);
  const fs::path base = tiny_base("peft-base", DType::f32, rng);
  const peft::Adapter a = random_adapter(4, 8, false, {"q_proj", "gate_proj"}, rng);
  const fs::path adapter = test::temp_dir("peft-ad");
  peft::write_adapter(adapter.string(), a);
  const fs::path out = test::temp_dir("peft-out") / "merged";
  const std::string cmd = test::lcx_train() + " merge --base " + base.string() + " --adapter " + adapter.string();
  auto r = test::run_command(cmd + " --out " + out.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("merge: layer 0 (q_proj gate_proj) done"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("merge: layer 1 (q_proj gate_proj) done"), std::string::npos) << r.output;
  check_merged(base, out, a, DType::f32);
  r = test::run_command(cmd + " --out " + out.string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("fix: give a new or empty folder, or pass --overwrite"), std::string::npos) << r.output;
  r = test::run_command(cmd + " --out " + out.string() + " --overwrite");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  r = test::run_command(test::lcx_train() + " merge --base " + base.string() + " --out " + out.string());
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("merge needs --adapter"), std::string::npos) << r.output;
  r = test::run_command(test::lcx_train() + " --help");
  EXPECT_NE(r.output.find("lcx-train merge --base DIR --adapter DIR --out DIR"), std::string::npos);
}

}  // namespace
}  // namespace lcx
