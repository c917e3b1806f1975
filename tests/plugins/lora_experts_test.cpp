// lora with experts = true: a Qwen3-MoE's experts adapted per expert (A [E, r, in], B [E, out, r]
// beside the stacked experts, run as grouped GEMMs over each expert's sorted rows). On the CPU in
// fp32: every expert factor's gradient against central differences of the step's loss (the LM
// loss plus the load-balancing loss), the frozen experts (no gradient); the adapted model's loss
// against the base merged by `lcx-train merge`'s code (W_e + scale * B_e A_e written per expert
// into a Hub checkpoint) as an independent reference; the PEFT files (per-expert keys) saved and
// read back by init_from bit for bit; ep 2 thread-ranks against one rank; the refusals by key;
// and the bf16 step against its fp32 twin.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "lcx/peft.h"
#include "lcx/safetensors.h"
#include "lcx/slots/adapter.h"
#include "models/model_util.h"
#include "plugins/sp_cp_cases.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;

// Two layers, the first dense (its MLP adapted as a dense one), the second sparse: 4 experts, top 2.
const char* const kSpec = R"({"model_type": "qwen3_moe", "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50, "num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 12, "norm_topk_prob": true, "output_router_logits": true,
    "router_aux_loss_coef": 0.3, "mlp_only_layers": [0], "initializer_range": 0.3, "tie_word_embeddings": false})";
const char* const kLora = "r = 2\nalpha = 6\ntarget_modules = \"all-linear\"\nexperts = true";

Shard tokens_shard(int64_t T, int64_t salt) {
  std::vector<int64_t> ids(static_cast<size_t>(T)), labels(static_cast<size_t>(T));
  for (int64_t t = 0; t < T; ++t) ids[static_cast<size_t>(t)] = labels[static_cast<size_t>(t)] = (t * 11 + t * t * salt + 5) % 50;
  labels[3] = -100;
  return test::shard_from_labels(ids, labels);
}

bool expert_factor(const Parameter& p) { return p.name.find(".mlp.experts.") != std::string::npos; }

// The model of kSpec with the adapter attached; B randomized (non-zero) so every factor has a gradient.
struct Adapted {
  std::shared_ptr<Model> model;
  std::shared_ptr<Adapter> lora;
  std::unique_ptr<test::DefaultSlots> slots;
  explicit Adapted(const std::string& table = kLora, std::shared_ptr<Model> m = nullptr, int partition_index = 0,
                   bool randomize_b = true, DType dtype = DType::f32) {
    model = m ? m : test::make_qwen3();
    model->init_random(kSpec, 9, Device::cpu(), dtype);
    lora = test::make_plugin<Adapter>("lora", table);
    AdapterContext ctx{Device::cpu(), dtype, 11, ""};
    ctx.partition_index = partition_index;
    lora->attach(*model, ctx);
    uint32_t seed = 100;
    if (randomize_b)
      for (Parameter* p : lora->parameters())
        if (p->name.find("lora_B") != std::string::npos) test::fill_normal(p->value, seed++, 0.2f);
    slots = std::make_unique<test::DefaultSlots>(*model);
    slots->slots.adapter = lora.get();
  }
  // The step's loss: the mean LM loss plus the coefficient times the load-balancing loss.
  double loss(const Shard& shard) {
    for (Parameter* p : lora->parameters()) p->grad.zero();
    model->zero_grad();
    const StepResult r = train_step(slots->slots, shard, 1.0 / static_cast<double>(test::count_valid(shard)), Device::cpu());
    return r.loss_sum / static_cast<double>(r.valid) + r.aux.coef * r.aux.value;
  }
};

TEST(LoraExperts, FactorsAreStackedPerExpertAndTheExpertsFrozen) {
  Adapted a(kLora, nullptr, 0, false);
  const int gate = test::module_id(*a.model, 1, "mlp.experts.gate_proj");
  const LowRank* g = a.lora->find_experts(1, gate);
  const LowRank* d = a.lora->find_experts(1, test::module_id(*a.model, 1, "mlp.experts.down_proj"));
  ASSERT_NE(g, nullptr);
  ASSERT_NE(d, nullptr);
  const int dense_gate = test::module_id(*a.model, 0, "mlp.gate_proj");
  EXPECT_EQ(a.lora->find_experts(0, dense_gate), nullptr);  // layer 0 is dense
  EXPECT_EQ(a.lora->find(1, gate), nullptr);                // a sparse layer's MLP: the experts only
  EXPECT_NE(a.lora->find(0, dense_gate), nullptr);
  EXPECT_EQ(g->a->value.shape(), (Shape{4, 2, 24}));
  EXPECT_EQ(g->b->value.shape(), (Shape{4, 12, 2}));
  EXPECT_EQ(d->a->value.shape(), (Shape{4, 2, 12}));
  EXPECT_EQ(d->b->value.shape(), (Shape{4, 24, 2}));
  EXPECT_EQ(g->rank(), 2);
  EXPECT_FLOAT_EQ(g->scale, 3.f);
  EXPECT_EQ(g->a->grad_group, GradGroup::world);  // one rank holds every expert
  // PEFT's init per expert: A ~ U(-1/sqrt(in), 1/sqrt(in)), each expert its own draw; B zero.
  const std::vector<float> av = g->a->value.to_floats();
  const float bound = 1.f / std::sqrt(24.f);
  for (float x : av) ASSERT_LE(std::abs(x), bound);
  EXPECT_NE(std::vector<float>(av.begin(), av.begin() + 48), std::vector<float>(av.begin() + 48, av.begin() + 96));
  for (float x : g->b->value.to_floats()) ASSERT_EQ(x, 0.f);
  // Today's runs are unchanged: without experts = true, "all-linear" passes the experts by.
  Adapted plain("r = 2\nalpha = 6\ntarget_modules = \"all-linear\"", nullptr, 0, false);
  EXPECT_EQ(plain.lora->find_experts(1, gate), nullptr);
  EXPECT_EQ(plain.lora->parameters().size() + 6, a.lora->parameters().size());
  // The base frozen: a step gives the experts (and every base weight) no gradient.
  a.loss(tokens_shard(20, 1));
  for (Parameter* p : a.model->parameters()) {
    EXPECT_TRUE(p->frozen) << p->name;
    EXPECT_FALSE(p->grad.defined()) << p->name;
  }
}

// Every expert factor's largest gradients against central differences of the step's loss (steps
// small enough to leave every token's top-k as it was).
TEST(LoraExperts, GradientsMatchFiniteDifferences) {
  Adapted a;
  const Shard shard = tokens_shard(30, 1);
  const double base = a.loss(shard);
  std::vector<std::pair<Parameter*, std::vector<float>>> grads;
  for (Parameter* p : a.lora->parameters())
    if (expert_factor(*p)) grads.emplace_back(p, p->grad.to_floats());
  ASSERT_EQ(grads.size(), 6u);
  double worst = 0;
  int checked = 0;
  for (auto& [p, g] : grads) {
    double norm = 0;
    for (float x : g) norm += static_cast<double>(x) * x;
    EXPECT_GT(norm, 0) << p->name << ": no gradient";
    std::vector<size_t> idx(g.size());
    std::iota(idx.begin(), idx.end(), size_t{0});
    std::partial_sort(idx.begin(), idx.begin() + 3, idx.end(), [&](size_t x, size_t y) { return std::abs(g[x]) > std::abs(g[y]); });
    for (int k = 0; k < 3; ++k) {
      const size_t i = idx[static_cast<size_t>(k)];
      std::vector<float> v = p->value.to_floats();
      const float x = v[i], eps = 1e-3f;
      v[i] = x + eps;
      p->value.copy_from(Tensor::from_floats(v, p->value.shape(), DType::f32));
      const double up = a.loss(shard);
      v[i] = x - eps;
      p->value.copy_from(Tensor::from_floats(v, p->value.shape(), DType::f32));
      const double down = a.loss(shard);
      v[i] = x;
      p->value.copy_from(Tensor::from_floats(v, p->value.shape(), DType::f32));
      const double numeric = (up - down) / (2.0 * eps);
      EXPECT_NEAR(numeric, g[i], 2e-2 * std::abs(g[i]) + 1e-4) << p->name << "[" << i << "]";
      worst = std::max(worst, std::abs(numeric - g[i]) / std::abs(g[i]));
      ++checked;
    }
  }
  EXPECT_EQ(checked, 18);
  std::printf("expert factors vs central differences: loss %.6f, %d entries, worst relative error %.2e\n", base, checked,
              worst);
}

// The independent reference: the adapter saved as PEFT files (per-expert keys), merged into the
// base's Hub checkpoint by peft::merge (`lcx-train merge`), and the merged model loaded plain: its
// loss equals the adapted model's. Then init_from reads the files back: every factor bit for bit.
TEST(LoraExperts, SavedFilesMergeAndLoadBack) {
  const fs::path base_dir = test::temp_dir("lora-experts-base"), adapter_dir = test::temp_dir("lora-experts-adapter"),
                 merged_dir = test::temp_dir("lora-experts-merged");
  Adapted a;
  const Shard shard = tokens_shard(26, 2);
  const double want = a.loss(shard);
  a.model->save_hf(base_dir.string(), DType::f32, a.model->config().rope_parameters_json);
  a.lora->save(adapter_dir.string(), "base");
  const nlohmann::json cfg = nlohmann::json::parse(std::ifstream(adapter_dir / "adapter_config.json"));
  EXPECT_EQ(cfg.at("target_modules"), "all-linear");
  auto st = safetensors::Checkpoint::open((adapter_dir / "adapter_model.safetensors").string());
  EXPECT_TRUE(st.has("base_model.model.model.layers.1.mlp.experts.3.gate_proj.lora_A.weight"));
  EXPECT_TRUE(st.has("base_model.model.model.layers.1.mlp.experts.0.down_proj.lora_B.weight"));
  EXPECT_TRUE(st.has("base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"));
  EXPECT_FALSE(st.has("base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight"));
  EXPECT_EQ(st.info("base_model.model.model.layers.1.mlp.experts.2.up_proj.lora_B.weight").shape, (Shape{12, 2}));

  peft::MergeOptions mo;
  mo.overwrite = true;
  mo.progress = false;
  peft::merge(base_dir.string(), adapter_dir.string(), merged_dir.string(), mo);
  auto merged = test::make_qwen3();
  merged->load_hf(merged_dir.string(), Device::cpu(), DType::f32);
  test::DefaultSlots s(*merged);
  const StepResult r = test::mean_loss_step(s, shard, test::count_valid(shard));
  const double got = r.loss_sum / static_cast<double>(r.valid) + r.aux.coef * r.aux.value;
  EXPECT_NEAR(got, want, 1e-5 * std::abs(want));
  std::printf("adapted experts %.7f, merged base %.7f (rel %.2e)\n", want, got, std::abs(got - want) / std::abs(want));

  // `lcx-train merge` itself: the same tensors, each layer's experts named once in its progress line.
  const fs::path cli_dir = test::temp_dir("lora-experts-cli") / "merged";
  const auto c = test::run_command(test::lcx_train() + " merge --base " + base_dir.string() + " --adapter " +
                                   adapter_dir.string() + " --out " + cli_dir.string());
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("merge: layer 1 (q_proj k_proj v_proj o_proj experts.gate_proj experts.up_proj "
                          "experts.down_proj) done"),
            std::string::npos)
      << c.output;
  const auto lib = safetensors::Checkpoint::open((merged_dir / "model.safetensors").string()),
             cli = safetensors::Checkpoint::open((cli_dir / "model.safetensors").string());
  for (const auto& n : lib.names()) EXPECT_EQ(cli.load(n, DType::f32).to_floats(), lib.load(n, DType::f32).to_floats()) << n;
  // Expert 2's merged gate_proj is W_2 + scale * B_2 A_2.
  {
    const LowRank* g = a.lora->find_experts(1, test::module_id(*a.model, 1, "mlp.experts.gate_proj"));
    std::vector<float> w = safetensors::Checkpoint::open((base_dir / "model.safetensors").string())
                               .load("model.layers.1.mlp.experts.2.gate_proj.weight", DType::f32)
                               .to_floats();
    const std::vector<float> av = g->a->value.rows(2, 3).to_floats(), bv = g->b->value.rows(2, 3).to_floats();
    peft::add_low_rank(w.data(), bv.data(), av.data(), 12, 24, 2, g->scale);
    EXPECT_EQ(lib.load("model.layers.1.mlp.experts.2.gate_proj.weight", DType::f32).to_floats(), w);
  }

  Adapted back(std::string(kLora) + "\ninit_from = \"" + adapter_dir.string() + "\"", nullptr, 0, false);
  const std::vector<Parameter*> x = a.lora->parameters(), y = back.lora->parameters();
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(x[i]->name, y[i]->name);
    EXPECT_EQ(x[i]->value.to_floats(), y[i]->value.to_floats()) << x[i]->name;
  }
  EXPECT_DOUBLE_EQ(back.loss(shard), want);
}

// ep 2 (dp 2: two sequences, one a rank) against one rank over both: each rank holds 2 of the 4
// experts' factors (drawn by Hub number: the one rank's rows), their gradients summed over the ranks holding the same experts; the loss and
// every factor's gradient (the experts' concatenated in expert order) equal one rank's.
TEST(LoraExperts, ExpertRanksEqualOneRank) {
  const std::vector<Shard> shards = {tokens_shard(22, 1), tokens_shard(17, 3)};
  const int64_t valid = test::count_valid(shards[0]) + test::count_valid(shards[1]);
  Adapted one;
  for (Parameter* p : one.lora->parameters()) p->grad.zero();
  one.model->zero_grad();
  double want = 0;
  for (const Shard& sh : shards)
    want += train_step(one.slots->slots, sh, 1.0 / static_cast<double>(valid), Device::cpu(), 0.5).loss_sum;

  const MeshShape shape{.dp = 2, .ep = 2};
  std::vector<std::unique_ptr<Adapted>> ranks;
  for (int r = 0; r < 2; ++r) {
    Manifest m = Manifest::parse("[qwen3]\n", "test manifest");
    PluginLoader loader({test::build_plugin_dir()});
    auto model = std::dynamic_pointer_cast<Model>(
        loader.create("qwen3", PluginArgs{"qwen3", m.section("qwen3"), Device::cpu(), shape, r}));
    ranks.push_back(std::make_unique<Adapted>(kLora, model, r, false));
    // The factors: A as drawn (checked against the one rank's rows), B the one rank's rows.
    const std::vector<Parameter*> mine = ranks.back()->lora->parameters(), all = one.lora->parameters();
    for (size_t i = 0; i < mine.size(); ++i) {
      if (!expert_factor(*mine[i])) {
        mine[i]->value.copy_from(all[i]->value);
        continue;
      }
      EXPECT_EQ(mine[i]->grad_group, GradGroup::partition_replicas) << mine[i]->name;
      const Tensor rows = all[i]->value.rows(2 * r, 2 * r + 2);
      if (mine[i]->name.find("lora_A") != std::string::npos) {
        EXPECT_EQ(mine[i]->value.to_floats(), rows.to_floats()) << mine[i]->name << ": drawn per expert by its Hub number";
      }
      mine[i]->value.copy_from(rows);
    }
  }
  std::vector<double> loss(2);
  run_in_process(2, [&](Communicator& world) {
    Mesh mesh(world, shape);
    const int r = world.rank();
    Adapted& a = *ranks[static_cast<size_t>(r)];
    StepSlots st = a.slots->slots;
    st.mesh = &mesh;
    for (Parameter* p : a.lora->parameters()) p->grad.zero();
    a.model->zero_grad();
    const StepResult got = train_step(st, shards[static_cast<size_t>(r)], 1.0 / static_cast<double>(valid), Device::cpu(), 0.5);
    for (Parameter* p : a.lora->parameters()) (p->grad_group == GradGroup::partition_replicas ? *mesh.partition_replicas() : world).all_reduce(p->grad);
    double sum = got.loss_sum;
    world.all_reduce(std::span<double>(&sum, 1));
    loss[static_cast<size_t>(r)] = sum;
  });
  EXPECT_NEAR(loss[0], want, 1e-6 * want);
  double worst = 0;
  const std::vector<Parameter*> w = one.lora->parameters(), a = ranks[0]->lora->parameters(), b = ranks[1]->lora->parameters();
  for (size_t i = 0; i < w.size(); ++i) {
    std::vector<float> got = a[i]->grad.to_floats();
    if (a[i]->grad_group == GradGroup::partition_replicas) {
      const std::vector<float> more = b[i]->grad.to_floats();
      got.insert(got.end(), more.begin(), more.end());
    }
    const double e = test::rel_l2(got, w[i]->grad.to_floats());
    EXPECT_LE(e, 1e-5) << w[i]->name;
    worst = std::max(worst, e);
  }
  // One rank's share alone is no adapter file: Run::save gathers the factors first.
  EXPECT_EQ(test::thrown_by([&] { ranks[0]->lora->save(test::temp_dir("lora-experts-ep").string(), "base"); }).key,
            "lora.experts");
  std::printf("ep 2 x dp 2: loss sum %.6f (one rank %.6f), worst factor gradient rel L2 %.2e\n", loss[0], want, worst);
}

// The step in bf16 (the factors, the experts' rows and their [rows, r] products in bf16, the
// factors' gradients fp32) against its fp32 twin on the same bf16-rounded values: the loss to
// bf16's resolution, every expert factor's gradient loosely (a near tie of the router may send a
// token elsewhere in bf16, as qwen3_moe_test says).
TEST(LoraExperts, Bf16MatchesTheFp32Twin) {
  Adapted lo(kLora, nullptr, 0, true, DType::bf16), hi;
  const std::vector<Parameter*> lb = lo.model->parameters(), hb = hi.model->parameters();
  for (size_t i = 0; i < lb.size(); ++i) hb[i]->value.copy_from(lb[i]->value.to(DType::f32));
  const std::vector<Parameter*> la = lo.lora->parameters(), ha = hi.lora->parameters();
  for (size_t i = 0; i < la.size(); ++i) ha[i]->value.copy_from(la[i]->value.to(DType::f32));
  const Shard shard = tokens_shard(30, 2);
  const double want = hi.loss(shard), got = lo.loss(shard);
  EXPECT_NEAR(got, want, 1e-2 * want);
  double worst = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    if (!expert_factor(*la[i])) continue;
    EXPECT_EQ(la[i]->grad.dtype(), DType::f32) << la[i]->name;
    const double e = test::rel_l2(la[i]->grad.to_floats(), ha[i]->grad.to_floats());
    EXPECT_LE(e, 0.1) << la[i]->name;
    worst = std::max(worst, e);
  }
  std::printf("bf16 %.5f against fp32 %.5f; worst expert factor gradient rel L2 %.2e\n", got, want, worst);
}

TEST(LoraExperts, RefusalsNameTheKey) {
  auto thrown = [](const std::string& table, const std::string& spec = kSpec) {
    return test::thrown_by([&] {
      auto model = test::make_qwen3();
      model->init_random(spec, 3, Device::cpu(), DType::f32);
      auto lora = test::make_plugin<Adapter>("lora", table);
      lora->attach(*model, AdapterContext{Device::cpu(), DType::f32, 1, ""});
    });
  };
  const std::string dense = R"({"vocab_size": 50, "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8})";
  EXPECT_EQ(thrown("experts = true", dense).key, "lora.experts");  // a dense model has no experts
  EXPECT_EQ(thrown("experts = true\ntarget_modules = [\"q_proj\"]").key, "lora.experts");
  EXPECT_EQ(thrown("target_modules = [\"gate_proj\"]").key, "lora.experts");  // named experts need experts = true
  EXPECT_EQ(thrown("r = 13\nexperts = true\ntarget_modules = [\"down_proj\"]").key, "lora.r");  // an expert is [24, 12]
  // An adapter with the experts' keys, read by a run without experts (and the converse).
  const fs::path dir = test::temp_dir("lora-experts-refuse"), plain = test::temp_dir("lora-experts-plain");
  {
    Adapted a(kLora, nullptr, 0, false);
    a.lora->save(dir.string(), "base");
    Adapted b("r = 2\nalpha = 6\ntarget_modules = \"all-linear\"", nullptr, 0, false);
    b.lora->save(plain.string(), "base");
  }
  EXPECT_EQ(thrown("r = 2\nalpha = 6\ninit_from = \"" + dir.string() + "\"").key, "lora.experts");
  EXPECT_EQ(thrown(std::string(kLora) + "\ninit_from = \"" + plain.string() + "\"").key, "lora.experts");
}

}  // namespace
}  // namespace lcx
