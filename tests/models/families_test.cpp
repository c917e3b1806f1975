// The dense families on models/common (llama, mistral, qwen2) against transformers. Each folder of
// fixtures/families written by gen_family_fixtures.py is a real HF checkpoint plus what the
// family's ForCausalLM computed in fp32 for fixed tokens: lcx loads the folder with the module its
// model_type names, runs a train step in fp32 on the CPU with core's default slots, and must give
// the loss within 1e-6 relative, the logits slice and every parameter's gradient within 1e-5
// relative L2. qwen2_packed (three packed documents, labels masked outside spans) runs on one rank
// and on thread-ranks cp 2, sp 2 and cp 2 x sp 2. Besides: LoRA on the fixtures equals the merged
// model, each module saves folders it loads back bit for bit, presets have the public shapes, and
// the variants not computed are refused by key.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "lcx/ops.h"
#include "lcx/plan.h"
#include "lcx/safetensors.h"
#include "lcx/slots/adapter.h"
#include "models/lora_merge_check.h"
#include "plugins/sp_cp_cases.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(LCX_TEST_DATA_DIR) / "models" / "fixtures" / "families";
constexpr const char* kWrite =
    "fixtures/families absent: python3 tests/models/gen_family_fixtures.py --out tests/models/fixtures/families "
    "(where transformers is)";

std::vector<int64_t> ints(const Tensor& t) {
  return std::vector<int64_t>(t.data_as<int64_t>(), t.data_as<int64_t>() + t.numel());
}

// The module a folder's config.json names (model_type "llama" -> the llama module).
std::string module_of(const fs::path& dir) {
  return nlohmann::json::parse(std::ifstream(dir / "config.json")).at("model_type").get<std::string>();
}

std::shared_ptr<Model> load(const fs::path& dir) {
  auto m = test::make_plugin<Model>(module_of(dir));
  m->load_hf(dir.string(), Device::cpu(), DType::f32);
  return m;
}

std::vector<fs::path> fixtures(const char* record) {
  std::vector<fs::path> out;
  if (fs::exists(kFixtures))
    for (const auto& e : fs::directory_iterator(kFixtures))
      if (fs::exists(e.path() / record)) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

std::map<std::string, std::vector<float>> recorded_grads(safetensors::Checkpoint& expected) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& name : expected.names())
    if (name.rfind("grad.", 0) == 0) out[name.substr(5)] = expected.load(name, DType::f32).to_floats();
  return out;
}

// Every recorded gradient matched by name, none missing on either side.
void expect_grads(Model& model, const std::map<std::string, std::vector<float>>& want, double tol, const std::string& what) {
  size_t checked = 0;
  double worst = 0;
  for (Parameter* p : model.parameters()) {
    ASSERT_TRUE(want.count(p->name)) << p->name << " has no transformers gradient: " << what;
    const double rel = test::rel_l2(p->grad.to_floats(), want.at(p->name));
    EXPECT_LE(rel, tol) << p->name << ": " << what;
    worst = std::max(worst, rel);
    ++checked;
  }
  EXPECT_EQ(checked, want.size()) << "transformers has parameters lcx does not: " << what;
  std::printf("%s: worst gradient rel L2 %.2e over %zu parameters\n", what.c_str(), worst, checked);
}

class FamilyParity : public ::testing::TestWithParam<fs::path> {};

TEST_P(FamilyParity, LossLogitsAndEveryGradientInFp32) {
  const fs::path dir = GetParam();
  auto model = load(dir);
  safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
  Shard shard = test::shard_from_labels(ints(expected.load("input_ids", DType::i64)), ints(expected.load("labels", DType::i64)));
  const int64_t valid = test::count_valid(shard);
  test::DefaultSlots s(*model);
  const StepResult r = test::mean_loss_step(s, shard, valid);
  ASSERT_EQ(r.valid, valid);
  const double want_loss = expected.load("loss", DType::f32).to_floats()[0];
  const double loss = r.loss_sum / static_cast<double>(r.valid);
  EXPECT_LE(std::abs(loss - want_loss) / want_loss, 1e-6) << "lcx " << loss << " transformers " << want_loss;
  std::printf("%s: loss rel %.2e\n", dir.filename().c_str(), std::abs(loss - want_loss) / want_loss);

  const Tensor want_logits = expected.load("logits", DType::f32);
  const Tensor hidden = forward_hidden(s.slots, shard, Device::cpu());
  const int64_t T = hidden.size(0), V = model->config().vocab_size, cols = want_logits.size(1);
  Tensor logits = Tensor::empty({T, V}, DType::f32);
  ops::matmul(hidden, false, model->head_weight(), true, logits);
  std::vector<float> all = logits.to_floats(), got;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < cols; ++v) got.push_back(all[static_cast<size_t>(t * V + v)]);
  EXPECT_LE(test::rel_l2(got, want_logits.to_floats()), 1e-5) << "logits";
  expect_grads(*model, recorded_grads(expected), 1e-5, dir.filename().string());
}

// On the GPU in bf16, as training runs: to bf16's resolution, the tolerances Qwen3's parity fixtures
// have there (tests/parity/parity_test.cpp).
TEST_P(FamilyParity, LossAndEveryGradientOnTheGpuInBf16) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU on this machine";
  const fs::path dir = GetParam();
  auto model = test::make_plugin<Model>(module_of(dir));
  model->load_hf(dir.string(), Device::cuda(0), DType::bf16);
  safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
  Shard shard = test::shard_from_labels(ints(expected.load("input_ids", DType::i64)), ints(expected.load("labels", DType::i64)));
  const int64_t valid = test::count_valid(shard);
  test::DefaultSlots s(*model);
  const StepResult r = test::mean_loss_step(s, shard, valid, Device::cuda(0));
  ASSERT_EQ(r.valid, valid);
  const double want_loss = expected.load("loss", DType::f32).to_floats()[0];
  const double loss = r.loss_sum / static_cast<double>(r.valid);
  EXPECT_LE(std::abs(loss - want_loss) / want_loss, 2e-2) << "lcx " << loss << " transformers " << want_loss;
  std::printf("%s cuda_bf16: loss rel %.2e\n", dir.filename().c_str(), std::abs(loss - want_loss) / want_loss);
  expect_grads(*model, recorded_grads(expected), 5e-2, dir.filename().string() + " cuda_bf16");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, FamilyParity, ::testing::ValuesIn(fixtures("expected.safetensors")),
                         [](const auto& info) { return info.param.filename().string(); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(FamilyParity);

TEST(FamilyParityFixtures, EveryFamilyAndRopeIsCovered) {
  // llama3 rope tied and untied, linear (transformers 4's config form), dynamic, mistral, qwen2 with
  // biases; and the packed qwen2.
  if (!fs::exists(kFixtures)) GTEST_SKIP() << kWrite;
  std::set<std::string> names;
  for (const auto& d : fixtures("expected.safetensors")) names.insert(d.filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"llama3_tied_f32", "llama3_untied", "llama_dynamic", "llama_linear_t4",
                                          "mistral_untied", "qwen2_bias_tied"}));
  EXPECT_EQ(fixtures("expected_masked.safetensors").size(), 1u);
}

// The packed fixture's sequence: targets[t] = labels[t + 1], each document to itself.
Sequence packed(const std::vector<int64_t>& ids, const std::vector<int64_t>& labels, const std::vector<int64_t>& bounds) {
  const int64_t T = static_cast<int64_t>(ids.size());
  Sequence s;
  s.tokens = Tensor::empty({T}, DType::i32);
  s.targets = Tensor::empty({T}, DType::i64);
  for (int64_t t = 0; t < T; ++t) {
    s.tokens.data_as<int32_t>()[t] = static_cast<int32_t>(ids[static_cast<size_t>(t)]);
    s.targets.data_as<int64_t>()[t] = t + 1 < T ? labels[static_cast<size_t>(t + 1)] : -100;
  }
  s.document_bounds = bounds;
  s.document_count = static_cast<int>(bounds.size()) - 1;
  return s;
}

struct MeshCase {
  const char* name;
  int cp, sp;
};

std::shared_ptr<Parallelism> parallelism(const MeshCase& m) {
  if (m.cp > 1 && m.sp > 1) return test::load_stacked(m.cp, m.sp);
  if (m.sp > 1) return test::load_ulysses(m.sp);
  if (m.cp > 1) return test::make_plugin<Parallelism>("cp_ring", "", Device::cpu(), nullptr, MeshShape{1, m.cp, 1});
  return std::shared_ptr<Parallelism>(make_single_rank());
}

TEST(FamilyPackedParity, EachMeshEqualsTransformers) {
  if (!fs::exists(kFixtures)) GTEST_SKIP() << kWrite;
  const std::vector<fs::path> dirs = fixtures("expected_masked.safetensors");
  ASSERT_EQ(dirs.size(), 1u) << kWrite;
  const fs::path dir = dirs[0];
  safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected_masked.safetensors").string());
  const Sequence seq = packed(ints(expected.load("input_ids", DType::i64)), ints(expected.load("labels", DType::i64)),
                              ints(expected.load("document_bounds", DType::i64)));
  const int64_t valid = ints(expected.load("valid", DType::i64))[0];
  const double want_loss = expected.load("loss", DType::f32).to_floats()[0];
  const auto want = recorded_grads(expected);
  const double scale = 1.0 / static_cast<double>(valid);
  for (const MeshCase& m : {MeshCase{"one rank", 1, 1}, {"cp 2", 2, 1}, {"sp 2", 1, 2}, {"cp 2 x sp 2", 2, 2}}) {
    const int n = m.cp * m.sp;
    std::vector<test::Slots> ranks;
    for (int r = 0; r < n; ++r) {
      test::Slots s;
      s.model = load(dir);
      s.loss = std::shared_ptr<Loss>(make_full_logits_loss());
      s.rope = std::shared_ptr<PositionalEncoding>(make_default_rope());
      s.memory = std::shared_ptr<MemoryStrategy>(make_on_device_memory());
      s.parallel = parallelism(m);
      ranks.push_back(std::move(s));
    }
    double loss_sum = 0, count = 0;
    if (n == 1) {
      StepSlots slots = ranks[0].slots();
      configure_slots(slots);
      ranks[0].model->zero_grad();
      const StepResult r = train_step(slots, ranks[0].parallel->shard(seq, 0), scale, Device::cpu());
      loss_sum = r.loss_sum;
      count = static_cast<double>(r.valid);
    } else {
      std::vector<double> sums(2);
      run_in_process(n, [&](Communicator& comm) {
        Mesh mesh(comm, {.dp = 1, .cp = m.cp, .sp = m.sp});
        const StepResult got = test::rank_step(ranks[static_cast<size_t>(comm.rank())], mesh, mesh.seq(), seq,
                                               seq_index(mesh.shape(), mesh.coord()), scale, Device::cpu());
        double s[2] = {got.loss_sum, static_cast<double>(got.valid)};
        mesh.seq().all_reduce(std::span<double>(s, 2));
        if (comm.rank() == 0) sums = {s[0], s[1]};
      });
      loss_sum = sums[0];
      count = sums[1];
    }
    EXPECT_EQ(static_cast<int64_t>(count), valid) << m.name;
    const double loss = loss_sum / count;
    EXPECT_LE(std::abs(loss - want_loss) / want_loss, 1e-6) << m.name << ": lcx " << loss << " transformers " << want_loss;
    expect_grads(*ranks[0].model, want, 1e-5, str("qwen2_packed, ", m.name));
  }
}

// LoRA on the families' projections (q/k/v with Qwen2's biases, no q/k norms): with B drawn at
// random, the adapted model's loss and input gradients equal the base with W + scale B A merged,
// the base (biases included) stays frozen, and every factor gets a gradient.
TEST(FamilyLora, EqualsTheMergedModelWithTheBaseFrozen) {
  if (!fs::exists(kFixtures)) GTEST_SKIP() << kWrite;
  for (const char* name : {"qwen2_bias_tied", "llama3_untied", "mistral_untied"}) {
    const fs::path dir = kFixtures / name;
    ASSERT_TRUE(fs::exists(dir / "expected.safetensors")) << dir;
    safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
    Shard shard = test::shard_from_labels(ints(expected.load("input_ids", DType::i64)), ints(expected.load("labels", DType::i64)));
    test::expect_lora_equals_merged_model([&] { return load(dir); }, shard, name);
  }
}

// PEFT's bias = "lora_only" on Qwen2's q, k and v: their biases train beside the factors, the rest of
// the base frozen. On a fresh adapter (B = 0) the model is the base, so the biases' gradients are
// the full fine-tune's on the same batch. Saved under PEFT's keys (an adapted module's tensors sit
// under its base_layer), a run started from the folder holds the trained values; a family without
// biases refuses the setting by key.
TEST(FamilyLora, BiasLoraOnlyTrainsTheAdaptedModulesBiases) {
  const fs::path dir = kFixtures / "qwen2_bias_tied";
  if (!fs::exists(dir / "expected.safetensors")) GTEST_SKIP() << kWrite;
  safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
  const Shard shard = test::shard_from_labels(ints(expected.load("input_ids", DType::i64)), ints(expected.load("labels", DType::i64)));
  const int64_t valid = test::count_valid(shard);
  auto full = load(dir);
  full->zero_grad();
  test::DefaultSlots sf(*full);
  test::mean_loss_step(sf, shard, valid);
  std::map<std::string, std::vector<float>> full_grads;
  for (Parameter* p : full->parameters()) full_grads[p->name] = p->grad.to_floats();

  const std::string table = "r = 4\nalpha = 8\ntarget_modules = [\"q_proj\", \"k_proj\", \"v_proj\"]\nbias = \"lora_only\"";
  auto adapted = load(dir);
  auto lora = test::make_plugin<Adapter>("lora", table);
  lora->attach(*adapted, AdapterContext{Device::cpu(), DType::f32, 5, ""});
  adapted->zero_grad();
  test::DefaultSlots sa(*adapted);
  sa.slots.adapter = lora.get();
  test::mean_loss_step(sa, shard, valid);
  int biases = 0;
  for (Parameter* p : adapted->parameters()) {
    const bool bias = p->name.ends_with(".bias");
    EXPECT_EQ(p->frozen, !bias) << p->name;
    if (!bias) continue;
    ++biases;
    const double rel = test::rel_l2(p->grad.to_floats(), full_grads.at(p->name));
    EXPECT_LE(rel, 1e-6) << p->name;
    EXPECT_GT(test::rel_l2(full_grads.at(p->name), std::vector<float>(full_grads.at(p->name).size(), 0.f)), 0) << p->name;
  }
  EXPECT_EQ(biases, 3 * static_cast<int>(adapted->config().num_layers));

  uint32_t seed = 70;
  std::map<std::string, std::vector<float>> trained;
  for (Parameter* p : adapted->parameters())
    if (!p->frozen) {
      test::fill_normal(p->value, seed++, 0.3f);
      trained[p->name] = p->value.to_floats();
    }
  const fs::path saved = test::temp_dir("family-lora-bias");
  lora->save(saved.string(), dir.string());
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(saved / "adapter_config.json")).at("bias"), "lora_only");
  const auto file = safetensors::Checkpoint::open((saved / "adapter_model.safetensors").string());
  EXPECT_TRUE(file.has("base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias"));
  EXPECT_TRUE(file.has("base_model.model.model.layers.1.self_attn.v_proj.base_layer.bias"));
  auto restarted = load(dir);
  auto from = test::make_plugin<Adapter>("lora", table + "\ninit_from = \"" + saved.string() + "\"");
  from->attach(*restarted, AdapterContext{Device::cpu(), DType::f32, 6, ""});
  for (Parameter* p : restarted->parameters())
    if (trained.count(p->name)) EXPECT_EQ(p->value.to_floats(), trained.at(p->name)) << p->name;

  // Llama's projections have no bias: the setting is refused by its key.
  const test::Thrown t = test::thrown_by([&] {
    auto llama = load(kFixtures / "llama3_untied");
    test::make_plugin<Adapter>("lora", "bias = \"all\"")->attach(*llama, AdapterContext{Device::cpu(), DType::f32, 1, ""});
  });
  EXPECT_EQ(t.key, "lora.bias");
  EXPECT_EQ(t.fix, "set bias = \"none\": this model's linear modules have no bias to train");
}

// A module's save: config.json of its family (the rope parameters the positional encoding gives)
// and safetensors that load back to the same bits.
TEST(FamilyExport, SavedFoldersLoadBackBitForBit) {
  const std::map<std::string, std::string> specs = {
      {"llama", R"({"hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,"num_attention_heads":4,
         "num_key_value_heads":2,"vocab_size":256,"tie_word_embeddings":false,"max_position_embeddings":256,
         "rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":8.0,"low_freq_factor":1.0,
         "high_freq_factor":4.0,"original_max_position_embeddings":64}})"},
      {"mistral", R"({"hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,"num_attention_heads":4,
         "num_key_value_heads":1,"vocab_size":256})"},
      {"qwen2", R"({"hidden_size":64,"intermediate_size":96,"num_hidden_layers":2,"num_attention_heads":4,
         "num_key_value_heads":2,"vocab_size":256})"}};
  for (const auto& [module, spec] : specs) {
    auto a = test::make_plugin<Model>(module);
    a->init_random(spec, 9, Device::cpu(), DType::bf16);
    test::DefaultSlots sa(*a);
    const fs::path dir = test::temp_dir("family_export_" + module);
    a->save_hf(dir.string(), DType::bf16, sa.rope->hf_rope_parameters());
    const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir / "config.json"));
    EXPECT_EQ(cfg["model_type"], module);
    if (module == "llama") {
      EXPECT_EQ(cfg["rope_parameters"]["rope_type"], "llama3");
      EXPECT_EQ(cfg["rope_parameters"]["factor"], 8.0);
      EXPECT_EQ(cfg["rope_parameters"]["original_max_position_embeddings"], 64);
    }
    if (module == "mistral") {
      EXPECT_TRUE(cfg["sliding_window"].is_null());
    }
    auto b = test::make_plugin<Model>(module);
    b->load_hf(dir.string(), Device::cpu(), DType::bf16);
    auto pa = a->parameters(), pb = b->parameters();
    ASSERT_EQ(pa.size(), pb.size()) << module;
    for (size_t i = 0; i < pa.size(); ++i) {
      ASSERT_EQ(pa[i]->name, pb[i]->name);
      EXPECT_EQ(0, std::memcmp(pa[i]->value.data(), pb[i]->value.data(), pa[i]->value.nbytes())) << pa[i]->name;
    }
    size_t biases = 0;
    for (Parameter* p : pa) biases += p->name.find(".bias") != std::string::npos;
    EXPECT_EQ(biases, module == "qwen2" ? 6u : 0u) << module;
  }
}

// Without transformers: Qwen2's bias gradients against central differences of the loss (fp32, a
// large init so the differences stand out of the rounding), and Qwen2 with zero biases computing
// what Llama computes on the same weights (no q/k norms either way), gradients included.
TEST(FamilyGradients, BiasesMatchFiniteDifferencesAndZeroBiasesAreLlama) {
  const std::string spec = R"({"hidden_size":32,"intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":8,"vocab_size":64,"tie_word_embeddings":false,"initializer_range":0.3,
    "rope_theta":10000.0,"rms_norm_eps":1e-6})";
  auto qwen2 = test::make_plugin<Model>("qwen2");
  qwen2->init_random(spec, 17, Device::cpu(), DType::f32);
  std::vector<int64_t> ids(24);
  for (size_t t = 0; t < ids.size(); ++t) ids[t] = static_cast<int64_t>((t * 37 + 5) % 64);
  Shard shard = test::shard_from_labels(ids, ids);
  const int64_t valid = test::count_valid(shard);
  test::DefaultSlots s(*qwen2);
  test::mean_loss_step(s, shard, valid);
  const double eps = 1e-2;
  for (Parameter* p : qwen2->parameters()) {
    if (p->name.find(".bias") == std::string::npos) continue;
    std::vector<float> numeric, analytic;
    const std::vector<float> grad = p->grad.to_floats();
    for (int64_t i = 0; i < p->value.numel(); i += 5) {
      float& v = p->value.data_as<float>()[i];
      const float keep = v;
      v = keep + static_cast<float>(eps);
      const double up = eval_step(s.slots, shard, Device::cpu()).loss_sum;
      v = keep - static_cast<float>(eps);
      const double down = eval_step(s.slots, shard, Device::cpu()).loss_sum;
      v = keep;
      numeric.push_back(static_cast<float>((up - down) / (2 * eps) / static_cast<double>(valid)));
      analytic.push_back(grad[static_cast<size_t>(i)]);
    }
    EXPECT_LE(test::rel_l2(analytic, numeric), 2e-2) << p->name;
  }
  // Zero biases: Llama's loss and every shared gradient.
  for (Parameter* p : qwen2->parameters())
    if (p->name.find(".bias") != std::string::npos) p->value.zero();
  const StepResult rq = test::mean_loss_step(s, shard, valid);
  auto llama = test::make_plugin<Model>("llama");
  llama->init_random(spec, 99, Device::cpu(), DType::f32);
  std::map<std::string, Parameter*> from;
  for (Parameter* p : qwen2->parameters()) from[p->name] = p;
  for (Parameter* p : llama->parameters()) p->value.copy_from(from.at(p->name)->value);
  test::DefaultSlots sl(*llama);
  const StepResult rl = test::mean_loss_step(sl, shard, valid);
  EXPECT_NEAR(rq.loss_sum, rl.loss_sum, 1e-6 * rl.loss_sum);
  for (Parameter* p : llama->parameters())
    EXPECT_LE(test::rel_l2(p->grad.to_floats(), from.at(p->name)->grad.to_floats()), 1e-6) << p->name;
}

int64_t parameter_count(const ModelConfig& c, bool qkv_bias) {
  const int64_t H = c.hidden_size, d = c.head_dim, qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  const int64_t layer = 2 * H + 2 * qd * H + 2 * kvd * H + 3 * H * c.intermediate_size + (qkv_bias ? qd + 2 * kvd : 0);
  return c.vocab_size * H * (c.tie_word_embeddings ? 1 : 2) + c.num_layers * layer + H;
}

TEST(FamilyPresets, HaveThePublicShapes) {
  auto llama = test::make_plugin<Model>("llama");
  const ModelConfig l = llama->describe("llama-3.1-8b");
  EXPECT_EQ(l.hidden_size, 4096);
  EXPECT_EQ(l.intermediate_size, 14336);
  EXPECT_EQ(l.num_layers, 32);
  EXPECT_EQ(l.num_heads, 32);
  EXPECT_EQ(l.num_kv_heads, 8);
  EXPECT_EQ(l.head_dim, 128);
  EXPECT_EQ(l.vocab_size, 128256);
  EXPECT_FALSE(l.tie_word_embeddings);
  EXPECT_EQ(l.rms_norm_eps, 1e-5);
  EXPECT_EQ(l.rope_theta, 500000);
  EXPECT_EQ(l.max_position_embeddings, 131072);
  const nlohmann::json rope = nlohmann::json::parse(l.rope_parameters_json);
  EXPECT_EQ(rope["rope_type"], "llama3");
  EXPECT_EQ(rope["factor"], 8.0);
  EXPECT_EQ(rope["original_max_position_embeddings"], 8192);
  EXPECT_EQ(parameter_count(l, false), 8030261248);  // Llama 3.1 8B's 8.03B
  const ModelConfig m = test::make_plugin<Model>("mistral")->describe("mistral-7b-v0.3");
  EXPECT_EQ(m.vocab_size, 32768);
  EXPECT_EQ(m.num_kv_heads, 8);
  EXPECT_EQ(m.rope_theta, 1e6);
  EXPECT_EQ(parameter_count(m, false), 7248023552);  // Mistral 7B v0.3's 7.25B
  const ModelConfig q = test::make_plugin<Model>("qwen2")->describe("qwen2.5-7b");
  EXPECT_EQ(q.hidden_size, 3584);
  EXPECT_EQ(q.intermediate_size, 18944);
  EXPECT_EQ(q.num_layers, 28);
  EXPECT_EQ(q.num_heads, 28);
  EXPECT_EQ(q.num_kv_heads, 4);
  EXPECT_EQ(q.head_dim, 128);
  EXPECT_EQ(q.vocab_size, 152064);
  EXPECT_EQ(q.rope_theta, 1e6);
  EXPECT_EQ(parameter_count(q, true), 7615616512);  // Qwen2.5 7B's 7.62B
}

// A config.json of the family with `edit` applied, written to a fresh folder; returns the key the
// module's refusal names ("" when it loads).
std::string refused_key(const std::string& module, const nlohmann::json& edit) {
  nlohmann::json cfg = {{"model_type", module}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 48},
                        {"num_hidden_layers", 1}, {"num_attention_heads", 4}, {"num_key_value_heads", 2}};
  if (module == "mistral") cfg["sliding_window"] = nullptr;
  for (const auto& [k, v] : edit.items()) cfg[k] = v;
  const fs::path dir = test::temp_dir("family_refusal");
  std::ofstream(dir / "config.json") << cfg.dump();
  try {
    test::make_plugin<Model>(module)->describe(dir.string());
  } catch (const Error& e) {
    return e.key();
  }
  return "";
}

TEST(FamilyRefusals, NameTheKey) {
  EXPECT_EQ(refused_key("llama", {}), "");
  EXPECT_EQ(refused_key("llama", {{"mlp_bias", true}}), "mlp_bias");
  EXPECT_EQ(refused_key("llama", {{"attention_bias", true}}), "attention_bias");
  EXPECT_EQ(refused_key("llama", {{"hidden_act", "gelu"}}), "hidden_act");
  EXPECT_EQ(refused_key("mistral", {}), "");
  EXPECT_EQ(refused_key("mistral", {{"sliding_window", 4096}}), "sliding_window");
  EXPECT_EQ(refused_key("qwen2", {}), "");
  EXPECT_EQ(refused_key("qwen2", {{"use_sliding_window", true}, {"sliding_window", 4096}}), "use_sliding_window");
  EXPECT_EQ(refused_key("qwen2", {{"model_type", "qwen3"}}), "model_type");
  // Left out, transformers' Mistral windows at 4096 tokens.
  nlohmann::json cfg = {{"model_type", "mistral"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 48},
                        {"num_hidden_layers", 1}, {"num_attention_heads", 4}};
  const fs::path dir = test::temp_dir("family_refusal");
  std::ofstream(dir / "config.json") << cfg.dump();
  try {
    test::make_plugin<Model>("mistral")->describe(dir.string());
    ADD_FAILURE() << "a Mistral config without sliding_window loaded";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "sliding_window");
  }
}

// lora's plan counts what modules_to_save trains whole from the list of parameters the model
// declares (ModelConfig::parameters), so a family's own norms, biases and sinks are counted as
// the run trains them: Gemma 3's sandwich norms, Qwen2's q/k/v biases, GPT-OSS's experts' biases.
TEST(FamiliesLora, PlanCountsWhatModulesToSaveTrains) {
  const fs::path models = fs::path(LCX_TEST_DATA_DIR) / "models" / "fixtures";
  const std::vector<std::pair<fs::path, std::string>> cases = {
      {models / "families" / "qwen2_bias_tied", R"(["q_proj", "input_layernorm", "norm"])"},
      {models / "families" / "llama3_untied", R"(["lm_head", "post_attention_layernorm"])"},
      {models / "gemma3" / "gemma3_text_f32", R"(["pre_feedforward_layernorm", "post_feedforward_layernorm", "embed_tokens"])"},
      {models / "gpt_oss" / "gpt_oss_basic", R"(["experts", "router", "norm"])"},
  };
  for (const auto& [dir, saved] : cases) {
    if (!fs::exists(dir / "config.json")) GTEST_SKIP() << dir << " absent";
    auto model = load(dir);
    const ModelConfig described = model->describe(dir.string());
    auto lora = test::make_plugin<Adapter>("lora", "r = 2\ntarget_modules = [\"o_proj\"]\nmodules_to_save = " + saved);
    PlanInputs in;
    in.model = described;
    lora->plan_inputs(in);
    lora->attach(*model, AdapterContext{Device::cpu(), DType::f32, 7, ""});
    int64_t trained = 0, gemm_trained = 0;
    for (Parameter* p : model->parameters())
      if (!p->frozen) (p->gemm_grad ? gemm_trained : trained) += p->value.numel();
    EXPECT_GT(trained, 0) << dir.filename();
    EXPECT_EQ(in.base_trained_parameters, trained) << dir.filename() << " with modules_to_save = " << saved;
    // The declared list is the built one, name for name.
    std::vector<std::string> built;
    for (Parameter* p : model->parameters()) built.push_back(p->name);
    std::vector<std::string> declared;
    for (const ParameterSize& p : described.parameters) declared.push_back(p.name);
    EXPECT_EQ(declared, built) << dir.filename();
  }
}

}  // namespace
}  // namespace lcx
