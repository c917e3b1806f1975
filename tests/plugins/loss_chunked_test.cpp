// loss_chunked against core's full-logits loss: loss sum, valid count, grad of hidden and
// accumulated grad of the head, for tied and untied heads, ragged and tiny T, odd V and chunks with
// every label ignored. The plugin is loaded through the real loader from the build's plugin folder,
// so these tests exercise the .so a run would load.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "config/manifest.h"
#include "lcx/defaults.h"
#include "lcx/loss.h"
#include "plugin/loader.h"
#include "support/test_util.h"

namespace lcx {
namespace {

std::shared_ptr<Loss> load_chunked(int64_t chunk_rows) {
  PluginInfo info;
  auto loss = test::make_plugin<Loss>("loss_chunked", str("chunk_rows = ", chunk_rows), Device::cpu(), &info);
  EXPECT_EQ(info.status, "ready");
  return loss;
}

Tensor random_tensor(Shape shape, std::mt19937& rng, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (auto& x : v) x = dist(rng);
  return Tensor::from_floats(v, std::move(shape), DType::f32);
}

// Targets in [0,V), with every position in `ignored` set to -100.
Tensor make_targets(int64_t T, int64_t V, std::mt19937& rng, const std::vector<std::pair<int64_t, int64_t>>& ignored,
                    double ignore_rate = 0.1) {
  Tensor t = Tensor::empty({T}, DType::i64);
  std::uniform_int_distribution<int64_t> tok(0, V - 1);
  std::bernoulli_distribution drop(ignore_rate);
  int64_t* p = t.data_as<int64_t>();
  for (int64_t i = 0; i < T; ++i) p[i] = drop(rng) ? -100 : tok(rng);
  for (auto [b, e] : ignored)
    for (int64_t i = b; i < e; ++i) p[i] = -100;
  return t;
}

void expect_close(const Tensor& got, const Tensor& want, float rtol, float atol, const char* what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  auto g = got.to_floats(), w = want.to_floats();
  float worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    float excess = std::fabs(g[i] - w[i]) - (atol + rtol * std::fabs(w[i]));
    if (excess > worst) worst = excess, worst_i = i;
  }
  EXPECT_EQ(worst, 0.f) << what << ": element " << worst_i << " got " << g[worst_i] << " want " << w[worst_i];
}

struct Case {
  int64_t T, H, V, chunk_rows;
  bool tied;
  std::vector<std::pair<int64_t, int64_t>> ignored;  // row ranges whose labels are all -100
  DType dtype = DType::f32;  // of hidden, head and grad_hidden (bf16 is what the GPU stores)
};

// Runs core's loss and the plugin on the same inputs and compares every output. The head gradient
// starts non-zero to check that both accumulate; with a tied head it is the embedding's gradient,
// which already holds the embedding's contribution.
void compare(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  Tensor hidden = random_tensor({c.T, c.H}, rng, 1.f).to(c.dtype);
  Tensor embed = random_tensor({c.V, c.H}, rng, 0.5f).to(c.dtype);
  Tensor head = c.tied ? embed : random_tensor({c.V, c.H}, rng, 0.5f).to(c.dtype);
  Tensor targets = make_targets(c.T, c.V, rng, c.ignored);
  Tensor grad_head0 = random_tensor({c.V, c.H}, rng, 0.1f);

  auto full = make_full_logits_loss();
  auto chunked = load_chunked(c.chunk_rows);
  const double scale = 1.0 / 37;  // as if the step had valid targets on other ranks too

  Tensor gh_ref = Tensor::empty({c.T, c.H}, c.dtype), gw_ref = grad_head0.clone();
  LossResult ref = full->forward_backward(hidden, head, targets, scale, gh_ref, gw_ref);
  Tensor gh = Tensor::empty({c.T, c.H}, c.dtype), gw = grad_head0.clone();
  // Garbage in grad_hidden: the plugin must write every row, skipped chunks included.
  std::vector<float> junk(static_cast<size_t>(c.T * c.H), 1e3f);
  gh.copy_from(Tensor::from_floats(junk, {c.T, c.H}, c.dtype));
  LossResult got = chunked->forward_backward(hidden, head, targets, scale, gh, gw);

  EXPECT_EQ(got.valid, ref.valid);
  EXPECT_GT(ref.valid, 0);
  EXPECT_NEAR(got.loss_sum, ref.loss_sum, 1e-6 * std::fabs(ref.loss_sum));
  expect_close(gh, gh_ref, 1e-5f, 1e-7f, "grad_hidden");
  expect_close(gw, gw_ref, 1e-5f, 1e-7f, "grad_head");

  LossResult fwd = chunked->forward(hidden, head, targets);
  EXPECT_EQ(fwd.valid, ref.valid);
  EXPECT_NEAR(fwd.loss_sum, ref.loss_sum, 1e-6 * std::fabs(ref.loss_sum));

  // Rows of a chunk with no valid label get a zero gradient, not whatever was in the buffer.
  auto g = gh.to_floats();
  const int64_t* t = targets.data_as<int64_t>();
  int64_t skipped = 0;
  for (int64_t b = 0; b < c.T; b += c.chunk_rows) {
    const int64_t e = std::min(c.T, b + c.chunk_rows);
    if (std::any_of(t + b, t + e, [](int64_t x) { return x != -100; })) continue;
    ++skipped;
    for (int64_t i = b * c.H; i < e * c.H; ++i) ASSERT_EQ(g[static_cast<size_t>(i)], 0.f) << "row " << i / c.H;
  }
  EXPECT_EQ(skipped > 0, !c.ignored.empty()) << "the case meant to have fully ignored chunks";
}

TEST(LossChunked, UntiedHeadMatchesFullLogits) { compare({300, 32, 257, 64, false, {}}, 1); }

TEST(LossChunked, TiedHeadMatchesFullLogits) { compare({300, 32, 257, 64, true, {}}, 2); }

TEST(LossChunked, ChunksWithEveryLabelIgnored) {
  // Chunks 1 and 3 (rows 64..127, 192..255) have no valid label; the last, partial chunk too.
  compare({290, 24, 101, 64, false, {{64, 128}, {192, 256}, {256, 290}}}, 3);
  compare({290, 24, 101, 64, true, {{60, 200}}}, 4);
}

TEST(LossChunked, TNotAMultipleOfChunkRows) {
  compare({257, 16, 64, 32, false, {}}, 5);
  compare({1000, 16, 64, 256, true, {}}, 6);
}

TEST(LossChunked, TSmallerThanChunkRows) {
  compare({7, 16, 33, 256, false, {}}, 7);
  compare({1, 8, 33, 256, true, {}}, 8);
}

TEST(LossChunked, OddVocabulary) {
  compare({128, 20, 1, 32, false, {}}, 9);
  compare({128, 20, 997, 48, true, {}}, 10);
}

// bf16 storage, as on the GPU: the GEMM against the head runs in bf16 from a cast of dlogits and
// the head gradient accumulates in fp32 from an fp32 copy of the hidden rows, as in core's loss.
TEST(LossChunked, Bf16HiddenAndHead) {
  compare({300, 32, 257, 64, false, {{64, 128}}, DType::bf16}, 15);
  compare({300, 32, 257, 64, true, {}, DType::bf16}, 16);
}

TEST(LossChunked, ChunkOfOneRow) { compare({37, 8, 19, 1, false, {{5, 9}}}, 11); }

TEST(LossChunked, AllTargetsIgnoredGivesZero) {
  std::mt19937 rng(12);
  Tensor hidden = random_tensor({50, 8}, rng, 1.f), head = random_tensor({11, 8}, rng, 1.f);
  Tensor targets = make_targets(50, 11, rng, {{0, 50}});
  Tensor gh = random_tensor({50, 8}, rng, 1.f), gw = Tensor::zeros({11, 8}, DType::f32);
  LossResult r = load_chunked(16)->forward_backward(hidden, head, targets, 1.0, gh, gw);
  EXPECT_EQ(r.valid, 0);
  EXPECT_EQ(r.loss_sum, 0.0);
  for (float v : gh.to_floats()) ASSERT_EQ(v, 0.f);
  for (float v : gw.to_floats()) ASSERT_EQ(v, 0.f);
}

TEST(LossChunked, RefusesBadChunkRows) {
  PluginLoader loader({test::build_plugin_dir()});
  Manifest m = Manifest::parse("[loss_chunked]\nchunk_rows = 0\n", "bad.toml");
  PluginArgs args{"loss_chunked", m.section("loss_chunked"), Device::cpu()};
  try {
    loader.create("loss_chunked", args);
    FAIL() << "chunk_rows = 0 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("chunk_rows"), std::string::npos) << e.what();
  }
}

TEST(LossChunked, RefusesMismatchedShapes) {
  std::mt19937 rng(13);
  Tensor hidden = random_tensor({10, 8}, rng, 1.f), head = random_tensor({11, 9}, rng, 1.f);
  Tensor targets = make_targets(10, 11, rng, {});
  EXPECT_THROW(load_chunked(4)->forward(hidden, head, targets), Error);
}

// The point of the plugin: the transient memory of the loss is one chunk's logits, not T of them.
// Measured on the CPU allocator, which accounts every tensor byte.
TEST(LossChunked, PeakTransientMemoryIsOneChunk) {
  const int64_t T = 4096, H = 64, V = 1001, C = 128;
  std::mt19937 rng(14);
  Tensor hidden = random_tensor({T, H}, rng, 1.f), head = random_tensor({V, H}, rng, 0.5f);
  Tensor targets = make_targets(T, V, rng, {});
  Tensor gh = Tensor::empty({T, H}, DType::f32), gw = Tensor::zeros({V, H}, DType::f32);
  auto full = make_full_logits_loss();
  auto chunked = load_chunked(C);
  Allocator& cpu = allocator_for(Device::cpu());

  auto transient_peak = [&](Loss& loss) {
    const int64_t live = cpu.stats().live_bytes;
    cpu.reset_peak();
    loss.forward_backward(hidden, head, targets, 1.0 / T, gh, gw);
    return cpu.stats().peak_bytes - live;
  };
  const int64_t full_peak = transient_peak(*full);
  const int64_t chunked_peak = transient_peak(*chunked);
  const int64_t logits_bytes = T * V * 4;
  const int64_t chunk_logits_bytes = C * V * 4;
  std::cout << "[ memory   ] T=" << T << " V=" << V << " chunk_rows=" << C << ": full-logits peak " << full_peak
            << " B, chunked peak " << chunked_peak << " B (" << static_cast<double>(full_peak) / chunked_peak
            << "x less)\n";
  EXPECT_GE(full_peak, 2 * logits_bytes);  // logits and dlogits, both [T,V] fp32
  // Logits and dlogits of one chunk, plus at most a small allowance for per-op work buffers.
  EXPECT_LE(chunked_peak, 2 * chunk_logits_bytes + chunk_logits_bytes / 2);
  EXPECT_LT(chunked_peak * 16, full_peak);
}

}  // namespace
}  // namespace lcx
