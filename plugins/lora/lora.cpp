// lora: low-rank adapters on a frozen base (Hu et al. 2021), as PEFT defines them, in the
// Adapter slot (lcx/slots/adapter.h). For each linear module W [out, in] the model lists
// (ModelConfig::linear_modules) that target_modules matches, as PEFT matches it, it holds
// A [r, in] and B [out, r], and the model computes y = x W^T + scale * (x A^T) B^T with
// scale = alpha / r (alpha / sqrt(r) with use_rslora). A starts Kaiming-uniform (PEFT's
// kaiming_uniform_(a = sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))), B at zero, so the first step's
// model is the base. Every model parameter is frozen except those of modules_to_save (matched as
// PEFT does: a module whose name ends with the entry), which train whole (LongLoRA's embeddings
// and norms).
//
// With target_parameters (PEFT's ParamWrapper), stacked experts stored as one parameter
// W [E, in, out] (LinearModule::parameter: GPT-OSS's mlp.experts.gate_up_proj and down_proj) are
// adapted per expert: A [E_local, r, in] and
// B [E_local, out, r], expert e's delta scale * A_e^T B_e^T; its files hold PEFT's lora_A [r*E, in]
// (expert-major rows) and lora_B [out, r*E] (column j*E + e) under the module's keys
// (peft::parameter_lora_key).
//
// With experts = true, the modules of one linear per expert that target_modules matches (a
// sparse layer's mlp.experts.gate_proj, up_proj and down_proj in Qwen3-MoE) are adapted per
// expert: A [E_local, r, in] and B [E_local, out, r] stacked by the experts this rank holds, as the
// experts' weights are, and the layer runs them as grouped GEMMs over each expert's rows. Their files are PEFT's per-expert keys
// ("model.layers.3.mlp.experts.5.gate_proj.lora_A.weight"), which merge folds into the Hub's
// per-expert weights.
//
// With bias (PEFT's), biases train whole beside the factors: "all", every parameter of the model
// named with "bias"; "lora_only", those of the adapted modules (Qwen2's q, k, v; GPT-OSS's
// attention). They are saved under PEFT's keys (peft::bias_key) and start a run from init_from.
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
#include <set>

namespace lcx {
namespace {

namespace fs = std::filesystem;

struct LoraOptions {
  int64_t r = 8;
  double alpha = 8;
  double dropout = 0;
  bool use_rslora = false;
  // target_modules as PEFT matches it against the modules a model exposes (peft::TargetModules):
  // a list of names (a module whose full name equals one or ends with "." + one), "all-linear"
  // (every linear module), or a pattern (any other string: a regex the full name must match, as
  // Python's re.fullmatch). A module of per-expert linears is matched by expert 0's name
  // ("model.layers.3.mlp.experts.0.gate_proj").
  std::vector<std::string> names;
  bool all_linear = false;
  std::string pattern;
  // Modules of stacked experts adapted too (per expert) where target_modules matches them.
  bool experts = false;
  // PEFT's target_parameters: experts stored as one 3-D parameter (LinearModule::parameter:
  // GPT-OSS's "mlp.experts.gate_up_proj", "mlp.experts.down_proj") adapted directly, per expert,
  // matched as the list is, in the order given.
  std::vector<std::string> target_parameters;
  std::optional<std::vector<std::string>> modules_to_save;
  // PEFT's bias: "none", "all" (every base parameter named with "bias" trains) or "lora_only" (the
  // biases of the adapted modules).
  std::string bias = "none";
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


// The A factors of one layer's modules that read one input (LinearModule::input), as rows of one
// tensor; `row` is the next factor's first.
struct Stack {
  Tensor value, grad;
  int64_t row = 0;
};

// What a table does with one linear module of a layer.
struct Use {
  enum Kind { none, plain, experts, parameter } kind = none;
  int entry = -1;  // parameter: its entry of target_parameters
};

class Lora final : public Adapter {
 public:
  explicit Lora(LoraOptions o) : o_(std::move(o)), matcher_(peft_config("")) {}

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
    const std::vector<std::vector<Use>> use = uses(cfg);
    std::map<std::string, Parameter*> base;
    for (Parameter* p : model.parameters()) base[p->name] = p;
    modules_ = cfg.linear_modules;
    params_.clear();
    saved_.clear();
    layers_.assign(static_cast<size_t>(cfg.num_layers), {});
    experts_.assign(layers_.size(), {});
    param_slots_.clear();
    first_expert_ = 0;
    seed_ = ctx.seed;
    pass_key_ = 0;
    local_experts_ = 0;
    num_experts_ = 0;
    int64_t count = 0;
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
      const auto& mods = cfg.linear_modules[static_cast<size_t>(l)];
      const auto& here = use[static_cast<size_t>(l)];
      // Modules that read one input (q, k and v; gate and up): the A's of each input adapted twice
      // or more are rows of one tensor, so the model runs one GEMM over the input for them.
      std::map<int, Stack> stacks;
      if (ctx.stack_factors) {
        std::map<int, std::pair<int64_t, int64_t>> rows;  // input: rows, in_features
        for (size_t i = 0; i < mods.size(); ++i)
          if (here[i].kind == Use::plain) rows[mods[i].input] = {rows[mods[i].input].first + o_.r, mods[i].in_features};
        for (const auto& [input, n] : rows)
          if (n.first >= 2 * o_.r)
            stacks[input] = Stack{Tensor::empty({n.first, n.second}, ctx.dtype, ctx.device, MemoryCategory::weights),
                                  Tensor::zeros({n.first, n.second}, DType::f32, ctx.device, MemoryCategory::gradients), 0};
      }
      for (size_t i = 0; i < mods.size(); ++i) {
        const auto st = stacks.find(mods[i].input);
        switch (here[i].kind) {
          case Use::plain: count += attach_plain(static_cast<int>(l), mods[i], base, ctx, st == stacks.end() ? nullptr : &st->second); break;
          case Use::experts: count += attach_experts(static_cast<int>(l), mods[i], base, ctx); break;
          case Use::parameter: count += attach_parameter(static_cast<int>(l), mods[i], here[i].entry, base, ctx); break;
          case Use::none: break;
        }
      }
    }
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
    trained += train_biases(model);
    const std::string from = !ctx.resume_dir.empty() ? ctx.resume_dir : o_.init_from;
    if (!from.empty()) load_from(from, model, base, ctx.resume_dir.empty());
    log::info(str("lora: r ", o_.r, ", alpha ", o_.alpha, o_.use_rslora ? " (rsLoRA)" : "", ", scale ", o_.scale(), o_.dropout > 0 ? str(", dropout ", o_.dropout) : std::string(), " on ",
                  targets_text(), o_.experts ? str(" and every expert (", local_experts_, " on this rank)") : std::string(),
                  o_.target_parameters.empty() ? std::string() : str(" and per expert ", joined(o_.target_parameters)), ": ", count, " adapter parameters", trained ? str(" + ", trained, " trained whole (",
                  o_.modules_to_save ? joined(*o_.modules_to_save) : std::string(), biases_.empty() ? "" : str(o_.modules_to_save ? ", " : "", biases_.size(), " biases"),
                  ")") : std::string(), "; the base's ", base_count(model) - trained,
                  " frozen", from.empty() ? std::string() : str("; from ", from)));
  }

  const LowRank* find(int layer, int id) const override { return lookup(layers_, layer, id); }
  const LowRank* find_experts(int layer, int id) const override { return lookup(experts_, layer, id); }

  std::vector<Parameter*> parameters() override {
    std::vector<Parameter*> out;
    for (Parameter& p : params_) out.push_back(&p);
    return out;
  }

  void save(const std::string& dir, const std::string& base) const override {
    peft::Adapter a;
    a.config = peft_config(base);
    for (size_t l = 0; l < layers_.size(); ++l)
      for (const LinearModule& m : modules_[l]) {
        if (m.experts > 0) continue;
        const LowRank* lr = find(static_cast<int>(l), m.id);
        if (!lr) continue;
        a.pairs.push_back({static_cast<int64_t>(l), m.path, to_host_f32(lr->a->value), to_host_f32(lr->b->value)});
      }
    for (const ParamSlot& ps : param_slots_) {
      const LowRank& lr = *find_experts(static_cast<int>(ps.layer), ps.id);
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
      for (const LinearModule& m : modules_[l]) {
        const LowRank* lr = find_experts(static_cast<int>(l), m.id);
        if (!lr || m.parameter) continue;
        // Written by rank 0 with every expert: under expert parallelism the run gathers the
        // factors over the group around the save (Run::save), as it gathers the experts.
        if (lr->a->value.size(0) != num_experts_)
          throw Error(str("lora: saving the experts' adapters needs every expert's factors; this rank holds ",
                          lr->a->value.size(0), " of ", num_experts_, " (gather them over the expert-parallel group first)"),
                      o_.key("experts"), "save through the run (Run::save gathers them), or train with [distributed] ep = 1");
        const Tensor ha = to_host_f32(lr->a->value), hb = to_host_f32(lr->b->value);
        for (int64_t e = 0; e < ha.size(0); ++e)
          a.pairs.push_back({static_cast<int64_t>(l), m.path, ha.rows(e, e + 1).view({ha.size(1), ha.size(2)}).clone(),
                             hb.rows(e, e + 1).view({hb.size(1), hb.size(2)}).clone(), e});
      }
    for (const auto& [name, p] : saved_)
      a.saved.emplace_back(name, p->value.device().is_cuda() ? p->value.to(Device::cpu()) : p->value);
    for (const auto& [name, p] : biases_) a.biases.emplace_back(name, to_host_f32(p->value));
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
    // What modules_to_save trains whole, from the model's own list: its norms, embeddings, head and
    // biases (the GEMM weights are the adapted modules').
    if (o_.modules_to_save) {
      LCX_CHECK(!in.model.parameters.empty(), "lora: the model module lists no parameters (ModelConfig::parameters)");
      for (const ParameterSize& p : in.model.parameters)
        if (!p.gemm && peft::saved_module(*o_.modules_to_save, p.name)) in.base_trained_parameters += p.numel;
    }
    const auto use = uses(in.model);
    in.adapter_ranks.assign(use.size(), {});
    for (size_t l = 0; l < use.size(); ++l)
      for (const Use& u : use[l]) in.adapter_ranks[l].push_back(u.kind == Use::none ? 0 : o_.r);
    // The biases trained whole (bias): the linear modules' (a router's few are not counted).
    if (o_.bias != "none")
      for (size_t l = 0; l < use.size(); ++l)
        for (size_t i = 0; i < use[l].size(); ++i) {
          const LinearModule& m = in.model.linear_modules[l][i];
          if (m.bias && (o_.bias == "all" || (use[l][i].kind == Use::plain)))
            in.base_trained_parameters += std::max<int64_t>(1, m.experts) * m.out_features;
        }
    in.adapter_dropout = o_.dropout > 0;
  }

  // The factors (values, gradients; the optimizer plans their master and moments from
  // MemoryPlan::parameters) and their work; the model plans the products it makes with them
  // (PlanInputs::adapter_ranks).
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const ModelConfig& c = in.model;
    const auto use = uses(c);
    const int64_t ab = static_cast<int64_t>(dtype_size(in.weight_dtype)), gb = static_cast<int64_t>(dtype_size(in.grad_dtype));
    // Sharded over the ranks with the base (ZeRO-3), a layer's factors gathered around its work.
    const int64_t shards = parameter_shards(in), ep = std::max<int64_t>(1, in.ep);
    // Per kind: the factors of every layer, and the most one layer holds.
    int64_t n[4] = {}, widest[4] = {};
    for (size_t l = 0; l < use.size(); ++l) {
      int64_t here[4] = {};
      for (size_t i = 0; i < use[l].size(); ++i) {
        const LinearModule& m = c.linear_modules[l][i];
        if (use[l][i].kind == Use::none) continue;
        here[use[l][i].kind] += (m.experts > 0 ? m.experts / ep : 1) * o_.r * (m.in_features + m.out_features);
      }
      for (int k = 1; k < 4; ++k) {
        n[k] += here[k];
        widest[k] = std::max(widest[k], here[k]);
      }
    }
    auto add = [&](int kind, const std::string& id, const std::string& what) {
      if (kind != Use::plain && n[kind] == 0) return;
      const int64_t per_rank = (n[kind] + shards - 1) / shards;
      plan.add(id + "weights", str("LoRA factors", what, " (", n[kind], ")"), PlanCategory::weights, per_rank * ab, plan_phase::always);
      plan.add(id + "gradients", str("LoRA factors", what, "' gradients (", dtype_name(shards > 1 ? DType::f32 : in.grad_dtype), ")"),
               PlanCategory::gradients, per_rank * (shards > 1 ? 4 : gb), plan_phase::always);
      plan.parameters += n[kind];
      plan.gemm_parameters += n[kind];
      if (shards > 1) {
        plan.add(id + "gathered_layer", str("one layer's gathered LoRA factors", what), PlanCategory::communication,
                 widest[kind] * ab, plan_phase::forward);
        for (const char* phase : {plan_phase::mlp_backward, plan_phase::backward})
          plan.add(id + "gathered_layer_grads", str("one layer's gathered LoRA factors", what, " + full fp32 grads"),
                   PlanCategory::communication, widest[kind] * (ab + 4), phase);
      }
    };
    add(Use::plain, "lora_", "");
    add(Use::experts, "lora_expert_", " of the experts");
    add(Use::parameter, "lora_parameter_", " of the target parameters");

    // The work, per adapted module and layer: u = x A^T and the update y = scale u B^T in the
    // forward and again in the recompute (y written first, the module's GEMM reading it in its
    // epilogue); in the backward g = scale dy B, dx (+)= g A, dA += g^T x, u again and
    // dB += scale dy^T u. Each reads or writes the full [rows, in] or [rows, out] side once, which
    // is what they cost: r is far below what keeps a GEMM compute-bound. 5 passes over [rows, in]
    // and 4 over [rows, out] in all; where the A's of modules that read one input are stacked (not
    // under ZeRO-3 or 16-bit gradients), one GEMM makes that input's passes for all of them. An
    // experts module runs each routed row (tokens x experts_per_token) through its expert's
    // factors. With dropout, each adapted plain module's input is dropped in the forward and the
    // recompute (a read and a write each), and in the backward the masked gradient (a read, dx
    // read and written) and the dropped input again: 9 passes over [T, in].
    const bool stacked = shards == 1 && in.grad_dtype == DType::f32;
    const double T = static_cast<double>(in.tokens_per_rank), rr = static_cast<double>(o_.r);
    for (size_t l = 0; l < use.size(); ++l) {
      std::set<int> inputs_paid;
      for (size_t i = 0; i < use[l].size(); ++i) {
        if (use[l][i].kind == Use::none) continue;
        const LinearModule& m = c.linear_modules[l][i];
        const double inn = static_cast<double>(m.in_features), out = static_cast<double>(m.out_features);
        const double t = m.experts > 0 ? T * static_cast<double>(std::max<int64_t>(1, m.experts_per_token)) : T;
        const bool pays_input = m.experts > 0 || !stacked || inputs_paid.insert(m.input).second;
        plan.work.gemm_flops += 2 * t * rr * (5 * inn + 4 * out);
        plan.work.memory_bytes += t * static_cast<double>(ab) * ((pays_input ? 5 * inn : 0) + 4 * out);
        if (o_.dropout > 0 && m.experts == 0) plan.work.memory_bytes += 9.0 * T * inn * static_cast<double>(ab);
      }
    }
  }

 private:
  static const LowRank* lookup(const std::vector<std::map<int, LowRank>>& by_layer, int layer, int id) {
    if (layer < 0 || static_cast<size_t>(layer) >= by_layer.size()) return nullptr;
    const auto& m = by_layer[static_cast<size_t>(layer)];
    const auto it = m.find(id);
    return it == m.end() ? nullptr : &it->second;
  }

  static std::string full_name(int64_t layer, const std::string& path) { return str("model.layers.", layer, ".", path); }

  // The model's module paths, each once, in the order its layers hold them (plain and per-expert
  // modules, or the parameters of stacked experts).
  static std::string module_names(const ModelConfig& c, bool parameters) {
    std::vector<std::string> seen;
    for (const auto& layer : c.linear_modules)
      for (const LinearModule& m : layer)
        if (m.parameter == parameters && std::find(seen.begin(), seen.end(), m.path) == seen.end()) seen.push_back(m.path);
    return seen.empty() ? std::string("none") : joined(seen);
  }

  // What this table does with each module of each layer, as PEFT matches target_modules and
  // target_parameters; refuses, by key, an entry that names no module of the model and what the
  // model's modules cannot take.
  std::vector<std::vector<Use>> uses(const ModelConfig& c) const {
    if (static_cast<int64_t>(c.linear_modules.size()) != c.num_layers)
      throw Error(str("lora: the model exposes the linear modules of ", c.linear_modules.size(), " layers of its ",
                      c.num_layers, " (ModelConfig::linear_modules)"),
                  o_.key("target_modules"), "use a model module that lists its layers' linear modules");
    bool sparse = false;
    for (const auto& layer : c.linear_modules)
      for (const LinearModule& m : layer) sparse = sparse || (m.experts > 0 && !m.parameter);
    if (o_.experts && !sparse)
      throw Error(str("lora: ", o_.key("experts"), " = true, but this model has no experts of one linear module each"),
                  o_.key("experts"),
                  "set experts = false (a dense model's modules are adapted by target_modules alone; fused experts by "
                  "target_parameters)");
    std::vector<bool> named(o_.names.size()), parameter_named(o_.target_parameters.size());
    std::vector<std::vector<Use>> out(c.linear_modules.size());
    int64_t adapted = 0, experts_adapted = 0;
    for (size_t l = 0; l < c.linear_modules.size(); ++l) {
      const int64_t layer = static_cast<int64_t>(l);
      for (const LinearModule& m : c.linear_modules[l]) {
        Use u;
        if (m.parameter) {
          const std::string name = full_name(layer, m.path);
          for (size_t i = 0; i < o_.target_parameters.size(); ++i)
            if (peft::TargetModules::entry_matches(o_.target_parameters[i], name)) {
              u = {Use::parameter, static_cast<int>(i)};
              parameter_named[i] = true;
            }
        } else {
          const std::string name = full_name(layer, m.experts > 0 ? peft::module_path(m.path, 0) : m.path);
          if (matcher_.matches(name)) {
            for (size_t i = 0; i < o_.names.size(); ++i)
              if (peft::TargetModules::entry_matches(o_.names[i], name)) named[i] = true;
            if (m.experts == 0) {
              u.kind = Use::plain;
            } else if (o_.experts) {
              u.kind = Use::experts;
              ++experts_adapted;
            } else if (!o_.all_linear) {
              // Experts are no linear modules of their own, as in transformers 5: "all-linear"
              // passes them by, as PEFT does; named, they need experts = true.
              throw Error(str("lora: ", name, " is a module of ", m.experts, " experts: they take an adapter only with ",
                              o_.key("experts"), " = true"),
                          o_.key("experts"), "set experts = true to adapt every expert, or target the other modules");
            }
          }
        }
        adapted += u.kind != Use::none;
        out[l].push_back(u);
      }
    }
    for (size_t i = 0; i < o_.names.size(); ++i)
      if (!named[i])
        throw Error(str("lora: ", o_.key("target_modules"), " names \"", o_.names[i], "\", which matches no linear module of this ",
                        c.model_type, " model (its modules: ", module_names(c, false), ")"),
                    o_.key("target_modules"), str("name modules of the model (", module_names(c, false), "), or \"all-linear\""));
    for (size_t i = 0; i < o_.target_parameters.size(); ++i)
      if (!parameter_named[i])
        throw Error(str("lora: ", o_.key("target_parameters"), " names ", o_.target_parameters[i],
                        ", which no layer of this model holds as stacked experts (its: ", module_names(c, true), ")"),
                    o_.key("target_parameters"), str("name the model's experts' parameters: ", module_names(c, true)));
    if (adapted == 0)
      throw Error(str("lora: ", o_.key("target_modules"), " = ", targets_text(), " adapts no module of this model"),
                  o_.key("target_modules"), str("match the layers' modules (", module_names(c, false), "), or \"all-linear\""));
    if (o_.experts && experts_adapted == 0)
      throw Error(str("lora: ", o_.key("experts"), " = true, but ", o_.key("target_modules"), " = ", targets_text(),
                      " adapts none of the experts' modules"),
                  o_.key("experts"), "match the experts' modules (e.g. gate_proj, up_proj, down_proj), or set experts = false");
    return out;
  }

  // Unfreezes the biases `bias` trains, as PEFT's bias option does: "all", every parameter of the
  // base named with "bias"; "lora_only", the bias of each adapted linear module. Refuses a setting
  // that would train none. Returns their element count.
  int64_t train_biases(Model& model) {
    biases_.clear();
    if (o_.bias == "none") return 0;
    std::set<std::string> adapted;
    std::vector<std::string> with_bias;
    for (size_t l = 0; l < modules_.size(); ++l)
      for (const LinearModule& m : modules_[l]) {
        if (!m.bias) continue;
        if (std::find(with_bias.begin(), with_bias.end(), m.path) == with_bias.end()) with_bias.push_back(m.path);
        if (m.experts == 0 && find(static_cast<int>(l), m.id)) adapted.insert(full_name(static_cast<int64_t>(l), m.path) + ".bias");
      }
    int64_t n = 0;
    for (Parameter* p : model.parameters()) {
      const bool take = o_.bias == "all" ? p->name.find("bias") != std::string::npos : adapted.count(p->name) > 0;
      if (!take || !p->frozen) continue;  // modules_to_save trains it already
      p->frozen = false;
      n += p->value.numel();
      biases_.emplace_back(p->name, p);
    }
    if (biases_.empty())
      throw Error(str("lora: ", o_.key("bias"), " = \"", o_.bias, "\", but ",
                      o_.bias == "all" ? std::string("this model has no bias") : str(o_.key("target_modules"), " = ", targets_text(), " adapts no module with a bias"),
                      " (its linear modules with a bias: ", with_bias.empty() ? std::string("none") : joined(with_bias), ")"),
                  o_.key("bias"),
                  with_bias.empty() ? std::string("set bias = \"none\": this model's linear modules have no bias to train")
                                    : str("set bias = \"none\", or adapt modules with a bias (", joined(with_bias), ")"));
    return n;
  }

  // A's values drawn per element: U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming_uniform_(a = sqrt(5))).
  static void draw_a(float* a, int64_t n, uint64_t key, int64_t in) {
    const float bound = 1.f / std::sqrt(static_cast<float>(in));
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t bits = mix(key + static_cast<uint64_t>(i));
      const float u = static_cast<float>(bits >> 40) * (1.f / 16777216.f);  // [0, 1) in 24 bits
      a[i] = (2.f * u - 1.f) * bound;
    }
  }

  void check_rank(const std::string& what, int64_t out, int64_t in) const {
    if (o_.r > std::min(out, in))
      throw Error(str("lora: r = ", o_.r, " is larger than ", what, " [", out, ", ", in, "] can hold"), o_.key("r"),
                  str("use r <= ", std::min(out, in)));
  }

  // A plain linear module's factors, A's rows in the stack of its input where there is one.
  int64_t attach_plain(int l, const LinearModule& m, const std::map<std::string, Parameter*>& base, const AdapterContext& ctx,
                       Stack* st) {
    const std::string stem = full_name(l, m.path), wname = stem + ".weight";
    const auto it = base.find(wname);
    if (it == base.end() || it->second->value.shape() != Shape{m.out_features, m.in_features})
      throw Error(str("lora: the model lists ", stem, " [", m.out_features, ", ", m.in_features, "] but holds ",
                      it == base.end() ? std::string("no ") + wname : str(wname, " ", shape_str(it->second->value.shape()))),
                  o_.key("target_modules"), "the model module's linear modules disagree with its parameters: report it");
    const int64_t out = m.out_features, in = m.in_features;
    check_rank(wname, out, in);
    Parameter& a = add_param(stem + ".lora_A.weight", {o_.r, in}, ctx, st);
    Parameter& b = add_param(stem + ".lora_B.weight", {out, o_.r}, ctx);
    // A ~ U(-1/sqrt(in), 1/sqrt(in)), B = 0 (PEFT's init_lora_weights = True).
    Tensor ha = Tensor::empty(a.value.shape(), DType::f32, Device::cpu());
    draw_a(ha.data_as<float>(), ha.numel(), name_key(ctx.seed, a.name), in);
    set_value(a, ha);
    b.value.zero();
    LowRank lr{&a, &b, static_cast<float>(o_.scale()), st ? st->value : Tensor(), st ? st->grad : Tensor(), st ? st->row : 0};
    if (st) st->row += o_.r;
    // Each module draws its own mask (PEFT's Dropout per module), from the pass's key.
    lr.dropout = static_cast<float>(o_.dropout);
    lr.dropout_stream = (static_cast<uint64_t>(l) << 20) + static_cast<uint64_t>(m.id);
    lr.dropout_pass = &pass_key_;
    layers_[static_cast<size_t>(l)][m.id] = lr;
    return a.value.numel() + b.value.numel();
  }

  // Layer l's module of per-expert linears: factors stacked by this rank's experts, A drawn per
  // expert keyed by its PEFT name (Hub number), so every ep starts from the factors one rank
  // would. Returns the factors' element count.
  int64_t attach_experts(int l, const LinearModule& m, const std::map<std::string, Parameter*>& base, const AdapterContext& ctx) {
    const std::string stem = full_name(l, m.path), wname = stem + ".weight";
    const auto it = base.find(wname);
    if (it == base.end() || it->second->value.dim() != 3)
      throw Error(str("lora: the model lists ", stem, " as ", m.experts, " experts but holds no stacked weight ", wname),
                  o_.key("experts"), "set experts = false");
    const Tensor& w = it->second->value;
    const int64_t El = w.size(0), out = w.size(1), in = w.size(2);
    check_rank(str("an expert's ", m.path), out, in);
    Parameter& a = add_param(stem + ".lora_A.weight", {El, o_.r, in}, ctx);
    Parameter& b = add_param(stem + ".lora_B.weight", {El, out, o_.r}, ctx);
    // This rank's experts' factors: their gradients summed where the experts' are.
    a.grad_group = b.grad_group = it->second->grad_group;
    first_expert_ = ctx.partition_index * El;
    Tensor ha = Tensor::empty(a.value.shape(), DType::f32, Device::cpu());
    const int64_t per = o_.r * in;
    for (int64_t e = 0; e < El; ++e)
      draw_a(ha.data_as<float>() + e * per, per, name_key(ctx.seed, peft::base_weight_name(l, m.path, first_expert_ + e) + ".lora_A"), in);
    set_value(a, ha);
    b.value.zero();
    experts_[static_cast<size_t>(l)][m.id] = LowRank{&a, &b, static_cast<float>(o_.scale()), {}, {}, 0};
    local_experts_ = El;
    num_experts_ = m.experts;
    return a.value.numel() + b.value.numel();
  }

  // Layer l's stacked experts stored as one parameter W [E_local, in, out] (PEFT's
  // target_parameters): factors A [E_local, r, in] and B [E_local, out, r], A drawn per expert.
  int64_t attach_parameter(int l, const LinearModule& m, int entry, const std::map<std::string, Parameter*>& base,
                           const AdapterContext& ctx) {
    const std::string key = o_.key("target_parameters"), name = full_name(l, m.path);
    const auto it = base.find(name);
    if (it == base.end() || it->second->value.dim() != 3)
      throw Error(str("lora: the model lists ", name, " as ", m.experts, " experts' parameter [E, in, out] but holds ",
                      it == base.end() ? std::string("none") : str(it->second->value.dim(), "-D")),
                  key, "name the fused experts' parameters");
    const Parameter& w = *it->second;
    const int64_t El = w.value.size(0), in = w.value.size(1), out = w.value.size(2);
    check_rank(str("an expert's ", m.path), out, in);
    Parameter& a = add_param(w.name + ".lora_A.weight", {El, o_.r, in}, ctx);
    Parameter& b = add_param(w.name + ".lora_B.weight", {El, out, o_.r}, ctx);
    a.grad_group = b.grad_group = w.grad_group;
    first_expert_ = ctx.partition_index * El;
    // PEFT's lora_A is one nn.Linear(in, r * E): kaiming_uniform over in, as every A here.
    Tensor ha = Tensor::empty(a.value.shape(), DType::f32, Device::cpu());
    const int64_t per = o_.r * in;
    for (int64_t e = 0; e < El; ++e)
      draw_a(ha.data_as<float>() + e * per, per, name_key(ctx.seed, str(w.name, ".", first_expert_ + e, ".lora_A")), in);
    set_value(a, ha);
    b.value.zero();
    experts_[static_cast<size_t>(l)][m.id] = LowRank{&a, &b, static_cast<float>(o_.scale()), {}, {}, 0};
    param_slots_.push_back({l, m.id, o_.target_parameters[static_cast<size_t>(entry)]});
    num_experts_ = m.experts;
    return a.value.numel() + b.value.numel();
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

  // The module of layer l a pair of an adapter file names (its path, an expert's or not), or null.
  const LinearModule* module_of(const peft::LoraPair& p) const {
    if (p.layer < 0 || static_cast<size_t>(p.layer) >= modules_.size()) return nullptr;
    for (const LinearModule& m : modules_[static_cast<size_t>(p.layer)])
      if (!m.parameter && (m.experts > 0) == (p.expert >= 0) && peft::module_path(p.module, p.expert) == peft::module_path(m.path, p.expert))
        return &m;
    return nullptr;
  }

  // The factors (and modules_to_save) from a PEFT folder, checked against the model and this
  // table's r and target_modules.
  void load_from(const std::string& dir, Model& model, const std::map<std::string, Parameter*>& base, bool init) {
    const std::string key = init ? o_.key("init_from") : std::string("--resume");
    if (!fs::is_directory(dir))
      throw Error(str("lora: ", dir, " is not a folder"), key, "give a folder holding adapter_config.json and adapter_model.safetensors");
    const peft::Adapter a = peft::read_adapter(dir);
    const ModelConfig& c = model.config();
    // Every expert's count by its stacked tensor's name, whatever ep splits them.
    std::map<std::string, int64_t> experts_of;
    for (size_t l = 0; l < modules_.size(); ++l)
      for (const LinearModule& m : modules_[l])
        if (m.experts > 0) experts_of[full_name(static_cast<int64_t>(l), m.path) + (m.parameter ? "" : ".weight")] = m.experts;
    peft::check_against_base(a, c.num_layers, [&](const std::string& name) -> std::optional<Shape> {
      const auto it = base.find(name);
      if (it != base.end()) {
        Shape s = it->second->value.shape();
        if (const auto e = experts_of.find(name); e != experts_of.end()) s[0] = e->second;
        return s;
      }
      // An expert's matrix ("model.layers.3.mlp.experts.5.gate_proj.weight"): a slice of the stacked
      // experts ("model.layers.3.mlp.experts.gate_proj.weight").
      for (const auto& [stacked, E] : experts_of) {
        if (!stacked.ends_with(".weight") || name.size() <= stacked.size() + 1) continue;
        const size_t dot = stacked.rfind('.', stacked.size() - 8);  // before the module's last part
        if (dot == std::string::npos || !name.starts_with(stacked.substr(0, dot + 1)) ||
            !name.ends_with(stacked.substr(dot)))
          continue;
        const std::string number = name.substr(dot + 1, name.size() - stacked.size() - 1);
        if (number.empty() || number.size() > 6 || !std::all_of(number.begin(), number.end(), ::isdigit)) continue;
        const int64_t e = std::stoll(number);
        const auto st = base.find(stacked);
        if (st == base.end() || st->second->value.dim() != 3 || e >= E) return std::nullopt;
        return Shape{st->second->value.size(1), st->second->value.size(2)};
      }
      return std::nullopt;
    });
    if (a.config.r != o_.r)
      throw Error(str("lora: ", dir, " holds an adapter of r = ", a.config.r, ", this run's ", o_.key("r"), " is ", o_.r),
                  o_.key("r"), str("set ", o_.key("r"), " = ", a.config.r));
    // The same plain modules adapted (the experts' are counted below).
    const peft::TargetModules theirs(a.config);
    for (size_t l = 0; l < modules_.size(); ++l)
      for (const LinearModule& m : modules_[l]) {
        if (m.experts > 0) continue;
        const std::string name = full_name(static_cast<int64_t>(l), m.path);
        if (theirs.matches(name) != (find(static_cast<int>(l), m.id) != nullptr))
          throw Error(str("lora: ", dir, " adapts ", peft_targets(a.config), ", this run's ", o_.key("target_modules"), " ",
                          targets_text(), ": they differ on ", name),
                      o_.key("target_modules"), str("set ", o_.key("target_modules"), " to the adapter's"));
      }
    if (std::abs(a.config.lora_alpha - o_.alpha) > 1e-12 || a.config.use_rslora != o_.use_rslora)
      log::warn(str("lora: ", dir, " was trained with lora_alpha ", a.config.lora_alpha, a.config.use_rslora ? " (rsLoRA)" : "",
                    "; this run scales by ", o_.key("alpha"), " = ", o_.alpha, o_.use_rslora ? " (rsLoRA)" : ""));
    int64_t expert_pairs = 0, expected = 0;
    for (size_t l = 0; l < modules_.size(); ++l)
      for (const LinearModule& m : modules_[l])
        if (!m.parameter && find_experts(static_cast<int>(l), m.id)) expected += m.experts;
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
        const LowRank& lr = *find_experts(static_cast<int>(slot->layer), slot->id);
        const int64_t E = num_experts_;
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
      const LinearModule* m = module_of(p);
      if (p.expert >= 0) {
        const LowRank* lr = m ? find_experts(static_cast<int>(p.layer), m->id) : nullptr;
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
      const LowRank* lr = m ? find(static_cast<int>(p.layer), m->id) : nullptr;
      if (!lr)
        throw Error(str("lora: ", dir, " adapts layer ", p.layer, "'s ", p.module, ", which this run does not"),
                    o_.key("target_modules"), str("set ", o_.key("target_modules"), " to the adapter's"));
      set_value(*lr->a, p.a);
      set_value(*lr->b, p.b);
    }
    if (parameter_pairs != param_slots_.size())
      throw Error(str("lora: ", dir, " holds ", parameter_pairs, " target parameters' adapters, this run adapts ",
                      param_slots_.size(), " (", o_.key("target_parameters"), ")"),
                  o_.key("target_parameters"), "set target_parameters to the adapter's");
    if (expert_pairs != expected)
      throw Error(str("lora: ", dir, " holds ", expert_pairs, " experts' adapters, this run adapts ", expected, " (",
                      o_.key("experts"), " = ", o_.experts ? "true" : "false", ")"),
                  o_.key("experts"), "set experts to match the adapter (true where it holds mlp.experts.N keys)");
    if (a.config.bias != o_.bias)
      throw Error(str("lora: ", dir, " trained bias = \"", a.config.bias, "\", this run's ", o_.key("bias"), " is \"", o_.bias, "\""),
                  o_.key("bias"), str("set ", o_.key("bias"), " = \"", a.config.bias, "\""));
    for (const auto& [name, t] : a.biases) {
      const auto it = std::find_if(biases_.begin(), biases_.end(), [&](const auto& b) { return b.first == name; });
      if (it == biases_.end())
        throw Error(str("lora: ", dir, " trains ", name, ", which this run's ", o_.key("bias"), " = \"", o_.bias, "\" does not"),
                    o_.key("bias"), "adapt the modules the adapter adapts");
      set_value(*it->second, t);
    }
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
    // The standard projections first, in their order, as PEFT's files list them once read back.
    if (o_.pattern.empty() && !o_.all_linear) {
      for (const std::string& m : peft::lora_modules())
        if (std::find(o_.names.begin(), o_.names.end(), m) != o_.names.end()) c.target_modules.push_back(m);
      for (const std::string& m : o_.names)
        if (std::find(c.target_modules.begin(), c.target_modules.end(), m) == c.target_modules.end()) c.target_modules.push_back(m);
    }
    c.base_model_name_or_path = base;
    c.modules_to_save = o_.modules_to_save;
    c.target_parameters = o_.target_parameters;
    c.bias = o_.bias;
    return c;
  }

  static std::string joined(const std::vector<std::string>& v) {
    std::string s;
    for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
    return s;
  }
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
  peft::TargetModules matcher_;
  std::vector<std::vector<LinearModule>> modules_;  // the model's, at attach
  std::deque<Parameter> params_;  // stable addresses: LowRank points into it
  // The factors by layer and module id (LinearModule::id): plain modules', and experts' stacked by
  // this rank's experts [first_expert_, + local_experts_).
  std::vector<std::map<int, LowRank>> layers_, experts_;
  // The target parameters' factors: which experts' module of which layer holds each.
  struct ParamSlot {
    int64_t layer;
    int id;
    std::string parameter;
  };
  std::vector<ParamSlot> param_slots_;
  int64_t first_expert_ = 0, local_experts_ = 0, num_experts_ = 0;
  uint64_t seed_ = 0, pass_key_ = 0;  // LowRank::dropout_pass points at pass_key_
  std::vector<std::pair<std::string, Parameter*>> saved_;
  std::vector<std::pair<std::string, Parameter*>> biases_;  // the biases `bias` trains
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
             "the linear modules adapted, as PEFT's target_modules matches the modules the model lists: a list takes a "
             "module whose full name (\"model.layers.3.self_attn.q_proj\") equals an entry or ends with \".\" + entry; "
             "any other string is a regex the full name must match; \"all-linear\" every linear module but the head",
             "a list of module names (q_proj, self_attn.o_proj, ...), \"all-linear\", or a regex", "\"all-linear\"");
  c.describe("experts", "adapt a mixture-of-experts model's experts too, per expert: its modules of one linear per expert that target_modules matches",
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
  bool listed = true;
  try {
    o.names = c.get_strings("target_modules", {});
    if (!c.has("target_modules")) listed = false;
  } catch (const Error&) {
    const std::string s = c.get_string("target_modules", "all-linear");
    listed = false;
    if (s != "all-linear") {
      try {
        std::regex check(s);
      } catch (const std::regex_error& e) {
        c.fail("target_modules", str("'", s, "' is not a regex (", e.what(), ")"),
               "e.g. \".*\\.(q_proj|v_proj)\", a list [\"q_proj\", \"v_proj\"] or \"all-linear\"");
      }
      o.pattern = s;
    }
  }
  if (!listed && o.pattern.empty()) o.all_linear = true;
  if (listed && o.names.empty()) c.fail("target_modules", "is empty: nothing would train", "name the modules, or \"all-linear\"");
  if (std::find(o.names.begin(), o.names.end(), "all-linear") != o.names.end()) {
    o.all_linear = true;
    o.names.clear();
  }
  o.experts = c.get_bool("experts", false);
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
  c.describe("bias",
             "biases trained beside the adapters, as PEFT's bias: \"none\"; \"all\", every parameter of the model named with "
             "\"bias\"; \"lora_only\", the biases of the adapted modules (saved with the adapter)",
             "\"none\", \"all\" or \"lora_only\" (not \"none\" only for a model with biases: Qwen2's q, k, v; GPT-OSS's)",
             "\"none\"");
  o.bias = c.get_string("bias", "none");
  if (o.bias != "none" && o.bias != "all" && o.bias != "lora_only")
    c.fail("bias", str("'", o.bias, "' is none of PEFT's settings"), "use \"none\", \"all\" or \"lora_only\"");
  o.init_from = c.get_string("init_from", "");
  return std::make_unique<Lora>(std::move(o));
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_ADAPTER, "lora", "0.1.0", "LoRA adapters on a frozen base, PEFT's files in and out", "ready",
           lcx::create)
