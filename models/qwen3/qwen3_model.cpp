// Qwen3 dense as transformers 5.17 computes it (Qwen3DecoderLayer), with an explicit backward.
//
// One layer, x [T,H] -> y [T,H]:
//   h1 = rmsnorm(x) ; q,k,v = h1 @ Wq^T, Wk^T, Wv^T ; q,k = rmsnorm per head (q_norm, k_norm)
//   q,k = rotary(q,k) ; a = attention(q,k,v) through the Parallelism slot ; x1 = x + a @ Wo^T
//   h2 = rmsnorm(x1) ; y = x1 + (silu(h2 @ Wg^T) * (h2 @ Wu^T)) @ Wd^T
// The MLP (gate/up, silu * up, down) runs through the MLP slot (StepContext::mlp), which decides how
// many rows it works on at once. Backward recomputes the attention half from x (the only thing
// kept between forward and backward, by the MemoryStrategy slot), holds its intermediates for the
// duration of the call, lets the MLP slot recompute and differentiate its own half, and walks the
// same lines upward. Parameter gradients are fp32 and accumulate across calls.
#include <cmath>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "lcx/config.h"
#include "lcx/defaults.h"
#include "lcx/hf_config.h"
#include "lcx/log.h"
#include "lcx/model.h"
#include "lcx/ops.h"
#include "lcx/plugin.h"
#include "lcx/safetensors.h"
#include "qwen3_config.h"

namespace lcx::qwen3 {
namespace {

namespace fs = std::filesystem;

// Counter-based normal numbers: element i of a parameter depends only on (seed, name, i), so
// init is independent of order and of how the work is split across threads.
uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t hash_name(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

void fill_normal(Tensor& t, uint64_t key, double std) {
  const int64_t n = t.numel();
  auto fill = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      // Box-Muller on two 53-bit uniforms; u1 in (0,1] keeps the log finite.
      const uint64_t a = mix(key ^ mix(static_cast<uint64_t>(i) * 2)), b = mix(key ^ mix(static_cast<uint64_t>(i) * 2 + 1));
      const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53, u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
      const float v = static_cast<float>(std * std::sqrt(-2.0 * std::log(u1)) * std::cos(2 * M_PI * u2));
      switch (t.dtype()) {
        case DType::f32: t.data_as<float>()[i] = v; break;
        case DType::bf16: t.data_as<bf16>()[i] = float_to_bf16(v); break;
        default: t.data_as<f16>()[i] = float_to_f16(v); break;
      }
    }
  };
  const int64_t workers = std::clamp<int64_t>(n / (1 << 20), 1, std::max(1u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t w = 0; w < workers; ++w) pool.emplace_back(fill, n * w / workers, n * (w + 1) / workers);
  for (auto& th : pool) th.join();
}

void fill_ones(Tensor& t) {
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) switch (t.dtype()) {
      case DType::f32: t.data_as<float>()[i] = 1.f; break;
      case DType::bf16: t.data_as<bf16>()[i] = float_to_bf16(1.f); break;
      default: t.data_as<f16>()[i] = float_to_f16(1.f); break;
    }
}

struct LayerParams {
  int input_norm, q, k, v, o, q_norm, k_norm, post_norm, gate, up, down;
};

// Everything one layer's forward produces, kept only inside one layer_backward call.
struct LayerActs {
  Tensor h1, rstd1;        // input norm [T,H], fp32 [T]
  Tensor q, k, v;          // projections [T,Hq*d], [T,Hkv*d], [T,Hkv*d]
  Tensor qr, kr;           // per-head norm then rotary [T,Hq,d], [T,Hkv,d]
  Tensor rstd_q, rstd_k;   // fp32 [T*Hq], [T*Hkv]
  Tensor attn, lse;        // [T,Hq,d], fp32 [Hq,T]
  Tensor x1;               // after the attention residual [T,H]
  Tensor h2, rstd2;        // post-attention norm, the MLP's input
};

class Qwen3Model final : public Model {
 public:
  Qwen3Model(bool check_finite, uint64_t max_shard_bytes)
      : check_finite_(check_finite), max_shard_bytes_(max_shard_bytes) {}

  void load_hf(const std::string& dir, Device device, DType dtype) override {
    HfConfig hc = HfConfig::load(dir);
    ModelConfig cfg = config_from_hf(hc);
    safetensors::Checkpoint ck = safetensors::Checkpoint::open(dir);
    build(cfg, device, dtype);
    // Refuse what does not belong before converting anything: a wrong folder fails in a second.
    std::set<std::string> expected;
    for (const auto& p : params_) expected.insert(p.name);
    for (const auto& name : ck.names()) {
      if (expected.count(name)) continue;
      if (name == "lm_head.weight" && cfg_.tie_word_embeddings) continue;  // redundant copy of a tied head
      if (name.size() > 20 && name.substr(name.size() - 20) == ".rotary_emb.inv_freq") continue;  // old buffers
      throw Error(str(ck.file_of(name), ": tensor '", name, "' is unexpected in a qwen3 checkpoint with ", cfg_.num_layers,
                      " layers", cfg_.tie_word_embeddings ? " and a tied head" : ""),
                  {}, "check that config.json belongs to these weights");
    }
    for (auto& p : params_) {
      if (!ck.has(p.name))
        throw Error(str(ck.path(), ": tensor '", p.name, "' is missing"), {},
                    p.name == "lm_head.weight" ? "an untied model needs lm_head.weight, or set tie_word_embeddings"
                                               : "the checkpoint is incomplete or belongs to another config");
      const auto& info = ck.info(p.name);
      if (info.shape != p.value.shape())
        throw Error(str(ck.file_of(p.name), ": tensor '", p.name, "' has shape ", shape_str(info.shape), " but config.json implies ",
                        shape_str(p.value.shape())));
      p.value = ck.load(p.name, dtype, device, check_finite_);
    }
    log::info(str("qwen3: loaded ", dir, " (", cfg_.num_layers, " layers, hidden ", cfg_.hidden_size, ", ",
                  parameter_count(), " parameters, ", dtype_name(dtype), ")"));
  }

  ModelConfig describe(const std::string& spec) const override {
    if (std::filesystem::is_directory(spec) || std::filesystem::path(spec).filename() == "config.json")
      return config_from_hf(HfConfig::load(spec));
    return config_from_spec(spec);
  }

  void init_random(const std::string& spec, uint64_t seed, Device device, DType dtype) override {
    double std = 0.02;
    ModelConfig cfg = config_from_spec(spec, &std);
    build(cfg, device, dtype);
    // transformers' _init_weights: Linear and Embedding ~ N(0, initializer_range), RMSNorm = 1.
    for (auto& p : params_) {
      Tensor host = Tensor::empty(p.value.shape(), dtype, Device::cpu(), MemoryCategory::weights);
      if (p.value.dim() == 1)
        fill_ones(host);
      else
        fill_normal(host, mix(seed) ^ hash_name(p.name), std);
      p.value = device.is_cuda() ? host.to(device) : host;
    }
  }

  void save_hf(const std::string& dir, DType dtype, const std::string& rope_parameters_json) const override {
    fs::create_directories(dir);
    std::vector<safetensors::NamedTensor> tensors;
    for (const auto& p : params_) tensors.push_back({p.name, p.value});
    safetensors::write_checkpoint(dir, tensors, dtype, max_shard_bytes_);
    const std::string path = (fs::path(dir) / "config.json").string();
    std::ofstream out(path);
    out << config_to_json(cfg_, rope_parameters_json, dtype);
    if (!out) throw Error(str(path, ": write failed"));
  }

  const ModelConfig& config() const override { return cfg_; }

  std::vector<Parameter*> parameters() override {
    std::vector<Parameter*> out;
    for (auto& p : params_) out.push_back(&p);
    return out;
  }

  void zero_grad() override {
    for (auto& p : params_) p.grad.zero();
  }

  void embed_forward(const Tensor& tokens, Tensor& x) override { ops::embedding_forward(tokens, W(embed_), x); }

  void embed_backward(const Tensor& tokens, const Tensor& dx) override {
    ops::embedding_backward(tokens, dx, G(embed_));
  }

  void layer_forward(int layer, const Tensor& x, Tensor& y, StepContext& ctx) override {
    LayerActs a;
    forward(layer, x, a, ctx, y);
  }

  void layer_backward(int layer, const Tensor& x, const Tensor& dy, Tensor& dx, StepContext& ctx) override {
    const LayerParams& L = layers_.at(static_cast<size_t>(layer));
    const int64_t T = x.size(0), H = cfg_.hidden_size;
    const int64_t Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads, d = cfg_.head_dim;
    const DType dt = x.dtype();
    const Device dev = x.device();
    LayerActs a;
    Tensor no_output;  // the recompute stops at the MLP's input; the MLP slot recomputes its half
    forward(layer, x, a, ctx, no_output);
    // Every gradient buffer of the layer is taken before the MLP's backward runs, so the layer's
    // peak is one sum (what the plan counts, plan_dense_decoder + the MLP slot's terms) rather
    // than a maximum over its halves; beside the MLP's own transient these are small.
    Tensor dh2 = Tensor::empty({T, H}, dt, dev), dx1 = Tensor::empty({T, H}, dt, dev);
    Tensor dattn = Tensor::empty({T, Hq, d}, dt, dev);
    Tensor dq = Tensor::empty({T, Hq, d}, dt, dev), dk = Tensor::empty({T, Hkv, d}, dt, dev),
           dv = Tensor::empty({T, Hkv, d}, dt, dev);
    Tensor dq_raw = Tensor::empty({T * Hq, d}, dt, dev), dk_raw = Tensor::empty({T * Hkv, d}, dt, dev);
    Tensor dh1 = Tensor::empty({T, H}, dt, dev);

    // MLP: y = x1 + mlp(h2).
    MlpWeights grads{G(L.gate), G(L.up), G(L.down)};
    mlp(ctx).backward(a.h2, mlp_weights(L), dy, dh2, grads);
    ops::rmsnorm_backward(a.x1, W(L.post_norm), a.rstd2, dh2, dx1, G(L.post_norm));
    ops::add(dx1, dy, dx1);  // the residual path

    // Attention: x1 = x + attn @ Wo^T.
    Tensor attn2 = a.attn.view({T, Hq * d});
    ops::matmul(dx1, true, attn2, false, G(L.o), 1.f, 1.f);
    Tensor dattn2 = dattn.view({T, Hq * d});
    ops::matmul(dx1, false, W(L.o), false, dattn2);
    ctx.parallel->attention_backward(a.qr, a.kr, a.v.view({T, Hkv, d}), a.attn, a.lse, dattn, dq, dk, dv, args());
    ops::rotary_backward(dq, ctx.rope->cos, ctx.rope->sin);
    ops::rotary_backward(dk, ctx.rope->cos, ctx.rope->sin);
    ops::rmsnorm_backward(a.q.view({T * Hq, d}), W(L.q_norm), a.rstd_q, dq.view({T * Hq, d}), dq_raw, G(L.q_norm));
    ops::rmsnorm_backward(a.k.view({T * Hkv, d}), W(L.k_norm), a.rstd_k, dk.view({T * Hkv, d}), dk_raw, G(L.k_norm));
    Tensor dq2 = dq_raw.view({T, Hq * d}), dk2 = dk_raw.view({T, Hkv * d}), dv2 = dv.view({T, Hkv * d});
    ops::matmul(dq2, true, a.h1, false, G(L.q), 1.f, 1.f);
    ops::matmul(dk2, true, a.h1, false, G(L.k), 1.f, 1.f);
    ops::matmul(dv2, true, a.h1, false, G(L.v), 1.f, 1.f);
    ops::matmul(dq2, false, W(L.q), false, dh1);
    ops::matmul(dk2, false, W(L.k), false, dh1, 1.f, 1.f);
    ops::matmul(dv2, false, W(L.v), false, dh1, 1.f, 1.f);
    ops::rmsnorm_backward(x, W(L.input_norm), a.rstd1, dh1, dx, G(L.input_norm));
    ops::add(dx, dx1, dx);
  }

  void final_norm_forward(const Tensor& x, Tensor& y) override {
    Tensor rstd = Tensor::empty({x.size(0)}, DType::f32, x.device());
    ops::rmsnorm_forward(x, W(final_norm_), eps(), y, rstd);
  }

  void final_norm_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override {
    Tensor rstd = Tensor::empty({x.size(0)}, DType::f32, x.device());
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    ops::rmsnorm_forward(x, W(final_norm_), eps(), y, rstd);
    ops::rmsnorm_backward(x, W(final_norm_), rstd, dy, dx, G(final_norm_));
  }

  Tensor head_weight() override { return W(head_); }
  Tensor head_grad() override { return G(head_); }

 private:
  float eps() const { return static_cast<float>(cfg_.rms_norm_eps); }
  Tensor& W(int i) { return params_[static_cast<size_t>(i)].value; }
  Tensor& G(int i) { return params_[static_cast<size_t>(i)].grad; }
  MlpWeights mlp_weights(const LayerParams& L) { return {W(L.gate), W(L.up), W(L.down)}; }
  MlpStrategy& mlp(const StepContext& ctx) { return ctx.mlp ? *ctx.mlp : *whole_mlp_; }
  AttentionArgs args() const {
    AttentionArgs a;
    a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(cfg_.head_dim)));
    a.causal = true;
    return a;
  }
  int64_t parameter_count() const {
    int64_t n = 0;
    for (const auto& p : params_) n += p.value.numel();
    return n;
  }

  // The parameter list in HF order, with zeroed fp32 grads and values to be filled.
  void build(const ModelConfig& cfg, Device device, DType dtype) {
    if (!is_floating(dtype)) throw Error(str("qwen3: weights must be a float dtype, not ", dtype_name(dtype)));
    cfg_ = cfg;
    params_.clear();
    layers_.clear();
    const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size, d = cfg.head_dim;
    const int64_t qd = cfg.num_heads * d, kvd = cfg.num_kv_heads * d;
    auto add = [&](const std::string& name, Shape shape) {
      Parameter p;
      p.name = name;
      p.value = Tensor::empty(shape, dtype, device, MemoryCategory::weights);
      p.grad = Tensor::zeros(shape, DType::f32, device, MemoryCategory::gradients);
      p.decay = shape.size() > 1;  // norms are not decayed, as transformers' Trainer does
      params_.push_back(std::move(p));
      return static_cast<int>(params_.size() - 1);
    };
    embed_ = add("model.embed_tokens.weight", {V, H});
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
      const std::string p = str("model.layers.", l, ".");
      LayerParams L;
      L.input_norm = add(p + "input_layernorm.weight", {H});
      L.q = add(p + "self_attn.q_proj.weight", {qd, H});
      L.k = add(p + "self_attn.k_proj.weight", {kvd, H});
      L.v = add(p + "self_attn.v_proj.weight", {kvd, H});
      L.o = add(p + "self_attn.o_proj.weight", {H, qd});
      L.q_norm = add(p + "self_attn.q_norm.weight", {d});
      L.k_norm = add(p + "self_attn.k_norm.weight", {d});
      L.post_norm = add(p + "post_attention_layernorm.weight", {H});
      L.gate = add(p + "mlp.gate_proj.weight", {I, H});
      L.up = add(p + "mlp.up_proj.weight", {I, H});
      L.down = add(p + "mlp.down_proj.weight", {H, I});
      layers_.push_back(L);
    }
    final_norm_ = add("model.norm.weight", {H});
    head_ = cfg.tie_word_embeddings ? embed_ : add("lm_head.weight", {V, H});
    for (size_t l = 0; l < cfg.layer_types.size(); ++l)
      if (cfg.layer_types[l] != "full_attention")
        log::warn(str("qwen3: layer ", l, " is ", cfg.layer_types[l],
                      "; this module computes full causal attention only and will refuse to run it"));
  }

  // Writes y when it is defined; an undefined y stops after the MLP's input h2 (the recompute).
  void forward(int layer, const Tensor& x, LayerActs& a, StepContext& ctx, Tensor& y) {
    const LayerParams& L = layers_.at(static_cast<size_t>(layer));
    if (cfg_.layer_types[static_cast<size_t>(layer)] != "full_attention")
      throw Error(str("qwen3: layer ", layer, " is ", cfg_.layer_types[static_cast<size_t>(layer)],
                      ", which this module does not compute"),
                  "layer_types", "use a checkpoint with full attention in every layer (use_sliding_window false)");
    LCX_CHECK(ctx.rope && ctx.parallel, "layer_forward needs rope tables and a parallelism in its StepContext");
    const int64_t T = x.size(0), H = cfg_.hidden_size;
    const int64_t Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads, d = cfg_.head_dim;
    const DType dt = x.dtype();
    const Device dev = x.device();
    auto act = [&](Shape s) { return Tensor::empty(std::move(s), dt, dev); };
    auto f32 = [&](Shape s) { return Tensor::empty(std::move(s), DType::f32, dev); };

    a.h1 = act({T, H});
    a.rstd1 = f32({T});
    ops::rmsnorm_forward(x, W(L.input_norm), eps(), a.h1, a.rstd1);
    a.q = act({T, Hq * d});
    a.k = act({T, Hkv * d});
    a.v = act({T, Hkv * d});
    ops::matmul(a.h1, false, W(L.q), true, a.q);
    ops::matmul(a.h1, false, W(L.k), true, a.k);
    ops::matmul(a.h1, false, W(L.v), true, a.v);
    // Per-head norm over head_dim, before rotary (Qwen3's q_norm / k_norm).
    a.qr = act({T * Hq, d});
    a.kr = act({T * Hkv, d});
    a.rstd_q = f32({T * Hq});
    a.rstd_k = f32({T * Hkv});
    ops::rmsnorm_forward(a.q.view({T * Hq, d}), W(L.q_norm), eps(), a.qr, a.rstd_q);
    ops::rmsnorm_forward(a.k.view({T * Hkv, d}), W(L.k_norm), eps(), a.kr, a.rstd_k);
    a.qr = a.qr.view({T, Hq, d});
    a.kr = a.kr.view({T, Hkv, d});
    ops::rotary_forward(a.qr, ctx.rope->cos, ctx.rope->sin);
    ops::rotary_forward(a.kr, ctx.rope->cos, ctx.rope->sin);
    a.attn = act({T, Hq, d});
    a.lse = f32({Hq, T});
    ctx.parallel->attention_forward(a.qr, a.kr, a.v.view({T, Hkv, d}), a.attn, a.lse, args());
    Tensor o = act({T, H});
    ops::matmul(a.attn.view({T, Hq * d}), false, W(L.o), true, o);
    a.x1 = act({T, H});
    ops::add(x, o, a.x1);

    a.h2 = act({T, H});
    a.rstd2 = f32({T});
    ops::rmsnorm_forward(a.x1, W(L.post_norm), eps(), a.h2, a.rstd2);
    if (!y.defined()) return;
    Tensor m = act({T, H});
    mlp(ctx).forward(a.h2, mlp_weights(L), m);
    ops::add(a.x1, m, y);
  }

  ModelConfig cfg_;
  std::vector<Parameter> params_;
  std::vector<LayerParams> layers_;
  int embed_ = 0, final_norm_ = 0, head_ = 0;
  bool check_finite_;
  uint64_t max_shard_bytes_;
  std::unique_ptr<MlpStrategy> whole_mlp_ = make_whole_mlp();  // for callers whose StepContext names no MLP
};

// "5GB", "200KB", "1MiB", as transformers' max_shard_size: KB/MB/GB are powers of 1000, KiB/MiB/GiB of
// 1024, a bare number is bytes.
uint64_t parse_size(const ConfigView& cfg, const std::string& key, const std::string& text) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    cfg.fail(key, str("'", text, "' is not a size"), "e.g. \"5GB\", \"500MB\", \"1MiB\"");
  }
  std::string unit = text.substr(used);
  unit.erase(0, unit.find_first_not_of(' '));
  static const std::pair<const char*, double> units[] = {{"", 1},     {"B", 1},          {"KB", 1e3},
                                                         {"MB", 1e6}, {"GB", 1e9},       {"KiB", 1024.0},
                                                         {"MiB", 1048576.0}, {"GiB", 1073741824.0}};
  for (const auto& [name, scale] : units)
    if (unit == name && value > 0) return static_cast<uint64_t>(value * scale);
  cfg.fail(key, str("'", text, "' is not a positive size"), "e.g. \"5GB\", \"500MB\", \"1MiB\"");
}

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  const bool check_finite = args.config.get_bool("check_finite", true);
  const uint64_t shard = parse_size(args.config, "max_shard_size", args.config.get_string("max_shard_size", "5GB"));
  return std::make_unique<Qwen3Model>(check_finite, shard);
}

}  // namespace
}  // namespace lcx::qwen3

LCX_PLUGIN(LCX_SLOT_MODEL, "qwen3", "0.1.0", "Qwen3 dense: exact forward/backward, HF checkpoints in and out",
           "ready", lcx::qwen3::create)
