// Two-dimensional sequence parallelism: sp_ulysses stacked over cp_ring, on CPU
// thread-ranks in fp32, against one rank holding the whole sequence; how core stacks the pair
// from a manifest; and the trainer running the mesh, dp x cp x sp included.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lcx/attention_cost.h"
#include "lcx/plan.h"
#include "plugins/sp_cp_cases.h"
#include "balance.h"
#include "slots/resolve.h"

namespace lcx {
namespace {

ParallelModelInfo model_info(int64_t Hq, int64_t Hkv) {
  ParallelModelInfo info;
  info.num_heads = Hq;
  info.num_kv_heads = Hkv;
  info.head_dim = 8;
  info.layer_types = {"full_attention"};
  return info;
}

TEST(SpCp, StacksOnlyOverTheCpAxis) {
  auto ring = test::make_plugin<Parallelism>("cp_ring", "", Device::cpu(), nullptr, MeshShape{1, 2, 2});
  auto ulysses = test::make_plugin<Parallelism>("sp_ulysses", "", Device::cpu(), nullptr, MeshShape{1, 2, 2});
  EXPECT_TRUE(ulysses->stacks_over(*ring));
  EXPECT_FALSE(ring->stacks_over(*ulysses));
  EXPECT_FALSE(ulysses->stacks_over(*test::make_plugin<Parallelism>("sp_ulysses", "", Device::cpu(), nullptr,
                                                                    MeshShape{1, 2, 2})));
  EXPECT_EQ(ulysses->size(), 2);
  ulysses->set_inner(ring);
  EXPECT_EQ(ulysses->size(), 4);
  EXPECT_EQ(ulysses->mesh_axis(), "sp");
  EXPECT_TRUE(ulysses->masks_documents());
}

// sp inside cp: the cp shard of cp rank c is cp_ring's zigzag chunks c and 2cp-1-c, and sp rank s
// of that group holds its s-th contiguous part, positions global.
TEST(SpCp, ShardIsTheContiguousSplitOfTheZigzagShard) {
  auto par = test::load_stacked(2, 2);
  const std::vector<std::vector<int32_t>> want = {{0, 1, 2, 3}, {12, 13, 14, 15}, {4, 5, 6, 7}, {8, 9, 10, 11}};
  for (int r = 0; r < 4; ++r) EXPECT_EQ(test::shard_rows(*par, 16, r), want[static_cast<size_t>(r)]) << "rank " << r;
  auto wide = test::load_stacked(2, 4);  // chunks of 8; each 16-row cp shard in 4 parts of 4
  EXPECT_EQ(test::shard_rows(*wide, 32, 1), (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_EQ(test::shard_rows(*wide, 32, 3), (std::vector<int32_t>{28, 29, 30, 31}));
  EXPECT_EQ(test::shard_rows(*wide, 32, 4), (std::vector<int32_t>{8, 9, 10, 11}));
}

TEST(SpCp, RefusesASequenceThatDoesNotSplitOverTwoCpSp) {
  auto par = test::load_stacked(2, 4);
  const test::Thrown e = test::thrown_by([&] { test::shard_rows(*par, 24, 0); });
  EXPECT_EQ(e.key, "data.pad_to_multiple_of");
  EXPECT_EQ(e.fix, "set data.pad_to_multiple_of = 16 and [data] seq_len to a multiple of 16");
}

TEST(SpCp, RefusesHeadsThatDoNotSplitOverSp) {
  auto par = test::load_stacked(2, 4);
  test::Thrown e = test::thrown_by([&] { par->configure(model_info(6, 2), nullptr); });
  EXPECT_EQ(e.key, "distributed.sp");
  EXPECT_EQ(e.fix, "use an sp that divides 6");
  EXPECT_NE(e.message.find("over sp = 4"), std::string::npos) << e.message;
  e = test::thrown_by([&] { par->configure(model_info(12, 3), nullptr); });
  EXPECT_EQ(e.key, "distributed.sp");
  EXPECT_EQ(e.fix, "use an sp that is a multiple of 3");
  EXPECT_NE(e.message.find("over sp = 4"), std::string::npos) << e.message;
}

// GQA: fewer kv heads than sp (replicas), as many, and more.
TEST(SpCpExact, AttentionEqualsSingleRank) {
  for (auto [cp, sp] : {std::pair{2, 2}, {2, 4}, {4, 2}})
    for (int64_t Hkv : {int64_t{1}, int64_t{2}, int64_t{4}, int64_t{8}}) {
      test::Attention2dCase c;
      c.cp = cp;
      c.sp = sp;
      c.L = 2 * cp * sp * 3;
      c.Hkv = Hkv;
      test::check_attention_2d(c);
    }
}

// Packed documents: the ring's document-aware pieces on each rank's heads, with bounds inside a
// chunk, on chunk edges and a one-token document.
TEST(SpCpExact, AttentionWithDocumentsEqualsSingleRank) {
  for (auto [cp, sp] : {std::pair{2, 2}, {2, 4}, {4, 2}}) {
    test::Attention2dCase c;
    c.cp = cp;
    c.sp = sp;
    c.L = 48;
    c.documents = {0, 1, 12, 13, 30, 48};
    test::check_attention_2d(c);
  }
}

// A sliding-window layer under cp x sp: the all-to-all gives each rank its cp shard's rows of its
// heads, and the ring fetches each chunk's halo; with packed documents both masks.
TEST(SpCpExact, AttentionWithAWindowEqualsSingleRank) {
  for (auto [cp, sp] : {std::pair{2, 2}, {4, 2}})
    for (int64_t w : {3, 10}) {
      test::Attention2dCase c;
      c.cp = cp;
      c.sp = sp;
      c.L = 48;
      c.window = w;
      test::check_attention_2d(c);
      c.documents = {0, 1, 12, 13, 30, 48};
      test::check_attention_2d(c);
    }
}

// Documents the ring's layout balanced for work cuts into chunks of 512 (k = 2), each cp shard then
// cut in sp.
TEST(SpCpExact, AttentionWithDocumentsCutFinerEqualsSingleRank) {
  test::Attention2dCase c;
  c.L = 4096;
  c.documents = {0, 1344, 2752, 4096};
  c.ring_table = "balance = \"work\"";
  ASSERT_EQ(cp_ring::balanced_layout(c.documents, c.L, c.cp, cp_ring::kMaskedWorkOnly).k, 2);
  test::check_attention_2d(c);
}

TEST(SpCpExact, TrainingStepEqualsSingleRank) {
  for (auto [cp, sp] : {std::pair{2, 2}, {2, 4}, {4, 2}}) {
    test::StepCase c;
    c.sp = sp;
    c.L = 48;
    c.tol = {1e-5, 1e-6, 0};  // the 1e-5 (relative L2; atol of each tensor's largest gradient)
    test::check_step_2d(cp, c);
  }
}

TEST(SpCpExact, TrainingStepWithPackedDocumentsEqualsSingleRank) {
  test::StepCase c;
  c.sp = 2;
  c.L = 48;
  c.Hkv = 4;
  c.documents = {0, 7, 20, 21, 48};
  c.tol = {1e-5, 1e-6, 0};
  test::check_step_2d(2, c);
}

// cp_inner: each cp ring on neighbouring ranks and each sp group strided over them, so world rank
// r holds the shard of another seq_index; the communicators must still meet the shards they carry.
TEST(SpCpExact, AttentionEqualsSingleRankCpInner) {
  for (auto [cp, sp] : {std::pair{2, 2}, {2, 4}, {4, 2}})
    for (int64_t Hkv : {int64_t{1}, int64_t{8}}) {
      test::Attention2dCase c;
      c.cp = cp;
      c.sp = sp;
      c.L = 48;
      c.Hkv = Hkv;
      c.order = MeshOrder::cp_inner;
      test::check_attention_2d(c);
      c.documents = {0, 1, 12, 13, 30, 48};
      test::check_attention_2d(c);
    }
}

TEST(SpCpExact, TrainingStepEqualsSingleRankCpInner) {
  for (auto [cp, sp] : {std::pair{2, 2}, {2, 4}, {4, 2}}) {
    test::StepCase c;
    c.sp = sp;
    c.L = 48;
    c.tol = {1e-5, 1e-6, 0};
    test::check_step_2d(cp, c, MeshOrder::cp_inner);
  }
}

// The composed buffers: the all-to-all's at the rank's T tokens, the ring's at the cp shard's
// sp T rows on the rank's heads, and no single-call attention scratch over the whole sequence.
TEST(SpCp, PlansTheAllToAllAndTheRingAtTheComposedShard) {
  PlanInputs in;
  in.model.num_heads = 32;
  in.model.num_kv_heads = 8;
  in.model.head_dim = 128;
  in.cp = 2;
  in.sp = 4;
  in.seq_len = 1 << 20;
  in.tokens_per_rank = in.seq_len / 8;
  MemoryPlan plan;
  test::load_stacked(2, 4)->plan(in, plan);
  auto bytes_of = [&](const std::string& id) {
    const PlanTerm* t = plan.find(id);
    return t ? t->bytes : int64_t{-1};
  };
  const int64_t T = in.tokens_per_rank;
  EXPECT_EQ(bytes_of("head_layout_forward"), T * (2 * 32 + 2 * 8) * 128 * 2);
  // K/V of 8/4 kv heads over the cp shard's 4T rows, two buffers each.
  EXPECT_EQ(bytes_of("ring_kv_buffers"), 4 * (4 * T) * 2 * 128 * 2);
  EXPECT_EQ(bytes_of("ring_dkv_accumulators"), 4 * (4 * T) * 2 * 128 * 4);
  // One attention backward call planned, the ring's piece (Hq/sp heads over the cp shard's rows):
  // sp_ulysses plans none of its own over all L rows.
  EXPECT_EQ(std::count_if(plan.terms.begin(), plan.terms.end(),
                          [](const PlanTerm& t) { return t.id == "attention_backward_call"; }),
            1);
  EXPECT_EQ(bytes_of("attention_backward_call"), attention_call_bytes(8, 4 * T, 128).backward);
}

// lcx-train as a user runs it: thread-ranks on the CPU, the trainer building the mesh, stacking
// the two plugins from [plugins] load, sharding and reducing over the whole world. cp x sp traces
// the single-rank run; dp 2 x cp 2 x sp 2 traces dp 2 alone (two sequences a step either way),
// in either placement order.
TEST(SpCpTrainer, RunsTrackTheSingleRankRunAndDpAlone) {
  if (!std::filesystem::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
  const auto dir = test::temp_dir("sp-cp-train");
  test::write_repeating_tokens(dir / "data.tokens");
  auto run = [&](int dp, int cp, int sp, const std::string& order = "sp_inner") {
    const std::string name = str("run", dp, cp, sp, order);
    const auto out = dir / name;
    const std::string load = cp * sp > 1 ? "\"sp_ulysses\", \"cp_ring\", " : "";
    test::write_file(dir / (name + ".toml"),
                     test::tiny_run_manifest(out, dir / "data.tokens", 3, true, "max_steps = 2\n",
                                             str("[plugins]\nload = [", load, "\"loss_chunked\"]\n[distributed]\nnproc_per_node = ",
                                                 dp * cp * sp, "\ncp = ", cp, "\nsp = ", sp, "\norder = \"", order,
                                                 "\"\n")));
    const test::CommandResult r = test::run_command(test::lcx_train() + " --config " + (dir / (name + ".toml")).string());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    if (cp * sp > 1) {
      EXPECT_NE(r.output.find(str("x sp ", sp, ", ", order, ")")), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("sp_ulysses: all-to-all per layer and rank"), std::string::npos) << r.output;
      EXPECT_NE(r.output.find("cp_ring: ring traffic per rank"), std::string::npos) << r.output;
    }
    return test::loss_and_norm(out);
  };
  auto same = [](const auto& got, const auto& want, const std::string& what) {
    ASSERT_EQ(got.size(), 2u) << what;
    ASSERT_EQ(want.size(), 2u) << what;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_NEAR(got[i].first, want[i].first, 1e-6 * want[i].first) << "loss, step " << i + 1 << ", " << what;
      // Step 2's norm follows step 1's AdamW update, which scales each gradient by its own size, so
      // the tiniest gradients' fp32 summation order (the ring sums each document's blocks by round,
      // the single rank in one call) shows at a few 1e-5 there.
      EXPECT_NEAR(got[i].second, want[i].second, (i == 0 ? 1e-5 : 3e-5) * want[i].second)
          << "grad_norm, step " << i + 1 << ", " << what;
    }
  };
  same(run(1, 2, 2), run(1, 1, 1), "cp 2 x sp 2");
  const auto dp2 = run(2, 1, 1);
  same(run(2, 2, 2), dp2, "dp 2 x cp 2 x sp 2");
  same(run(2, 2, 2, "cp_inner"), dp2, "dp 2 x cp 2 x sp 2, cp_inner");
}

}  // namespace
}  // namespace lcx
