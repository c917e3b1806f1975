// Parity with transformers. Each folder of tests/parity/fixtures written by gen_fixtures.py is a
// real HF checkpoint plus expected.safetensors (what Qwen3ForCausalLM computed for fixed tokens);
// lcx loads the folder on the CPU, runs the step driver with core's default slots, and must give
// the same loss and logits (1e-5 relative) and every parameter gradient (1e-4 relative L2).
// The export half: an HF folder written by lcx reloads with identical weights and loss, and the
// committed lcx export is what transformers read back (fixtures/lcx_export).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lcx/ops.h"
#include "lcx/safetensors.h"
#include "models/model_util.h"
#include "parity/export_spec.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(LCX_TEST_DATA_DIR) / "parity" / "fixtures";

std::vector<int64_t> ints(const Tensor& t) {
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = t.data_as<int64_t>()[i];
  return v;
}

double relative_l2(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// hidden [T,H] @ head^T -> logits [T,V], columns [0, cols).
std::vector<float> logits_slice(Model& m, const Tensor& hidden, int64_t cols) {
  const int64_t T = hidden.size(0), V = m.config().vocab_size;
  Tensor logits = Tensor::empty({T, V}, DType::f32, hidden.device());
  ops::matmul(hidden, false, m.head_weight(), true, logits);
  std::vector<float> all = logits.to_floats(), out;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t v = 0; v < cols; ++v) out.push_back(all[static_cast<size_t>(t * V + v)]);
  return out;
}

std::vector<fs::path> fixture_models() {
  std::vector<fs::path> out;
  if (fs::exists(kFixtures))
    for (const auto& e : fs::directory_iterator(kFixtures))
      if (fs::exists(e.path() / "expected.safetensors")) out.push_back(e.path());
  std::sort(out.begin(), out.end());
  return out;
}

// Where and in what precision a fixture runs, and how close it must come: the CPU reference in
// fp32 to the issue's tolerances; the GPU in fp32 (cuBLASLt and the attention kernels accumulate
// in another order); the GPU in bf16, as training runs, to bf16's resolution.
struct Mode {
  const char* name;
  Device device;
  DType dtype;
  double loss_tol, logits_tol, grad_tol;
};
const Mode kModes[] = {
    {"cpu_fp32", Device::cpu(), DType::f32, 1e-5, 1e-5, 1e-4},
    {"cuda_fp32", Device::cuda(0), DType::f32, 1e-4, 1e-4, 1e-3},
    {"cuda_bf16", Device::cuda(0), DType::bf16, 2e-2, 3e-2, 5e-2},
};

class TransformersParity : public ::testing::TestWithParam<std::tuple<fs::path, Mode>> {};

TEST_P(TransformersParity, LossLogitsAndEveryGradient) {
  const fs::path dir = std::get<0>(GetParam());
  const Mode mode = std::get<1>(GetParam());
  if (mode.device.is_cuda() && !cuda_available()) GTEST_SKIP() << "no GPU on this machine";
  const Device device = mode.device;
  auto model = test::make_qwen3();
  model->load_hf(dir.string(), device, mode.dtype);
  safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
  Shard shard = test::shard_from_labels(ints(expected.load("input_ids", DType::i64)),
                                        ints(expected.load("labels", DType::i64)));
  const int64_t valid = test::count_valid(shard);
  // A YaRN checkpoint runs with the rope_yarn plugin, which reads the checkpoint's rope parameters.
  const bool yarn = nlohmann::json::parse(model->config().rope_parameters_json).value("rope_type", "") == "yarn";
  test::DefaultSlots s(*model, yarn ? test::make_plugin<PositionalEncoding>("rope_yarn") : make_default_rope());
  StepResult r = test::mean_loss_step(s, shard, valid, device);
  ASSERT_EQ(r.valid, valid);

  const double want_loss = expected.load("loss", DType::f32).to_floats()[0];
  const double loss = r.loss_sum / static_cast<double>(r.valid);
  EXPECT_LE(std::abs(loss - want_loss) / std::abs(want_loss), mode.loss_tol) << "lcx " << loss << " transformers " << want_loss;

  const Tensor want_logits = expected.load("logits", DType::f32);
  std::vector<float> got = logits_slice(*model, forward_hidden(s.slots, shard, device), want_logits.size(1));
  std::vector<float> want = want_logits.to_floats();
  float max_ref = 0, max_diff = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_ref = std::max(max_ref, std::abs(want[i]));
    max_diff = std::max(max_diff, std::abs(got[i] - want[i]));
  }
  EXPECT_LE(max_diff, mode.logits_tol * max_ref) << "logits: max |diff| " << max_diff << " of max |ref| " << max_ref;
  EXPECT_LE(relative_l2(got, want), mode.logits_tol);

  size_t checked = 0;
  double worst = 0;
  for (Parameter* p : model->parameters()) {
    const std::string key = "grad." + p->name;
    ASSERT_TRUE(expected.has(key)) << key << " missing from " << dir;
    const double rel = relative_l2(p->grad.to_floats(), expected.load(key, DType::f32).to_floats());
    EXPECT_LE(rel, mode.grad_tol) << p->name;
    worst = std::max(worst, rel);
    ++checked;
  }
  std::printf("%s %s: loss rel %.2e, logits max|diff|/max|ref| %.2e, worst gradient rel L2 %.2e over %zu parameters\n",
              dir.filename().c_str(), mode.name, std::abs(loss - want_loss) / std::abs(want_loss), max_diff / max_ref, worst, checked);
  size_t recorded = 0;
  for (const auto& n : expected.names()) recorded += n.rfind("grad.", 0) == 0;
  EXPECT_EQ(checked, recorded) << "transformers has parameters lcx does not";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TransformersParity,
                         ::testing::Combine(::testing::ValuesIn(fixture_models()), ::testing::ValuesIn(kModes)),
                         [](const auto& info) {
                           return std::get<0>(info.param).filename().string() + "_" + std::get<1>(info.param).name;
                         });

TEST(TransformersParityFixtures, AllFiveModelsArePresent) {
  // Tied and untied, GQA 1/2/4, head_dim 64 and 128, sharded and not, YaRN (see gen_fixtures.py).
  EXPECT_EQ(fixture_models().size(), 5u);
}

TEST(LcxExport, WrittenFoldersReloadWithIdenticalWeightsAndLoss) {
  for (DType disk : {DType::f32, DType::bf16}) {
    auto dir = test::temp_dir("export");
    auto a = test::make_qwen3("max_shard_size = \"1MiB\"");
    a->init_random(R"({"vocab_size":2048,"hidden_size":128,"intermediate_size":96,"num_hidden_layers":2,
       "num_attention_heads":4,"num_key_value_heads":1,"head_dim":32,"tie_word_embeddings":false})",
                   4, Device::cpu(), disk);
    test::DefaultSlots sa(*a);
    a->save_hf(dir.string(), disk, sa.rope->hf_rope_parameters());
    EXPECT_TRUE(fs::exists(dir / "model.safetensors.index.json"));  // 2 x 1 MiB embedding and head: sharded
    auto b = test::make_qwen3();
    b->load_hf(dir.string(), Device::cpu(), disk);
    auto pa = a->parameters(), pb = b->parameters();
    ASSERT_EQ(pa.size(), pb.size());
    for (size_t i = 0; i < pa.size(); ++i) {
      ASSERT_EQ(pa[i]->name, pb[i]->name);
      ASSERT_EQ(0, std::memcmp(pa[i]->value.data(), pb[i]->value.data(), pa[i]->value.nbytes())) << pa[i]->name;
    }
    test::DefaultSlots sb(*b);
    Shard shard = test::shard_from_labels(parity::export_ids(), parity::export_labels());
    EvalResult ea = eval_step(sa.slots, shard, Device::cpu()), eb = eval_step(sb.slots, shard, Device::cpu());
    EXPECT_EQ(ea.loss_sum, eb.loss_sum);
    EXPECT_EQ(ea.valid, eb.valid);
  }
}

class CommittedExport : public ::testing::TestWithParam<parity::ExportVariant> {};

TEST_P(CommittedExport, IsWhatLcxWritesAndWhatTransformersRead) {
  const parity::ExportVariant& v = GetParam();
  const fs::path dir = kFixtures / v.folder;
  ASSERT_TRUE(fs::exists(dir / "expected.json")) << "write it with lcx_parity_export (tests/parity/README.md)";
  nlohmann::json expected = nlohmann::json::parse(std::ifstream(dir / "expected.json"));
  // The tool's model, rounded to bf16 as saved, equals the committed weights.
  auto fresh = test::make_qwen3();
  fresh->init_random(v.spec, parity::kExportSeed, Device::cpu(), DType::bf16);
  auto saved = test::make_qwen3();
  saved->load_hf(dir.string(), Device::cpu(), DType::bf16);
  auto pf = fresh->parameters(), ps = saved->parameters();
  ASSERT_EQ(pf.size(), ps.size());
  for (size_t i = 0; i < pf.size(); ++i)
    ASSERT_EQ(0, std::memcmp(pf[i]->value.data(), ps[i]->value.data(), pf[i]->value.nbytes())) << pf[i]->name;
  // lcx's loss on the folder is the one recorded.
  auto model = test::make_qwen3();
  model->load_hf(dir.string(), Device::cpu(), DType::f32);
  test::DefaultSlots s(*model);
  Shard shard = test::shard_from_labels(parity::export_ids(), parity::export_labels());
  EvalResult e = eval_step(s.slots, shard, Device::cpu());
  const double loss = e.loss_sum / static_cast<double>(e.valid);
  EXPECT_NEAR(loss, expected["loss"].get<double>(), 1e-6 * loss);
  // And transformers' loss on the same folder (check_export.py, run where transformers is).
  ASSERT_TRUE(fs::exists(dir / "transformers_check.json")) << "run check_export.py (tests/parity/README.md)";
  nlohmann::json hf = nlohmann::json::parse(std::ifstream(dir / "transformers_check.json"));
  EXPECT_TRUE(hf["problems"].empty()) << hf["problems"].dump();
  EXPECT_LE(std::abs(loss - hf["loss"].get<double>()) / loss, 1e-5) << "transformers " << hf["loss"] << " lcx " << loss;
  EXPECT_EQ(hf["weights_compared"].get<size_t>(), pf.size() + (model->config().tie_word_embeddings ? 1 : 0));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CommittedExport, ::testing::ValuesIn(parity::kExports),
                         [](const auto& info) { return std::string(info.param.folder); });

}  // namespace
}  // namespace lcx
