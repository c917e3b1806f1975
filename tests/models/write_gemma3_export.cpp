// Writes the lcx side of Gemma 3's export check: a random-init gemma3_text model (windows of 8 over
// 48 tokens, sliding and full layers, linear scaling on the full ones, query_pre_attn_scalar other
// than head_dim, (1 + w) norms drawn away from 0) saved by the module as an HF folder in bf16, with
// expected.json holding fixed token ids, labels and the loss lcx computes on exactly those saved
// weights. check_gemma3_export.py then loads the folder in transformers and compares weights and loss.
//
//   lcx_gemma3_export tests/models/fixtures/gemma3_export
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/model_util.h"

namespace {

constexpr const char* kSpec =
    R"({"vocab_size":256,"hidden_size":48,"intermediate_size":64,"num_hidden_layers":3,"num_attention_heads":4,)"
    R"("num_key_value_heads":2,"head_dim":16,"query_pre_attn_scalar":24,"sliding_window":8,"initializer_range":0.1,)"
    R"("layer_types":["sliding_attention","full_attention","sliding_attention"],)"
    R"("rope_parameters":{"sliding_attention":{"rope_type":"default","rope_theta":10000.0},)"
    R"("full_attention":{"rope_type":"linear","factor":8.0,"rope_theta":1000000.0}}})";
constexpr uint64_t kSeed = 20261207;

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <folder>\n", argv[0]);
    return 2;
  }
  try {
    using namespace lcx;
    const std::string dir = argv[1];
    auto model = test::make_plugin<Model>("gemma3_text");
    model->init_random(kSpec, kSeed, Device::cpu(), DType::f32);
    // Norm weights start at 0 (read as 1 + w): draw them so the (1 + w) form is visible.
    uint32_t seed = 7;
    for (Parameter* p : model->parameters())
      if (p->value.dim() == 1) test::fill_normal(p->value, seed++, 0.3f);
    test::DefaultSlots writer(*model);
    model->save_hf(dir, DType::bf16, writer.rope->hf_rope_parameters());
    // The loss of what was written: reload the bf16 folder in fp32.
    auto saved = test::make_plugin<Model>("gemma3_text");
    saved->load_hf(dir, Device::cpu(), DType::f32);
    test::DefaultSlots s(*saved);
    std::vector<int64_t> ids, labels;
    for (int64_t t = 0; t < 48; ++t) ids.push_back(1 + (t * 97 + 13) % 255);
    labels = ids;
    labels[7] = labels[30] = -100;
    Shard shard = test::shard_from_labels(ids, labels);
    EvalResult e = eval_step(s.slots, shard, Device::cpu());
    const double loss = e.loss_sum / static_cast<double>(e.valid);
    nlohmann::json j = {{"spec", nlohmann::json::parse(kSpec)}, {"seed", kSeed}, {"input_ids", ids},
                        {"labels", labels}, {"loss", loss}, {"valid", e.valid}};
    std::ofstream(std::filesystem::path(dir) / "expected.json") << j.dump(2) << "\n";
    std::printf("wrote %s: loss %.8f over %lld targets\n", dir.c_str(), loss, static_cast<long long>(e.valid));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
