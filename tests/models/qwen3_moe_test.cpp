// Qwen3-MoE against transformers. A folder of tests/models/fixtures written by gen_moe_fixtures.py
// is a qwen3_moe checkpoint as save_pretrained wrote it (one tensor per expert) plus
// expected.safetensors: what Qwen3MoeForCausalLM computed for fixed tokens in fp32 (the LM loss, the
// load-balancing loss, the reported loss, a slice of the logits and every gradient, the auxiliary
// loss's included where the config trains it). lcx loads the folder, runs one step and must agree:
// losses within 1e-5 relative, every gradient within 1e-4 relative L2 on the CPU (fp32), on one rank
// and on cp 2, sp 2 and cp 2 x sp 2 thread-ranks; on the GPU in bf16 to bf16's resolution. kNames
// lists the fixtures: moe_norm_aux (top-k renormalized, the auxiliary loss trained, one dense
// layer), moe_step2_plain (a tied bf16 checkpoint, every second layer sparse, the auxiliary loss
// logged only) and moe_packed (three documents packed, each attending to itself, most labels -100).
// Also: the backward against finite differences, every token to one expert, the
// checkpoint written back in the Hub's layout and read again bit for bit, refusals by key.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <nlohmann/json.hpp>

#include "decoder_config.h"
#include "lcx/error.h"
#include "lcx/ops.h"
#include "lcx/safetensors.h"
#include "models/fixture_sequence.h"
#include "models/model_util.h"
#include "plugins/sp_cp_cases.h"

#include <functional>

namespace lcx {
namespace {

namespace fs = std::filesystem;

const fs::path kFixtures = fs::path(LCX_TEST_DATA_DIR) / "models" / "fixtures";
const char* const kNames[] = {"moe_norm_aux", "moe_step2_plain", "moe_packed"};

using test::ints;
using test::rel_l2;
using test::sequence_of;

// The gradient transformers recorded for a parameter: under its own name, or for a stacked
// experts' parameter each expert's slice ("...mlp.experts.M.gate_proj.weight") in expert order.
std::vector<float> expected_grad(const safetensors::Checkpoint& expected, const Parameter& p) {
  const std::string marker = ".mlp.experts.";
  const size_t at = p.name.find(marker);
  if (at == std::string::npos) return expected.load("grad." + p.name, DType::f32).to_floats();
  std::vector<float> out;
  for (int64_t e = 0; e < p.value.size(0); ++e) {
    const std::string key = str("grad.", p.name.substr(0, at + marker.size()), e, ".", p.name.substr(at + marker.size()));
    const std::vector<float> g = expected.load(key, DType::f32).to_floats();
    out.insert(out.end(), g.begin(), g.end());
  }
  return out;
}

// What creating the module with this [qwen3] table throws: "key: message", or "accepted".
std::string refusal_of_table(const std::string& table);

struct Mode {
  const char* name;
  Device device;
  DType dtype;
  double loss_tol, logits_tol, grad_tol;
};
// bf16 against transformers' fp32: a token whose k-th and (k+1)-th router probabilities are within
// bf16's rounding may pick another expert (the fixture's 72 tokens: one or two do), which moves the
// gradients of the layers below it by far more than rounding does elsewhere. So in bf16 the losses
// are held tight and the gradients loosely (measured on the CPU: loss 5.5e-4, aux 2.7e-4, logits
// 4.3e-2, worst gradient 0.24); fp32 is the exact check.
const Mode kModes[] = {
    {"cpu_fp32", Device::cpu(), DType::f32, 1e-5, 1e-5, 1e-4},
    {"cpu_bf16", Device::cpu(), DType::bf16, 2e-3, 6e-2, 0.35},
    {"cuda_bf16", Device::cuda(0), DType::bf16, 2e-3, 6e-2, 0.35},
};

class MoeParity : public ::testing::TestWithParam<std::tuple<const char*, Mode>> {};

TEST_P(MoeParity, LossesLogitsAndEveryGradient) {
  const fs::path dir = kFixtures / std::get<0>(GetParam());
  const Mode mode = std::get<1>(GetParam());
  if (mode.device.is_cuda() && !cuda_available()) GTEST_SKIP() << "no GPU on this machine";
  ASSERT_TRUE(fs::exists(dir / "expected.safetensors")) << dir << ": run tests/models/gen_moe_fixtures.py";
  auto model = test::make_qwen3();
  model->load_hf(dir.string(), mode.device, mode.dtype);
  const ModelConfig& cfg = model->config();
  ASSERT_EQ(cfg.model_type, "qwen3_moe");
  const safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
  const Shard shard = make_single_rank()->shard(sequence_of(expected), 0);
  const int64_t valid = test::count_valid(shard);
  test::DefaultSlots s(*model);
  const StepResult r = test::mean_loss_step(s, shard, valid, mode.device);
  ASSERT_EQ(r.valid, valid);
  ASSERT_TRUE(r.aux.present);

  auto rel = [](double got, double want) { return std::abs(got - want) / std::abs(want); };
  const double lm = r.loss_sum / static_cast<double>(r.valid);
  const double want_lm = expected.load("lm_loss", DType::f32).to_floats()[0];
  const double want_aux = expected.load("aux_loss", DType::f32).to_floats()[0];
  const double want_loss = expected.load("loss", DType::f32).to_floats()[0];
  EXPECT_LE(rel(lm, want_lm), mode.loss_tol) << "LM loss: lcx " << lm << ", transformers " << want_lm;
  EXPECT_LE(rel(r.aux.value, want_aux), mode.loss_tol) << "aux loss: lcx " << r.aux.value << ", transformers " << want_aux;
  EXPECT_LE(rel(lm + r.aux.coef * r.aux.value, want_loss), mode.loss_tol) << "the loss transformers reports";
  EXPECT_EQ(r.aux.coef, decoder::moe(cfg).output_router_logits ? decoder::moe(cfg).router_aux_loss_coef : 0.0);
  EXPECT_GE(static_cast<int64_t>(r.aux.stat("expert_tokens_max")), static_cast<int64_t>(r.aux.stat("expert_tokens_min")));
  EXPECT_GT(static_cast<int64_t>(r.aux.stat("expert_tokens_max")), 0);

  // Logits of the first columns, from the final hidden state.
  const Tensor want_logits = expected.load("logits", DType::f32);
  const Tensor hidden = forward_hidden(s.slots, shard, mode.device);
  Tensor logits = Tensor::empty({hidden.size(0), cfg.vocab_size}, DType::f32, mode.device);
  ops::matmul(hidden, false, model->head_weight(), true, logits);
  const std::vector<float> all = logits.to_floats();
  std::vector<float> got;
  for (int64_t t = 0; t < hidden.size(0); ++t)
    for (int64_t v = 0; v < want_logits.size(1); ++v) got.push_back(all[static_cast<size_t>(t * cfg.vocab_size + v)]);
  EXPECT_LE(rel_l2(got, want_logits.to_floats()), mode.logits_tol);

  double worst = 0;
  size_t checked = 0;
  for (Parameter* p : model->parameters()) {
    const double g = rel_l2(p->grad.to_floats(), expected_grad(expected, *p));
    EXPECT_LE(g, mode.grad_tol) << p->name;
    worst = std::max(worst, g);
    ++checked;
  }
  std::printf("%s %s: LM loss rel %.2e, aux loss rel %.2e (aux %.6f, coef %g), worst gradient rel L2 %.2e over %zu "
              "parameters, experts' rows %lld..%lld\n",
              dir.filename().c_str(), mode.name, rel(lm, want_lm), rel(r.aux.value, want_aux), r.aux.value, r.aux.coef, worst,
              checked, static_cast<long long>(r.aux.stat("expert_tokens_min")), static_cast<long long>(r.aux.stat("expert_tokens_max")));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, MoeParity, ::testing::Combine(::testing::ValuesIn(kNames), ::testing::ValuesIn(kModes)),
                         [](const auto& info) { return std::string(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name; });

// A sparse layer's tokens in tiles ([qwen3] moe_tile_rows; 17 leaves a short last tile): routing
// is per token and the load-balancing loss sums over the tiles, so the step equals transformers'
// as the whole layer does.
TEST(Qwen3Moe, TokenTilesEqualTransformers) {
  const fs::path dir = kFixtures / "moe_norm_aux";
  auto model = test::make_qwen3("moe_tile_rows = 17");
  model->load_hf(dir.string(), Device::cpu(), DType::f32);
  const safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
  const Shard shard = make_single_rank()->shard(sequence_of(expected), 0);
  test::DefaultSlots s(*model);
  const StepResult r = test::mean_loss_step(s, shard, test::count_valid(shard));
  EXPECT_NEAR(r.loss_sum / static_cast<double>(r.valid), expected.load("lm_loss", DType::f32).to_floats()[0], 1e-5);
  EXPECT_NEAR(r.aux.value, expected.load("aux_loss", DType::f32).to_floats()[0], 1e-5);
  for (Parameter* p : model->parameters()) EXPECT_LE(rel_l2(p->grad.to_floats(), expected_grad(expected, *p)), 1e-4) << p->name;
  EXPECT_NE(refusal_of_table("moe_tile_rows = 0").find("moe_tile_rows"), std::string::npos);
}

// The same fixtures over thread-ranks sharing the sequence: cp_ring 2, sp_ulysses 2 and cp 2 x sp 2.
// Each rank routes its own tokens; the load-balancing loss's counts and probabilities are summed
// over the sequence's ranks, so its value and gradient are the whole sequence's. The loss summed
// over the ranks and every gradient (summed as the trainer's all-reduce does) equal transformers'.
TEST(Qwen3Moe, SequenceRanksEqualTransformers) {
  struct MeshCase {
    int cp, sp;
  };
  for (const char* name : kNames)
    for (const MeshCase m : {MeshCase{2, 1}, MeshCase{1, 2}, MeshCase{2, 2}}) {
      const fs::path dir = kFixtures / name;
      const safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
      const Sequence seq = sequence_of(expected);
      int64_t valid = 0;
      for (int64_t t = 0; t < seq.targets.numel(); ++t) valid += seq.targets.data_as<int64_t>()[t] != -100;
      const std::string what = str(name, " on cp ", m.cp, " x sp ", m.sp);
      const int n = m.cp * m.sp;
      std::vector<test::Slots> ranks(static_cast<size_t>(n));
      for (auto& r : ranks) {
        r.model = test::make_qwen3();
        r.model->load_hf(dir.string(), Device::cpu(), DType::f32);
        r.loss = std::shared_ptr<Loss>(make_full_logits_loss());
        r.rope = std::shared_ptr<PositionalEncoding>(make_default_rope());
        r.memory = std::shared_ptr<MemoryStrategy>(make_on_device_memory());
        r.parallel = m.sp == 1   ? test::make_plugin<Parallelism>("cp_ring", "", Device::cpu(), nullptr, MeshShape{1, m.cp, 1})
                     : m.cp == 1 ? test::make_plugin<Parallelism>("sp_ulysses", "", Device::cpu(), nullptr, MeshShape{1, 1, m.sp})
                                 : test::load_stacked(m.cp, m.sp);
      }
      std::vector<double> loss(static_cast<size_t>(n)), aux(static_cast<size_t>(n));
      run_in_process(n, [&](Communicator& comm) {
        Mesh mesh(comm, {.dp = 1, .cp = m.cp, .sp = m.sp});
        const int r = comm.rank();
        const StepResult got = test::rank_step(ranks[static_cast<size_t>(r)], mesh, mesh.seq(), seq,
                                               seq_index(mesh.shape(), mesh.coord()), 1.0 / static_cast<double>(valid),
                                               Device::cpu());
        double sum = got.loss_sum;
        mesh.seq().all_reduce(std::span<double>(&sum, 1));
        loss[static_cast<size_t>(r)] = sum / static_cast<double>(valid);
        aux[static_cast<size_t>(r)] = got.aux.value;
      });
      const double want_lm = expected.load("lm_loss", DType::f32).to_floats()[0];
      const double want_aux = expected.load("aux_loss", DType::f32).to_floats()[0];
      for (int r = 0; r < n; ++r) {
        EXPECT_NEAR(loss[static_cast<size_t>(r)], want_lm, 1e-5 * want_lm) << what;
        EXPECT_NEAR(aux[static_cast<size_t>(r)], want_aux, 1e-5 * want_aux) << what << ": rank " << r;
      }
      double worst = 0;
      for (Parameter* p : ranks[0].model->parameters()) {
        const double g = rel_l2(p->grad.to_floats(), expected_grad(expected, *p));
        EXPECT_LE(g, 1e-4) << p->name << ": " << what;
        worst = std::max(worst, g);
      }
      std::printf("%s: LM loss %.7f (transformers %.7f), aux %.7f (%.7f), worst gradient rel L2 %.2e\n", what.c_str(),
                  loss[0], want_lm, aux[0], want_aux, worst);
    }
}

// The qwen3 module created for world rank `rank` of a mesh with expert parallelism, as core's
// resolve_slots creates it (PluginArgs::mesh and rank).
std::shared_ptr<Model> make_qwen3_for(const MeshShape& mesh, int rank) {
  Manifest m = Manifest::parse("[qwen3]\n", "test manifest");
  PluginLoader loader({test::build_plugin_dir()});
  return std::dynamic_pointer_cast<Model>(loader.create("qwen3", PluginArgs{"qwen3", m.section("qwen3"), Device::cpu(), mesh, rank}));
}

struct EpCase {
  int dp, cp, sp, ep;
};

// One step of `seq` on thread-ranks of the mesh `m` (each dp rank a copy of the sequence at 1/dp of
// the weight, as a step of dp sequences weighs them), the gradients summed as the trainer sums
// them: an expert shard's over the ranks holding the same experts, every other over the world.
struct EpOutcome {
  std::vector<double> loss, aux;  // per rank: the loss summed over the world, its own auxiliary loss
  // Every parameter's gradient; a stacked experts' one is the first group's slices in expert order.
  std::vector<std::pair<std::string, std::vector<float>>> grads;
};
EpOutcome expert_step(const fs::path& dir, const Sequence& seq, int64_t valid, const EpCase m, Device device, DType dtype) {
  const MeshShape shape{.dp = m.dp, .cp = m.cp, .sp = m.sp, .ep = m.ep};
  const int n = m.dp * m.cp * m.sp;
  std::vector<test::Slots> ranks(static_cast<size_t>(n));
  for (int r = 0; r < n; ++r) {
    test::Slots& s = ranks[static_cast<size_t>(r)];
    s.model = make_qwen3_for(shape, r);
    s.model->load_hf(dir.string(), device, dtype);
    s.loss = std::shared_ptr<Loss>(make_full_logits_loss());
    s.rope = std::shared_ptr<PositionalEncoding>(make_default_rope());
    s.memory = std::shared_ptr<MemoryStrategy>(make_on_device_memory());
    s.parallel = m.cp > 1   ? test::make_plugin<Parallelism>("cp_ring", "", device, nullptr, MeshShape{1, m.cp, 1})
                 : m.sp > 1 ? test::make_plugin<Parallelism>("sp_ulysses", "", device, nullptr, MeshShape{1, 1, m.sp})
                            : std::shared_ptr<Parallelism>(make_single_rank());
  }
  EpOutcome out;
  out.loss.resize(static_cast<size_t>(n));
  out.aux.resize(static_cast<size_t>(n));
  run_in_process(n, [&](Communicator& world) {
    Mesh mesh(world, shape);
    const int r = world.rank();
    test::Slots& s = ranks[static_cast<size_t>(r)];
    StepSlots slots = s.slots();
    slots.mesh = &mesh;
    configure_slots(slots);
    s.model->zero_grad();
    const StepResult got = train_step(slots, s.parallel->shard(seq, seq_index(mesh.shape(), mesh.coord())),
                                      1.0 / static_cast<double>(m.dp * valid), device, 1.0 / m.dp);
    for (Parameter* p : s.model->parameters())
      (p->grad_group == GradGroup::partition_replicas ? *mesh.partition_replicas() : world).all_reduce(p->grad);
    double sum = got.loss_sum;
    world.all_reduce(std::span<double>(&sum, 1));
    out.loss[static_cast<size_t>(r)] = sum / static_cast<double>(m.dp * valid);
    out.aux[static_cast<size_t>(r)] = got.aux.value;
  });
  const std::vector<Parameter*> first = ranks[0].model->parameters();
  for (size_t i = 0; i < first.size(); ++i) {
    std::vector<float> g = first[i]->grad.to_floats();
    if (first[i]->grad_group == GradGroup::partition_replicas) {
      EXPECT_EQ(first[i]->value.size(0) * m.ep, decoder::moe(ranks[0].model->config()).num_experts) << first[i]->name;
      for (int r = 1; r < m.ep; ++r) {
        const std::vector<float> more = ranks[static_cast<size_t>(r)].model->parameters()[i]->grad.to_floats();
        g.insert(g.end(), more.begin(), more.end());
      }
    }
    out.grads.emplace_back(first[i]->name, std::move(g));
  }
  return out;
}

// Expert parallelism ([distributed] ep) against transformers: every ep consecutive ranks split each
// sparse layer's experts (moe_packed's 6: 3 a rank at ep 2, 2 at ep 3), route their own tokens with
// the whole router and exchange the rows with the experts' ranks. Over ep 2 x cp 2 (the two ranks
// of the ring hold half the experts each), ep 2 x sp 2, ep 2 across dp 2 (each dp rank a copy of
// the sequence at half the weight, as a step of two sequences weighs them), ep 2 inside dp 2 x cp 2
// (two groups, the experts' gradients summed over the ranks holding the same experts) and ep 3
// across dp 3: the loss summed over the ranks equals transformers', every gradient other than
// the experts' summed over the world equals transformers', and the experts' gradients, each
// group's ranks' slices concatenated in expert order after the sum over the ranks holding the same
// experts, equal transformers' every expert's.
TEST(Qwen3Moe, ExpertRanksEqualTransformers) {
  const fs::path dir = kFixtures / "moe_packed";
  const safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
  const Sequence seq = sequence_of(expected);
  const int64_t valid = test::count_valid(make_single_rank()->shard(seq, 0));
  const double want_lm = expected.load("lm_loss", DType::f32).to_floats()[0];
  const double want_aux = expected.load("aux_loss", DType::f32).to_floats()[0];
  for (const EpCase m : {EpCase{1, 2, 1, 2}, EpCase{1, 1, 2, 2}, EpCase{2, 1, 1, 2}, EpCase{2, 2, 1, 2}, EpCase{3, 1, 1, 3}}) {
    const std::string what = str("moe_packed on ep ", m.ep, " with dp ", m.dp, " x cp ", m.cp, " x sp ", m.sp);
    const EpOutcome got = expert_step(dir, seq, valid, m, Device::cpu(), DType::f32);
    for (size_t r = 0; r < got.loss.size(); ++r) {
      EXPECT_NEAR(got.loss[r], want_lm, 1e-5 * want_lm) << what;
      EXPECT_NEAR(got.aux[r], want_aux, 1e-5 * want_aux) << what << ": rank " << r;
    }
    double worst = 0, worst_expert = 0;
    for (const auto& [name, g] : got.grads) {
      std::vector<float> want;
      const std::string marker = ".mlp.experts.";
      const size_t at = name.find(marker);
      if (at == std::string::npos) {
        want = expected.load("grad." + name, DType::f32).to_floats();
      } else {
        for (int64_t e = 0; e < 6; ++e) {
          const std::vector<float> w =
              expected.load(str("grad.", name.substr(0, at + marker.size()), e, ".", name.substr(at + marker.size())), DType::f32)
                  .to_floats();
          want.insert(want.end(), w.begin(), w.end());
        }
      }
      const double e = rel_l2(g, want);
      EXPECT_LE(e, 1e-4) << name << ": " << what;
      (at != std::string::npos ? worst_expert : worst) = std::max(at != std::string::npos ? worst_expert : worst, e);
    }
    std::printf("%s: LM loss %.7f (transformers %.7f), aux %.7f (%.7f), worst gradient rel L2 %.2e, experts' %.2e\n",
                what.c_str(), got.loss[0], want_lm, got.aux[0], want_aux, worst, worst_expert);
  }
}

// The same on one GPU in bf16 (thread-ranks sharing it: the rows move between device buffers):
// ep 2 across dp 2 and inside cp 2 against the same meshes with every expert on every rank (ep 1),
// which differ only in where each expert's rows are computed and summed.
TEST(Qwen3Moe, ExpertRanksOnTheGpuEqualEp1) {
  if (!cuda_available()) GTEST_SKIP() << "no GPU on this machine";
  const fs::path dir = kFixtures / "moe_packed";
  const safetensors::Checkpoint expected = safetensors::Checkpoint::open((dir / "expected.safetensors").string());
  const Sequence seq = sequence_of(expected);
  const int64_t valid = test::count_valid(make_single_rank()->shard(seq, 0));
  for (const EpCase m : {EpCase{2, 1, 1, 2}, EpCase{1, 2, 1, 2}}) {
    const std::string what = str("moe_packed bf16 on the GPU, ep 2 with dp ", m.dp, " x cp ", m.cp);
    const EpOutcome got = expert_step(dir, seq, valid, m, Device::cuda(0), DType::bf16);
    const EpOutcome want = expert_step(dir, seq, valid, EpCase{m.dp, m.cp, m.sp, 1}, Device::cuda(0), DType::bf16);
    EXPECT_NEAR(got.loss[0], want.loss[0], 1e-3 * want.loss[0]) << what;
    EXPECT_NEAR(got.aux[0], want.aux[0], 1e-3 * want.aux[0]) << what;
    double worst = 0;
    for (size_t i = 0; i < got.grads.size(); ++i) {
      const double e = rel_l2(got.grads[i].second, want.grads[i].second);
      EXPECT_LE(e, 2e-2) << got.grads[i].first << ": " << what;
      worst = std::max(worst, e);
    }
    std::printf("%s: LM loss %.6f (ep 1: %.6f), aux %.6f (%.6f), worst gradient rel L2 against ep 1 %.2e\n", what.c_str(),
                got.loss[0], want.loss[0], got.aux[0], want.aux[0], worst);
  }
}

// Expert parallelism where the ranks differ: dp 2 x ep 2 with sequences of 40 and 23 tokens in
// token tiles of 10 (4 tiles against 3: the second rank runs an empty tile and still serves the
// first rank's rows to its experts), with a trained router and with a zero router (every token's
// two choices tie to experts 0 and 1, both on the first rank: it runs every row of the group, the
// worst case the plan sizes for). Against one rank stepping both sequences: the loss, the auxiliary
// loss and every gradient (the experts' concatenated in expert order).
TEST(Qwen3Moe, ExpertRanksWithUnevenTokensEqualOneRank) {
  const std::string spec = R"({"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "num_experts": 6,
    "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": true, "output_router_logits": true,
    "router_aux_loss_coef": 0.1, "initializer_range": 0.2})";
  auto tokens = [](int64_t n, int64_t salt) {
    std::vector<int64_t> v(static_cast<size_t>(n));
    for (int64_t t = 0; t < n; ++t) v[static_cast<size_t>(t)] = (t * 13 + t * t * salt + 7) % 64;
    return v;
  };
  const std::vector<Shard> shards = {test::shard_from_labels(tokens(40, 3), tokens(40, 3)),
                                     test::shard_from_labels(tokens(23, 5), tokens(23, 5))};
  const int64_t valid = test::count_valid(shards[0]) + test::count_valid(shards[1]);
  for (const bool zero_router : {false, true}) {
    const std::string what = zero_router ? "zero router: every row to the first rank's experts" : "trained router";
    auto prepare = [&](Model& m) {
      m.init_random(spec, 7, Device::cpu(), DType::f32);
      if (zero_router)
        for (Parameter* p : m.parameters())
          if (p->name.ends_with("mlp.gate.weight")) p->value.zero();
    };
    auto one = test::make_qwen3("moe_tile_rows = 10");
    prepare(*one);
    test::DefaultSlots s(*one);
    one->zero_grad();
    double want_loss = 0, want_aux = 0;
    int64_t want_max = 0;
    for (const Shard& sh : shards) {
      const StepResult r = train_step(s.slots, sh, 1.0 / static_cast<double>(valid), Device::cpu(), 0.5);
      want_loss += r.loss_sum;
      want_aux += 0.5 * r.aux.value;
      want_max = std::max(want_max, static_cast<int64_t>(r.aux.stat("expert_tokens_max")));
    }
    const MeshShape shape{.dp = 2, .ep = 2};
    std::vector<std::shared_ptr<Model>> models;
    std::vector<std::unique_ptr<test::DefaultSlots>> slots;
    for (int r = 0; r < 2; ++r) {
      Manifest m = Manifest::parse("[qwen3]\nmoe_tile_rows = 10\n", "test manifest");
      PluginLoader loader({test::build_plugin_dir()});
      models.push_back(
          std::dynamic_pointer_cast<Model>(loader.create("qwen3", PluginArgs{"qwen3", m.section("qwen3"), Device::cpu(), shape, r})));
      prepare(*models.back());
      slots.push_back(std::make_unique<test::DefaultSlots>(*models.back()));
    }
    std::vector<double> loss(2), aux(2);
    std::vector<int64_t> most(2);
    run_in_process(2, [&](Communicator& world) {
      Mesh mesh(world, shape);
      const int r = world.rank();
      StepSlots st = slots[static_cast<size_t>(r)]->slots;
      st.mesh = &mesh;
      models[static_cast<size_t>(r)]->zero_grad();
      const StepResult got = train_step(st, shards[static_cast<size_t>(r)], 1.0 / static_cast<double>(valid), Device::cpu(), 0.5);
      for (Parameter* p : models[static_cast<size_t>(r)]->parameters())
        (p->grad_group == GradGroup::partition_replicas ? *mesh.partition_replicas() : world).all_reduce(p->grad);
      double sums[2] = {got.loss_sum, 0.5 * got.aux.value};
      world.all_reduce(std::span<double>(sums, 2));
      loss[static_cast<size_t>(r)] = sums[0];
      aux[static_cast<size_t>(r)] = sums[1];
      most[static_cast<size_t>(r)] = static_cast<int64_t>(got.aux.stat("expert_tokens_max"));
    });
    EXPECT_NEAR(loss[0], want_loss, 1e-6 * want_loss) << what;
    EXPECT_NEAR(aux[0], want_aux, 1e-6 * want_aux) << what;
    if (zero_router) {
      EXPECT_EQ(want_max, 40) << "one rank: every token of the longer sequence on expert 0";
      EXPECT_EQ(most[0], 40);
      EXPECT_EQ(most[1], 23);
    }
    double worst = 0;
    const std::vector<Parameter*> want = one->parameters(), a = models[0]->parameters(), b = models[1]->parameters();
    for (size_t i = 0; i < want.size(); ++i) {
      std::vector<float> got = a[i]->grad.to_floats();
      if (a[i]->grad_group == GradGroup::partition_replicas) {
        const std::vector<float> g = b[i]->grad.to_floats();
        got.insert(got.end(), g.begin(), g.end());
      }
      const double e = rel_l2(got, want[i]->grad.to_floats());
      EXPECT_LE(e, 1e-5) << want[i]->name << ": " << what;
      worst = std::max(worst, e);
    }
    std::printf("ep 2 x dp 2, 40 and 23 tokens in tiles of 10, %s: loss sum %.6f (one rank %.6f), worst gradient rel L2 %.2e\n",
                what.c_str(), loss[0], want_loss, worst);
  }
}

std::string thrown_key(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return str(e.key(), ": ", e.what());
  }
  return "accepted";
}

// Refusals by name: ep not dividing the model's experts (moe_norm_aux's 7), nor the world size, a
// dense model under ep, and a model built for ep 2 stepped with no expert-parallel group. And an
// expert-parallel rank's random init is its rows of the one-rank draw.
TEST(Qwen3Moe, ExpertParallelRefusalsAndInit) {
  const std::string odd = thrown_key([] {
    make_qwen3_for(MeshShape{.dp = 2, .ep = 2}, 1)->load_hf((kFixtures / "moe_norm_aux").string(), Device::cpu(), DType::f32);
  });
  EXPECT_EQ(odd.rfind("distributed.ep: ", 0), 0u) << odd;
  EXPECT_NE(odd.find("7 experts"), std::string::npos) << odd;
  const std::string world = thrown_key([] { Mesh::validate(MeshShape{.dp = 2, .ep = 3}, 2); });
  EXPECT_EQ(world.rfind("distributed.ep: ", 0), 0u) << world;
  const std::string dense = thrown_key([] {
    make_qwen3_for(MeshShape{.dp = 2, .ep = 2}, 0)->init_random(
        R"({"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64})",
        1, Device::cpu(), DType::f32);
  });
  EXPECT_EQ(dense.rfind("distributed.ep: ", 0), 0u) << dense;

  const std::string spec = R"({"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "num_experts": 6,
    "num_experts_per_tok": 2, "moe_intermediate_size": 16})";
  auto whole = test::make_qwen3();
  whole->init_random(spec, 3, Device::cpu(), DType::f32);
  auto second = make_qwen3_for(MeshShape{.dp = 2, .ep = 2}, 1);
  second->init_random(spec, 3, Device::cpu(), DType::f32);
  const std::vector<Parameter*> a = whole->parameters(), b = second->parameters();
  ASSERT_EQ(a.size(), b.size());
  int sliced = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i]->name, b[i]->name);
    if (a[i]->name.find(".mlp.experts.") == std::string::npos) {
      EXPECT_EQ(a[i]->value.to_floats(), b[i]->value.to_floats()) << a[i]->name;
      continue;
    }
    EXPECT_EQ(b[i]->value.size(0), 3);
    EXPECT_EQ(a[i]->value.rows(3, 6).to_floats(), b[i]->value.to_floats()) << a[i]->name;
    ++sliced;
  }
  EXPECT_EQ(sliced, 2 * 3);
  const Shard shard = test::shard_from_labels(std::vector<int64_t>(8, 5), std::vector<int64_t>(8, 5));
  test::DefaultSlots s(*second);
  const std::string alone = thrown_key([&] { test::mean_loss_step(s, shard, 7); });
  EXPECT_EQ(alone.rfind("distributed.ep: ", 0), 0u) << alone;
}

// Written back in the Hub's layout (a tensor per expert, qwen3_moe's config keys) and read again:
// the same tensors, bit for bit, and the same config.
TEST(Qwen3Moe, SavesTheHubsLayoutAndReadsItBack) {
  const fs::path dir = kFixtures / "moe_norm_aux";
  auto model = test::make_qwen3();
  model->load_hf(dir.string(), Device::cpu(), DType::f32);
  const fs::path out = fs::temp_directory_path() / "lcx_moe_save";
  fs::remove_all(out);
  model->save_hf(out.string(), DType::f32, model->config().rope_parameters_json);
  const nlohmann::json j = nlohmann::json::parse(std::ifstream(out / "config.json"));
  EXPECT_EQ(j["model_type"], "qwen3_moe");
  EXPECT_EQ(j["architectures"][0], "Qwen3MoeForCausalLM");
  EXPECT_EQ(j["num_experts"], 7);
  EXPECT_EQ(j["mlp_only_layers"], nlohmann::json::array({1}));
  const safetensors::Checkpoint a = safetensors::Checkpoint::open(dir.string());
  const safetensors::Checkpoint b = safetensors::Checkpoint::open(out.string());
  EXPECT_EQ(a.names().size(), b.names().size());
  for (const auto& name : a.names()) {
    ASSERT_TRUE(b.has(name)) << name;
    EXPECT_EQ(a.load(name, DType::f32).to_floats(), b.load(name, DType::f32).to_floats()) << name;
  }
  auto again = test::make_qwen3();
  again->load_hf(out.string(), Device::cpu(), DType::f32);
  EXPECT_EQ(decoder::moe(again->config()).num_experts_per_tok, 3);
  EXPECT_TRUE(decoder::moe(again->config()).norm_topk_prob);
  fs::remove_all(out);
}

std::string refusal_of_table(const std::string& table) {
  try {
    test::make_qwen3(table);
  } catch (const Error& e) {
    return str(e.key(), ": ", e.what());
  }
  return "accepted";
}

std::string refusal(const std::string& spec) {
  try {
    test::make_qwen3()->describe(spec);
  } catch (const Error& e) {
    return str(e.key(), ": ", e.what());
  }
  return "accepted";
}

TEST(Qwen3Moe, RefusesByKey) {
  const std::string base = R"("model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "moe_intermediate_size": 16)";
  EXPECT_NE(refusal("{" + base + R"(, "num_experts": 4, "num_experts_per_tok": 5})").find("num_experts_per_tok: "),
            std::string::npos);
  EXPECT_NE(refusal("{" + base + R"(, "num_experts": 4, "num_experts_per_tok": 2, "mlp_only_layers": [2]})").find("mlp_only_layers: "),
            std::string::npos);
  EXPECT_NE(refusal("{" + base + R"(, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 0})").find("decoder_sparse_step: "),
            std::string::npos);
  EXPECT_EQ(refusal("{" + base + R"(, "num_experts": 4, "num_experts_per_tok": 2})"), "accepted");
  const ModelConfig c = test::make_qwen3()->describe("qwen3-30b-a3b");
  EXPECT_EQ(decoder::moe(c).num_experts, 128);
  EXPECT_EQ(decoder::sparse_layers(c), 48);
}

// Every token routed to one expert (a zero router: uniform probabilities, ties to the lower
// expert): nothing is dropped, and the step's gradients stay finite.
TEST(Qwen3Moe, EveryTokenToOneExpert) {
  auto model = test::make_qwen3();
  model->init_random(R"({"model_type": "qwen3_moe", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 64, "num_experts": 6,
    "num_experts_per_tok": 1, "moe_intermediate_size": 16, "output_router_logits": true})",
                     5, Device::cpu(), DType::f32);
  for (Parameter* p : model->parameters())
    if (p->name.ends_with("mlp.gate.weight")) {
      p->value.zero();
    }
  std::vector<int64_t> ids(40), labels(40);
  for (int64_t t = 0; t < 40; ++t) ids[static_cast<size_t>(t)] = labels[static_cast<size_t>(t)] = (t * 7 + 3) % 64;
  const Shard shard = test::shard_from_labels(ids, labels);
  test::DefaultSlots s(*model);
  const StepResult r = test::mean_loss_step(s, shard, test::count_valid(shard));
  EXPECT_EQ(static_cast<int64_t>(r.aux.stat("expert_tokens_max")), 40);
  EXPECT_EQ(static_cast<int64_t>(r.aux.stat("expert_tokens_min")), 0);
  EXPECT_NEAR(r.aux.value, 1.0, 1e-6);  // E * (1 * 1/E): every pick on one expert, probabilities uniform
  for (Parameter* p : model->parameters())
    for (float g : p->grad.to_floats()) ASSERT_TRUE(std::isfinite(g)) << p->name;
}

// The backward against central differences of the loss transformers reports (LM loss plus the
// coefficient times the load-balancing loss), in fp32 on the CPU: the router's, every expert
// projection's and an attention projection's largest gradients. The steps are small enough to
// leave every token's top-k as it was.
TEST(Qwen3Moe, GradientsMatchFiniteDifferences) {
  auto model = test::make_qwen3();
  model->init_random(R"({"model_type": "qwen3_moe", "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 50, "num_experts": 5,
    "num_experts_per_tok": 2, "moe_intermediate_size": 12, "norm_topk_prob": true, "output_router_logits": true,
    "router_aux_loss_coef": 0.3, "mlp_only_layers": [0], "initializer_range": 0.3})",
                     9, Device::cpu(), DType::f32);
  std::vector<int64_t> ids(30), labels(30);
  for (int64_t t = 0; t < 30; ++t) ids[static_cast<size_t>(t)] = labels[static_cast<size_t>(t)] = (t * 11 + t * t + 5) % 50;
  labels[3] = -100;
  const Shard shard = test::shard_from_labels(ids, labels);
  const int64_t valid = test::count_valid(shard);
  test::DefaultSlots s(*model);
  auto loss = [&] {
    const StepResult r = test::mean_loss_step(s, shard, valid);
    return r.loss_sum / static_cast<double>(r.valid) + r.aux.coef * r.aux.value;
  };
  loss();
  std::map<std::string, std::vector<float>> grads;
  for (Parameter* p : model->parameters()) grads[p->name] = p->grad.to_floats();
  int checked = 0;
  for (Parameter* p : model->parameters()) {
    const bool wanted = p->name.find("layers.1.mlp.") != std::string::npos || p->name.ends_with("layers.1.self_attn.q_proj.weight");
    if (!wanted) continue;
    const std::vector<float>& g = grads[p->name];
    // The three largest entries of this parameter's gradient.
    std::vector<size_t> order(g.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::partial_sort(order.begin(), order.begin() + 3, order.end(),
                      [&](size_t a, size_t b) { return std::abs(g[a]) > std::abs(g[b]); });
    for (int j = 0; j < 3; ++j) {
      const size_t i = order[static_cast<size_t>(j)];
      std::vector<float> v = p->value.to_floats();
      const float x = v[i], eps = 1e-3f;
      v[i] = x + eps;
      p->value.copy_from(Tensor::from_floats(v, p->value.shape(), DType::f32));
      const double up = loss();
      v[i] = x - eps;
      p->value.copy_from(Tensor::from_floats(v, p->value.shape(), DType::f32));
      const double down = loss();
      v[i] = x;
      p->value.copy_from(Tensor::from_floats(v, p->value.shape(), DType::f32));
      const double numeric = (up - down) / (2.0 * eps);
      EXPECT_NEAR(numeric, g[i], 2e-2 * std::abs(g[i]) + 1e-4) << p->name << "[" << i << "]";
      ++checked;
    }
  }
  EXPECT_EQ(checked, 3 * 5);  // the router, the experts' gate, up and down, q_proj
}

}  // namespace
}  // namespace lcx
