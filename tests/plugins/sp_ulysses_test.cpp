// sp_ulysses on CPU with thread-ranks: attention and a whole qwen3 training step equal the
// single-rank results for sp = 2, 4, 8 with kv heads replicated (Hkv < sp), one per rank and
// several per rank; the refusals name their key and fix; the plugin plans its buffers.
#include <gtest/gtest.h>

#include "support/test_util.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "lcx/attention_cost.h"
#include "lcx/plan.h"
#include "plugins/sp_ulysses_cases.h"

namespace lcx {
namespace {


ParallelModelInfo model_info(int64_t Hq, int64_t Hkv, std::vector<std::string> types = {"full_attention"}) {
  ParallelModelInfo info;
  info.num_heads = Hq;
  info.num_kv_heads = Hkv;
  info.head_dim = 8;
  info.layer_types = std::move(types);
  return info;
}

TEST(SpUlysses, LoadsReadyWithItsSize) {
  PluginInfo info;
  auto p = test::make_plugin<Parallelism>("sp_ulysses", "", Device::cpu(), &info, MeshShape{1, 1, 4});
  EXPECT_EQ(info.status, "ready");
  EXPECT_EQ(p->size(), 4);
  EXPECT_EQ(p->mesh_axis(), "sp");
  EXPECT_FALSE(p->attention_takes_head_groups());
  EXPECT_EQ(test::make_plugin<Parallelism>("sp_ulysses", "")->size(), 1);
  EXPECT_TRUE(test::make_plugin<Parallelism>("sp_ulysses", "")->attention_takes_head_groups());
  // The deprecated `size` is accepted when it repeats [distributed] sp, refused naming both otherwise.
  EXPECT_EQ(test::make_plugin<Parallelism>("sp_ulysses", "size = 4", Device::cpu(), nullptr, MeshShape{1, 1, 4})->size(), 4);
  const test::Thrown differs = test::thrown_by(
      [] { test::make_plugin<Parallelism>("sp_ulysses", "size = 2", Device::cpu(), nullptr, MeshShape{1, 1, 4}); });
  EXPECT_EQ(differs.key, "sp_ulysses.size");
  EXPECT_NE(differs.message.find("[distributed] sp = 4"), std::string::npos) << differs.message;
  EXPECT_EQ(test::thrown_by([] { test::make_plugin<Parallelism>("sp_ulysses", "size = 0"); }).key, "sp_ulysses.size");
  EXPECT_EQ(test::thrown_by([] { test::make_plugin<Parallelism>("sp_ulysses", "sise = 2"); }).key, "sp_ulysses.sise");
}

TEST(SpUlysses, ShardsAreContiguousWithGlobalPositions) {
  auto p = test::load_ulysses(4);
  Sequence seq;
  seq.tokens = Tensor::empty({12}, DType::i32);
  seq.targets = Tensor::empty({12}, DType::i64);
  for (int i = 0; i < 12; ++i) seq.tokens.data_as<int32_t>()[i] = 100 + i, seq.targets.data_as<int64_t>()[i] = 200 + i;
  for (int r = 0; r < 4; ++r) {
    Shard s = p->shard(seq, r);
    ASSERT_EQ(s.tokens.size(0), 3);
    EXPECT_EQ(s.global_length, 12);
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(s.tokens.data_as<int32_t>()[i], 100 + 3 * r + i);
      EXPECT_EQ(s.targets.data_as<int64_t>()[i], 200 + 3 * r + i);
      EXPECT_EQ(s.positions.data_as<int64_t>()[i], 3 * r + i);
    }
  }
  seq.tokens = seq.tokens.rows(0, 10);
  seq.targets = seq.targets.rows(0, 10);
  const test::Thrown e = test::thrown_by([&] { p->shard(seq, 0); });
  EXPECT_EQ(e.key, "data.seq_len");
  EXPECT_NE(e.fix.find("pad_to_multiple_of = 4"), std::string::npos) << e.fix;
  EXPECT_NE(e.message.find("10 tokens"), std::string::npos) << e.message;
}

TEST(SpUlysses, RefusesHeadsThatDoNotSplitAndChunkedLayers) {
  auto p = test::load_ulysses(4);
  // Each refused by [distributed] sp, its fix the divisor or multiple sp needs.
  test::Thrown e = test::thrown_by([&] { p->configure(model_info(6, 2), nullptr); });
  EXPECT_EQ(e.key, "distributed.sp");
  EXPECT_EQ(e.fix, "use an sp that divides 6");
  e = test::thrown_by([&] { p->configure(model_info(12, 6), nullptr); });
  EXPECT_EQ(e.key, "distributed.sp");
  EXPECT_NE(e.message.find("6 key/value heads do not divide"), std::string::npos) << e.message;
  e = test::thrown_by([&] { test::load_ulysses(4)->configure(model_info(12, 3), nullptr); });
  EXPECT_EQ(e.key, "distributed.sp");
  EXPECT_EQ(e.fix, "use an sp that is a multiple of 3");
  e = test::thrown_by([&] { p->configure(model_info(8, 2, {"chunked_attention"}), nullptr); });
  EXPECT_EQ(e.key, "layer_types");
  EXPECT_NE(e.message.find("layer 0 is chunked_attention"), std::string::npos) << e.message;
  EXPECT_FALSE(
      test::thrown_by([&] { p->configure(model_info(8, 2, {"full_attention", "sliding_attention"}), nullptr); }).thrown);
  EXPECT_FALSE(test::thrown_by([&] { p->configure(model_info(8, 2), nullptr); }).thrown);
  EXPECT_FALSE(test::thrown_by([&] { p->configure(model_info(8, 8), nullptr); }).thrown);
}

TEST(SpUlysses, NeedsAMatchingMesh) {
  auto p = test::load_ulysses(2);
  p->configure(model_info(4, 2), nullptr);
  Tensor q = Tensor::zeros({2, 4, 8}, DType::f32), k = Tensor::zeros({2, 2, 8}, DType::f32), v = k.clone();
  Tensor out = q.clone(), lse = Tensor::zeros({4, 2}, DType::f32);
  const test::Thrown e = test::thrown_by([&] { p->attention_forward(q, k, v, out, lse, AttentionArgs{0.3f, true}); });
  EXPECT_EQ(e.key, "distributed.sp");
  EXPECT_NE(e.message.find("needs a mesh"), std::string::npos) << e.message;
  std::vector<test::Thrown> errors(4);
  run_in_process(4, [&](Communicator& c) {
    Mesh mesh(c, {.dp = 1, .cp = 1, .sp = 4});
    errors[static_cast<size_t>(c.rank())] =
        test::thrown_by([&] { test::load_ulysses(2)->configure(model_info(4, 2), &mesh); });
  });
  for (const auto& m : errors) {
    EXPECT_EQ(m.key, "distributed.sp");
    EXPECT_NE(m.message.find("mesh's sp axis is 4"), std::string::npos) << m.message;
  }
  run_in_process(2, [&](Communicator& c) {
    Mesh mesh(c, {.dp = 1, .cp = 2, .sp = 1});
    errors[static_cast<size_t>(c.rank())] =
        test::thrown_by([&] { test::load_ulysses(1)->configure(model_info(4, 2), &mesh); });
  });
  EXPECT_EQ(errors[0].key, "distributed.cp");
  EXPECT_NE(errors[0].message.find("cp = 2"), std::string::npos) << errors[0].message;
}

TEST(SpUlysses, SizeOneWithoutAMeshIsSingleRank) {
  auto p = test::load_ulysses(1);
  p->configure(model_info(4, 2), nullptr);
  test::AttentionCase c;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist;
  auto rnd = [&](Shape s) {
    std::vector<float> v(static_cast<size_t>(shape_numel(s)));
    for (auto& x : v) x = dist(rng);
    return Tensor::from_floats(v, std::move(s), DType::f32);
  };
  Tensor q = rnd({6, 4, 8}), k = rnd({6, 2, 8}), v = rnd({6, 2, 8});
  Tensor out = Tensor::empty({6, 4, 8}, DType::f32), lse = Tensor::empty({4, 6}, DType::f32);
  Tensor out1 = out.clone(), lse1 = lse.clone();
  p->attention_forward(q, k, v, out, lse, AttentionArgs{0.35f, true});
  ops::attention_forward(q, k, v, out1, lse1, ops::AttentionParams{0.35f, true, 0, 0});
  EXPECT_EQ(out.to_floats(), out1.to_floats());
  EXPECT_EQ(lse.to_floats(), lse1.to_floats());
}

TEST(SpUlyssesExact, AttentionEqualsSingleRank) {
  for (int sp : {2, 4, 8})
    for (int64_t Hkv : test::kv_cases(sp, 16)) {
      test::AttentionCase c;
      c.sp = sp;
      c.Hkv = Hkv;
      test::check_attention(c);
    }
}

TEST(SpUlyssesExact, AttentionBackwardWithoutItsForwardMovesTheInputsAgain) {
  for (int sp : {2, 4})
    for (int64_t Hkv : {int64_t{1}, int64_t{sp}, int64_t{2 * sp}}) {
      test::AttentionCase c;
      c.sp = sp;
      c.Hkv = Hkv;
      c.reuse_forward = false;
      test::check_attention(c);
    }
}

TEST(SpUlyssesExact, AttentionWithOneTokenPerRankAndManyHeadsPerRank) {
  test::AttentionCase c;
  c.sp = 8;
  c.tokens_per_rank = 1;
  c.Hq = 32;
  c.Hkv = 4;
  test::check_attention(c);
  c.sp = 2;
  c.tokens_per_rank = 17;
  c.Hkv = 32;
  c.d = 16;
  test::check_attention(c);
}

TEST(SpUlyssesExact, TrainingStepEqualsSingleRank) {
  // Hkv 2: one kv head per rank at sp 2, replicated at sp 4 and 8; Hkv 8: several per rank.
  for (int sp : {2, 4, 8})
    for (int64_t Hkv : {int64_t{2}, int64_t{8}}) {
      test::StepCase c;
      c.sp = sp;
      c.Hkv = Hkv;
      test::check_step(c);
    }
}

TEST(SpUlyssesExact, TrainingStepComposesWithLossRopeYarnAndOffload) {
  test::StepCase c;
  c.sp = 4;
  c.Hkv = 1;
  c.loss = "nll";
  c.rope_yarn_table = "factor = 2.0\noriginal_max_position_embeddings = 24";
  test::check_step(c);
  c.loss = "loss_chunked";
  test::check_step(c);
  c.Hkv = 2;
  c.offload = true;
  test::check_step(c);
}

// Packed documents: the all-to-all hands each rank the whole sequence for its heads, so the
// single-rank masked attention serves; documents cross the ranks' shard boundaries.
TEST(SpUlyssesExact, AttentionWithDocumentsEqualsSingleRank) {
  for (int sp : {2, 4}) {
    test::AttentionCase c;
    c.sp = sp;
    c.tokens_per_rank = 12;
    c.Hkv = 2;
    c.documents = {0, 1, 7, 20, 12 * sp};
    test::check_attention(c);
  }
}

// A sliding window applies as it is to the whole sequence each rank gets, documents or not.
TEST(SpUlyssesExact, AttentionWithAWindowEqualsSingleRank) {
  for (int sp : {2, 4})
    for (int64_t w : {1, 7, 30}) {
      test::AttentionCase c;
      c.sp = sp;
      c.tokens_per_rank = 12;
      c.Hkv = 2;
      c.window = w;
      test::check_attention(c);
      c.documents = {0, 1, 7, 20, 12 * sp};
      test::check_attention(c);
    }
}

TEST(SpUlyssesExact, TrainingStepWithPackedDocumentsEqualsSingleRank) {
  for (int sp : {2, 4}) {
    test::StepCase c;
    c.sp = sp;
    c.documents = {0, 5, 6, 30, 48};  // positions restart per document across the shards
    test::check_step(c);
    c.rope_yarn_table = "factor = 2.0\noriginal_max_position_embeddings = 24";
    test::check_step(c);
  }
}

TEST(SpUlysses, ShardsRestartPositionsAtEachDocument) {
  auto p = test::load_ulysses(2);
  EXPECT_TRUE(p->masks_documents());
  Sequence seq;
  seq.tokens = Tensor::zeros({8}, DType::i32);
  seq.targets = Tensor::zeros({8}, DType::i64);
  seq.document_bounds = {0, 3, 8};
  const Shard s = p->shard(seq, 1);
  const int64_t* pos = s.positions.data_as<const int64_t>();
  EXPECT_EQ(std::vector<int64_t>(pos, pos + 4), (std::vector<int64_t>{1, 2, 3, 4}));  // tokens 4..7 of [3, 8)
  EXPECT_EQ(s.document_bounds, seq.document_bounds);
}

// lcx-train as a user runs it: [distributed] sp thread-ranks on the CPU, the trainer passing each
// rank its mesh, sharding and reducing. Three optimizer steps trace the single-rank run's losses
// and norms.
TEST(SpUlyssesTrainer, RunsTrackTheSingleRankRun) {
  if (!std::filesystem::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
  const auto dir = test::temp_dir("sp-train");
  test::write_repeating_tokens(dir / "data.tokens");
  auto run = [&](int sp) {
    const auto out = dir / str("out", sp);
    test::write_file(dir / str("run", sp, ".toml"),
                     test::tiny_run_manifest(out, dir / "data.tokens", 3, true, "max_steps = 3\n",
                                             str("[plugins]\nload = [\"sp_ulysses\", \"loss_chunked\"]\n[distributed]\nnproc_per_node = ", sp, "\nsp = ", sp, "\n")));
    const test::CommandResult r = test::run_command(test::lcx_train() + " --config " + (dir / str("run", sp, ".toml")).string());
    EXPECT_EQ(r.exit_code, 0) << r.output;
    if (sp > 1) {
      EXPECT_NE(r.output.find("sp_ulysses: all-to-all per layer and rank"), std::string::npos) << r.output;
    }
    return test::loss_and_norm(out);
  };
  const auto one = run(1);
  ASSERT_EQ(one.size(), 3u);
  for (int sp : {2, 4}) {  // Hkv 2: one kv head per rank, then replicated
    const auto got = run(sp);
    ASSERT_EQ(got.size(), 3u) << "sp " << sp;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_NEAR(got[i].first, one[i].first, 1e-6 * one[i].first) << "loss, step " << i + 1 << ", sp " << sp;
      EXPECT_NEAR(got[i].second, one[i].second, 1e-5 * one[i].second) << "grad_norm, step " << i + 1 << ", sp " << sp;
    }
  }
}

TEST(SpUlysses, PlansItsBuffers) {
  PlanInputs in;
  in.model.num_heads = 32;
  in.model.num_kv_heads = 8;
  in.model.head_dim = 128;
  in.sp = 4;
  in.seq_len = 1 << 20;
  in.tokens_per_rank = in.seq_len / 4;
  MemoryPlan plan;
  test::load_ulysses(4)->plan(in, plan);
  ASSERT_FALSE(plan.terms.empty());
  // Buffers of the all-to-all, and the fused attention's own scratch (lcx/attention_cost.h) as transient.
  for (const PlanTerm& t : plan.terms) {
    const bool call = t.id == "attention_forward_workspace" || t.id == "attention_backward_call";
    EXPECT_EQ(t.category, call ? PlanCategory::transient : PlanCategory::communication) << t.id;
  }
  ASSERT_NE(plan.find("attention_backward_call"), nullptr);
  ASSERT_NE(plan.find("head_layout_forward"), nullptr);
  // q, k, v, out in head layout: T (2 Hq + 2 Hkv) d bf16 in the forward, twice that backward; the
  // backward adds the fp32 LSE/delta and cuDNN's dQ accumulator and workspace over Hq/sp heads x L rows.
  const int64_t heads = in.tokens_per_rank * (2 * 32 + 2 * 8) * 128 * 2;
  EXPECT_EQ(plan.find("head_layout_forward")->bytes, heads);
  const int64_t L = in.seq_len;
  EXPECT_EQ(plan.gpu_bytes(plan_phase::backward, false) - plan.gpu_bytes(plan_phase::forward, false),
            heads + in.tokens_per_rank * 32 * 4 + attention_call_bytes(32 / 4, L, 128).backward -
                attention_call_bytes(32 / 4, L, 128).forward);
  // Replication: with 2 kv heads over 8 ranks every rank sends 8 heads' worth of k and v.
  in.model.num_kv_heads = 2;
  in.sp = 8;
  in.tokens_per_rank = in.seq_len / 8;
  MemoryPlan rep;
  test::load_ulysses(8)->plan(in, rep);
  ASSERT_NE(rep.find("head_layout_forward"), nullptr);
  EXPECT_EQ(rep.find("head_layout_forward")->bytes, in.tokens_per_rank * (2 * 32 + 2 * 8) * 128 * 2);
  // size 1 moves nothing: only the attention's own delta, as the single-rank default plans it.
  in.sp = 1;
  in.tokens_per_rank = in.seq_len;
  MemoryPlan one, single;
  test::load_ulysses(1)->plan(in, one);
  make_single_rank()->plan(in, single);
  ASSERT_EQ(one.terms.size(), single.terms.size());
  ASSERT_NE(one.find("attention_delta"), nullptr);
  EXPECT_EQ(one.find("attention_delta")->bytes, single.find("attention_delta")->bytes);
  EXPECT_EQ(one.category_bytes(PlanCategory::communication), 0);
}

}  // namespace
}  // namespace lcx
