// config.json reading: transformers 4 and 5 layouts of the rope keys, sliding-window layer types,
// dtype names, and errors that name the file and the key.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "lcx/error.h"
#include "lcx/hf_config.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::error_of;

TEST(HfConfig, TransformersFiveRopeParameters) {
  HfConfig c = HfConfig::parse(R"({"model_type":"qwen3","rope_parameters":{"rope_type":"yarn","rope_theta":1000000.0,
      "factor":4.0,"original_max_position_embeddings":40960},"dtype":"bfloat16","num_hidden_layers":2,
      "layer_types":["full_attention","full_attention"]})",
                               "v5.json");
  EXPECT_DOUBLE_EQ(c.rope_theta(10000), 1e6);
  auto rp = nlohmann::json::parse(c.rope_parameters_json());
  EXPECT_EQ(rp["rope_type"], "yarn");
  EXPECT_EQ(rp["factor"], 4.0);
  EXPECT_EQ(c.torch_dtype("float32"), "bfloat16");
  EXPECT_EQ(c.layer_types(2), (std::vector<std::string>{"full_attention", "full_attention"}));
  EXPECT_NO_THROW(c.expect_model_type("qwen3"));
}

TEST(HfConfig, TransformersFourRopeScalingGetsThetaMerged) {
  HfConfig c = HfConfig::parse(R"({"model_type":"qwen3","rope_theta":5000000,"rope_scaling":{"type":"yarn","factor":2.0,
      "original_max_position_embeddings":32768},"torch_dtype":"float16"})",
                               "v4.json");
  EXPECT_DOUBLE_EQ(c.rope_theta(10000), 5e6);
  auto rp = nlohmann::json::parse(c.rope_parameters_json());
  EXPECT_EQ(rp["rope_type"], "yarn");
  EXPECT_EQ(rp["rope_theta"], 5000000);
  EXPECT_EQ(c.torch_dtype("bfloat16"), "float16");
  HfConfig plain = HfConfig::parse(R"({"rope_theta":1000000,"rope_scaling":null})", "v4b.json");
  EXPECT_EQ(plain.rope_parameters_json(), "{}");
  EXPECT_DOUBLE_EQ(plain.rope_theta(1), 1e6);
  EXPECT_DOUBLE_EQ(HfConfig::parse("{}", "e").rope_theta(10000), 10000);
}

TEST(HfConfig, SlidingWindowLayersAreDerivedAsTransformersDoes) {
  HfConfig on = HfConfig::parse(R"({"use_sliding_window":true,"sliding_window":4096,"max_window_layers":2})", "s.json");
  EXPECT_EQ(on.layer_types(4),
            (std::vector<std::string>{"full_attention", "full_attention", "sliding_attention", "sliding_attention"}));
  // use_sliding_window false disables the window whatever sliding_window says.
  HfConfig off = HfConfig::parse(R"({"use_sliding_window":false,"sliding_window":4096,"max_window_layers":0})", "s.json");
  EXPECT_EQ(off.layer_types(2), (std::vector<std::string>{"full_attention", "full_attention"}));
  HfConfig wrong = HfConfig::parse(R"({"layer_types":["full_attention"]})", "lt.json");
  const test::Thrown e = test::thrown_by([&] { wrong.layer_types(3); });
  EXPECT_EQ(e.key, "layer_types");
  EXPECT_NE(e.message.find("lt.json"), std::string::npos) << e.message;
}

TEST(HfConfig, ErrorsNameFileKeyAndValue) {
  auto dir = test::temp_dir("hfconfig");
  test::write_file(dir / "config.json", R"({"model_type":"llama","hidden_size":"big","tie_word_embeddings":1})");
  HfConfig c = HfConfig::load(dir.string());
  test::Thrown e = test::thrown_by([&] { c.expect_model_type("qwen3"); });
  EXPECT_EQ(e.key, "model_type");
  EXPECT_NE(e.message.find((dir / "config.json").string()), std::string::npos) << e.message;
  EXPECT_NE(e.message.find("'llama'"), std::string::npos) << e.message;
  e = test::thrown_by([&] { c.get_int("hidden_size", 0); });
  EXPECT_EQ(e.key, "hidden_size");
  EXPECT_NE(e.message.find("\"big\""), std::string::npos) << e.message;
  e = test::thrown_by([&] { c.get_bool("tie_word_embeddings", false); });
  EXPECT_EQ(e.key, "tie_word_embeddings");
  EXPECT_NE(e.message.find("true or false"), std::string::npos) << e.message;
  e = test::thrown_by([&] { c.require_int("vocab_size"); });
  EXPECT_EQ(e.key, "vocab_size");
  EXPECT_NE(e.message.find("required"), std::string::npos) << e.message;
  EXPECT_NE(error_of([&] { HfConfig::load((dir / "missing").string()); }).find("does not exist"), std::string::npos);
  // A folder where config.json should be is named as such, not read as empty.
  std::filesystem::create_directories(dir / "odd" / "config.json");
  e = test::thrown_by([&] { HfConfig::load((dir / "odd").string()); });
  EXPECT_NE(e.message.find((dir / "odd" / "config.json").string() + "' is a folder, not a file"), std::string::npos)
      << e.message;
  EXPECT_NE(error_of([&] { HfConfig::parse("[1]", "arr"); }).find("not a JSON object"), std::string::npos);
}

}  // namespace
}  // namespace lcx
