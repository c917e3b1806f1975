// tiled_mlp (MLP slot): tiles of rows against core's whole MLP, alone and inside a qwen3 step; its
// plan terms; its refusal; and that lcx-train lists it. One tile covering the sequence is the whole
// MLP bit for bit. Smaller tiles do the same per-row math, but the CPU's GEMM (OpenBLAS sgemm)
// picks its kernel by the matrix's shape, so a row computed in a 9-row GEMM may differ in the last
// bits from the same row in a 40-row one: held to fp32 rounding instead.
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <random>

#include "lcx/ops.h"
#include "lcx/plan.h"
#include "models/model_util.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::rel_l2;

std::shared_ptr<MlpStrategy> make_tiled(const std::string& table, Device device = Device::cpu()) {
  return test::make_plugin<MlpStrategy>("tiled_mlp", table, device);
}

Tensor random(Shape shape, DType dt, std::mt19937& rng, Device d = Device::cpu(), float scale = 0.5f) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (float& x : v) x = dist(rng);
  return Tensor::from_floats(v, shape, dt, d);
}

struct MlpRun {
  std::vector<float> out, dx, dgate, dup, ddown;
};

MlpRun run_mlp(MlpStrategy& mlp, const Tensor& x, const MlpWeights& w, const Tensor& dout) {
  const int64_t T = x.size(0), H = x.size(1), I = w.gate.size(0);
  const Device d = x.device();
  Tensor out = Tensor::empty({T, H}, x.dtype(), d), dx = Tensor::empty({T, H}, x.dtype(), d);
  MlpWeights g{Tensor::zeros({I, H}, DType::f32, d), Tensor::zeros({I, H}, DType::f32, d),
               Tensor::zeros({H, I}, DType::f32, d)};
  mlp.forward(x, w, out);
  mlp.backward(x, w, dout, dx, g);
  return {out.to_floats(), dx.to_floats(), g.gate.to_floats(), g.up.to_floats(), g.down.to_floats()};
}

class TiledMlpCpu : public ::testing::TestWithParam<DType> {};

TEST_P(TiledMlpCpu, TilesMatchTheWholeMlp) {
  const DType dt = GetParam();
  const int64_t T = 100, H = 32, I = 48;
  std::mt19937 rng(11);
  const Tensor x = random({T, H}, dt, rng), dout = random({T, H}, dt, rng);
  const MlpWeights w{random({I, H}, dt, rng, Device::cpu(), 0.2f), random({I, H}, dt, rng, Device::cpu(), 0.2f),
                     random({H, I}, dt, rng, Device::cpu(), 0.2f)};
  auto whole = make_whole_mlp();
  const MlpRun want = run_mlp(*whole, x, w, dout);
  for (int64_t rows : {1, 7, 64, 100, 1000}) {
    auto tiled = make_tiled(str("tile_rows = ", rows));
    const MlpRun got = run_mlp(*tiled, x, w, dout);
    if (rows >= T) {  // one tile: the same GEMMs as the whole MLP
      EXPECT_EQ(got.out, want.out) << rows;
      EXPECT_EQ(got.dx, want.dx) << rows;
      EXPECT_EQ(got.dgate, want.dgate) << rows;
      EXPECT_EQ(got.dup, want.dup) << rows;
      EXPECT_EQ(got.ddown, want.ddown) << rows;
    } else {  // fp32 rounding; a bf16 output rounds that difference to a bf16 step at most
      const double tol = dt == DType::f32 ? 1e-6 : 1e-3;
      EXPECT_LT(rel_l2(got.out, want.out), tol) << rows;
      EXPECT_LT(rel_l2(got.dx, want.dx), tol) << rows;
      EXPECT_LT(rel_l2(got.dgate, want.dgate), 1e-6) << rows;  // fp32 sums over rows, added tile by tile
      EXPECT_LT(rel_l2(got.dup, want.dup), 1e-6) << rows;
      EXPECT_LT(rel_l2(got.ddown, want.ddown), 1e-6) << rows;
      EXPECT_NE(got.dgate, std::vector<float>(got.dgate.size(), 0.f));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, TiledMlpCpu, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST(TiledMlp, Qwen3StepMatchesTheWholeMlp) {
  const nlohmann::json spec = {{"vocab_size", 128},        {"hidden_size", 32},        {"intermediate_size", 80},
                               {"num_hidden_layers", 3},   {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                               {"head_dim", 8},            {"tie_word_embeddings", false}};
  auto model = test::make_qwen3();
  model->init_random(spec.dump(), 12, Device::cpu(), DType::f32);
  std::vector<int64_t> ids(40);
  for (size_t t = 0; t < ids.size(); ++t) ids[t] = static_cast<int64_t>((t * 53 + 7) % 128);
  const Shard shard = test::shard_from_labels(ids, ids);
  test::DefaultSlots s(*model);
  auto step = [&](MlpStrategy* mlp) {
    StepSlots slots = s.slots;
    slots.mlp = mlp;
    model->zero_grad();
    const double loss = train_step(slots, shard, 1.0 / 39, Device::cpu()).loss_sum;
    std::vector<std::vector<float>> grads;
    for (Parameter* p : model->parameters()) grads.push_back(p->grad.to_floats());
    return std::make_pair(loss, grads);
  };
  const auto want = step(nullptr);  // core's whole MLP
  auto one_tile = make_tiled("tile_rows = 40");
  const auto same = step(one_tile.get());
  EXPECT_EQ(same.first, want.first);
  EXPECT_EQ(same.second, want.second);
  auto tiled = make_tiled("tile_rows = 9");
  const auto got = step(tiled.get());
  EXPECT_NEAR(got.first, want.first, 1e-6 * want.first);
  for (size_t i = 0; i < want.second.size(); ++i)
    EXPECT_LT(rel_l2(got.second[i], want.second[i]), 1e-5) << model->parameters()[i]->name;
  // Under "auto" the step hands the plan's tile to the MLP slot (use_recipe): the recipe's 9 rows
  // are the same tiles as the key's, bit for bit.
  auto chosen = make_tiled("");
  s.slots.recipe.set("tiled_mlp", "tile_rows", 9);
  const auto planned = step(chosen.get());
  EXPECT_EQ(planned.first, got.first);
  EXPECT_EQ(planned.second, got.second);
}

// Under "auto" (the key absent or "auto") the tile is the plan's (the knob tiled_mlp.tile_rows, handed over
// by use_recipe), else one of about 256 MiB per [rows, I] buffer; a count set in the manifest wins.
// The CPU allocator's peak in the forward is one tile's gate, up and act.
TEST(TiledMlp, AutoTakesThePlansTileAndAKeySetWins) {
  const int64_t T = 100, H = 32, I = 48;
  std::mt19937 rng(21);
  const Tensor x = random({T, H}, DType::f32, rng);
  const MlpWeights w{random({I, H}, DType::f32, rng), random({I, H}, DType::f32, rng), random({H, I}, DType::f32, rng)};
  Allocator& cpu = allocator_for(Device::cpu());
  Tensor out = Tensor::empty({T, H}, DType::f32);
  auto peak = [&](MlpStrategy& mlp) {
    const int64_t live = cpu.stats().live_bytes;
    cpu.reset_peak();
    mlp.forward(x, w, out);
    return cpu.stats().peak_bytes - live;
  };
  auto tile = [&](int64_t rows) { return 3 * rows * I * 4; };
  Recipe r;
  r.set("tiled_mlp", "tile_rows", 7);
  for (const char* table : {"", "tile_rows = \"auto\""}) {
    auto mlp = make_tiled(table);
    EXPECT_EQ(peak(*mlp), tile(T)) << table;  // the sequence is shorter than the 256 MiB tile
    mlp->use_recipe(r);
    EXPECT_EQ(peak(*mlp), tile(7)) << table;
  }
  auto keyed = make_tiled("tile_rows = 64");
  keyed->use_recipe(r);
  EXPECT_EQ(peak(*keyed), tile(64));
}

TEST(TiledMlp, PlanHoldsOneTileOfTheIntermediates) {
  PlanInputs in;
  in.model.intermediate_size = 9728;
  in.model.hidden_size = 2560;
  in.weight_dtype = DType::bf16;
  in.tokens_per_rank = in.seq_len = 1048576;
  auto transient = [&](const MlpStrategy& m, const char* phase) {
    MemoryPlan p;
    m.plan(in, p);
    return p.gpu_bytes(phase, false);
  };
  auto whole = make_whole_mlp();
  const int64_t TI = 1048576LL * 9728 * 2;  // 19 GiB
  EXPECT_EQ(transient(*whole, plan_phase::mlp_backward), 6 * TI);
  EXPECT_EQ(transient(*whole, plan_phase::forward), 3 * TI);
  // Automatic tiles: the largest multiple of 256 rows within 256 MiB per [rows, I] buffer.
  const int64_t auto_rows = (256LL << 20) / (9728 * 2) / 256 * 256;
  EXPECT_EQ(auto_rows, 13568);
  auto tiled = make_tiled("");
  EXPECT_EQ(transient(*tiled, plan_phase::mlp_backward), 6 * auto_rows * 9728 * 2);
  EXPECT_EQ(transient(*tiled, plan_phase::forward), 3 * auto_rows * 9728 * 2);
  auto fixed = make_tiled("tile_rows = 8192");
  EXPECT_EQ(transient(*fixed, plan_phase::mlp_backward), 6 * 8192LL * 9728 * 2);
  // Under "auto" the plan's tile (PlanInputs::recipe); a key set wins over it.
  in.recipe.set("tiled_mlp", "tile_rows", 32768);
  EXPECT_EQ(transient(*tiled, plan_phase::mlp_backward), 6 * 32768LL * 9728 * 2);
  EXPECT_EQ(transient(*fixed, plan_phase::mlp_backward), 6 * 8192LL * 9728 * 2);
  // Each tile accumulates into the three weights' gradients once (whole's work per call): smaller
  // tiles are predicted slower.
  in.model.num_layers = 36;
  auto work = [&](const MlpStrategy& m) {
    MemoryPlan p;
    m.plan(in, p);
    return p.work.memory_bytes;
  };
  MemoryPlan one;
  whole->plan(in, one);
  EXPECT_DOUBLE_EQ(one.work.memory_bytes, 36 * 6.0 * 9728 * 2560 * 4);  // fp32 gradients
  EXPECT_DOUBLE_EQ(work(*tiled), 32 * one.work.memory_bytes);
  EXPECT_DOUBLE_EQ(work(*fixed), 128 * one.work.memory_bytes);
  in.tokens_per_rank = 1000;  // a sequence shorter than a tile holds only its own rows
  EXPECT_EQ(transient(*fixed, plan_phase::mlp_backward), 6 * 1000LL * 9728 * 2);
}

TEST(TiledMlp, RefusesBadTileRowsByName) {
  for (const char* bad : {"tile_rows = -1", "tile_rows = 0", "tile_rows = \"big\"", "tile_row = 4"}) {
    try {
      make_tiled(bad);
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(std::string(bad).substr(0, std::string(bad).find(' '))), std::string::npos)
          << e.what();
      if (std::string(bad).rfind("tile_rows", 0) == 0) {
        EXPECT_NE(e.fix().find("\"auto\" (the plan's choice"), std::string::npos) << e.fix();
      }
    }
  }
}

TEST(TiledMlp, ListedWithTheMlpSlot) {
  const auto r = test::run_command(test::lcx_train() + " --list-plugins");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  size_t line = r.output.find("tiled_mlp");
  ASSERT_NE(line, std::string::npos) << r.output;
  const std::string row = r.output.substr(line, r.output.find('\n', line) - line);
  EXPECT_NE(row.find(" mlp "), std::string::npos) << row;
  EXPECT_NE(row.find("ready"), std::string::npos) << row;
  const size_t off = r.output.find("\noffload ") + 1;
  ASSERT_NE(off, 0u) << r.output;
  EXPECT_NE(r.output.substr(off, r.output.find('\n', off) - off).find("ready"), std::string::npos) << r.output;
}

TEST(TiledMlpGpu, TilesMatchTheWholeMlpOnTheGpu) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device visible";
  const Device gpu = Device::cuda();
  const int64_t T = 3000, H = 256, I = 768;
  std::mt19937 rng(13);
  const Tensor x = random({T, H}, DType::bf16, rng, gpu), dout = random({T, H}, DType::bf16, rng, gpu);
  const MlpWeights w{random({I, H}, DType::bf16, rng, gpu, 0.05f), random({I, H}, DType::bf16, rng, gpu, 0.05f),
                     random({H, I}, DType::bf16, rng, gpu, 0.05f)};
  auto whole = make_whole_mlp();
  const MlpRun want = run_mlp(*whole, x, w, dout);
  auto tiled = make_tiled("tile_rows = 1024", gpu);
  const MlpRun got = run_mlp(*tiled, x, w, dout);
  // cuBLASLt may pick another algorithm for a tile's shape: bf16 rounding apart, not bits.
  EXPECT_LT(rel_l2(got.out, want.out), 1e-2);
  EXPECT_LT(rel_l2(got.dx, want.dx), 1e-2);
  EXPECT_LT(rel_l2(got.dgate, want.dgate), 1e-2);
  EXPECT_LT(rel_l2(got.dup, want.dup), 1e-2);
  EXPECT_LT(rel_l2(got.ddown, want.ddown), 1e-2);
}

}  // namespace
}  // namespace lcx
