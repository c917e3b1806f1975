// Writes the lcx side of the export check: random-init Qwen3 models (export_spec.h) saved by the
// qwen3 module as HF folders (bf16 weights, as a training run exports them), each with
// expected.json holding fixed token ids, labels and the loss lcx computes on exactly those saved
// weights. check_export.py then loads each folder in transformers and compares weights and loss.
//
//   lcx_parity_export tests/parity/fixtures
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/model_util.h"
#include "parity/export_spec.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <fixtures folder>\n", argv[0]);
    return 2;
  }
  try {
    using namespace lcx;
    for (const auto& v : parity::kExports) {
      const std::string dir = (std::filesystem::path(argv[1]) / v.folder).string();
      auto model = test::make_qwen3(v.table);
      model->init_random(v.spec, parity::kExportSeed, Device::cpu(), DType::f32);
      test::DefaultSlots writer(*model);
      model->save_hf(dir, DType::bf16, writer.rope->hf_rope_parameters());
      // The loss of what was written: reload the bf16 folder in fp32.
      auto saved = test::make_qwen3();
      saved->load_hf(dir, Device::cpu(), DType::f32);
      test::DefaultSlots s(*saved);
      const auto ids = parity::export_ids(), labels = parity::export_labels();
      Shard shard = test::shard_from_labels(ids, labels);
      EvalResult e = eval_step(s.slots, shard, Device::cpu());
      const double loss = e.loss_sum / static_cast<double>(e.valid);
      nlohmann::json j = {{"spec", nlohmann::json::parse(v.spec)}, {"seed", parity::kExportSeed}, {"input_ids", ids},
                          {"labels", labels}, {"loss", loss}, {"valid", e.valid}};
      std::ofstream(std::filesystem::path(dir) / "expected.json") << j.dump(2) << "\n";
      std::printf("wrote %s: loss %.8f over %lld targets\n", dir.c_str(), loss, static_cast<long long>(e.valid));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
