#include <atomic>
#include <cctype>
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <numbers>

#include "lcx/defaults.h"
#include "lcx/error.h"
#include "lcx/log.h"
#include "lcx/plan.h"
#include "slots/resolve.h"

namespace lcx {
namespace {

// cos and sin [T, inv.size()] of positions * inv, times `attention_scaling`.
RopeTables tables_of(const std::vector<double>& inv, double attention_scaling, const Tensor& positions, Device device) {
  LCX_CHECK(positions.dtype() == DType::i64 && positions.dim() == 1, "positions must be int64 [T]");
  const int64_t T = positions.size(0), half = static_cast<int64_t>(inv.size());
  const float scale = static_cast<float>(attention_scaling);
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
  out.attention_scaling = attention_scaling;
  out.cos = device.is_cuda() ? cos.to(device) : cos;
  out.sin = device.is_cuda() ? sin.to(device) : sin;
  return out;
}

}  // namespace

RopeTables PositionalEncoding::tables(const Tensor& positions, Device device) const {
  return tables_of(inv_freq(), attention_scaling(), positions, device);
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
    type_ = type == "linear" || type == "dynamic" || type == "llama3" ? type : std::string("default");
    if (type_ != "default") {
      read_scaling(info);
      info_ = info;
      return;
    }
    if (!type.empty() && type != "default") {
      if (stands_in_for_.empty())
        throw Error(str("the model's config.json has rope parameters of rope_type '", type,
                        "', and core's positional encoding ('rope') computes the default, linear, dynamic and llama3 kinds only"),
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
  // transformers' default, linear and llama3 frequencies (dynamic's at max_position_embeddings,
  // where it equals the default; tables() rescales it for longer sequences).
  std::vector<double> inv_freq() const override {
    std::vector<double> inv = default_inv_freq(info_.rope_theta);
    if (type_ == "linear")
      for (double& f : inv) f = static_cast<float>(static_cast<float>(f) / static_cast<float>(factor_));
    if (type_ == "llama3") llama3(inv);
    return inv;
  }
  // Dynamic NTK as transformers' dynamic_rope_update: a sequence whose positions reach past
  // max_position_embeddings (positions restart per document: its longest document) runs with the
  // base rescaled for that length, base * (factor * len / max - (factor - 1)) ^ (d / (d - 2)).
  // The positions are the shard's: under cp or sp a shard may see a shorter length than the
  // whole sequence, so such a run equals transformers only within max_position_embeddings.
  RopeTables tables(const Tensor& positions, Device device) const override {
    if (type_ != "dynamic") return tables_of(inv_freq(), attention_scaling(), positions, device);
    int64_t longest = 0;
    for (int64_t t = 0; t < positions.numel(); ++t) longest = std::max(longest, positions.data_as<int64_t>()[t] + 1);
    const double max = static_cast<double>(info_.max_position_embeddings), d = static_cast<double>(info_.head_dim);
    const double len = std::max(static_cast<double>(longest), max);
    const double base = info_.rope_theta * std::pow(factor_ * len / max - (factor_ - 1), d / (d - 2));
    return tables_of(default_inv_freq(base), 1.0, positions, device);
  }
  double attention_scaling() const override { return 1.0; }
  int64_t effective_max_positions() const override { return info_.max_position_embeddings; }
  std::string hf_rope_parameters() const override {
    if (type_ != "default") return scaling_.dump();
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

  // transformers: 1 / base ** (arange(0, d, 2, int64).float() / d), in fp32.
  std::vector<double> default_inv_freq(double base) const {
    const int64_t d = info_.head_dim;
    std::vector<double> inv(static_cast<size_t>(d / 2));
    for (int64_t i = 0; i < d / 2; ++i)
      inv[static_cast<size_t>(i)] = static_cast<float>(
          1.0 / std::pow(base, static_cast<double>(static_cast<float>(2 * i) / static_cast<float>(d))));
    return inv;
  }
  // Llama 3.1's scaling, in fp32 as transformers computes it: wavelengths above
  // original / low_freq_factor divided by factor, below original / high_freq_factor kept, and
  // between them a blend of the two by where 1 / wavelength lies.
  void llama3(std::vector<double>& inv) const {
    const float factor = static_cast<float>(factor_), low = static_cast<float>(low_freq_factor_),
                high = static_cast<float>(high_freq_factor_), old = static_cast<float>(original_);
    const double low_wavelen = original_ / low_freq_factor_, high_wavelen = original_ / high_freq_factor_;
    for (double& f : inv) {
      const float fi = static_cast<float>(f);
      const float wavelen = static_cast<float>(2 * std::numbers::pi) / fi;
      const float scaled = wavelen > low_wavelen ? fi / factor : fi;
      const float smooth = (old / wavelen - low) / (high - low);
      const float smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
      const bool medium = !(wavelen < high_wavelen) && !(wavelen > low_wavelen);
      f = medium ? smoothed : scaled;
    }
  }
  // The scaling's numbers from the rope parameters, each required key named when missing.
  void read_scaling(const RopeModelInfo& info) {
    scaling_ = nlohmann::json::parse(info.rope_parameters_json);
    scaling_.erase("type");
    scaling_["rope_type"] = type_;
    if (!scaling_.contains("rope_theta")) scaling_["rope_theta"] = info.rope_theta;
    auto number = [&](const char* key) {
      auto it = scaling_.find(key);
      if (it == scaling_.end() || !it->is_number())
        throw Error(str("the model's rope parameters of rope_type '", type_, "' have no number '", key, "'"),
                    str("rope_parameters.", key), "use the checkpoint's config.json as transformers wrote it");
      return it->get<double>();
    };
    factor_ = number("factor");
    if (!(factor_ > 0))
      throw Error(str("rope_parameters.factor is ", factor_, "; it must be positive"), "rope_parameters.factor");
    if (type_ != "llama3") return;
    low_freq_factor_ = number("low_freq_factor");
    high_freq_factor_ = number("high_freq_factor");
    original_ = number("original_max_position_embeddings");
    if (!(high_freq_factor_ > low_freq_factor_) || !(low_freq_factor_ > 0) || !(original_ > 0))
      throw Error(str("llama3 rope parameters low_freq_factor ", low_freq_factor_, ", high_freq_factor ",
                      high_freq_factor_, ", original_max_position_embeddings ", original_,
                      ": they need 0 < low_freq_factor < high_freq_factor and a positive length"),
                  "rope_parameters.high_freq_factor");
  }

  std::string stands_in_for_;
  RopeOffers offers_;
  RopeModelInfo info_;
  std::string type_ = "default";  // default, linear, dynamic or llama3
  nlohmann::json scaling_;        // the parameters of a scaled type, as hf_rope_parameters() writes them
  double factor_ = 1, low_freq_factor_ = 1, high_freq_factor_ = 4, original_ = 8192;
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
