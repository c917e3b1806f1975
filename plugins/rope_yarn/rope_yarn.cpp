// rope_yarn: YaRN-rescaled rotary positions, equal to transformers' `_compute_yarn_parameters`.
//
// YaRN keeps the fast-rotating dimensions as trained (extrapolation), divides the slow ones by
// `factor` (interpolation), and ramps linearly between the two over the dimensions whose
// wavelength falls between beta_fast and beta_slow rotations of the original context; cos and sin
// are then multiplied by an attention factor (0.1 ln(factor) + 1 unless given). transformers does
// this in fp32 and the model sees those fp32 values, so each step below rounds to fp32 where torch
// does; only the correction range is fp64, as it is Python math there.
//
// Values come from the manifest's [rope_yarn] table, else from the checkpoint's rope parameters
// (config.json's `rope_parameters`, or transformers 4's `rope_scaling`); the model supplies
// rope_theta and head_dim. The cos/sin tables are core's (PositionalEncoding::tables) over the
// global positions the Parallelism slot hands over.
#include <lcx/log.h>
#include <lcx/plan.h>
#include <lcx/plugin.h>
#include <lcx/slots/positional_encoding.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <ios>
#include <nlohmann/json.hpp>
#include <numbers>
#include <optional>

namespace lcx {
namespace {

// The YaRN keys, each unset unless the manifest or the checkpoint gives it.
struct YarnKeys {
  std::optional<double> factor;
  std::optional<int64_t> original_max;
  std::optional<double> beta_fast;
  std::optional<double> beta_slow;
  std::optional<double> attention_factor;
  std::optional<double> mscale;
  std::optional<double> mscale_all_dim;
  std::optional<bool> truncate;
};

constexpr const char* kOriginalMax = "original_max_position_embeddings";

// transformers' get_mscale: the YaRN paper's attention temperature for a scale factor.
double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

YarnKeys read_manifest(const ConfigView& cfg) {
  // Each key falls back to the checkpoint's rope parameters: absent is nullopt. The getter runs
  // either way, so the key's type reaches the reference (ConfigView::describe).
  auto given = [&](const char* key, auto value) {
    return cfg.has(key) ? std::optional<decltype(value)>(value) : std::nullopt;
  };
  const char* from_checkpoint = "the checkpoint's";
  cfg.describe("factor", "target length / the trained length (163840 / 40960 = 4)", ">= 1",
               "the checkpoint's, else max_position_embeddings / original_max_position_embeddings, else 1");
  cfg.describe(kOriginalMax, "the number of positions the model was trained on (40960 for Qwen3)", ">= 1",
               "the checkpoint's, else its max_position_embeddings");
  cfg.describe("beta_fast", "rotations of the original context where the ramp starts", "> 0", "the checkpoint's, else 32");
  cfg.describe("beta_slow", "rotations of the original context where the ramp ends", "> 0", "the checkpoint's, else 1");
  cfg.describe("attention_factor", "the cos/sin scale", "> 0",
               "the checkpoint's, else 0.1 ln(factor) + 1 (or from mscale / mscale_all_dim when both are set)");
  cfg.describe("mscale", "DeepSeek-style attention factor numerator", "> 0", from_checkpoint);
  cfg.describe("mscale_all_dim", "DeepSeek-style attention factor denominator", "> 0", from_checkpoint);
  cfg.describe("truncate", "floor/ceil the ramp's ends, as transformers does", {}, "the checkpoint's, else true");
  YarnKeys k;
  auto positive = [&](const char* key, std::optional<double>& out, const char* fix) {
    out = given(key, cfg.get_double(key, 0));
    if (out && !(*out > 0)) cfg.fail(key, str("must be > 0, got ", *out), fix);
  };
  k.factor = given("factor", cfg.get_double("factor", 1));
  if (k.factor && !(*k.factor >= 1))
    cfg.fail("factor", str("must be >= 1, got ", *k.factor),
             "factor = target sequence length / original_max_position_embeddings (e.g. 163840 / 40960 = 4)");
  k.original_max = given(kOriginalMax, cfg.get_int(kOriginalMax, 0));
  if (k.original_max && *k.original_max < 1)
    cfg.fail(kOriginalMax, str("must be >= 1, got ", *k.original_max),
             "the number of positions the model was trained on (40960 for Qwen3)");
  positive("beta_fast", k.beta_fast, "32 is the YaRN paper's and transformers' default");
  positive("beta_slow", k.beta_slow, "1 is the YaRN paper's and transformers' default");
  positive("attention_factor", k.attention_factor, "leave it out to use 0.1 ln(factor) + 1");
  positive("mscale", k.mscale, "leave it out unless the checkpoint's config.json sets it");
  positive("mscale_all_dim", k.mscale_all_dim, "leave it out unless the checkpoint's config.json sets it");
  k.truncate = given("truncate", cfg.get_bool("truncate", true));
  return k;
}

// The checkpoint's YaRN values. Another scaling type is refused, unless the manifest gives both
// factor and original_max_position_embeddings: then YaRN replaces it knowingly (the long-context
// recipe for Llama 3.x: YaRN over the base frequencies in place of its llama3 scaling), said once.
YarnKeys read_checkpoint(const std::string& text, const YarnKeys& manifest) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.empty() ? "{}" : text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(str("rope_yarn: the checkpoint's rope parameters are not valid JSON: ", e.what()), "rope_parameters");
  }
  YarnKeys k;
  if (!j.is_object()) return k;
  auto pf = j.find("partial_rotary_factor");
  if (pf != j.end() && pf->is_number() && pf->get<double>() != 1.0)
    throw Error(str("rope_yarn: partial_rotary_factor ", pf->get<double>(),
                    " is not supported (Qwen3 rotates the whole head)"),
                "rope_parameters.partial_rotary_factor", "use a model that rotates every dimension of a head");
  std::string type = j.value("rope_type", j.value("type", std::string()));
  if (type != "yarn") {
    // YaRN over a model trained with another scaling would give it positions it never saw.
    if (!type.empty() && type != "default") {
      if (!manifest.factor || !manifest.original_max)
        throw Error(str("rope_yarn: the checkpoint's rope parameters are of rope_type '", type,
                        "', which YaRN does not reproduce"),
                    "rope_parameters.rope_type",
                    str("set [rope_yarn] factor and ", kOriginalMax,
                        " to replace its scaling with YaRN over the base frequencies (for Llama 3.1 at 1M tokens: "
                        "factor = 128.0 over 8192), or use a checkpoint with rope_type 'default' or 'yarn'"));
      static std::atomic<bool> said{false};
      if (!said.exchange(true))
        log::warn(str("rope_yarn: YaRN (factor ", *manifest.factor, " over ", *manifest.original_max,
                      " positions) replaces the checkpoint's rope_type '", type, "'; saved checkpoints say rope_type 'yarn'"));
    }
    return k;
  }
  auto number = [&](const char* key) -> std::optional<double> {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return std::nullopt;
    if (!it->is_number())
      throw Error(str("rope_yarn: rope_parameters.", key, " must be a number, got ", it->dump()),
                  str("rope_parameters.", key));
    return it->get<double>();
  };
  k.factor = number("factor");
  if (auto v = number(kOriginalMax)) k.original_max = static_cast<int64_t>(*v);
  k.beta_fast = number("beta_fast");
  k.beta_slow = number("beta_slow");
  k.attention_factor = number("attention_factor");
  k.mscale = number("mscale");
  k.mscale_all_dim = number("mscale_all_dim");
  auto tr = j.find("truncate");
  if (tr != j.end() && tr->is_boolean()) k.truncate = tr->get<bool>();
  return k;
}

// Manifest first, then the checkpoint; a manifest value that replaces the checkpoint's is noted.
template <typename T>
std::optional<T> merge(const char* key, const std::optional<T>& manifest, const std::optional<T>& checkpoint) {
  if (manifest && checkpoint && *manifest != *checkpoint)
    log::info(str(std::boolalpha, "rope_yarn: [rope_yarn] ", key, " = ", *manifest, " overrides the checkpoint's ",
                  *checkpoint));
  return manifest ? manifest : checkpoint;
}

class YarnRope final : public PositionalEncoding {
 public:
  explicit YarnRope(YarnKeys manifest) : manifest_(manifest) {}

  void configure(const RopeModelInfo& info) override {
    if (info.head_dim < 2 || info.head_dim % 2)
      throw Error(str("rope_yarn: head_dim must be even and >= 2, got ", info.head_dim), "head_dim");
    if (!(info.rope_theta > 1))
      throw Error(str("rope_yarn: rope_theta must be > 1, got ", info.rope_theta), "rope_theta");
    info_ = info;
    const YarnKeys ckpt = read_checkpoint(info.rope_parameters_json, manifest_);
    keys_.factor = merge("factor", manifest_.factor, ckpt.factor);
    keys_.original_max = merge(kOriginalMax, manifest_.original_max, ckpt.original_max);
    keys_.beta_fast = merge("beta_fast", manifest_.beta_fast, ckpt.beta_fast);
    keys_.beta_slow = merge("beta_slow", manifest_.beta_slow, ckpt.beta_slow);
    keys_.attention_factor = merge("attention_factor", manifest_.attention_factor, ckpt.attention_factor);
    keys_.mscale = merge("mscale", manifest_.mscale, ckpt.mscale);
    keys_.mscale_all_dim = merge("mscale_all_dim", manifest_.mscale_all_dim, ckpt.mscale_all_dim);
    keys_.truncate = merge("truncate", manifest_.truncate, ckpt.truncate);

    if (!keys_.factor && keys_.original_max) {
      // transformers derives the factor the same way when only the two lengths are given.
      keys_.factor = static_cast<double>(info.max_position_embeddings) / static_cast<double>(*keys_.original_max);
      log::info(str("rope_yarn: no factor given; using max_position_embeddings / original_max_position_embeddings = ",
                    *keys_.factor));
    }
    if (!keys_.factor) {
      log::warn("rope_yarn: no factor in [rope_yarn] or in the checkpoint; YaRN with factor 1 is plain rotary");
      keys_.factor = 1.0;
    }
    factor_ = *keys_.factor;
    if (!(factor_ >= 1))
      throw Error(str("rope_yarn: factor must be >= 1, got ", factor_), "factor",
                  "factor = target sequence length / original_max_position_embeddings (e.g. 163840 / 40960 = 4)");
    if (!keys_.original_max) {
      if (factor_ > 1)
        throw Error(str("rope_yarn: factor ", factor_, " needs original_max_position_embeddings, which neither [rope_yarn] ",
                        "nor the checkpoint's rope parameters give"),
                    kOriginalMax,
                    str("set [rope_yarn] original_max_position_embeddings to the length the model was trained on (",
                        info.max_position_embeddings, " in its config.json)"));
      keys_.original_max = info.max_position_embeddings;
    }
    original_max_ = *keys_.original_max;
    if (original_max_ < 1)
      throw Error(str("rope_yarn: original_max_position_embeddings must be >= 1, got ", original_max_), kOriginalMax);
    compute();
    configured_ = true;
  }

  std::vector<double> inv_freq() const override {
    require_configured();
    return inv_freq_;
  }
  double attention_scaling() const override {
    require_configured();
    return attention_factor_;
  }
  int64_t effective_max_positions() const override {
    require_configured();
    // The small epsilon keeps 4 * 40960 from landing on 163839 through rounding.
    return static_cast<int64_t>(std::floor(factor_ * static_cast<double>(original_max_) + 1e-6));
  }
  // YaRN changes the frequencies, not the tables: cos and sin [T, head_dim/2] fp32 on the GPU
  // for the whole step (PositionalEncoding::tables), already scaled by the attention factor.
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    plan.add("rope_tables", "rope cos/sin [T,d/2] fp32", PlanCategory::transient,
             2 * in.tokens_per_rank * (in.model.head_dim / 2) * 4, plan_phase::step);
  }
  std::string hf_rope_parameters() const override {
    require_configured();
    nlohmann::json j = {{"rope_type", "yarn"},
                        {"rope_theta", info_.rope_theta},
                        {"factor", factor_},
                        {kOriginalMax, original_max_}};
    auto put = [&](const char* key, const std::optional<double>& v) {
      if (v) j[key] = *v;
    };
    put("beta_fast", keys_.beta_fast);
    put("beta_slow", keys_.beta_slow);
    put("attention_factor", keys_.attention_factor);
    put("mscale", keys_.mscale);
    put("mscale_all_dim", keys_.mscale_all_dim);
    if (keys_.truncate) j["truncate"] = *keys_.truncate;
    return j.dump();
  }

 private:
  void require_configured() const {
    LCX_CHECK(configured_, "rope_yarn used before configure(RopeModelInfo)");
  }

  void compute() {
    const int64_t dim = info_.head_dim, half = dim / 2;
    const double base = info_.rope_theta;
    // transformers treats 0/None as unset (`get("beta_fast") or 32`), and so does `if mscale and ...`.
    const double beta_fast = keys_.beta_fast.value_or(32), beta_slow = keys_.beta_slow.value_or(1);
    const double mscale = keys_.mscale.value_or(0), mscale_all_dim = keys_.mscale_all_dim.value_or(0);
    if (keys_.attention_factor)
      attention_factor_ = *keys_.attention_factor;
    else if (mscale != 0 && mscale_all_dim != 0)
      attention_factor_ = yarn_mscale(factor_, mscale) / yarn_mscale(factor_, mscale_all_dim);
    else
      attention_factor_ = yarn_mscale(factor_, 1);

    // The dimension whose wavelength fits `rotations` times into the original context.
    auto correction_dim = [&](double rotations) {
      return static_cast<double>(dim) * std::log(static_cast<double>(original_max_) / (rotations * 2 * std::numbers::pi)) /
             (2 * std::log(base));
    };
    double low = correction_dim(beta_fast), high = correction_dim(beta_slow);
    if (keys_.truncate.value_or(true)) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, static_cast<double>(dim - 1));
    if (low == high) high += 0.001;  // transformers' guard against a zero-width ramp
    const float low_f = static_cast<float>(low), span_f = static_cast<float>(high - low);

    const float base_f = static_cast<float>(base), factor_f = static_cast<float>(factor_);
    inv_freq_.assign(static_cast<size_t>(half), 0.0);
    for (int64_t i = 0; i < half; ++i) {
      const float expo = static_cast<float>(2 * i) / static_cast<float>(dim);
      const float pos_freq = static_cast<float>(std::pow(static_cast<double>(base_f), static_cast<double>(expo)));
      const float extrapolation = 1.0f / pos_freq;
      const float interpolation = 1.0f / (factor_f * pos_freq);
      const float ramp = std::clamp((static_cast<float>(i) - low_f) / span_f, 0.0f, 1.0f);
      const float keep = 1.0f - ramp;  // share of the trained (extrapolated) frequency
      const float a = interpolation * (1.0f - keep);
      const float b = extrapolation * keep;
      inv_freq_[static_cast<size_t>(i)] = static_cast<double>(a + b);
    }
  }

  YarnKeys manifest_;
  YarnKeys keys_;
  RopeModelInfo info_;
  double factor_ = 1;
  int64_t original_max_ = 0;
  double attention_factor_ = 1;
  std::vector<double> inv_freq_;
  bool configured_ = false;
};

std::unique_ptr<Plugin> create(const PluginArgs& args) { return std::make_unique<YarnRope>(read_manifest(args.config)); }

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_POSITIONAL_ENCODING, "rope_yarn", "0.2.0", "YaRN rescaled rotary positions", "ready", lcx::create)
