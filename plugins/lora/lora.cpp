// lora: low-rank adapters on a frozen base (Hu et al. 2021), as PEFT defines them, in the
// Adapter slot (lcx/slots/adapter.h). For each targeted projection W [out, in] of every layer it
// holds A [r, in] and B [out, r], and the model computes y = x W^T + scale * (x A^T) B^T with
// scale = alpha / r (alpha / sqrt(r) with use_rslora). A starts Kaiming-uniform (PEFT's
// kaiming_uniform_(a = sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))), B at zero, so the first step's
// model is the base. Every model parameter is frozen except those of modules_to_save (matched as
// PEFT does: a module whose name ends with the entry), which train whole (LongLoRA's embeddings
// and norms).
//
// With target_parameters (PEFT's ParamWrapper), a fused experts' parameter W [E, in, out] (GPT-OSS's
// mlp.experts.gate_up_proj and down_proj) is adapted per expert: A [E_local, r, in] and
// B [E_local, out, r], expert e's delta scale * A_e^T B_e^T; its files hold PEFT's lora_A [r*E, in]
// (expert-major rows) and lora_B [out, r*E] (column j*E + e) under the module's keys
// (peft::parameter_lora_key).
//
// With experts = true, a sparse layer's (mixture of experts) gate_proj, up_proj and down_proj
// are adapted per expert: A [E_local, r, in] and B [E_local, out, r] stacked by the experts this
// rank holds, as the experts' weights are, and the layer runs them as grouped GEMMs over each
// expert's rows (qwen3_moe.cpp). Their files are PEFT's per-expert keys
// ("model.layers.3.mlp.experts.5.gate_proj.lora_A.weight"), which merge folds into the Hub's
// per-expert weights.
//
// Files are PEFT's: a checkpoint holds adapter_config.json and adapter_model.safetensors with
// PEFT's key names (lcx/peft.h); init_from starts from such a folder, and `lcx-train merge`
// folds one into its base.
//
// Written against the SDK headers only.
#include <lcx/config.h>
#include <lcx/log.h>
#include <lcx/ops.h>
#include <lcx/peft.h>
#include <lcx/plan.h>
#include <lcx/plugin.h>
#include <lcx/slots/adapter.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <regex>

namespace lcx {
namespace {

namespace fs = std::filesystem;

struct LoraOptions {
  int64_t r = 8;
  double alpha = 8;
  double dropout = 0;
  bool use_rslora = false;
  // target_modules as PEFT matches it: a list (or "all-linear") adapts its projections in every
  // layer; a pattern (any other string) adapts a module whose whole name it matches
  // ("model.layers.3.self_attn.q_proj"; a sparse layer's experts by expert 0's,
  // "model.layers.3.mlp.experts.0.gate_proj"), as Python's re.fullmatch does.
  std::array<bool, kLinearCount> targets{};
  bool all_linear = false;
  std::string pattern;
  std::shared_ptr<const std::regex> regex;  // pattern compiled
  // A sparse layer's experts adapted too (per expert) where target_modules names their projections.
  bool experts = false;
  // PEFT's target_parameters: fused experts' parameters adapted directly ("mlp.experts.gate_up_proj",
  // "mlp.experts.down_proj": GPT-OSS's [E, in, out] weights), per expert, in the order given.
  std::vector<std::string> target_parameters;
  std::optional<std::vector<std::string>> modules_to_save;
  std::string init_from;
  std::string table = "lora";
  double scale() const { return use_rslora ? alpha / std::sqrt(static_cast<double>(r)) : alpha / static_cast<double>(r); }
  std::string key(const char* k) const { return table + "." + k; }
};

// A counter-based generator (splitmix64) keyed by the seed and the tensor's name: the same
// factors on every rank and every run of a seed, whatever the order they are made in.
uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
uint64_t name_key(uint64_t seed, const std::string& name) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the name
  for (unsigned char c : name) h = (h ^ c) * 1099511628211ull;
  return mix(seed ^ mix(h));
}

// The base's parameters that are not GEMM weights, by the dense decoder's names and sizes: what
// modules_to_save may train whole, counted for the plan before any weight exists. The families'
// layers differ in their per-head norms (Qwen3's) and projection biases (Qwen2's).
std::vector<std::pair<std::string, int64_t>> dense_other_params(const ModelConfig& c) {
  const int64_t d = c.head_dim > 0 ? c.head_dim : c.hidden_size / std::max<int64_t>(1, c.num_heads);
  const bool qkv_bias = c.model_type == "qwen2";
  const bool qk_norm = !qkv_bias && c.model_type != "llama" && c.model_type != "mistral";
  std::vector<std::pair<std::string, int64_t>> out = {{"model.embed_tokens.weight", c.vocab_size * c.hidden_size}};
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = str("model.layers.", l, ".");
    out.emplace_back(p + "input_layernorm.weight", c.hidden_size);
    if (qkv_bias) {
      out.emplace_back(p + "self_attn.q_proj.bias", c.num_heads * d);
      out.emplace_back(p + "self_attn.k_proj.bias", c.num_kv_heads * d);
      out.emplace_back(p + "self_attn.v_proj.bias", c.num_kv_heads * d);
    }
    if (qk_norm) {
      out.emplace_back(p + "self_attn.q_norm.weight", d);
      out.emplace_back(p + "self_attn.k_norm.weight", d);
    }
    out.emplace_back(p + "post_attention_layernorm.weight", c.hidden_size);
  }
  out.emplace_back("model.norm.weight", c.hidden_size);
  if (!c.tie_word_embeddings) out.emplace_back("lm_head.weight", c.vocab_size * c.hidden_size);
  return out;
}

// [out, in] of each projection of a dense Qwen3 layer.
std::array<std::pair<int64_t, int64_t>, kLinearCount> projection_shapes(const ModelConfig& c) {
  const int64_t d = c.head_dim > 0 ? c.head_dim : c.hidden_size / std::max<int64_t>(1, c.num_heads);
  const int64_t H = c.hidden_size, I = c.intermediate_size, qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  return {{{qd, H}, {kvd, H}, {kvd, H}, {H, qd}, {I, H}, {I, H}, {H, I}}};
}

// The A factors of one layer's projections that share an input, as rows of one tensor; `row` is
// the next factor's first.
struct Stack {
  Tensor value, grad;
  int64_t row = 0;
};

class Lora final : public Adapter {
 public:
  explicit Lora(LoraOptions o) : o_(std::move(o)) {}

  bool active() const override { return true; }

  // The pass's key for the dropout masks: the seed, the step and the pass (not the rank: the
  // masks count rows by their index in the sequence, so a mesh draws what one rank does); 0
  // (nothing drops) outside training.
  void begin_pass(int64_t step, int64_t pass, bool training) override {
    pass_key_ = 0;
    if (!training || o_.dropout <= 0) return;
    pass_key_ = mix(seed_ ^ mix(static_cast<uint64_t>(step) ^ mix(static_cast<uint64_t>(pass)))) | 1;
  }

  void attach(Model& model, const AdapterContext& ctx) override {
    const ModelConfig& cfg = model.config();
    std::map<std::string, Parameter*> base;
    for (Parameter* p : model.parameters()) base[p->name] = p;
    params_.clear();
    saved_.clear();
    layers_.assign(static_cast<size_t>(cfg.num_layers), {});
    has_.assign(layers_.size() * kLinearCount, false);
    experts_.assign(layers_.size(), {});
    has_experts_.assign(layers_.size() * kLinearCount, false);
    first_expert_ = 0;
    seed_ = ctx.seed;
    pass_key_ = 0;
    local_experts_ = 0;
    num_experts_ = cfg.num_experts;
    if (o_.experts && cfg.sparse_layers() == 0)
      throw Error(str("lora: ", o_.key("experts"), " = true, but this model has no experts (no sparse layer)"),
                  o_.key("experts"), "set experts = false (a dense model's MLP is adapted by target_modules alone)");
    int64_t count = 0;
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
      // q, k and v read one input, as gate and up do: the A's of each set that is adapted twice
      // or more are rows of one tensor, so the model runs one GEMM over the input for them.
      std::array<Stack, kLinearCount> stacks{};
      if (ctx.stack_factors)
        for (const auto& set : {std::vector<int>{0, 1, 2}, std::vector<int>{4, 5}}) {
          int64_t rows = 0;
          for (int m : set) rows += targeted(l, m, false) ? o_.r : 0;
          if (rows < 2 * o_.r || (set[0] == static_cast<int>(Linear::gate_proj) && cfg.sparse(l))) continue;
          const auto it = base.find(peft::base_weight_name(l, linear_name(static_cast<Linear>(set[0]))));
          if (it == base.end()) continue;  // refused below, by name
          const int64_t in = it->second->value.size(1);
          Stack st{Tensor::empty({rows, in}, ctx.dtype, ctx.device, MemoryCategory::weights),
                   Tensor::zeros({rows, in}, DType::f32, ctx.device, MemoryCategory::gradients), 0};
          for (int m : set)
            if (targeted(l, m, false)) {
              stacks[static_cast<size_t>(m)] = st;
              st.row += o_.r;
            }
        }
      for (int m = 0; m < kLinearCount; ++m) {
        // A sparse layer's experts (mixture of experts) are no linear modules of their own, as in
        // transformers 5: "all-linear" passes them by, as PEFT does; named, they are refused.
        const bool sparse = cfg.sparse(l) && m >= static_cast<int>(Linear::gate_proj);
        if (!targeted(l, m, sparse)) continue;
        const std::string module = linear_name(static_cast<Linear>(m));
        const std::string wname = peft::base_weight_name(l, module);
        const auto it = base.find(wname);
        if (sparse && o_.experts) {
          count += attach_experts(static_cast<int>(l), static_cast<Linear>(m), base, ctx);
          continue;
        }
        if (sparse && o_.all_linear) continue;
        if (sparse)
          throw Error(str("lora: layer ", l, " is sparse (mixture of experts): its experts' ", module,
                          " take an adapter only with ", o_.key("experts"), " = true"),
                      o_.key("experts"), "set experts = true to adapt every expert, or target the attention projections");
        if (it == base.end())
          throw Error(str("lora: target module ", module, " has no weight ", wname, " in this model"),
                      o_.key("target_modules"), str("target the model's projections: ", joined_modules()));
        const Tensor& w = it->second->value;
        const int64_t out = w.size(0), in = w.size(1);
        if (o_.r > std::min(out, in))
          throw Error(str("lora: r = ", o_.r, " is larger than ", wname, " [", out, ", ", in, "] can hold"), o_.key("r"),
                      str("use r <= ", std::min(out, in)));
        const std::string stem = wname.substr(0, wname.size() - 7);  // without ".weight"
        const Stack& st = stacks[static_cast<size_t>(m)];
        if (st.value.defined() && st.value.size(1) != in)
          throw Error(str("lora: ", wname, " reads ", in, " features where the layer's other projections of its input read ",
                          st.value.size(1)), o_.key("target_modules"), "this model's layers are not Qwen3's");
        Parameter& a = add_param(stem + ".lora_A.weight", {o_.r, in}, ctx, &st);
        Parameter& b = add_param(stem + ".lora_B.weight", {out, o_.r}, ctx);
        // A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0 (PEFT's init_lora_weights = True).
        Tensor ha = Tensor::empty(a.value.shape(), DType::f32, Device::cpu());
        const float bound = 1.f / std::sqrt(static_cast<float>(in));  // kaiming_uniform_(a = sqrt(5))
        uint64_t key = name_key(ctx.seed, a.name);
        float* pa = ha.data_as<float>();
        for (int64_t i = 0; i < ha.numel(); ++i) {
          const uint64_t bits = mix(key + static_cast<uint64_t>(i));
          const float u = static_cast<float>(bits >> 40) * (1.f / 16777216.f);  // [0, 1) in 24 bits
          pa[i] = (2.f * u - 1.f) * bound;
        }
        set_value(a, ha);
        b.value.zero();
        LowRank lr{&a, &b, static_cast<float>(o_.scale()), st.value, st.grad, st.row};
        // Each projection draws its own mask (PEFT's Dropout per module), from the pass's key.
        lr.dropout = static_cast<float>(o_.dropout);
        lr.dropout_stream = static_cast<uint64_t>(l * kLinearCount + m);
        lr.dropout_pass = &pass_key_;
        layers_[static_cast<size_t>(l)][static_cast<size_t>(m)] = lr;
        has_[static_cast<size_t>(l) * kLinearCount + static_cast<size_t>(m)] = true;
        count += a.value.numel() + b.value.numel();
      }
    }
    param_slots_.clear();
    for (const std::string& t : o_.target_parameters) {
      int64_t found = 0;
      for (int64_t l = 0; l < cfg.num_layers; ++l) {
        const auto it = base.find(str("model.layers.", l, ".", t));
        if (it == base.end()) continue;
        count += attach_parameter(static_cast<int>(l), t, *it->second, ctx);
        ++found;
      }
      if (found == 0)
        throw Error(str("lora: ", o_.key("target_parameters"), " names ", t, ", which no layer of this model holds"),
                    o_.key("target_parameters"), "name the fused experts' parameters: \"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"");
    }
    if (count == 0)
      throw Error(str("lora: ", o_.key("target_modules"), " = ", targets_text(), " adapts no module of this model"),
                  o_.key("target_modules"), str("match the layers' projections (", joined_modules(), "), or \"all-linear\""));
    if (o_.experts && local_experts_ == 0)
      throw Error(str("lora: ", o_.key("experts"), " = true, but ", o_.key("target_modules"), " = ", targets_text(),
                      " adapts none of the experts' projections"),
                  o_.key("experts"), "match the experts' gate_proj, up_proj or down_proj, or set experts = false");
    // The base frozen, but for modules_to_save.
    int64_t trained = 0;
    for (Parameter* p : model.parameters()) {
      if (o_.modules_to_save && peft::saved_module(*o_.modules_to_save, p->name)) {
        trained += p->value.numel();
        saved_.emplace_back(p->name, p);
        continue;
      }
      p->frozen = true;
      p->grad = Tensor();
    }
    if (o_.modules_to_save) refuse_unmatched_saved(*o_.modules_to_save, model.config().tie_word_embeddings);
    const std::string from = !ctx.resume_dir.empty() ? ctx.resume_dir : o_.init_from;
    if (!from.empty()) load_from(from, model, base, ctx.resume_dir.empty());
    log::info(str("lora: r ", o_.r, ", alpha ", o_.alpha, o_.use_rslora ? " (rsLoRA)" : "", ", scale ", o_.scale(), o_.dropout > 0 ? str(", dropout ", o_.dropout) : std::string(), " on ",
                  targets_text(), o_.experts ? str(" and every expert (", local_experts_, " on this rank)") : std::string(),
                  o_.target_parameters.empty() ? std::string() : str(" and per expert ", joined(o_.target_parameters)), ": ", count, " adapter parameters", trained ? str(" + ", trained, " trained whole (",
                  joined(*o_.modules_to_save), ")") : std::string(), "; the base's ", base_count(model) - trained,
                  " frozen", from.empty() ? std::string() : str("; from ", from)));
  }

  const LowRank* find(int layer, Linear which) const override {
    const size_t i = static_cast<size_t>(layer) * kLinearCount + static_cast<size_t>(which);
    return i < has_.size() && has_[i] ? &layers_[static_cast<size_t>(layer)][static_cast<size_t>(which)] : nullptr;
  }

  const LowRank* find_experts(int layer, Linear which) const override {
    const size_t i = static_cast<size_t>(layer) * kLinearCount + static_cast<size_t>(which);
    return i < has_experts_.size() && has_experts_[i] ? &experts_[static_cast<size_t>(layer)][static_cast<size_t>(which)]
                                                      : nullptr;
  }

  std::vector<Parameter*> parameters() override {
    std::vector<Parameter*> out;
    for (Parameter& p : params_) out.push_back(&p);
    return out;
  }

  void save(const std::string& dir, const std::string& base) const override {
    peft::Adapter a;
    a.config = peft_config(base);
    for (size_t l = 0; l < layers_.size(); ++l)
      for (int m = 0; m < kLinearCount; ++m) {
        const LowRank* lr = find(static_cast<int>(l), static_cast<Linear>(m));
        if (!lr) continue;
        a.pairs.push_back({static_cast<int64_t>(l), linear_name(static_cast<Linear>(m)), to_host_f32(lr->a->value),
                           to_host_f32(lr->b->value)});
      }
    for (const ParamSlot& ps : param_slots_) {
      const LowRank& lr = experts_[static_cast<size_t>(ps.layer)][static_cast<size_t>(ps.which)];
      if (lr.a->value.size(0) != num_experts_)
        throw Error(str("lora: saving ", ps.parameter, "'s adapters needs every expert's factors; this rank holds ",
                        lr.a->value.size(0), " of ", num_experts_), o_.key("target_parameters"),
                    "save through the run (Run::save gathers them), or train with [distributed] ep = 1");
      const Tensor ha = to_host_f32(lr.a->value), hb = to_host_f32(lr.b->value);  // [E, r, in], [E, out, r]
      const int64_t E = ha.size(0), r = ha.size(1), in = ha.size(2), out = hb.size(1);
      Tensor pb = Tensor::empty({out, r * E}, DType::f32);  // PEFT's [out, r*E]: column j*E + e
      for (int64_t e = 0; e < E; ++e)
        for (int64_t o = 0; o < out; ++o)
          for (int64_t j = 0; j < r; ++j) pb.data_as<float>()[o * r * E + j * E + e] = hb.data_as<float>()[(e * out + o) * r + j];
      peft::LoraPair pair;
      pair.layer = ps.layer;
      pair.parameter = ps.parameter;
      pair.a = ha.view({E * r, in}).clone();
      pair.b = pb;
      a.pairs.push_back(std::move(pair));
    }
    for (size_t l = 0; l < layers_.size(); ++l)
      for (int m = 0; m < kLinearCount; ++m) {
        const LowRank* lr = find_experts(static_cast<int>(l), static_cast<Linear>(m));
        if (!lr || is_param_slot(static_cast<int64_t>(l), m)) continue;
        // Written by rank 0 with every expert: under expert parallelism the run gathers the
        // factors over the group around the save (Run::save), as it gathers the experts.
        if (lr->a->value.size(0) != num_experts_)
          throw Error(str("lora: saving the experts' adapters needs every expert's factors; this rank holds ",
                          lr->a->value.size(0), " of ", num_experts_, " (gather them over the expert-parallel group first)"),
                      o_.key("experts"), "save through the run (Run::save gathers them), or train with [distributed] ep = 1");
        const Tensor ha = to_host_f32(lr->a->value), hb = to_host_f32(lr->b->value);
        for (int64_t e = 0; e < ha.size(0); ++e)
          a.pairs.push_back({static_cast<int64_t>(l), linear_name(static_cast<Linear>(m)),
                             ha.rows(e, e + 1).view({ha.size(1), ha.size(2)}).clone(),
                             hb.rows(e, e + 1).view({hb.size(1), hb.size(2)}).clone(), e});
      }
    for (const auto& [name, p] : saved_)
      a.saved.emplace_back(name, p->value.device().is_cuda() ? p->value.to(Device::cpu()) : p->value);
    peft::write_adapter(dir, a, DType::f32);
  }

  bool saved_in(const std::string& dir) const override {
    return fs::is_regular_file(fs::path(dir) / "adapter_config.json") &&
           fs::is_regular_file(fs::path(dir) / "adapter_model.safetensors");
  }

  void plan_inputs(PlanInputs& in) const override {
    in.base_frozen = true;
    in.base_trained_parameters = 0;
    const bool saved = o_.modules_to_save.has_value();
    in.head_frozen = !(saved && peft::saved_module(*o_.modules_to_save, in.model.tie_word_embeddings
                                                                          ? "model.embed_tokens.weight"
                                                                          : "lm_head.weight"));
    if (o_.modules_to_save)
      for (const auto& [name, n] : dense_other_params(in.model))
        if (peft::saved_module(*o_.modules_to_save, name)) in.base_trained_parameters += n;
  }

  // The factors (values, gradients; the optimizer plans their master and moments from
  // MemoryPlan::parameters), each layer's [T, r] products, and their work.
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const ModelConfig& c = in.model;
    const auto shapes = projection_shapes(c);
    // A sparse layer's experts take no factors (attach passes them by).
    auto adapted = [&](int64_t layer, int m) {
      return !(c.sparse(layer) && m >= static_cast<int>(Linear::gate_proj)) && targeted(layer, m, false);
    };
    // Adapted in some layer: the [T, r] products live one layer at a time.
    auto target = [&](Linear which) {
      for (int64_t l = 0; l < c.num_layers; ++l)
        if (adapted(l, static_cast<int>(which))) return true;
      return false;
    };
    int64_t per_layer = 0, n = 0;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      int64_t here = 0;
      for (int m = 0; m < kLinearCount; ++m)
        if (adapted(l, m)) here += o_.r * (shapes[static_cast<size_t>(m)].first + shapes[static_cast<size_t>(m)].second);
      per_layer = std::max(per_layer, here);
      n += here;
    }
    const int64_t ab = static_cast<int64_t>(dtype_size(in.weight_dtype)), gb = static_cast<int64_t>(dtype_size(in.grad_dtype));
    // Sharded over the ranks with the base (ZeRO-3), a layer's factors gathered around its work.
    const int64_t shards = parameter_shards(in), per_rank = (n + shards - 1) / shards;
    plan.add("lora_weights", str("LoRA factors A, B (", n, ")"), PlanCategory::weights, per_rank * ab, plan_phase::always);
    plan.add("lora_gradients", str("LoRA factors' gradients (", dtype_name(shards > 1 ? DType::f32 : in.grad_dtype), ")"),
             PlanCategory::gradients, per_rank * (shards > 1 ? 4 : gb), plan_phase::always);
    if (shards > 1) {
      plan.add("lora_gathered_layer", "one layer's gathered LoRA factors", PlanCategory::communication, per_layer * ab,
               plan_phase::forward);
      for (const char* phase : {plan_phase::mlp_backward, plan_phase::backward})
        plan.add("lora_gathered_layer_grads", "one layer's gathered LoRA factors + full fp32 grads",
                 PlanCategory::communication, per_layer * (ab + 4), phase);
    }
    plan.parameters += n;
    plan.gemm_parameters += n;

    // The experts' factors (experts = true): per sparse layer and adapted projection, this rank's
    // E/ep experts' A [r, in] and B [out, r]; in the layer's work, each of the layer's routed rows
    // (T * k of them) runs u = x A_e^T [rows, r] and its update, and in the backward u again,
    // g = scale dy B_e [rows, r] and the factors' grouped wgrads.
    if (o_.experts && c.sparse_layers() > 0) {
      const int64_t El = c.num_experts / std::max<int64_t>(1, in.ep), H = c.hidden_size, Im = c.moe_intermediate_size;
      // The sparse layers whose experts' projection m is adapted, and the most one layer holds.
      std::array<int64_t, kLinearCount> layers{};
      int64_t ne = 0, all = 0;
      for (int64_t l = 0; l < c.num_layers; ++l) {
        if (!c.sparse(l)) continue;
        int64_t here = 0;
        for (int m = static_cast<int>(Linear::gate_proj); m < kLinearCount; ++m)
          if (targeted(l, m, true)) {
            ++layers[static_cast<size_t>(m)];
            here += El * o_.r * (H + Im);
          }
        ne = std::max(ne, here);
        all += here;
      }
      auto expert_target = [&](Linear which) { return layers[static_cast<size_t>(which)] > 0; };
      const int64_t per = (all + shards - 1) / shards;
      plan.add("lora_expert_weights", str("LoRA factors of the experts (", all, ")"), PlanCategory::weights, per * ab,
               plan_phase::always);
      plan.add("lora_expert_gradients", "LoRA factors of the experts' gradients", PlanCategory::gradients,
               per * (shards > 1 ? 4 : gb), plan_phase::always);
      plan.parameters += all;
      plan.gemm_parameters += all;
      if (shards > 1) {  // ZeRO-3: a sparse layer's expert factors gathered around its work, as the others are
        plan.add("lora_expert_gathered_layer", "one sparse layer's gathered LoRA factors of the experts",
                 PlanCategory::communication, ne * ab, plan_phase::forward);
        for (const char* phase : {plan_phase::mlp_backward, plan_phase::backward})
          plan.add("lora_expert_gathered_layer_grads", "one sparse layer's gathered LoRA factors of the experts + full fp32 grads",
                   PlanCategory::communication, ne * (ab + 4), phase);
      }
      // The [rows, r] products (u = x A_e^T, g = scale dy B_e) live one at a time, each beside
      // buffers the sparse layer's plan (qwen3_plan.cpp, "moe_backward") already holds at its widest
      // moment but one: down's backward, beside the experts' inputs, gate, up, silu*up, dact and
      // the outputs' gradients (2H + 4I columns). There the product adds r columns, which raise
      // the layer's peak only where that moment is (or becomes) its widest; every other product
      // comes where [rows, I] buffers (I >= r) were just released, in the forward as in the backward.
      if (expert_target(Linear::down_proj)) {
        const int64_t tile = in.recipe.get("qwen3", "moe_tile_rows", 0) > 0
                                 ? std::min<int64_t>(in.tokens_per_rank, in.recipe.get("qwen3", "moe_tile_rows", 0))
                                 : in.tokens_per_rank;
        const int64_t tk = tile * std::max<int64_t>(1, c.num_experts_per_tok), ep = std::max<int64_t>(1, in.ep), R = tk * ep;
        const int64_t widest = ep == 1 ? tk * std::max({3 * H + 3 * Im, 2 * H + 4 * Im, H + 5 * Im})
                                       : std::max({R * (2 * H + 3 * Im) + tk * H, R * (2 * H + 4 * Im), R * (H + 5 * Im)});
        const int64_t extra = std::max<int64_t>(0, R * (2 * H + 4 * Im + o_.r) - widest) * ab;
        if (extra > 0)
          plan.add("lora_expert_backward", "LoRA on the experts: down's [rows, r] product beside its backward's widest moment",
                   PlanCategory::transient, extra, plan_phase::mlp_backward);
      }
      const double t = static_cast<double>(in.tokens_per_rank * std::max<int64_t>(1, c.num_experts_per_tok)),
                   rr = static_cast<double>(o_.r);
      for (int m = static_cast<int>(Linear::gate_proj); m < kLinearCount; ++m) {
        const double n_layers = static_cast<double>(layers[static_cast<size_t>(m)]);
        const double inn = static_cast<double>(m == static_cast<int>(Linear::down_proj) ? Im : H),
                     out = static_cast<double>(m == static_cast<int>(Linear::down_proj) ? H : Im);
        plan.work.gemm_flops += n_layers * 2 * t * rr * (5 * inn + 4 * out);
        plan.work.memory_bytes += n_layers * t * static_cast<double>(ab) * (5 * inn + 4 * out);
      }
    }

    // The target parameters' factors (GPT-OSS's fused experts): per layer holding them, this rank's
    // E/ep experts' A [r, in] and B [out, r] (gate_up_proj: in H, out 2I; down_proj: in I, out H);
    // each routed row runs u = x A_e^T and its update, and in the backward u again, g and the
    // factors' grouped wgrads, as the experts' adapters above.
    if (!o_.target_parameters.empty() && c.sparse_layers() > 0) {
      const int64_t El = c.num_experts / std::max<int64_t>(1, in.ep), H = c.hidden_size, Im = c.moe_intermediate_size;
      int64_t per_layer_factors = 0;
      double flops = 0, bytes = 0;
      const double t = static_cast<double>(in.tokens_per_rank * std::max<int64_t>(1, c.num_experts_per_tok)),
                   rr = static_cast<double>(o_.r);
      for (const std::string& p : o_.target_parameters) {
        const bool gate_up = p.ends_with("gate_up_proj");
        const int64_t inn = gate_up ? H : Im, out = gate_up ? 2 * Im : H;
        per_layer_factors += El * o_.r * (inn + out);
        flops += 2 * t * rr * (5.0 * static_cast<double>(inn) + 4.0 * static_cast<double>(out));
        bytes += t * static_cast<double>(ab) * (5.0 * static_cast<double>(inn) + 4.0 * static_cast<double>(out));
      }
      const int64_t layers = c.sparse_layers(), all = per_layer_factors * layers, per = (all + shards - 1) / shards;
      plan.add("lora_parameter_weights", str("LoRA factors of the target parameters (", all, ")"), PlanCategory::weights,
               per * ab, plan_phase::always);
      plan.add("lora_parameter_gradients", "LoRA factors of the target parameters' gradients", PlanCategory::gradients,
               per * (shards > 1 ? 4 : gb), plan_phase::always);
      plan.parameters += all;
      plan.gemm_parameters += all;
      if (shards > 1) {
        plan.add("lora_parameter_gathered_layer", "one layer's gathered LoRA factors of the target parameters",
                 PlanCategory::communication, per_layer_factors * ab, plan_phase::forward);
        for (const char* phase : {plan_phase::mlp_backward, plan_phase::backward})
          plan.add("lora_parameter_gathered_layer_grads", "one layer's gathered target parameters' factors + full fp32 grads",
                   PlanCategory::communication, per_layer_factors * (ab + 4), phase);
      }
      plan.work.gemm_flops += static_cast<double>(layers) * flops;
      plan.work.memory_bytes += static_cast<double>(layers) * bytes;
    }

    // A layer's [T, r] products (qwen3_model.cpp): h1 @ A^T of q, k, v and the fp32 sum of
    // attn @ Ao^T live from the attention's recompute through the MLP's backward; the attention
    // backward adds scale * dx1 @ Bo and the fp32 sums of dq @ Bq (k, v) with their rounding.
    const int64_t T = in.tokens_per_rank, r = o_.r;
    const bool q = target(Linear::q_proj), k = target(Linear::k_proj), v = target(Linear::v_proj),
               o = target(Linear::o_proj);
    const int64_t qkv = (q + k + v) * T * r * ab, uo = o ? T * r * 4 : 0;
    const int64_t mlp_tile = std::min<int64_t>(T, in.recipe.get("tiled_mlp", "tile_rows", 0) > 0
                                                      ? in.recipe.get("tiled_mlp", "tile_rows", 0) : T);
    const bool mlp = (target(Linear::gate_proj) || target(Linear::up_proj) || target(Linear::down_proj)) &&
                     c.sparse_layers() < c.num_layers;
    if (qkv + uo > 0)
      plan.add("lora_forward", "LoRA: h1 @ A^T of q, k, v [T,r], fp32 attn @ Ao^T [T,r] and its rounding",
               PlanCategory::transient, qkv + uo + (o ? T * r * ab : 0), plan_phase::forward);
    // The MLP's backward holds gate's and up's u^T from its recompute to the end (with the
    // stacked g^T beside them at the end), and down's u and g while down's backward runs.
    const int64_t n_in = target(Linear::gate_proj) + target(Linear::up_proj);
    const int64_t mlp_products = mlp ? std::max(n_in + 2 * target(Linear::down_proj), 2 * n_in) * mlp_tile * r * ab : 0;
    if (qkv + uo + mlp_products > 0)
      plan.add("lora_mlp_backward", "LoRA: the attention's [T,r] products held through the MLP backward, the MLP's",
               PlanCategory::transient, qkv + uo + mlp_products, plan_phase::mlp_backward);
    const int64_t back = qkv + (o ? T * r * ab : 0) + (q + k + v) * T * r * 4 + ((q || k || v) ? T * r * ab : 0);
    if (back > 0)
      plan.add("lora_attention_backward", "LoRA: h1 @ A^T, scale dx1 @ Bo, fp32 sums of dq @ Bq (k, v) [T,r]",
               PlanCategory::transient, back, plan_phase::backward);

    // Dropout: the dropped input of one projection at a time ([rows, in] beside the call that
    // reads it, adapter_none.cpp): h1's [T,H] or the attention's [T,Hq*d] (a head group's columns
    // of it, counted whole) in the forward and the attention backward, and the MLP's input [tile,H]
    // beside the MLP backward's widest moment, or act's [tile,I] beside the forward's MLP.
    if (o_.dropout > 0) {
      const int64_t H = c.hidden_size;
      const int64_t d = c.head_dim > 0 ? c.head_dim : H / std::max<int64_t>(1, c.num_heads);
      const int64_t attn_in = std::max((q || k || v) ? H : 0, o ? c.num_heads * d : 0);
      const bool mlp_in = mlp && (target(Linear::gate_proj) || target(Linear::up_proj)), down = mlp && target(Linear::down_proj);
      const int64_t fwd = std::max(T * attn_in, mlp_tile * std::max(mlp_in ? H : 0, down ? c.intermediate_size : 0)) * ab;
      if (fwd > 0)
        plan.add("lora_dropout_forward", "LoRA dropout: one projection's dropped input", PlanCategory::transient, fwd,
                 plan_phase::forward);
      if (attn_in > 0)
        plan.add("lora_dropout_backward", "LoRA dropout: one attention projection's dropped input or its masked gradient",
                 PlanCategory::transient, T * attn_in * ab, plan_phase::backward);
      // gate's and up's u^T are released just before (mlp_whole.cpp), so the input adds the rest.
      if (mlp_in)
        plan.add("lora_dropout_mlp_backward", "LoRA dropout: gate's or up's dropped input or its masked gradient",
                 PlanCategory::transient, mlp_tile * std::max<int64_t>(0, H - n_in * r) * ab, plan_phase::mlp_backward);
      // Its work: each adapted projection's input dropped in the forward and the recompute (a
      // read and a write each), and in the backward the masked gradient (a read, dx read and
      // written) and the dropped input again: 9 passes over [T, in].
      for (int64_t l = 0; l < c.num_layers; ++l)
        for (int m = 0; m < kLinearCount; ++m)
          if (adapted(l, m))
            plan.work.memory_bytes += 9.0 * static_cast<double>(T) * static_cast<double>(shapes[static_cast<size_t>(m)].second) *
                                      static_cast<double>(ab);
    }

    // The work, per adapted projection and layer: u = x A^T and the update y = scale u B^T in the
    // forward and again in the recompute (y written first, the projection's GEMM reading it in
    // its epilogue); in the backward g = scale dy B, dx (+)= g A, dA += g^T x, u again and
    // dB += scale dy^T u. Each reads or writes the full [T, in] or [T, out] side once, which is
    // what they cost: r is far below what keeps a GEMM compute-bound. 5 passes over [T, in] and
    // 4 over [T, out] in all; where the A's of projections that read one input are stacked (q, k,
    // v; gate, up: not under ZeRO-3 or 16-bit gradients), one GEMM makes that input's passes for
    // all of them.
    const bool stacked = shards == 1 && in.grad_dtype == DType::f32;
    const double t = static_cast<double>(T), rr = static_cast<double>(r);
    for (int64_t l = 0; l < c.num_layers; ++l)
      for (int m = 0; m < kLinearCount; ++m) {
        if (!adapted(l, m)) continue;
        const double out = static_cast<double>(shapes[static_cast<size_t>(m)].first),
                     inn = static_cast<double>(shapes[static_cast<size_t>(m)].second);
        // Of the projections reading one input, the first adapted one pays that input's passes.
        auto input_of = [](int j) { return j <= 2 ? 0 : j == 3 ? 1 : j <= 5 ? 2 : 3; };  // h1, attn, h2, act
        bool shared = false;
        for (int j = 0; j < m; ++j) shared = shared || (adapted(l, j) && input_of(j) == input_of(m));
        const bool pays_input = !stacked || !shared;
        plan.work.gemm_flops += 2 * t * rr * (5 * inn + 4 * out);
        plan.work.memory_bytes += t * static_cast<double>(ab) * ((pays_input ? 5 * inn : 0) + 4 * out);
      }
  }

 private:
  // Whether target_modules adapts projection m of `layer` (a sparse layer's experts' with expert).
  bool targeted(int64_t layer, int m, bool expert) const { return adapts(o_.targets, o_.regex.get(), layer, m, expert); }
  // The same for a list (or "all-linear": every entry set) or a pattern, as PEFT matches a module.
  static bool adapts(const std::array<bool, kLinearCount>& listed, const std::regex* pattern, int64_t layer, int m,
                     bool expert) {
    if (!pattern) return listed[static_cast<size_t>(m)];
    return std::regex_match(peft::module_name(layer, linear_name(static_cast<Linear>(m)), expert ? 0 : -1), *pattern);
  }

  // Layer l's experts' `which`: factors stacked by this rank's experts, A drawn per expert keyed by
  // its PEFT name (Hub number), so every ep starts from the factors one rank would. Returns the
  // factors' element count.
  int64_t attach_experts(int l, Linear which, const std::map<std::string, Parameter*>& base, const AdapterContext& ctx) {
    const std::string module = linear_name(which);
    const std::string wname = str("model.layers.", l, ".mlp.experts.", module, ".weight");
    const auto it = base.find(wname);
    if (it == base.end() || it->second->value.dim() != 3)
      throw Error(str("lora: layer ", l, " is sparse, but the model has no stacked experts' weight ", wname),
                  o_.key("experts"), "set experts = false");
    const Tensor& w = it->second->value;
    const int64_t El = w.size(0), out = w.size(1), in = w.size(2);
    if (o_.r > std::min(out, in))
      throw Error(str("lora: r = ", o_.r, " is larger than an expert's ", module, " [", out, ", ", in, "] can hold"),
                  o_.key("r"), str("use r <= ", std::min(out, in)));
    const std::string stem = wname.substr(0, wname.size() - 7);
    Parameter& a = add_param(stem + ".lora_A.weight", {El, o_.r, in}, ctx);
    Parameter& b = add_param(stem + ".lora_B.weight", {El, out, o_.r}, ctx);
    // This rank's experts' factors: their gradients summed where the experts' are.
    a.grad_group = b.grad_group = it->second->grad_group;
    first_expert_ = ctx.partition_index * El;
    Tensor ha = Tensor::empty(a.value.shape(), DType::f32, Device::cpu());
    const float bound = 1.f / std::sqrt(static_cast<float>(in));
    float* pa = ha.data_as<float>();
    const int64_t per = o_.r * in;
    for (int64_t e = 0; e < El; ++e) {
      const uint64_t key = name_key(ctx.seed, peft::base_weight_name(l, module, first_expert_ + e) + ".lora_A");
      for (int64_t i = 0; i < per; ++i) {
        const uint64_t bits = mix(key + static_cast<uint64_t>(i));
        const float u = static_cast<float>(bits >> 40) * (1.f / 16777216.f);
        pa[e * per + i] = (2.f * u - 1.f) * bound;
      }
    }
    set_value(a, ha);
    b.value.zero();
    experts_[static_cast<size_t>(l)][static_cast<size_t>(which)] = LowRank{&a, &b, static_cast<float>(o_.scale()), {}, {}, 0};
    has_experts_[static_cast<size_t>(l) * kLinearCount + static_cast<size_t>(which)] = true;
    local_experts_ = El;
    return a.value.numel() + b.value.numel();
  }

  // A target parameter of layer l (a fused experts' W [E_local, in, out]): factors A [E_local, r, in]
  // and B [E_local, out, r] in the experts' slot its name gives (gate_up_proj: the fused gate and
  // up, where find_experts(gate_proj) is read; down_proj), A drawn per expert from its PEFT rows.
  int64_t attach_parameter(int l, const std::string& parameter, const Parameter& w, const AdapterContext& ctx) {
    const std::string key = o_.key("target_parameters");
    Linear which;
    if (parameter.ends_with("experts.gate_up_proj"))
      which = Linear::gate_proj;
    else if (parameter.ends_with("experts.down_proj"))
      which = Linear::down_proj;
    else
      throw Error(str("lora: ", key, " names ", parameter, "; lcx adapts the fused experts' gate_up_proj and down_proj"),
                  key, "use \"mlp.experts.gate_up_proj\" and \"mlp.experts.down_proj\"");
    if (w.value.dim() != 3)
      throw Error(str("lora: ", key, " names ", w.name, ", which is ", w.value.dim(), "-D, not fused experts [E, in, out]"),
                  key, "name the fused experts' parameters");
    if (is_param_slot(l, static_cast<int>(which)) || find_experts(l, which))
      throw Error(str("lora: ", w.name, " is adapted twice (", key, " and experts)"), key, "name each parameter once");
    const int64_t El = w.value.size(0), in = w.value.size(1), out = w.value.size(2);
    if (o_.r > std::min(out, in))
      throw Error(str("lora: r = ", o_.r, " is larger than an expert's ", parameter, " [", in, ", ", out, "] can hold"),
                  o_.key("r"), str("use r <= ", std::min(out, in)));
    Parameter& a = add_param(w.name + ".lora_A.weight", {El, o_.r, in}, ctx);
    Parameter& b = add_param(w.name + ".lora_B.weight", {El, out, o_.r}, ctx);
    a.grad_group = b.grad_group = w.grad_group;
    first_expert_ = ctx.partition_index * El;
    // PEFT's lora_A is one nn.Linear(in, r * E): kaiming_uniform over in, as every A here.
    Tensor ha = Tensor::empty(a.value.shape(), DType::f32, Device::cpu());
    const float bound = 1.f / std::sqrt(static_cast<float>(in));
    float* pa = ha.data_as<float>();
    const int64_t per = o_.r * in;
    for (int64_t e = 0; e < El; ++e) {
      const uint64_t k = name_key(ctx.seed, str(w.name, ".", first_expert_ + e, ".lora_A"));
      for (int64_t i = 0; i < per; ++i) {
        const uint64_t bits = mix(k + static_cast<uint64_t>(i));
        const float u = static_cast<float>(bits >> 40) * (1.f / 16777216.f);
        pa[e * per + i] = (2.f * u - 1.f) * bound;
      }
    }
    set_value(a, ha);
    b.value.zero();
    experts_[static_cast<size_t>(l)][static_cast<size_t>(which)] = LowRank{&a, &b, static_cast<float>(o_.scale()), {}, {}, 0};
    has_experts_[static_cast<size_t>(l) * kLinearCount + static_cast<size_t>(which)] = true;
    param_slots_.push_back({l, static_cast<int>(which), parameter});
    return a.value.numel() + b.value.numel();
  }
  bool is_param_slot(int64_t l, int m) const {
    return std::any_of(param_slots_.begin(), param_slots_.end(), [&](const ParamSlot& p) { return p.layer == l && p.which == m; });
  }

  // A factor of its own, or rows of a stack (value and gradient views of it).
  Parameter& add_param(const std::string& name, Shape shape, const AdapterContext& ctx, const Stack* st = nullptr) {
    Parameter p;
    p.name = name;
    p.gemm_grad = true;
    p.decay = true;
    if (st && st->value.defined()) {
      p.value = st->value.rows(st->row, st->row + shape[0]);
      p.grad = st->grad.rows(st->row, st->row + shape[0]);
    } else {
      p.value = Tensor::empty(shape, ctx.dtype, ctx.device, MemoryCategory::weights);
      p.grad = Tensor::zeros(shape, DType::f32, ctx.device, MemoryCategory::gradients);
    }
    params_.push_back(std::move(p));
    return params_.back();
  }

  // p's value (of its dtype, on its device) from fp32 host values, rounded as a cast rounds.
  static void set_value(Parameter& p, const Tensor& host_f32) {
    p.value.copy_from(host_f32.to(p.value.dtype()));
  }

  static Tensor to_host_f32(const Tensor& t) {
    const Tensor h = t.device().is_cuda() ? t.to(Device::cpu()) : t;
    return h.dtype() == DType::f32 ? h.clone() : h.to(DType::f32);
  }

  // An entry of modules_to_save that matches no parameter would train nothing, silently; a tied
  // head has no weight of its own (the embedding is the head).
  void refuse_unmatched_saved(const std::vector<std::string>& entries, bool tied) const {
    const std::string key = o_.key("modules_to_save");
    for (const std::string& entry : entries) {
      const bool matched = std::any_of(saved_.begin(), saved_.end(),
                                       [&](const auto& s) { return peft::saved_module({entry}, s.first); });
      if (matched) continue;
      if (tied && entry.ends_with("lm_head"))
        throw Error(str("lora: ", key, " names \"", entry, "\", but this model's head is its embedding (tie_word_embeddings): "
                        "lm_head has no weight of its own"),
                    key, str("name \"embed_tokens\" in ", key, " instead: it trains the embedding, which is the head too"));
      throw Error(str("lora: ", key, " names \"", entry, "\", which matches no module of the model"), key,
                  str("name modules as the model's parameters end, e.g. \"norm\", \"embed_tokens\", \"lm_head\" "
                      "(a parameter's module is its name without \".weight\")"));
    }
  }

  // The factors (and modules_to_save) from a PEFT folder, checked against the model and this
  // table's r and target_modules.
  void load_from(const std::string& dir, Model& model, const std::map<std::string, Parameter*>& base, bool init) {
    const std::string key = init ? o_.key("init_from") : std::string("--resume");
    if (!fs::is_directory(dir))
      throw Error(str("lora: ", dir, " is not a folder"), key, "give a folder holding adapter_config.json and adapter_model.safetensors");
    const peft::Adapter a = peft::read_adapter(dir);
    const int64_t E = model.config().num_experts;
    peft::check_against_base(a, model.config().num_layers, [&](const std::string& name) -> std::optional<Shape> {
      const auto it = base.find(name);
      if (it != base.end()) {
        Shape s = it->second->value.shape();
        if (s.size() == 3 && name.find(".mlp.experts.") != std::string::npos) s[0] = E;  // every expert's, whatever ep
        return s;
      }
      // An expert's matrix ("...mlp.experts.5.gate_proj.weight"): a slice of the stacked experts.
      const size_t at = name.find(".mlp.experts.");
      if (at == std::string::npos) return std::nullopt;
      const size_t e0 = at + 13, e1 = name.find('.', e0);
      if (e1 == std::string::npos) return std::nullopt;
      const int64_t e = std::stoll(name.substr(e0, e1 - e0));
      const auto st = base.find(name.substr(0, e0) + name.substr(e1 + 1));
      if (st == base.end() || st->second->value.dim() != 3 || e < 0 || e >= E) return std::nullopt;
      return Shape{st->second->value.size(1), st->second->value.size(2)};
    });
    if (a.config.r != o_.r)
      throw Error(str("lora: ", dir, " holds an adapter of r = ", a.config.r, ", this run's ", o_.key("r"), " is ", o_.r),
                  o_.key("r"), str("set ", o_.key("r"), " = ", a.config.r));
    // The same modules adapted (a sparse layer's experts are counted below).
    std::array<bool, kLinearCount> listed{};
    for (int m = 0; m < kLinearCount; ++m)
      listed[static_cast<size_t>(m)] = std::find(a.config.target_modules.begin(), a.config.target_modules.end(),
                                                 linear_name(static_cast<Linear>(m))) != a.config.target_modules.end();
    const std::regex theirs = a.config.target_pattern.empty() ? std::regex() : std::regex(a.config.target_pattern);
    const ModelConfig& c = model.config();
    for (int64_t l = 0; l < c.num_layers; ++l)
      for (int m = 0; m < kLinearCount; ++m) {
        if (c.sparse(l) && m >= static_cast<int>(Linear::gate_proj)) continue;
        if (adapts(listed, a.config.target_pattern.empty() ? nullptr : &theirs, l, m, false) != targeted(l, m, false))
          throw Error(str("lora: ", dir, " adapts ", peft_targets(a.config), ", this run's ", o_.key("target_modules"), " ",
                          targets_text(), ": they differ on ", peft::module_name(l, linear_name(static_cast<Linear>(m)))),
                      o_.key("target_modules"), str("set ", o_.key("target_modules"), " to the adapter's"));
      }
    if (std::abs(a.config.lora_alpha - o_.alpha) > 1e-12 || a.config.use_rslora != o_.use_rslora)
      log::warn(str("lora: ", dir, " was trained with lora_alpha ", a.config.lora_alpha, a.config.use_rslora ? " (rsLoRA)" : "",
                    "; this run scales by ", o_.key("alpha"), " = ", o_.alpha, o_.use_rslora ? " (rsLoRA)" : ""));
    int64_t expert_pairs = 0, expected = 0;
    for (size_t l = 0; l < layers_.size(); ++l)
      for (int m = 0; m < kLinearCount; ++m)
        if (find_experts(static_cast<int>(l), static_cast<Linear>(m)) && !is_param_slot(static_cast<int64_t>(l), m))
          expected += E;
    size_t parameter_pairs = 0;
    for (const auto& p : a.pairs) {
      if (!p.parameter.empty()) {  // PEFT's [r*E, in] and [out, r*E] into this rank's [El, r, in], [El, out, r]
        const auto slot = std::find_if(param_slots_.begin(), param_slots_.end(),
                                       [&](const ParamSlot& s) { return s.layer == p.layer && s.parameter == p.parameter; });
        if (slot == param_slots_.end())
          throw Error(str("lora: ", dir, " adapts layer ", p.layer, "'s ", p.parameter, ", which this run's ",
                          o_.key("target_parameters"), " does not"),
                      o_.key("target_parameters"), "set target_parameters to the adapter's");
        ++parameter_pairs;
        const LowRank& lr = experts_[static_cast<size_t>(slot->layer)][static_cast<size_t>(slot->which)];
        const int64_t El = lr.a->value.size(0), r = o_.r, in = lr.a->value.size(2), out = lr.b->value.size(1);
        Tensor ha = Tensor::empty({El, r, in}, DType::f32), hb = Tensor::empty({El, out, r}, DType::f32);
        for (int64_t e = 0; e < El; ++e) {
          const int64_t x = first_expert_ + e;
          std::copy_n(p.a.data_as<float>() + x * r * in, r * in, ha.data_as<float>() + e * r * in);
          for (int64_t o = 0; o < out; ++o)
            for (int64_t j = 0; j < r; ++j)
              hb.data_as<float>()[(e * out + o) * r + j] = p.b.data_as<float>()[o * r * E + j * E + x];
        }
        set_value(*lr.a, ha);
        set_value(*lr.b, hb);
        continue;
      }
      const int m = static_cast<int>(std::find_if(std::begin(kModules), std::end(kModules),
                                                  [&](const char* n) { return p.module == n; }) - std::begin(kModules));
      if (p.expert >= 0) {
        const LowRank* lr = find_experts(static_cast<int>(p.layer), static_cast<Linear>(m));
        if (!lr)
          throw Error(str("lora: ", dir, " adapts layer ", p.layer, "'s experts, which this run does not (", o_.key("experts"),
                          " = ", o_.experts ? "true" : "false", ")"),
                      o_.key("experts"), "set experts = true");
        ++expert_pairs;
        const int64_t e = p.expert - first_expert_;
        if (e < 0 || e >= local_experts_) continue;  // another expert-parallel rank's expert
        lr->a->value.rows(e, e + 1).view(p.a.shape()).copy_from(p.a.to(lr->a->value.dtype()));
        lr->b->value.rows(e, e + 1).view(p.b.shape()).copy_from(p.b.to(lr->b->value.dtype()));
        continue;
      }
      const LowRank& lr = layers_.at(static_cast<size_t>(p.layer)).at(static_cast<size_t>(m));
      if (!lr.a)
        throw Error(str("lora: ", dir, " adapts layer ", p.layer, "'s ", p.module, ", which this run does not"),
                    o_.key("target_modules"), str("set ", o_.key("target_modules"), " to the adapter's"));
      set_value(*lr.a, p.a);
      set_value(*lr.b, p.b);
    }
    if (parameter_pairs != param_slots_.size())
      throw Error(str("lora: ", dir, " holds ", parameter_pairs, " target parameters' adapters, this run adapts ",
                      param_slots_.size(), " (", o_.key("target_parameters"), ")"),
                  o_.key("target_parameters"), "set target_parameters to the adapter's");
    if (expert_pairs != expected)
      throw Error(str("lora: ", dir, " holds ", expert_pairs, " experts' adapters, this run adapts ", expected, " (",
                      o_.key("experts"), " = ", o_.experts ? "true" : "false", ")"),
                  o_.key("experts"), "set experts to match the adapter (true where it holds mlp.experts.N keys)");
    for (const auto& [name, t] : a.saved) {
      const auto it = base.find(name);
      if (it == base.end() || it->second->frozen)
        throw Error(str("lora: ", dir, " trains ", name, " whole (modules_to_save), which this run's ",
                        o_.key("modules_to_save"), " does not"),
                    o_.key("modules_to_save"), str("add the module of ", name, " to ", o_.key("modules_to_save")));
      set_value(*it->second, to_host_f32(t));
    }
    // A resume trains what the checkpoint trained: a module added to modules_to_save has neither
    // the checkpoint's values nor its optimizer state.
    if (!init)
      for (const auto& [name, p] : saved_) {
        const bool held = std::any_of(a.saved.begin(), a.saved.end(), [&](const auto& t) { return t.first == name; });
        if (held) continue;
        std::string was = "none";
        if (a.config.modules_to_save) {
          was = "[";
          for (const std::string& m : *a.config.modules_to_save) was += str(was.size() > 1 ? ", " : "", "\"", m, "\"");
          was += "]";
        }
        throw Error(str("lora: this run's ", o_.key("modules_to_save"), " trains ", name, " whole, which the checkpoint ", dir,
                        " did not (its modules_to_save: ", was, ")"),
                    o_.key("modules_to_save"),
                    str("resume with the checkpoint's modules_to_save, or start a new run from it with ", o_.key("init_from"),
                        " = \"", dir, "\""));
      }
  }

  peft::AdapterConfig peft_config(const std::string& base) const {
    peft::AdapterConfig c;
    c.r = o_.r;
    c.lora_alpha = o_.alpha;
    c.lora_dropout = o_.dropout;
    c.use_rslora = o_.use_rslora;
    c.all_linear = o_.all_linear;
    c.target_pattern = o_.pattern;
    for (int m = 0; m < kLinearCount; ++m)
      if (o_.pattern.empty() && o_.targets[static_cast<size_t>(m)]) c.target_modules.push_back(linear_name(static_cast<Linear>(m)));
    c.base_model_name_or_path = base;
    c.modules_to_save = o_.modules_to_save;
    c.target_parameters = o_.target_parameters;
    return c;
  }

  static constexpr const char* kModules[kLinearCount] = {"q_proj", "k_proj", "v_proj", "o_proj",
                                                          "gate_proj", "up_proj", "down_proj"};
  static std::string joined(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s;
  }
  static std::string joined_modules() { return joined({std::begin(kModules), std::end(kModules)}); }
  // An adapter's target_modules as its adapter_config.json gives them.
  static std::string peft_targets(const peft::AdapterConfig& c) {
    if (c.all_linear) return "all-linear";
    if (!c.target_pattern.empty()) return "'" + c.target_pattern + "'";
    return "[" + joined(c.target_modules) + "]";
  }
  std::string targets_text() const { return peft_targets(peft_config("")); }
  static int64_t base_count(Model& model) {
    int64_t n = 0;
    for (Parameter* p : model.parameters()) n += p->value.numel();
    return n;
  }

  LoraOptions o_;
  std::deque<Parameter> params_;  // stable addresses: LowRank points into it
  std::vector<std::array<LowRank, kLinearCount>> layers_;
  std::vector<bool> has_;
  // The experts' factors (find_experts), stacked by this rank's experts [first_expert_, + local_experts_).
  std::vector<std::array<LowRank, kLinearCount>> experts_;
  std::vector<bool> has_experts_;
  // The target parameters' factors: which experts' slot of which layer holds each.
  struct ParamSlot {
    int64_t layer;
    int which;
    std::string parameter;
  };
  std::vector<ParamSlot> param_slots_;
  int64_t first_expert_ = 0, local_experts_ = 0, num_experts_ = 0;
  uint64_t seed_ = 0, pass_key_ = 0;  // LowRank::dropout_pass points at pass_key_
  std::vector<std::pair<std::string, Parameter*>> saved_;
};

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  const ConfigView& c = args.config;
  LoraOptions o;
  o.table = c.name().empty() ? std::string("lora") : c.name();
  c.describe("r", "the adapters' rank: A [r, in], B [out, r]", ">= 1, at most the adapted matrix's smaller side");
  c.describe("alpha", "the adapters' scale numerator: scale = alpha / r (alpha / sqrt(r) with use_rslora)", "> 0");
  c.describe("dropout", "dropout on each adapter's input in training (PEFT's lora_dropout); evaluation drops nothing",
             "in [0, 1); > 0 not with experts = true", "0");
  c.describe("use_rslora", "rank-stabilized LoRA: scale = alpha / sqrt(r)");
  c.describe("target_modules",
             "the projections adapted, as PEFT's target_modules: a list adapts them in every layer; any other string is a "
             "regex a module's whole name must match (\"model.layers.3.self_attn.q_proj\")",
             "a list of q_proj k_proj v_proj o_proj gate_proj up_proj down_proj, \"all-linear\", or a regex", "\"all-linear\"");
  c.describe("experts", "adapt a mixture-of-experts model's experts too: gate_proj, up_proj and down_proj of target_modules, per expert",
             "true or false (true needs a model with sparse layers)", "false");
  c.describe("modules_to_save", "modules trained whole beside the adapters, matched as PEFT does (a module whose name ends with the entry)",
             "e.g. [\"embed_tokens\", \"norm\", \"lm_head\"]", "[]");
  c.describe("init_from", "a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start from", "a folder", "\"\"");
  o.r = c.get_int("r", 8);
  if (o.r < 1) c.fail("r", str(o.r, " is not a rank"), "a rank >= 1, e.g. 16");
  o.alpha = c.get_double("alpha", static_cast<double>(o.r));
  if (!(o.alpha > 0)) c.fail("alpha", str(o.alpha, " is not a positive scale"), "e.g. alpha = 2 * r");
  o.dropout = c.get_double("dropout", 0.0);
  if (!(o.dropout >= 0 && o.dropout < 1)) c.fail("dropout", str(o.dropout, " is not a probability below 1"), "e.g. dropout = 0.05");
  o.use_rslora = c.get_bool("use_rslora", false);
  std::vector<std::string> targets;
  bool listed = true;
  try {
    targets = c.get_strings("target_modules", {});
    if (!c.has("target_modules")) listed = false;
  } catch (const Error&) {
    const std::string s = c.get_string("target_modules", "all-linear");
    listed = false;
    if (s != "all-linear") {
      try {
        o.regex = std::make_shared<const std::regex>(s);
      } catch (const std::regex_error& e) {
        c.fail("target_modules", str("'", s, "' is not a regex (", e.what(), ")"),
               "e.g. \".*\\.(q_proj|v_proj)\", a list [\"q_proj\", \"v_proj\"] or \"all-linear\"");
      }
      o.pattern = s;
    }
  }
  if (!listed && o.pattern.empty()) {
    o.all_linear = true;
    o.targets.fill(true);
  } else if (listed) {
    if (targets.empty()) c.fail("target_modules", "is empty: nothing would train", "name the projections, or \"all-linear\"");
    for (const auto& t : targets) {
      if (t == "all-linear") {
        o.all_linear = true;
        o.targets.fill(true);
        continue;
      }
      int found = -1;
      for (int m = 0; m < kLinearCount; ++m)
        if (t == linear_name(static_cast<Linear>(m))) found = m;
      if (found < 0)
        c.fail("target_modules", str("'", t, "' is not a projection of a Qwen3 layer"),
               "use q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj or \"all-linear\"");
      o.targets[static_cast<size_t>(found)] = true;
    }
  }
  o.experts = c.get_bool("experts", false);
  if (o.experts && o.pattern.empty() && !o.targets[static_cast<size_t>(Linear::gate_proj)] && !o.targets[static_cast<size_t>(Linear::up_proj)] &&
      !o.targets[static_cast<size_t>(Linear::down_proj)])
    c.fail("experts", "is true, but target_modules names none of the experts' projections",
           "add gate_proj, up_proj or down_proj to target_modules (or \"all-linear\"), or set experts = false");
  // The experts' factors run as grouped GEMMs over rows sorted by expert, which have no mask path.
  if (o.experts && o.dropout > 0)
    c.fail("dropout", str(o.dropout, " with experts = true: the experts' adapters take no dropout"),
           "set dropout = 0, or experts = false (dropout then applies to the attention's adapters)");
  c.describe("target_parameters",
             "fused experts' parameters adapted per expert, as PEFT's target_parameters (GPT-OSS: \"mlp.experts.gate_up_proj\", "
             "\"mlp.experts.down_proj\")",
             "a list of parameter names", "[]");
  o.target_parameters = c.get_strings("target_parameters", {});
  if (!o.target_parameters.empty() && o.dropout > 0)
    c.fail("dropout", str(o.dropout, " with target_parameters: PEFT's ParamWrapper takes no dropout"), "set dropout = 0");
  if (c.has("modules_to_save")) o.modules_to_save = c.get_strings("modules_to_save", {});
  o.init_from = c.get_string("init_from", "");
  return std::make_unique<Lora>(std::move(o));
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_ADAPTER, "lora", "0.1.0", "LoRA adapters on a frozen base, PEFT's files in and out", "ready",
           lcx::create)
