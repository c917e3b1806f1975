// The decoder library's sliding-window layers and attention sinks in whole training steps: a
// family with both (Qwen3's shapes, layer 0 windowed at W = 5, learned sinks) trains the same loss
// and gradients on one rank and on cp_ring's virtual ranks, with packed documents; the sinks'
// gradient equals central differences of the loss; a family without windows refuses them by key.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "decoder_model.h"
#include "plugins/cp_ring_cases.h"
#include "qwen3_config.h"

namespace lcx::decoder {
namespace {

ModelConfig windowed_spec(const std::string& spec, double* init_std) {
  ModelConfig c = qwen3::config_from_spec(spec, init_std);
  c.layer_types = {"sliding_attention", "full_attention"};
  c.sliding_window = 5;
  return c;
}

const Family kWindowed{.name = "qwen3", .qk_norm = true, .sliding_window = true, .sinks = true,
                       .from_hf = qwen3::config_from_hf, .from_spec = windowed_spec, .to_json = qwen3::config_to_json};
const Family kFullOnly{.name = "qwen3", .qk_norm = true, .from_hf = qwen3::config_from_hf, .from_spec = windowed_spec,
                       .to_json = qwen3::config_to_json};

std::shared_ptr<Model> model_of(const Family& family) {
  const Manifest m = Manifest::parse("[qwen3]\n", "test manifest");
  std::unique_ptr<Plugin> p = create_model(PluginArgs{"qwen3", m.section("qwen3"), Device::cpu(), {}}, family);
  return std::shared_ptr<Model>(dynamic_cast<Model*>(p.release()));
}

// The tiny model with sinks of either sign and size, so they move the softmax visibly.
std::shared_ptr<Model> windowed_model(Device device, DType dtype) {
  auto m = model_of(kWindowed);
  m->init_random(test::kTinyQwen3, 11, device, dtype);
  for (Parameter* p : m->parameters())
    if (p->name.ends_with(".self_attn.sinks")) p->value.copy_from(Tensor::from_floats({1.5f, -0.5f, 0.f, 2.5f}, {4}, dtype));
  return m;
}

test::StepPlugins windowed_plugins() {
  test::StepPlugins with;
  with.model = windowed_model;
  return with;
}

TEST(DecoderWindowStep, NamesItsSinksAndRefusesWindowsWhereTheFamilyHasNone) {
  auto m = windowed_model(Device::cpu(), DType::f32);
  int sinks = 0;
  for (Parameter* p : m->parameters()) sinks += p->name.ends_with(".self_attn.sinks") && p->value.numel() == 4;
  EXPECT_EQ(sinks, 2);
  auto plain = model_of(kFullOnly);
  plain->init_random(test::kTinyQwen3, 11, Device::cpu(), DType::f32);
  const Sequence seq = test::random_sequence(32, 64, 5);
  test::StepPlugins with;
  with.model = [&](Device, DType) { return plain; };
  const test::Thrown e = test::thrown_by([&] { test::single_rank_step(seq, Device::cpu(), DType::f32, with); });
  EXPECT_EQ(e.key, "layer_types");
  EXPECT_NE(e.message.find("layer 0 is sliding_attention"), std::string::npos) << e.message;
}

TEST(DecoderWindowStep, CpRingEqualsOneRankWithDocuments) {
  for (int cp : {2, 4}) {
    Sequence seq = test::random_sequence(32, 64, 5);
    const test::StepOutcome want = test::single_rank_step(seq, Device::cpu(), DType::f32, windowed_plugins());
    const test::StepOutcome got = test::cp_step(seq, cp, Device::cpu(), DType::f32, windowed_plugins());
    test::expect_same_step(got, want, 1e-6, 2e-5, str("cp = ", cp));
    seq.document_bounds = {0, 3, 4, 19, 32};
    const test::StepOutcome want_docs = test::single_rank_step(seq, Device::cpu(), DType::f32, windowed_plugins());
    const test::StepOutcome got_docs = test::cp_step(seq, cp, Device::cpu(), DType::f32, windowed_plugins());
    test::expect_same_step(got_docs, want_docs, 1e-6, 2e-5, str("cp = ", cp, ", packed documents"));
  }
}

TEST(DecoderWindowStep, SinksGradientMatchesFiniteDifferences) {
  const Sequence seq = test::random_sequence(32, 64, 7);
  const test::StepOutcome at = test::single_rank_step(seq, Device::cpu(), DType::f32, windowed_plugins());
  for (const char* name : {"model.layers.0.self_attn.sinks", "model.layers.1.self_attn.sinks"}) {
    const std::vector<float>& g = at.grads.at(name);
    ASSERT_EQ(g.size(), 4u);
    EXPECT_GT(std::abs(*std::max_element(g.begin(), g.end(), [](float a, float b) { return std::abs(a) < std::abs(b); })),
              1e-3f)
        << name;
    for (size_t h = 0; h < 4; ++h) {
      auto shifted = [&](float by) {
        test::StepPlugins with;
        with.model = [&](Device d, DType t) {
          auto mm = windowed_model(d, t);
          for (Parameter* p : mm->parameters())
            if (p->name == name) p->value.data_as<float>()[h] += by;
          return mm;
        };
        const test::StepOutcome o = test::single_rank_step(seq, Device::cpu(), DType::f32, with);
        return o.loss_sum / static_cast<double>(o.valid);
      };
      const double eps = 1e-2, numeric = (shifted(eps) - shifted(-eps)) / (2 * eps);
      EXPECT_NEAR(g[h], numeric, 1e-2 * std::abs(numeric) + 2e-4) << name << " head " << h;
    }
  }
}

}  // namespace
}  // namespace lcx::decoder
