// rope_yarn against transformers: inverse frequencies, attention factor and cos/sin rows equal to
// those transformers computed (fixtures/yarn_transformers.json, written by gen_yarn_fixtures.py),
// whether the values come from the checkpoint's rope parameters or from the manifest; manifest
// overrides, the transformers 4 spelling, guards, the exported rope_parameters, and a shard far into
// the sequence getting its true rows. The plugin is loaded through the real loader.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "config/manifest.h"
#include "lcx/defaults.h"
#include "lcx/slots/positional_encoding.h"
#include "loader/plugin_loader.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using nlohmann::json;

std::shared_ptr<PositionalEncoding> load_yarn(const std::string& table_toml = "") {
  PluginInfo info;
  auto rope = test::make_plugin<PositionalEncoding>("rope_yarn", table_toml, Device::cpu(), &info);
  EXPECT_EQ(info.status, "ready");
  return rope;
}

RopeModelInfo model_info(int64_t head_dim, double theta, int64_t max_pos, const json& rope_parameters) {
  RopeModelInfo info;
  info.head_dim = head_dim;
  info.rope_theta = theta;
  info.max_position_embeddings = max_pos;
  info.rope_parameters_json = rope_parameters.dump();
  return info;
}

json load_fixtures() {
  std::ifstream f(LCX_YARN_FIXTURES);
  if (!f) throw Error(str("missing fixture file ", LCX_YARN_FIXTURES, " (run tests/plugins/gen_yarn_fixtures.py)"));
  return json::parse(f);
}

void expect_rel(double got, double want, double rtol, const std::string& what) {
  EXPECT_LE(std::fabs(got - want), rtol * std::fabs(want)) << what << ": got " << got << " want " << want;
}

void expect_matches_case(const PositionalEncoding& rope, const json& c, const std::string& via) {
  const std::string name = c["name"].get<std::string>() + " (" + via + ")";
  const auto want = c["inv_freq"].get<std::vector<double>>();
  const auto got = rope.inv_freq();
  ASSERT_EQ(got.size(), want.size()) << name;
  for (size_t i = 0; i < want.size(); ++i) expect_rel(got[i], want[i], 1e-6, str(name, " inv_freq[", i, "]"));
  expect_rel(rope.attention_scaling(), c["attention_factor"].get<double>(), 1e-6, name + " attention_factor");
}

// A TOML [rope_yarn] table carrying the case's YaRN values, for the manifest route.
std::string as_toml(const json& params) {
  std::string t;
  for (const auto& [k, v] : params.items()) {
    if (k == "rope_type" || k == "rope_theta") continue;
    if (k == "original_max_position_embeddings")
      t += str(k, " = ", v.get<int64_t>(), "\n");
    else if (v.is_boolean())
      t += str(k, " = ", v.get<bool>() ? "true" : "false", "\n");
    else
      t += str(k, " = ", json(v.get<double>()).dump(), "\n");  // nlohmann keeps the decimal point
  }
  return t;
}

TEST(RopeYarn, FixturesWereMadeByTransformers5) {
  json fx = load_fixtures();
  EXPECT_EQ(fx["transformers"].get<std::string>().substr(0, 2), "5.");
  int usable = 0;
  for (const auto& c : fx["cases"]) {
    EXPECT_FALSE(c.contains("error")) << c["name"] << ": " << c.value("error", "");
    usable += c.contains("inv_freq");
  }
  EXPECT_GE(usable, 12);
}

TEST(RopeYarn, MatchesTransformersFromCheckpointParameters) {
  int matched = 0;
  const json fx = load_fixtures();
  for (const auto& c : fx["cases"]) {
    if (!c.contains("inv_freq")) continue;
    json params = c.contains("rope_parameters") ? c["rope_parameters"] : c["rope_scaling"];
    if (c.contains("rope_scaling")) params["rope_theta"] = c["rope_theta"];  // as core merges it for v4
    auto rope = load_yarn();
    rope->configure(model_info(c["head_dim"], c["rope_theta"], c["max_position_embeddings"], params));
    expect_matches_case(*rope, c, "checkpoint");
    ++matched;
  }
  EXPECT_GE(matched, 17);  // every case, the transformers 4 spelling included
}

TEST(RopeYarn, MatchesTransformersFromManifest) {
  int matched = 0;
  const json fx = load_fixtures();
  for (const auto& c : fx["cases"]) {
    if (!c.contains("inv_freq") || !c.contains("rope_parameters")) continue;
    auto rope = load_yarn(as_toml(c["rope_parameters"]));
    rope->configure(model_info(c["head_dim"], c["rope_theta"], c["max_position_embeddings"], json::object()));
    expect_matches_case(*rope, c, "manifest");
    ++matched;
  }
  EXPECT_GE(matched, 16);
}

// cos/sin rows as Qwen3RotaryEmbedding produced them, attention factor included, far positions too.
TEST(RopeYarn, TablesMatchTransformersRotary) {
  int checked = 0;
  const json fx = load_fixtures();
  for (const auto& c : fx["cases"]) {
    if (!c.contains("cos")) continue;
    auto rope = load_yarn();
    rope->configure(model_info(c["head_dim"], c["rope_theta"], c["max_position_embeddings"], c["rope_parameters"]));
    const auto positions = c["positions"].get<std::vector<int64_t>>();
    Tensor pos = Tensor::empty({static_cast<int64_t>(positions.size())}, DType::i64);
    std::copy(positions.begin(), positions.end(), pos.data_as<int64_t>());
    RopeTables tables = rope->tables(pos, Device::cpu());
    const auto cos = tables.cos.to_floats(), sin = tables.sin.to_floats();
    const size_t half = static_cast<size_t>(c["head_dim"].get<int64_t>() / 2);
    const auto inv = rope->inv_freq();
    const auto inv_want = c["inv_freq"].get<std::vector<double>>();
    const double scale = rope->attention_scaling();
    for (size_t t = 0; t < positions.size(); ++t)
      for (size_t i = 0; i < half; ++i) {
        // torch's vectorized powf is not correctly rounded, so a column's inv_freq may sit an ulp or
        // two away (within the 1e-6 above); at position p that moves the angle by p * that gap.
        // Beyond it, the same fp32 angle, with cos/sin differing at most in their last bits.
        const double tol = 2e-6 + static_cast<double>(positions[t]) * std::fabs(inv[i] - inv_want[i]) * scale;
        EXPECT_NEAR(cos[t * half + i], c["cos"][t][i].get<double>(), tol) << c["name"] << " pos " << positions[t];
        EXPECT_NEAR(sin[t * half + i], c["sin"][t][i].get<double>(), tol) << c["name"] << " pos " << positions[t];
      }
    ++checked;
  }
  EXPECT_GE(checked, 3);
}

// Context parallelism hands a rank two chunks of the sequence (zigzag); their rows must be the rows
// of the full table at the same global positions, bit for bit.
TEST(RopeYarn, ShardFarIntoSequenceGetsItsGlobalRows) {
  auto rope = load_yarn("factor = 4.0\noriginal_max_position_embeddings = 40960\n");
  rope->configure(model_info(32, 1e6, 40960, json::object()));
  const int64_t L = 163840, cp = 4, chunk = L / (2 * cp), half = 16;
  Tensor all = Tensor::empty({L}, DType::i64);
  for (int64_t i = 0; i < L; ++i) all.data_as<int64_t>()[i] = i;
  RopeTables full = rope->tables(all, Device::cpu());
  const float* fc = full.cos.data_as<float>();
  const float* fs = full.sin.data_as<float>();
  for (int64_t rank = 0; rank < cp; ++rank) {
    const int64_t a = rank * chunk, b = (2 * cp - 1 - rank) * chunk;
    Tensor pos = Tensor::empty({2 * chunk}, DType::i64);
    for (int64_t i = 0; i < chunk; ++i) {
      pos.data_as<int64_t>()[i] = a + i;
      pos.data_as<int64_t>()[chunk + i] = b + i;
    }
    RopeTables shard = rope->tables(pos, Device::cpu());
    ASSERT_EQ(shard.cos.shape(), (Shape{2 * chunk, half}));
    const float* sc = shard.cos.data_as<float>();
    const float* ss = shard.sin.data_as<float>();
    for (int64_t r = 0; r < 2 * chunk; ++r) {
      const int64_t g = pos.data_as<int64_t>()[r];
      ASSERT_EQ(0, std::memcmp(sc + r * half, fc + g * half, half * sizeof(float))) << "rank " << rank << " pos " << g;
      ASSERT_EQ(0, std::memcmp(ss + r * half, fs + g * half, half * sizeof(float))) << "rank " << rank << " pos " << g;
    }
  }
  // The attention factor is inside the tables: at position 0 cos is the factor itself.
  EXPECT_FLOAT_EQ(fc[0], static_cast<float>(0.1 * std::log(4.0) + 1.0));
  EXPECT_DOUBLE_EQ(full.attention_scaling, 0.1 * std::log(4.0) + 1.0);
}

TEST(RopeYarn, ManifestOverridesCheckpoint) {
  const json ckpt = {{"rope_type", "yarn"}, {"rope_theta", 1e6}, {"factor", 2.0},
                     {"original_max_position_embeddings", 40960}, {"beta_fast", 16.0}};
  auto from_ckpt = load_yarn();
  from_ckpt->configure(model_info(128, 1e6, 40960, ckpt));
  auto overridden = load_yarn("factor = 8.0\n");
  overridden->configure(model_info(128, 1e6, 40960, ckpt));
  auto manifest_only = load_yarn("factor = 8.0\noriginal_max_position_embeddings = 40960\nbeta_fast = 16.0\n");
  manifest_only->configure(model_info(128, 1e6, 40960, json::object()));

  EXPECT_EQ(from_ckpt->effective_max_positions(), 81920);
  EXPECT_EQ(overridden->effective_max_positions(), 327680);
  EXPECT_EQ(overridden->inv_freq(), manifest_only->inv_freq());
  EXPECT_NE(overridden->inv_freq(), from_ckpt->inv_freq());
  EXPECT_DOUBLE_EQ(overridden->attention_scaling(), 0.1 * std::log(8.0) + 1.0);
  json exported = json::parse(overridden->hf_rope_parameters());
  EXPECT_EQ(exported["factor"], 8.0);
  EXPECT_EQ(exported["beta_fast"], 16.0);  // kept from the checkpoint
}

TEST(RopeYarn, ReadsTransformers4RopeScaling) {
  const json v4 = {{"type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 40960}, {"rope_theta", 1e6}};
  const json v5 = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 40960}, {"rope_theta", 1e6}};
  auto a = load_yarn(), b = load_yarn();
  a->configure(model_info(128, 1e6, 40960, v4));
  b->configure(model_info(128, 1e6, 40960, v5));
  EXPECT_EQ(a->inv_freq(), b->inv_freq());
  EXPECT_EQ(a->effective_max_positions(), 163840);
}

void expect_error_naming(const std::function<void()>& f, const std::string& key);

TEST(RopeYarn, ReplacesAnotherScalingOnlyWhereTheManifestSaysHow) {
  // YaRN over a model trained with another scaling, from the checkpoint's values alone, would give
  // it positions it never saw: refused. With factor and original_max_position_embeddings in the
  // manifest, YaRN replaces that scaling (Llama 3.1's llama3 at 1M tokens): the base frequencies
  // rescaled as for a plain checkpoint.
  for (const char* type : {"linear", "dynamic", "llama3", "longrope"}) {
    const json params = {{"rope_type", type}, {"factor", 2.0}, {"rope_theta", 1e6}};
    auto half = load_yarn("factor = 4.0\n");
    expect_error_naming([&] { half->configure(model_info(128, 1e6, 40960, params)); }, str("rope_type '", type, "'"));
    auto rope = load_yarn("factor = 4.0\noriginal_max_position_embeddings = 40960\n");
    auto plain = load_yarn("factor = 4.0\noriginal_max_position_embeddings = 40960\n");
    rope->configure(model_info(128, 1e6, 40960, params));
    plain->configure(model_info(128, 1e6, 40960, json::object()));
    EXPECT_EQ(rope->inv_freq(), plain->inv_freq()) << type;
    EXPECT_EQ(json::parse(rope->hf_rope_parameters())["rope_type"], "yarn");
  }
}

TEST(RopeYarn, HfRopeParametersRoundTrip) {
  auto rope = load_yarn("factor = 4.0\noriginal_max_position_embeddings = 40960\ntruncate = false\nmscale = 0.5\n");
  rope->configure(model_info(128, 1e6, 40960, json::object()));
  json j = json::parse(rope->hf_rope_parameters());
  EXPECT_EQ(j["rope_type"], "yarn");
  EXPECT_EQ(j["rope_theta"], 1e6);
  EXPECT_EQ(j["factor"], 4.0);
  EXPECT_EQ(j["original_max_position_embeddings"], 40960);
  EXPECT_EQ(j["truncate"], false);
  EXPECT_EQ(j["mscale"], 0.5);
  EXPECT_FALSE(j.contains("beta_fast"));  // unset keys stay out, so transformers applies its defaults
  EXPECT_FALSE(j.contains("attention_factor"));
  // What a checkpoint exported with these parameters gives back when read again.
  auto again = load_yarn();
  again->configure(model_info(128, 1e6, 40960, j));
  EXPECT_EQ(again->inv_freq(), rope->inv_freq());
  EXPECT_EQ(again->attention_scaling(), rope->attention_scaling());
  EXPECT_EQ(again->effective_max_positions(), 163840);
}

TEST(RopeYarn, FactorOneIsPlainRotary) {
  auto yarn = load_yarn("factor = 1.0\n");
  yarn->configure(model_info(128, 1e6, 40960, json::object()));
  auto plain = make_default_rope();
  plain->configure(model_info(128, 1e6, 40960, json::object()));
  const auto a = yarn->inv_freq(), b = plain->inv_freq();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) expect_rel(a[i], b[i], 1e-6, str("inv_freq[", i, "]"));
  EXPECT_EQ(yarn->attention_scaling(), 1.0);
  EXPECT_EQ(yarn->effective_max_positions(), 40960);
}

void expect_error_naming(const std::function<void()>& f, const std::string& key) {
  try {
    f();
    ADD_FAILURE() << "accepted; expected an error naming " << key;
  } catch (const Error& e) {
    const std::string all = std::string(e.what()) + " | " + e.key() + " | " + e.fix();
    EXPECT_NE(all.find(key), std::string::npos) << all;
  }
}

TEST(RopeYarn, Guards) {
  expect_error_naming([] { load_yarn("factor = 0.5\n"); }, "factor");
  expect_error_naming([] { load_yarn("original_max_position_embeddings = 0\n"); }, "original_max_position_embeddings");
  expect_error_naming([] { load_yarn("beta_fast = -1.0\n"); }, "beta_fast");
  expect_error_naming([] { load_yarn("factr = 4.0\n"); }, "factr");
  expect_error_naming(
      [] {
        load_yarn("factor = 4.0\n")->configure(model_info(128, 1e6, 40960, json::object()));
      },
      "original_max_position_embeddings");
  expect_error_naming(
      [] {
        load_yarn()->configure(
            model_info(128, 1e6, 40960,
                       {{"rope_type", "yarn"}, {"factor", 0.25}, {"original_max_position_embeddings", 4096}}));
      },
      "factor");
  expect_error_naming([] { load_yarn()->configure(model_info(127, 1e6, 40960, json::object())); }, "head_dim");
  EXPECT_THROW(load_yarn()->inv_freq(), Error);  // used before configure()
}

}  // namespace
}  // namespace lcx
