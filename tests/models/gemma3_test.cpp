// Gemma 3's language model (the gemma3_text module on models/common) against transformers. Each
// folder of fixtures/gemma3 written by gen_gemma3_fixtures.py is a real HF checkpoint plus what
// transformers 5.17's Gemma3ForCausalLM (or Gemma3ForConditionalGeneration on text alone) computed
// in fp32 for fixed tokens, with windows of 8 and 16 over 64 tokens and sliding and full layers
// mixed: lcx loads the folder, runs a train step in fp32 on the CPU with core's default slots and
// must give the loss within 1e-6 relative and the logits slice and every parameter's gradient within
// 1e-5 relative L2, on one rank and on thread-ranks cp 2, sp 2 and cp 2 x sp 2; gemma3_packed (three
// documents, each longer than the window) the same. Besides: LoRA equals the merged model, a saved
// folder loads back bit for bit with transformers' keys, the presets have the public shapes, and
// what is not computed is refused by key.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "lcx/ops.h"
#include "lcx/safetensors.h"
#include "lcx/slots/adapter.h"
#include "models/lora_merge_check.h"
#include "plugins/sp_cp_cases.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(LCX_TEST_DATA_DIR) / "models" / "fixtures" / "gemma3";
constexpr const char* kWrite =
    "fixtures/gemma3 absent: python3 tests/models/gen_gemma3_fixtures.py --out tests/models/fixtures/gemma3 "
    "(where transformers is)";
constexpr const char* kModule = "gemma3_text";

std::vector<int64_t> ints(const Tensor& t) {
  return std::vector<int64_t>(t.data_as<int64_t>(), t.data_as<int64_t>() + t.numel());
}

std::shared_ptr<Model> load(const fs::path& dir, DType dtype = DType::f32, Device device = Device::cpu()) {
  auto m = test::make_plugin<Model>(kModule);
  m->load_hf(dir.string(), device, dtype);
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

// A fixture's tokens as one sequence: targets[t] = labels[t + 1], the last ignored; with bounds,
// packed documents each attending to itself.
Sequence sequence(const std::vector<int64_t>& ids, const std::vector<int64_t>& labels, const std::vector<int64_t>& bounds = {}) {
  const int64_t T = static_cast<int64_t>(ids.size());
  Sequence s;
  s.tokens = Tensor::empty({T}, DType::i32);
  s.targets = Tensor::empty({T}, DType::i64);
  for (int64_t t = 0; t < T; ++t) {
    s.tokens.data_as<int32_t>()[t] = static_cast<int32_t>(ids[static_cast<size_t>(t)]);
    s.targets.data_as<int64_t>()[t] = t + 1 < T ? labels[static_cast<size_t>(t + 1)] : -100;
  }
  if (!bounds.empty()) {
    s.document_bounds = bounds;
    s.document_count = static_cast<int>(bounds.size()) - 1;
  }
  return s;
}

class Gemma3Parity : public ::testing::TestWithParam<fs::path> {};

TEST_P(Gemma3Parity, LossLogitsAndEveryGradientInFp32) {
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
TEST_P(Gemma3Parity, LossAndEveryGradientOnTheGpuInBf16) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU on this machine";
  const fs::path dir = GetParam();
  auto model = load(dir, DType::bf16, Device::cuda(0));
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

INSTANTIATE_TEST_SUITE_P(Fixtures, Gemma3Parity, ::testing::ValuesIn(fixtures("expected.safetensors")),
                         [](const auto& info) { return info.param.filename().string(); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Gemma3Parity);

TEST(Gemma3ParityFixtures, EveryFormIsCovered) {
  // gemma3_text in fp32 and in bf16 with transformers 4's config keys, the language model of a
  // gemma3 checkpoint, and the packed documents.
  if (!fs::exists(kFixtures)) GTEST_SKIP() << kWrite;
  std::set<std::string> names;
  for (const auto& d : fixtures("expected.safetensors")) names.insert(d.filename().string());
  EXPECT_EQ(names, (std::set<std::string>{"gemma3_text_f32", "gemma3_text_bf16", "gemma3_mm"}));
  EXPECT_EQ(fixtures("expected_masked.safetensors").size(), 1u);
  // The fixtures exercise what Gemma 3 adds: windows that bite and both layer kinds.
  const ModelConfig c = load(kFixtures / "gemma3_text_f32")->config();
  EXPECT_EQ(c.sliding_window, 8);
  EXPECT_EQ(std::count(c.layer_types.begin(), c.layer_types.end(), "full_attention"), 1);
  EXPECT_EQ(std::count(c.layer_types.begin(), c.layer_types.end(), "sliding_attention"), 3);
  EXPECT_NEAR(c.attention_scale, 1.0 / std::sqrt(24.0), 1e-12);
  EXPECT_EQ(nlohmann::json::parse(c.rope_parameters_json)["rope_type"], "linear");
  EXPECT_EQ(nlohmann::json::parse(c.sliding_rope_parameters_json)["rope_theta"], 10000.0);
}

struct MeshCase {
  const char* name;
  int cp, sp;
};
constexpr MeshCase kMeshes[] = {{"one rank", 1, 1}, {"cp 2", 2, 1}, {"sp 2", 1, 2}, {"cp 2 x sp 2", 2, 2}};

std::shared_ptr<Parallelism> parallelism(const MeshCase& m) {
  if (m.cp > 1 && m.sp > 1) return test::load_stacked(m.cp, m.sp);
  if (m.sp > 1) return test::load_ulysses(m.sp);
  if (m.cp > 1) return test::make_plugin<Parallelism>("cp_ring", "", Device::cpu(), nullptr, MeshShape{1, m.cp, 1});
  return std::shared_ptr<Parallelism>(make_single_rank());
}

// One step of `seq` over the mesh's thread-ranks with the whole sequence's scale, the gradients
// summed over the ranks: (loss sum, valid count), rank 0's model holding the summed gradients.
std::pair<double, double> mesh_step(const fs::path& dir, const Sequence& seq, double scale, const MeshCase& m,
                                    std::shared_ptr<Model>& model) {
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
  model = ranks[0].model;
  if (n == 1) {
    StepSlots slots = ranks[0].slots();
    configure_slots(slots);
    ranks[0].model->zero_grad();
    const StepResult r = train_step(slots, ranks[0].parallel->shard(seq, 0), scale, Device::cpu());
    return {r.loss_sum, static_cast<double>(r.valid)};
  }
  std::vector<double> sums(2);
  run_in_process(n, [&](Communicator& comm) {
    Mesh mesh(comm, {.dp = 1, .cp = m.cp, .sp = m.sp});
    const StepResult got = test::rank_step(ranks[static_cast<size_t>(comm.rank())], mesh, mesh.seq(), seq,
                                           seq_index(mesh.shape(), mesh.coord()), scale, Device::cpu());
    double s[2] = {got.loss_sum, static_cast<double>(got.valid)};
    mesh.seq().all_reduce(std::span<double>(s, 2));
    if (comm.rank() == 0) sums = {s[0], s[1]};
  });
  return {sums[0], sums[1]};
}

// The windows under cp and sp: each rank's shard sees only the keys its window reaches, through
// the ring or the head exchange, and the step equals transformers.
TEST(Gemma3MeshParity, EachMeshEqualsTransformers) {
  if (!fs::exists(kFixtures)) GTEST_SKIP() << kWrite;
  const fs::path dir = kFixtures / "gemma3_text_f32";
  ASSERT_TRUE(fs::exists(dir / "expected.safetensors")) << kWrite;
  safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
  const Sequence seq = sequence(ints(expected.load("input_ids", DType::i64)), ints(expected.load("labels", DType::i64)));
  int64_t valid = 0;
  for (int64_t t = 0; t < seq.targets.numel(); ++t) valid += seq.targets.data_as<int64_t>()[t] != -100;
  const double want_loss = expected.load("loss", DType::f32).to_floats()[0];
  const auto want = recorded_grads(expected);
  for (const MeshCase& m : kMeshes) {
    std::shared_ptr<Model> model;
    const auto [loss_sum, count] = mesh_step(dir, seq, 1.0 / static_cast<double>(valid), m, model);
    EXPECT_EQ(static_cast<int64_t>(count), valid) << m.name;
    const double loss = loss_sum / count;
    EXPECT_LE(std::abs(loss - want_loss) / want_loss, 1e-6) << m.name << ": lcx " << loss << " transformers " << want_loss;
    expect_grads(*model, want, 1e-5, str("gemma3_text_f32, ", m.name));
  }
}

TEST(Gemma3PackedParity, EachMeshEqualsTransformers) {
  if (!fs::exists(kFixtures)) GTEST_SKIP() << kWrite;
  const std::vector<fs::path> dirs = fixtures("expected_masked.safetensors");
  ASSERT_EQ(dirs.size(), 1u) << kWrite;
  const fs::path dir = dirs[0];
  safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected_masked.safetensors").string());
  const Sequence seq = sequence(ints(expected.load("input_ids", DType::i64)), ints(expected.load("labels", DType::i64)),
                                ints(expected.load("document_bounds", DType::i64)));
  const int64_t valid = ints(expected.load("valid", DType::i64))[0];
  const double want_loss = expected.load("loss", DType::f32).to_floats()[0];
  const auto want = recorded_grads(expected);
  for (const MeshCase& m : kMeshes) {
    std::shared_ptr<Model> model;
    const auto [loss_sum, count] = mesh_step(dir, seq, 1.0 / static_cast<double>(valid), m, model);
    EXPECT_EQ(static_cast<int64_t>(count), valid) << m.name;
    const double loss = loss_sum / count;
    EXPECT_LE(std::abs(loss - want_loss) / want_loss, 1e-6) << m.name << ": lcx " << loss << " transformers " << want_loss;
    expect_grads(*model, want, 1e-5, str("gemma3_packed, ", m.name));
  }
}

// Without transformers: a random Gemma 3 (windows of 5, both layer kinds, each with its rotary
// base) over three packed documents on cp 2, sp 2 and cp 2 x sp 2 thread-ranks equals one rank, loss
// and every gradient: the sliding layers' own tables follow each rank's positions.
TEST(Gemma3MeshParity, RanksEqualOneRankWithoutFixtures) {
  auto m = test::make_plugin<Model>(kModule);
  m->init_random(R"({"hidden_size":32,"intermediate_size":48,"num_hidden_layers":3,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":8,"vocab_size":64,"initializer_range":0.2,"query_pre_attn_scalar":12,
    "sliding_window":5,"layer_types":["sliding_attention","full_attention","sliding_attention"],
    "rope_parameters":{"sliding_attention":{"rope_type":"default","rope_theta":100.0},
                       "full_attention":{"rope_type":"linear","factor":2.0,"rope_theta":10000.0}}})",
                 23, Device::cpu(), DType::f32);
  uint32_t seed = 5;
  for (Parameter* p : m->parameters())
    if (p->value.dim() == 1) test::fill_normal(p->value, seed++, 0.3f);
  const fs::path dir = test::temp_dir("gemma3_mesh");
  m->save_hf(dir.string(), DType::f32, "{\"rope_type\":\"linear\",\"factor\":2.0,\"rope_theta\":10000.0}");
  std::vector<int64_t> ids(48), labels(48);
  for (size_t t = 0; t < ids.size(); ++t) ids[t] = labels[t] = static_cast<int64_t>(1 + (t * 29 + 3) % 63);
  labels[12] = labels[33] = -100;
  const Sequence seq = sequence(ids, labels, {0, 19, 36, 48});
  int64_t valid = 0;
  for (int64_t t = 0; t < seq.targets.numel(); ++t) valid += seq.targets.data_as<int64_t>()[t] != -100;
  const double scale = 1.0 / static_cast<double>(valid);
  std::shared_ptr<Model> one;
  const auto [want_sum, want_count] = mesh_step(dir, seq, scale, kMeshes[0], one);
  // The window bites on one rank too: the same weights with windows past every document differ.
  {
    nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir / "config.json"));
    cfg["sliding_window"] = 48;
    const fs::path wide = test::temp_dir("gemma3_mesh_wide");
    fs::copy(dir, wide, fs::copy_options::overwrite_existing | fs::copy_options::recursive);
    std::ofstream(wide / "config.json") << cfg.dump();
    std::shared_ptr<Model> unwindowed;
    const double full_sum = mesh_step(wide, seq, scale, kMeshes[0], unwindowed).first;
    EXPECT_GT(std::abs(full_sum - want_sum), 1e-3 * want_sum) << "the window of 5 changed nothing";
  }
  std::map<std::string, std::vector<float>> want;
  for (Parameter* p : one->parameters()) want[p->name] = p->grad.to_floats();
  for (const MeshCase& mesh : {kMeshes[1], kMeshes[2], kMeshes[3]}) {
    std::shared_ptr<Model> model;
    const auto [loss_sum, count] = mesh_step(dir, seq, scale, mesh, model);
    EXPECT_EQ(count, want_count) << mesh.name;
    EXPECT_NEAR(loss_sum, want_sum, 1e-6 * want_sum) << mesh.name;
    expect_grads(*model, want, 1e-5, str("random gemma3, ", mesh.name));
  }
}

// LoRA on Gemma 3's projections (q/k/v/o with q/k norms after them, the GeGLU MLP): with B drawn at
// random, the adapted model's loss equals the base with W + scale B A merged, the base stays frozen
// and every factor gets a gradient.
TEST(Gemma3Lora, EqualsTheMergedModelWithTheBaseFrozen) {
  if (!fs::exists(kFixtures)) GTEST_SKIP() << kWrite;
  for (const char* name : {"gemma3_text_f32", "gemma3_mm"}) {
    const fs::path dir = kFixtures / name;
    ASSERT_TRUE(fs::exists(dir / "expected.safetensors")) << dir;
    safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
    Shard shard = test::shard_from_labels(ints(expected.load("input_ids", DType::i64)), ints(expected.load("labels", DType::i64)));
    test::expect_lora_equals_merged_model([&] { return load(dir); }, shard, name);
  }
}

// The names transformers' Gemma3ForCausalLM gives a checkpoint with a tied head.
std::set<std::string> gemma3_names(int64_t layers) {
  std::set<std::string> n = {"model.embed_tokens.weight", "model.norm.weight"};
  for (int64_t l = 0; l < layers; ++l)
    for (const char* s : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                          "post_feedforward_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
                          "mlp.down_proj"})
      n.insert(str("model.layers.", l, ".", s, ".weight"));
  return n;
}

// A save: config.json of gemma3_text in transformers 5's form with transformers 4's keys beside,
// and safetensors of Gemma3ForCausalLM's names that load back to the same bits; a gemma3
// checkpoint's save is its language model alone.
TEST(Gemma3Export, SavedFoldersLoadBackBitForBit) {
  auto a = test::make_plugin<Model>(kModule);
  a->init_random(R"({"hidden_size":64,"intermediate_size":96,"num_hidden_layers":3,"num_attention_heads":4,
      "num_key_value_heads":2,"head_dim":16,"vocab_size":256,"query_pre_attn_scalar":24,"sliding_window":8,
      "layer_types":["sliding_attention","full_attention","sliding_attention"],
      "rope_parameters":{"sliding_attention":{"rope_type":"default","rope_theta":10000.0},
                         "full_attention":{"rope_type":"linear","factor":8.0,"rope_theta":1000000.0}}})",
                 9, Device::cpu(), DType::bf16);
  for (Parameter* p : a->parameters()) {
    if (p->value.dim() != 1) continue;
    EXPECT_EQ(p->value.to_floats(), std::vector<float>(p->value.numel(), 0.f)) << p->name;
  }
  test::DefaultSlots sa(*a);
  const fs::path dir = test::temp_dir("gemma3_export");
  a->save_hf(dir.string(), DType::bf16, sa.rope->hf_rope_parameters());
  const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(dir / "config.json"));
  EXPECT_EQ(cfg["model_type"], "gemma3_text");
  EXPECT_EQ(cfg["architectures"][0], "Gemma3ForCausalLM");
  EXPECT_EQ(cfg["hidden_activation"], "gelu_pytorch_tanh");
  EXPECT_EQ(cfg["query_pre_attn_scalar"], 24);
  EXPECT_TRUE(cfg["query_pre_attn_scalar"].is_number_integer());
  EXPECT_EQ(cfg["sliding_window"], 8);
  EXPECT_EQ(cfg["layer_types"][1], "full_attention");
  EXPECT_EQ(cfg["rope_parameters"]["full_attention"]["rope_type"], "linear");
  EXPECT_EQ(cfg["rope_parameters"]["full_attention"]["factor"], 8.0);
  EXPECT_EQ(cfg["rope_parameters"]["sliding_attention"]["rope_theta"], 10000.0);
  EXPECT_EQ(cfg["rope_local_base_freq"], 10000.0);
  EXPECT_EQ(cfg["rope_theta"], 1000000.0);
  EXPECT_TRUE(cfg["final_logit_softcapping"].is_null());
  EXPECT_TRUE(cfg["tie_word_embeddings"].get<bool>());
  safetensors::Checkpoint ck = safetensors::Checkpoint::open(dir.string());
  const std::vector<std::string> names = ck.names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), gemma3_names(3));
  auto b = test::make_plugin<Model>(kModule);
  b->load_hf(dir.string(), Device::cpu(), DType::bf16);
  EXPECT_EQ(b->config().attention_scale, a->config().attention_scale);
  EXPECT_EQ(b->config().sliding_rope_parameters_json, a->config().sliding_rope_parameters_json);
  auto pa = a->parameters(), pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (size_t i = 0; i < pa.size(); ++i) {
    ASSERT_EQ(pa[i]->name, pb[i]->name);
    EXPECT_EQ(0, std::memcmp(pa[i]->value.data(), pb[i]->value.data(), pa[i]->value.nbytes())) << pa[i]->name;
  }
  if (!fs::exists(kFixtures / "gemma3_mm")) GTEST_SKIP() << kWrite;
  auto mm = load(kFixtures / "gemma3_mm");
  const fs::path text = test::temp_dir("gemma3_export_mm");
  mm->save_hf(text.string(), DType::f32, sa.rope->hf_rope_parameters());
  safetensors::Checkpoint saved = safetensors::Checkpoint::open(text.string());
  const std::vector<std::string> kept = saved.names();
  EXPECT_EQ(std::set<std::string>(kept.begin(), kept.end()), gemma3_names(mm->config().num_layers));
  EXPECT_EQ(nlohmann::json::parse(std::ifstream(text / "config.json"))["model_type"], "gemma3_text");
}

// Without transformers: every kind of parameter's gradient against central differences of the loss
// (fp32, a large init so the differences stand out of the rounding; norms drawn away from 0), over
// 24 tokens with a window of 4, both layer kinds, the sliding ones on their own rotary base.
TEST(Gemma3Gradients, MatchFiniteDifferences) {
  auto m = test::make_plugin<Model>(kModule);
  m->init_random(R"({"hidden_size":32,"intermediate_size":48,"num_hidden_layers":2,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":8,"vocab_size":64,"initializer_range":0.3,"query_pre_attn_scalar":12,
    "sliding_window":4,"layer_types":["sliding_attention","full_attention"],
    "rope_parameters":{"sliding_attention":{"rope_type":"default","rope_theta":100.0},
                       "full_attention":{"rope_type":"linear","factor":2.0,"rope_theta":10000.0}}})",
                 17, Device::cpu(), DType::f32);
  uint32_t seed = 3;
  for (Parameter* p : m->parameters())
    if (p->value.dim() == 1) test::fill_normal(p->value, seed++, 0.3f);
  std::vector<int64_t> ids(24);
  for (size_t t = 0; t < ids.size(); ++t) ids[t] = static_cast<int64_t>((t * 37 + 5) % 64);
  Shard shard = test::shard_from_labels(ids, ids);
  const int64_t valid = test::count_valid(shard);
  test::DefaultSlots s(*m);
  test::mean_loss_step(s, shard, valid);
  const double eps = 1e-2;
  size_t checked = 0;
  for (Parameter* p : m->parameters()) {
    std::vector<float> numeric, analytic;
    const std::vector<float> grad = p->grad.to_floats();
    const int64_t stride = std::max<int64_t>(1, p->value.numel() / 6);
    for (int64_t i = 0; i < p->value.numel(); i += stride) {
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
    ++checked;
  }
  EXPECT_EQ(checked, gemma3_names(2).size());
}

// A gemma3 checkpoint as transformers 4 wrote the Hub's (language_model.model.*, the vision tower
// and projector beside, the config's keys in text_config) and as 5 writes it (model.language_model.*):
// the language model loads bit for bit, the tower stays unread.
TEST(Gemma3Checkpoint, MultimodalNamesOfBothVersionsLoadTheLanguageModel) {
  auto a = test::make_plugin<Model>(kModule);
  const nlohmann::json text = {{"model_type", "gemma3_text"}, {"hidden_size", 32}, {"intermediate_size", 48},
                               {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                               {"head_dim", 8}, {"vocab_size", 64}, {"sliding_window", 4}, {"sliding_window_pattern", 2},
                               {"rope_scaling", {{"rope_type", "linear"}, {"factor", 8.0}}}};
  a->init_random(text.dump(), 31, Device::cpu(), DType::bf16);
  for (const std::string prefix : {"language_model.model.", "model.language_model."}) {
    std::vector<safetensors::NamedTensor> tensors;
    for (Parameter* p : a->parameters()) tensors.push_back({prefix + p->name.substr(6), p->value});  // drop "model."
    const Tensor tower = Tensor::zeros({4, 8}, DType::bf16, Device::cpu());
    const std::string outer = prefix == "model.language_model." ? "model." : "";
    tensors.push_back({outer + "vision_tower.vision_model.embeddings.patch_embedding.weight", tower});
    tensors.push_back({outer + "multi_modal_projector.mm_input_projection_weight", tower});
    const fs::path dir = test::temp_dir("gemma3_multimodal");
    safetensors::write_checkpoint(dir.string(), tensors, DType::bf16);
    nlohmann::json cfg = {{"model_type", "gemma3"}, {"architectures", {"Gemma3ForConditionalGeneration"}},
                          {"text_config", text}, {"vision_config", {{"model_type", "siglip_vision_model"}}},
                          {"mm_tokens_per_image", 256}, {"image_token_index", 262144}};
    cfg["text_config"].erase("model_type");
    std::ofstream(dir / "config.json") << cfg.dump();
    auto b = load(dir, DType::bf16);
    EXPECT_EQ(b->config().layer_types, (std::vector<std::string>{"sliding_attention", "full_attention"})) << prefix;
    EXPECT_EQ(nlohmann::json::parse(b->config().rope_parameters_json)["factor"], 8.0) << prefix;
    auto pa = a->parameters(), pb = b->parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      ASSERT_EQ(pa[i]->name, pb[i]->name);
      EXPECT_EQ(0, std::memcmp(pa[i]->value.data(), pb[i]->value.data(), pa[i]->value.nbytes())) << prefix << pa[i]->name;
    }
  }
}

int64_t parameter_count(const ModelConfig& c) {
  const int64_t H = c.hidden_size, d = c.head_dim, qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  const int64_t layer = 4 * H + 2 * d + 2 * qd * H + 2 * kvd * H + 3 * H * c.intermediate_size;
  return c.vocab_size * H + c.num_layers * layer + H;
}

TEST(Gemma3Presets, HaveThePublicShapes) {
  auto m = test::make_plugin<Model>(kModule);
  const ModelConfig one = m->describe("gemma-3-1b");
  EXPECT_EQ(one.vocab_size, 262144);
  EXPECT_EQ(one.hidden_size, 1152);
  EXPECT_EQ(one.num_layers, 26);
  EXPECT_EQ(one.num_kv_heads, 1);
  EXPECT_EQ(one.sliding_window, 512);
  EXPECT_EQ(nlohmann::json::parse(one.rope_parameters_json)["rope_type"], "default");
  EXPECT_EQ(parameter_count(one), 999885952);  // gemma-3-1b's 1.0B
  // Every sixth layer full, the others sliding.
  EXPECT_EQ(one.layer_types[5], "full_attention");
  EXPECT_EQ(one.layer_types[4], "sliding_attention");
  EXPECT_EQ(std::count(one.layer_types.begin(), one.layer_types.end(), "full_attention"), 4);
  const ModelConfig twelve = m->describe("gemma-3-12b");
  EXPECT_EQ(twelve.vocab_size, 262208);
  EXPECT_EQ(twelve.hidden_size, 3840);
  EXPECT_EQ(twelve.intermediate_size, 15360);
  EXPECT_EQ(twelve.num_layers, 48);
  EXPECT_EQ(twelve.num_heads, 16);
  EXPECT_EQ(twelve.num_kv_heads, 8);
  EXPECT_EQ(twelve.head_dim, 256);
  EXPECT_EQ(twelve.sliding_window, 1024);
  EXPECT_TRUE(twelve.tie_word_embeddings);
  EXPECT_NEAR(twelve.attention_scale, 1.0 / 16.0, 1e-15);
  const nlohmann::json rope = nlohmann::json::parse(twelve.rope_parameters_json);
  EXPECT_EQ(rope["rope_type"], "linear");
  EXPECT_EQ(rope["factor"], 8.0);
  EXPECT_EQ(rope["rope_theta"], 1e6);
  EXPECT_EQ(nlohmann::json::parse(twelve.sliding_rope_parameters_json)["rope_theta"], 10000.0);
  const ModelConfig four = m->describe("gemma-3-4b");
  EXPECT_EQ(parameter_count(four), 3880263168);  // gemma-3-4b's language model
  const ModelConfig big = m->describe("gemma-3-27b");
  EXPECT_EQ(big.hidden_size, 5376);
  EXPECT_EQ(big.num_layers, 62);
  EXPECT_EQ(big.head_dim, 128);
  EXPECT_NEAR(big.attention_scale, 1.0 / std::sqrt(168.0), 1e-15);
}

// The model FLOPs (MFU's) count a sliding layer's band, twice its pairs, in place of the causal
// square: n W - W (W - 1) / 2 pairs a document of n >= W tokens, n (n + 1) / 2 below that.
TEST(Gemma3Flops, SlidingLayersCountTheirBand) {
  const std::string shape = R"({"hidden_size":32,"intermediate_size":48,"num_hidden_layers":3,"num_attention_heads":4,
    "num_key_value_heads":2,"head_dim":8,"vocab_size":64,"layer_types":["sliding_attention","full_attention","sliding_attention"],
    "sliding_window":)";
  auto windowed = test::make_plugin<Model>(kModule), wide = test::make_plugin<Model>(kModule);
  windowed->init_random(shape + "16}", 1, Device::cpu(), DType::f32);
  wide->init_random(shape + "4096}", 1, Device::cpu(), DType::f32);
  const double qd = 4 * 8, T = 1000, W = 16;
  const double band = 2 * (T * W - W * (W - 1) / 2);
  EXPECT_NEAR(wide->step_flops(1000, {}) - windowed->step_flops(1000, {}), 6 * qd * 2 * (T * (T + 1) - band), 1e-6 * T * T);
  // Documents: one of 10 tokens (below the window: its square) and one of 990.
  const std::vector<int64_t> docs = {0, 10, 1000};
  const double doc_band = 2 * (990 * W - W * (W - 1) / 2);
  EXPECT_NEAR(wide->step_flops(1000, docs) - windowed->step_flops(1000, docs), 6 * qd * 2 * (990.0 * 991 - doc_band),
              1e-6 * T * T);
}

// A config.json with `edit` applied, written to a fresh folder; returns the key the module's
// refusal names ("" when it loads).
std::string refused_key(const nlohmann::json& edit) {
  nlohmann::json cfg = {{"model_type", "gemma3_text"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 48},
                        {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                        {"head_dim", 8}, {"sliding_window", 4}};
  for (const auto& [k, v] : edit.items()) cfg[k] = v;
  const fs::path dir = test::temp_dir("gemma3_refusal");
  std::ofstream(dir / "config.json") << cfg.dump();
  try {
    test::make_plugin<Model>(kModule)->describe(dir.string());
  } catch (const Error& e) {
    return e.key();
  }
  return "";
}

TEST(Gemma3Refusals, NameTheKey) {
  EXPECT_EQ(refused_key({}), "");
  EXPECT_EQ(refused_key({{"attn_logit_softcapping", 50.0}}), "attn_logit_softcapping");
  EXPECT_EQ(refused_key({{"final_logit_softcapping", 30.0}}), "final_logit_softcapping");
  EXPECT_EQ(refused_key({{"attn_logit_softcapping", nullptr}, {"final_logit_softcapping", nullptr}}), "");
  EXPECT_EQ(refused_key({{"hidden_activation", "gelu"}}), "hidden_activation");
  EXPECT_EQ(refused_key({{"use_bidirectional_attention", true}}), "use_bidirectional_attention");
  EXPECT_EQ(refused_key({{"attention_bias", true}}), "attention_bias");
  EXPECT_EQ(refused_key({{"sliding_window", nullptr}}), "sliding_window");
  EXPECT_EQ(refused_key({{"rope_parameters", {{"sliding_attention", {{"rope_type", "linear"}, {"factor", 2.0}}}}}}),
            "rope_parameters.sliding_attention.rope_type");
  EXPECT_EQ(refused_key({{"model_type", "gemma2"}}), "model_type");
  // A gemma3 checkpoint reads its text_config, and needs one.
  EXPECT_EQ(refused_key({{"model_type", "gemma3"}}), "text_config");
  EXPECT_EQ(refused_key({{"model_type", "gemma3"},
                         {"text_config", {{"model_type", "gemma3_text"}, {"hidden_size", 32}, {"num_hidden_layers", 2},
                                          {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"head_dim", 8},
                                          {"final_logit_softcapping", 30.0}}}}),
            "final_logit_softcapping");
}

// transformers 4's keys: layer types from sliding_window_pattern, the full layers' theta and
// scaling from rope_theta and rope_scaling, the sliding layers' from rope_local_base_freq.
TEST(Gemma3Config, ReadsTransformers4Keys) {
  nlohmann::json cfg = {{"model_type", "gemma3_text"}, {"vocab_size", 64}, {"hidden_size", 32}, {"intermediate_size", 48},
                        {"num_hidden_layers", 6}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                        {"head_dim", 8}, {"sliding_window", 4}, {"sliding_window_pattern", 3},
                        {"rope_theta", 500000.0}, {"rope_local_base_freq", 20000.0},
                        {"rope_scaling", {{"rope_type", "linear"}, {"factor", 4.0}}}, {"query_pre_attn_scalar", 8}};
  const fs::path dir = test::temp_dir("gemma3_t4");
  std::ofstream(dir / "config.json") << cfg.dump();
  const ModelConfig c = test::make_plugin<Model>(kModule)->describe(dir.string());
  EXPECT_EQ(c.layer_types, (std::vector<std::string>{"sliding_attention", "sliding_attention", "full_attention",
                                                     "sliding_attention", "sliding_attention", "full_attention"}));
  const nlohmann::json full = nlohmann::json::parse(c.rope_parameters_json);
  EXPECT_EQ(full["rope_type"], "linear");
  EXPECT_EQ(full["factor"], 4.0);
  EXPECT_EQ(full["rope_theta"], 500000.0);
  EXPECT_EQ(c.rope_theta, 500000.0);
  EXPECT_EQ(nlohmann::json::parse(c.sliding_rope_parameters_json)["rope_theta"], 20000.0);
  EXPECT_NEAR(c.attention_scale, 1.0 / std::sqrt(8.0), 1e-15);
}

}  // namespace
}  // namespace lcx
