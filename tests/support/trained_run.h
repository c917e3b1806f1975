// What an lcx-train run left in its output folder, for tests that compare whole runs: the loss
// and gradient norm of every step (metrics.jsonl) and the weights of one checkpoint.
#pragma once
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "lcx/safetensors.h"
#include "lcx/tensor.h"

namespace lcx::test {

struct TrainedRun {
  std::vector<double> losses, grad_norms;
  std::map<std::string, std::vector<float>> weights;  // empty when the checkpoint is absent
};

inline TrainedRun read_trained_run(const std::filesystem::path& out, const std::string& checkpoint) {
  TrainedRun run;
  std::ifstream in(out / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;  // an evaluation's row
    run.losses.push_back(j.at("loss").get<double>());
    run.grad_norms.push_back(j.at("grad_norm").get<double>());
  }
  if (std::filesystem::exists(out / checkpoint)) {
    auto ck = safetensors::Checkpoint::open((out / checkpoint).string());
    for (const auto& n : ck.names()) run.weights[n] = ck.load(n, DType::f32).to_floats();
  }
  return run;
}

}  // namespace lcx::test
