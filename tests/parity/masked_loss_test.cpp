// The masked loss of packed documents, as assistant-only training leaves it: one sequence of three
// documents, each attending only to itself, with targets ignored (-100) outside a few trained
// spans. Against transformers (fixtures/masked_packed, gen_fixtures.py --only masked_packed: a
// random Qwen3 of odd shapes, labels -100 outside the spans, loss and gradients in fp32): lcx's
// loss within 1e-6 relative and every gradient within 1e-4 relative L2, on the CPU in fp32, on one
// rank and on thread-ranks cp 2, sp 2 and cp 2 x sp 2. Without the fixture, the same shapes at a
// random init: each mesh's loss and gradients against one rank's. Under cp and sp each target is
// counted on the one rank holding it, so the count and the loss summed over the ranks are one rank's
// (not cp times it).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <random>

#include "lcx/safetensors.h"
#include "plugins/sp_cp_cases.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;

const fs::path kFixture = fs::path(LCX_TEST_DATA_DIR) / "parity" / "fixtures" / "masked_packed";
const fs::path kExpected = kFixture / "expected_masked.safetensors";

// gen_fixtures.py's MASKED, MASKED_BOUNDS and MASKED_SPANS.
constexpr const char* kSpec = R"({"vocab_size":331,"hidden_size":40,"intermediate_size":56,"num_hidden_layers":2,
  "num_attention_heads":6,"num_key_value_heads":2,"head_dim":12,"max_position_embeddings":72,"rms_norm_eps":1e-6,
  "rope_theta":10000.0,"tie_word_embeddings":false})";
const std::vector<int64_t> kBounds = {0, 29, 55, 72};
const std::vector<std::pair<int64_t, int64_t>> kSpans = {{9, 18}, {24, 29}, {36, 47}, {56, 61}, {66, 72}};

// HF labels (unshifted) -> the packed Sequence lcx's dataset yields: targets[t] = labels[t + 1],
// the sequence's last ignored, the documents' bounds.
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

// The generator's sequence without its random draw: tokens from a seeded generator, each document
// ending with EOS (the vocabulary's last id), labels only inside the spans.
Sequence synthetic() {
  std::mt19937 rng(4242);
  std::uniform_int_distribution<int64_t> tok(0, 329);
  std::vector<int64_t> ids(72), labels(72, -100);
  for (auto& x : ids) x = tok(rng);
  for (size_t d = 1; d < kBounds.size(); ++d) ids[static_cast<size_t>(kBounds[d] - 1)] = 330;
  for (auto [b, e] : kSpans)
    for (int64_t t = b; t < e; ++t) labels[static_cast<size_t>(t)] = ids[static_cast<size_t>(t)];
  return packed(ids, labels, kBounds);
}

std::vector<int64_t> ints(const Tensor& t) {
  return std::vector<int64_t>(t.data_as<int64_t>(), t.data_as<int64_t>() + t.numel());
}

int64_t valid_of(const Sequence& s) {
  int64_t n = 0;
  for (int64_t t = 0; t < s.targets.numel(); ++t) n += s.targets.data_as<int64_t>()[t] != -100;
  return n;
}

// What one step gave: the loss summed over the sequence's ranks, their count, every gradient summed.
struct Outcome {
  double loss_sum = 0;
  int64_t valid = 0;
  std::map<std::string, std::vector<float>> grads;
  double loss() const { return loss_sum / static_cast<double>(valid); }
};

struct MeshCase {
  const char* name;
  int cp, sp;
};
const MeshCase kMeshes[] = {{"one rank", 1, 1}, {"cp 2", 2, 1}, {"sp 2", 1, 2}, {"cp 2 x sp 2", 2, 2}};

std::shared_ptr<Parallelism> parallelism(const MeshCase& m) {
  if (m.cp > 1 && m.sp > 1) return test::load_stacked(m.cp, m.sp);
  if (m.sp > 1) return test::load_ulysses(m.sp);
  if (m.cp > 1) return test::make_plugin<Parallelism>("cp_ring", "", Device::cpu(), nullptr, MeshShape{1, m.cp, 1});
  return std::shared_ptr<Parallelism>(make_single_rank());
}

// The model from the fixture's folder, or (fixture absent) the same shapes at a random init.
std::shared_ptr<Model> model(bool fixture) {
  auto m = test::make_qwen3();
  if (fixture)
    m->load_hf(kFixture.string(), Device::cpu(), DType::f32);
  else
    m->init_random(kSpec, 31, Device::cpu(), DType::f32);
  return m;
}

// One training step of `seq` over the mesh's ranks (threads), each with its own copy of the
// model, with the whole sequence's mean scale (transformers' mean over the valid labels).
Outcome step(const MeshCase& m, const Sequence& seq, bool fixture, const std::string& loss) {
  const int n = m.cp * m.sp;
  const double scale = 1.0 / static_cast<double>(valid_of(seq));
  std::vector<test::Slots> ranks;
  for (int r = 0; r < n; ++r) {
    test::Slots s;
    s.model = model(fixture);
    s.loss = loss == "nll" ? std::shared_ptr<Loss>(make_full_logits_loss()) : test::make_plugin<Loss>(loss, "chunk_rows = 5");
    s.rope = std::shared_ptr<PositionalEncoding>(make_default_rope());
    s.memory = std::shared_ptr<MemoryStrategy>(make_on_device_memory());
    s.parallel = parallelism(m);
    ranks.push_back(std::move(s));
  }
  Outcome out;
  auto collect = [&](test::Slots& s) {
    for (Parameter* p : s.model->parameters()) out.grads[p->name] = p->grad.to_floats();
  };
  if (n == 1) {
    StepSlots slots = ranks[0].slots();
    configure_slots(slots);
    ranks[0].model->zero_grad();
    const StepResult r = train_step(slots, ranks[0].parallel->shard(seq, 0), scale, Device::cpu());
    out.loss_sum = r.loss_sum;
    out.valid = r.valid;
    collect(ranks[0]);
    return out;
  }
  std::vector<double> sums(2 * static_cast<size_t>(n));
  run_in_process(n, [&](Communicator& comm) {
    Mesh mesh(comm, {.dp = 1, .cp = m.cp, .sp = m.sp});
    const int r = comm.rank();
    const StepResult got = test::rank_step(ranks[static_cast<size_t>(r)], mesh, mesh.seq(), seq,
                                           seq_index(mesh.shape(), mesh.coord()), scale, Device::cpu());
    double s[2] = {got.loss_sum, static_cast<double>(got.valid)};
    mesh.seq().all_reduce(std::span<double>(s, 2));
    sums[2 * static_cast<size_t>(r)] = s[0];
    sums[2 * static_cast<size_t>(r) + 1] = s[1];
  });
  for (int r = 1; r < n; ++r) {  // every rank holds the same sums
    EXPECT_EQ(sums[2 * static_cast<size_t>(r)], sums[0]) << m.name;
    EXPECT_EQ(sums[2 * static_cast<size_t>(r) + 1], sums[1]) << m.name;
  }
  out.loss_sum = sums[0];
  out.valid = static_cast<int64_t>(sums[1]);
  collect(ranks[0]);
  return out;
}

void expect_grads(const std::map<std::string, std::vector<float>>& got, const std::map<std::string, std::vector<float>>& want,
                  double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  for (const auto& [name, w] : want) {
    ASSERT_TRUE(got.count(name)) << name << ": " << what;
    const double rel = test::rel_l2(got.at(name), w);
    EXPECT_LE(rel, tol) << name << ": " << what;
    worst = std::max(worst, rel);
  }
  std::printf("%s: worst gradient rel L2 %.2e over %zu parameters\n", what.c_str(), worst, want.size());
}

// The sequence holds what the dataset would give it: each document's EOS predicts nothing, every
// trained span lies inside one document, and half the targets or more are masked.
void expect_masked_packed(const Sequence& seq) {
  const int64_t* t = seq.targets.data_as<int64_t>();
  for (size_t d = 1; d < seq.document_bounds.size(); ++d) EXPECT_EQ(t[seq.document_bounds[d] - 1], -100) << "document " << d;
  const int64_t valid = valid_of(seq);
  EXPECT_GT(valid, 0);
  EXPECT_LE(valid, seq.targets.numel() / 2) << "an assistant-only mask leaves half the targets or more out";
}

TEST(MaskedLossParity, EachMeshEqualsTransformers) {
  if (!fs::exists(kExpected))
    GTEST_SKIP() << "fixtures/masked_packed absent: python3 tests/parity/gen_fixtures.py --out tests/parity/fixtures "
                    "--only masked_packed (where transformers is; tests/parity/README.md)";
  safetensors::Checkpoint expected = safetensors::Checkpoint::open(kExpected.string());
  const std::vector<int64_t> bounds = ints(expected.load("document_bounds", DType::i64));
  ASSERT_EQ(bounds, kBounds) << "the fixture and this test describe other documents";
  const Sequence seq = packed(ints(expected.load("input_ids", DType::i64)), ints(expected.load("labels", DType::i64)), bounds);
  expect_masked_packed(seq);
  const int64_t want_valid = ints(expected.load("valid", DType::i64))[0];
  ASSERT_EQ(valid_of(seq), want_valid);
  const double want_loss = expected.load("loss", DType::f32).to_floats()[0];
  std::map<std::string, std::vector<float>> want_grads;
  for (const auto& name : expected.names())
    if (name.rfind("grad.", 0) == 0) want_grads[name.substr(5)] = expected.load(name, DType::f32).to_floats();
  for (const MeshCase& m : kMeshes)
    for (const std::string loss : {"nll", "loss_chunked"}) {
      const std::string what = str(m.name, ", ", loss);
      const Outcome got = step(m, seq, true, loss);
      EXPECT_EQ(got.valid, want_valid) << what << ": each target counted once over the ranks";
      EXPECT_LE(std::fabs(got.loss() - want_loss) / want_loss, 1e-6) << what << ": lcx " << got.loss() << ", transformers " << want_loss;
      std::printf("%s: loss rel %.2e\n", what.c_str(), std::fabs(got.loss() - want_loss) / want_loss);
      expect_grads(got.grads, want_grads, 1e-4, what);
    }
}

TEST(MaskedLossMesh, EachMeshEqualsOneRank) {
  const Sequence seq = synthetic();
  expect_masked_packed(seq);
  for (const std::string loss : {"nll", "loss_chunked"}) {
    const Outcome one = step(kMeshes[0], seq, false, loss);
    ASSERT_EQ(one.valid, valid_of(seq));
    for (const MeshCase& m : kMeshes) {
      if (m.cp * m.sp == 1) continue;
      const std::string what = str(m.name, ", ", loss, ", random init");
      const Outcome got = step(m, seq, false, loss);
      EXPECT_EQ(got.valid, one.valid) << what << ": each target counted once over the ranks";
      EXPECT_LE(std::fabs(got.loss() - one.loss()) / one.loss(), 1e-6) << what << ": " << got.loss() << " vs one rank " << one.loss();
      expect_grads(got.grads, one.grads, 1e-5, what);
    }
  }
}

}  // namespace
}  // namespace lcx
