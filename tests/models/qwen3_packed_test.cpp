// Packed documents with [data] attend_across_documents = false: a sequence holding several
// documents trains as each document alone (CPU, fp32): the loss sum (1e-6 relative) and every
// parameter gradient (2e-6 relative L2) of one packed step equal the sums over one step per document. Positions restart at
// each document (core's rotary and rope_yarn read them from the shard), the attention is masked
// per document, and each document's EOS predicts nothing, as the dataset sets it. With
// train.checkpoint_every the backward's rebuild forwards carry the mask too.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <map>
#include <random>

#include "models/model_util.h"

namespace lcx {
namespace {

const nlohmann::json kSpec = {{"vocab_size", 64},       {"hidden_size", 32},       {"intermediate_size", 48},
                              {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                              {"head_dim", 16},         {"rope_theta", 10000.0},    {"tie_word_embeddings", false},
                              {"initializer_range", 0.02}};
constexpr int32_t kEos = 63;

// Documents of these lengths (each ending with its EOS), random tokens.
std::vector<std::vector<int32_t>> documents(const std::vector<int64_t>& lengths) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> tok(0, kEos - 1);
  std::vector<std::vector<int32_t>> docs;
  for (int64_t n : lengths) {
    std::vector<int32_t> d(static_cast<size_t>(n));
    for (auto& t : d) t = tok(rng);
    d.back() = kEos;
    docs.push_back(d);
  }
  return docs;
}

// The documents end to end as the dataset packs them: targets shifted within each document, its
// EOS's ignored; with `masked`, the bounds between them.
Sequence pack(const std::vector<std::vector<int32_t>>& docs, bool masked) {
  int64_t L = 0;
  for (const auto& d : docs) L += static_cast<int64_t>(d.size());
  Sequence s;
  s.tokens = Tensor::empty({L}, DType::i32);
  s.targets = Tensor::empty({L}, DType::i64);
  s.document_count = static_cast<int>(docs.size());
  int64_t at = 0;
  if (masked) s.document_bounds.push_back(0);
  for (const auto& d : docs) {
    const int64_t n = static_cast<int64_t>(d.size());
    for (int64_t i = 0; i < n; ++i) {
      s.tokens.data_as<int32_t>()[at + i] = d[static_cast<size_t>(i)];
      s.targets.data_as<int64_t>()[at + i] = i + 1 < n ? d[static_cast<size_t>(i + 1)] : -100;
    }
    at += n;
    if (masked) s.document_bounds.push_back(at);
  }
  return s;
}

struct Trained {
  double loss_sum = 0;
  int64_t valid = 0;
  std::map<std::string, std::vector<float>> grads;
};

// One step per sequence, gradients accumulating (grad_scale 1: sums, not means).
Trained train(const std::vector<Sequence>& seqs, const std::string& rope_yarn_table, const std::string& qwen3_table,
              int64_t checkpoint_every) {
  std::shared_ptr<Model> model = test::make_qwen3(qwen3_table);
  model->init_random(kSpec.dump(), 23, Device::cpu(), DType::f32);
  std::shared_ptr<PositionalEncoding> pe =
      rope_yarn_table.empty() ? std::shared_ptr<PositionalEncoding>(make_default_rope())
                              : test::make_plugin<PositionalEncoding>("rope_yarn", rope_yarn_table);
  test::DefaultSlots s(*model, pe);
  s.slots.recipe.set_checkpoint_every(checkpoint_every);
  model->zero_grad();
  Trained t;
  for (const Sequence& seq : seqs) {
    const StepResult r = train_step(s.slots, s.parallel->shard(seq, 0), 1.0, Device::cpu());
    t.loss_sum += r.loss_sum;
    t.valid += r.valid;
  }
  for (Parameter* p : model->parameters()) t.grads[p->name] = p->grad.to_floats();
  return t;
}

void expect_packed_equals_alone(const std::vector<int64_t>& lengths, const std::string& rope_yarn_table,
                                const std::string& qwen3_table = "", int64_t checkpoint_every = 1) {
  const auto docs = documents(lengths);
  std::vector<Sequence> alone;
  for (const auto& d : docs) alone.push_back(pack({d}, false));
  const Trained want = train(alone, rope_yarn_table, qwen3_table, checkpoint_every);
  const Trained got = train({pack(docs, true)}, rope_yarn_table, qwen3_table, checkpoint_every);
  const std::string what = str(lengths.size(), " documents", rope_yarn_table.empty() ? "" : ", rope_yarn",
                               qwen3_table.empty() ? "" : ", " + qwen3_table, ", checkpoint_every ", checkpoint_every);
  EXPECT_EQ(got.valid, want.valid) << what;
  EXPECT_NEAR(got.loss_sum, want.loss_sum, 1e-6 * std::abs(want.loss_sum)) << what;
  for (const auto& [name, g] : want.grads) {
    double norm = 0;
    for (float x : g) norm = std::max(norm, std::abs(static_cast<double>(x)));
    ASSERT_GT(norm, 0) << name << " has no gradient: " << what;
    // Relative L2: fp32 GEMMs over the packed rows and over each document's sum in another order,
    // a few ulps per element; measured up to 8.3e-7 here, the bound leaves room for other BLAS
    // builds. A missing mask or wrong positions are off by far more (checked below).
    EXPECT_LE(test::rel_l2(got.grads.at(name), g), 2e-6) << name << ": " << what;
  }
  // Unmasked, the same packed sequence is another computation: the mask is what makes them equal.
  const Trained across = train({pack(docs, false)}, rope_yarn_table, qwen3_table, checkpoint_every);
  EXPECT_GT(std::abs(across.loss_sum - want.loss_sum), 1e-4 * std::abs(want.loss_sum)) << what;
}

TEST(PackedDocuments, TrainAsEachDocumentAlone) {
  // A long one, a one-token one (its EOS alone), and lengths that cross the kernel's key blocks.
  expect_packed_equals_alone({70, 1, 9, 131, 4}, "");
}

TEST(PackedDocuments, RopeYarnPositionsRestartPerDocument) {
  expect_packed_equals_alone({40, 17, 66}, "factor = 4.0\noriginal_max_position_embeddings = 32");
}

TEST(PackedDocuments, HeadGroupsCarryTheMask) {
  expect_packed_equals_alone({33, 12, 50}, "", "attention_head_groups = 2");
}

// Two layers, the second's input rebuilt in the backward by layer 0's forward again: that forward
// masks too, or layer 1's gradients would be the unmasked ones.
TEST(PackedDocuments, CheckpointRebuildCarriesTheMask) {
  expect_packed_equals_alone({45, 3, 60}, "", "", 2);
}

}  // namespace
}  // namespace lcx
