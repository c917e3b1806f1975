#include <atomic>
#include <cctype>
#include <cmath>
#include <nlohmann/json.hpp>

#include "lcx/defaults.h"
#include "lcx/error.h"
#include "lcx/log.h"
#include "lcx/plan.h"
#include "slots/resolve.h"

namespace lcx {

RopeTables PositionalEncoding::tables(const Tensor& positions, Device device) const {
  LCX_CHECK(positions.dtype() == DType::i64 && positions.dim() == 1, "positions must be int64 [T]");
  std::vector<double> inv = inv_freq();
  const int64_t T = positions.size(0), half = static_cast<int64_t>(inv.size());
  const float scale = static_cast<float>(attention_scaling());
  Tensor cos = Tensor::empty({T, half}, DType::f32), sin = Tensor::empty({T, half}, DType::f32);
  const int64_t* pos = positions.data_as<int64_t>();
  float* c = cos.data_as<float>();
  float* s = sin.data_as<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < half; ++i) {
      // transformers multiplies fp32 position by fp32 inv_freq; do the same to match bits.
      float f = static_cast<float>(pos[t]) * static_cast<float>(inv[static_cast<size_t>(i)]);
      c[t * half + i] = std::cos(f) * scale;
      s[t * half + i] = std::sin(f) * scale;
    }
  RopeTables out;
  out.attention_scaling = attention_scaling();
  out.cos = device.is_cuda() ? cos.to(device) : cos;
  out.sin = device.is_cuda() ? sin.to(device) : sin;
  return out;
}

namespace {

// The scaling type of the model's rope parameters ("" or "default" when it has none).
std::string rope_type_of(const std::string& rope_parameters_json) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(rope_parameters_json.empty() ? "{}" : rope_parameters_json);
  } catch (const nlohmann::json::exception& e) {
    throw Error(str("the model's rope parameters are not valid JSON: ", e.what()), "rope_parameters");
  }
  if (!j.is_object()) return {};
  auto type = j.find("rope_type");
  if (type == j.end()) type = j.find("type");
  return type != j.end() && type->is_string() ? type->get<std::string>() : std::string();
}

class DefaultRope final : public PositionalEncoding {
 public:
  // `stands_in_for`: the positional-encoding plugin --disable'd for this run, if any.
  explicit DefaultRope(std::string stands_in_for = {}, RopeOffers offers = {})
      : stands_in_for_(std::move(stands_in_for)), offers_(std::move(offers)) {}

  // Plain rotary over a checkpoint trained with scaled positions would train on other positions
  // than the checkpoint's without a word; only an explicit --disable of the plugin accepts that.
  void configure(const RopeModelInfo& info) override {
    const std::string type = rope_type_of(info.rope_parameters_json);
    if (!type.empty() && type != "default") {
      if (stands_in_for_.empty())
        throw Error(str("the model's config.json has rope parameters of rope_type '", type,
                        "', and core's positional encoding ('rope') computes plain rotary positions only"),
                    "rope_parameters.rope_type",
                    fix_for(type));
      static std::atomic<bool> warned{false};
      if (!warned.exchange(true))
        log::warn(str("--disable ", stands_in_for_, ": the checkpoint's rope_type '", type,
                      "' is ignored; positions are plain rotary with rope_theta ", info.rope_theta,
                      " (an ablation; the checkpoint's own positions differ)"));
    }
    info_ = info;
  }
  std::vector<double> inv_freq() const override {
    const int64_t d = info_.head_dim;
    std::vector<double> inv(static_cast<size_t>(d / 2));
    // transformers: 1 / theta ** (arange(0, d, 2, int64).float() / d), in fp32.
    for (int64_t i = 0; i < d / 2; ++i)
      inv[static_cast<size_t>(i)] = static_cast<float>(
          1.0 / std::pow(info_.rope_theta, static_cast<double>(static_cast<float>(2 * i) / static_cast<float>(d))));
    return inv;
  }
  double attention_scaling() const override { return 1.0; }
  int64_t effective_max_positions() const override { return info_.max_position_embeddings; }
  std::string hf_rope_parameters() const override {
    return nlohmann::json{{"rope_type", "default"}, {"rope_theta", info_.rope_theta}}.dump();
  }
  // tables(): cos and sin [T, head_dim/2] fp32 on the GPU for the whole step.
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    plan.add("rope_tables", "rope cos/sin [T,d/2] fp32", PlanCategory::transient,
             2 * in.tokens_per_rank * (in.model.head_dim / 2) * 4, plan_phase::step);
  }

 private:
  // The installed positional-encoding plugin whose name or summary speaks of `type` is the fix.
  std::string fix_for(const std::string& type) const {
    auto lower = [](std::string s) {
      for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      return s;
    };
    if (offers_)
      for (const auto& [name, summary] : offers_())
        if (lower(name).find(type) != std::string::npos || lower(summary).find(type) != std::string::npos)
          return str("add \"", name, "\" to [plugins] load: it takes the checkpoint's ", type,
                     " values (for an ablation without them, add it and pass --disable ", name, ")");
    return str("no installed positional encoding computes rope_type '", type,
               "' (lcx-train --list-plugins lists them); use a checkpoint without it");
  }

  std::string stands_in_for_;
  RopeOffers offers_;
  RopeModelInfo info_;
};

}  // namespace

std::unique_ptr<PositionalEncoding> make_default_rope() { return std::make_unique<DefaultRope>(); }

std::unique_ptr<PositionalEncoding> make_default_rope_offering(RopeOffers offers) {
  return std::make_unique<DefaultRope>(std::string(), std::move(offers));
}

std::unique_ptr<PositionalEncoding> make_default_rope_in_place_of(const std::string& disabled) {
  return std::make_unique<DefaultRope>(disabled);
}

}  // namespace lcx
