// The decoder every family module builds (decoder_model.h), as transformers 5.17 computes its
// decoder layers (Qwen3DecoderLayer, LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer),
// with an explicit backward.
//
// One layer, x [T,H] -> y [T,H]:
//   h1 = rmsnorm(x) ; q,k,v = h1 @ Wq^T, Wk^T, Wv^T (+ bq, bk, bv where the family has biases)
//   q,k = rmsnorm per head (q_norm, k_norm, where the family has them) ; q,k = rotary(q,k) ; a = attention(q,k,v) through the Parallelism slot ; x1 = x + a @ Wo^T
//   h2 = rmsnorm(x1) ; y = x1 + (silu(h2 @ Wg^T) * (h2 @ Wu^T)) @ Wd^T
// The MLP (gate/up, silu * up, down) runs through the MLP slot (StepContext::mlp), which decides how
// many rows it works on at once. The attention half runs one head group at a time
// (attention_head_groups): a group of kv heads with the query heads GQA maps to them is
// self-contained, so its q, k, v, attention output and their gradients exist for one group only,
// and o_proj accumulates each group's columns. Backward recomputes the attention half from x (the
// only thing kept between forward and backward, by the MemoryStrategy slot) up to the MLP's input,
// lets the MLP slot recompute and differentiate its own half, then recomputes each group again for
// its attention backward (one group: the recompute's tensors serve, as nothing is cut; with
// attention_keep_outputs each group's output and LSE are kept from the recompute, so only its
// q, k, v are made again and no attention forward runs twice). With keep_attention (selective
// recompute) every group's output and LSE are kept from the forward through the memory strategy
// (MemoryStrategy::keep, so they may wait in host memory like the input): the backward rebuilds
// x1 from them with o_proj alone and no attention forward runs in it at all. Buffers
// go as soon as their last reader has run, so the layer's peak is the larger of two moments, the
// MLP's backward and one group's attention backward (plan_dense_decoder counts both). Parameter
// gradients are fp32 and accumulate across calls.
//
// Gemma 3 (Family::sandwich_norms, unit_offset_norms, scaled_embedding, GeGLU): every norm reads its
// weight as (1 + w), the embedding's rows are scaled by sqrt(H), and a layer is
//   x1 = x + rmsnorm_pa(attention(rmsnorm_in(x))) ; y = x1 + rmsnorm_pf(mlp(rmsnorm_pre(x1)))
// with gelu_tanh for silu. The backward recomputes the MLP's output (its norm's backward needs it)
// before the MLP slot's own backward, and holds the attention's output before its norm through
// the MLP's backward. Sliding layers see ModelConfig::sliding_window keys and may rotate with
// their own base (sliding_rope_parameters_json: tables built here from StepContext::positions).
#include <cmath>
#include <algorithm>
#include <limits>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <vector>

#include "lcx/comm.h"
#include "lcx/config.h"
#include "lcx/defaults.h"
#include "lcx/hf_config.h"
#include "lcx/log.h"
#include "lcx/ops.h"
#include "lcx/plan.h"
#include "lcx/plugin.h"
#include "lcx/safetensors.h"
#include "lcx/slots/adapter.h"
#include "lcx/slots/model.h"
#include "decoder_config.h"
#include "decoder_init.h"
#include "decoder_model.h"
#include "moe.h"
#include "moe_mxfp4.h"
#include "decoder_plan.h"

namespace lcx::decoder {
namespace {

namespace fs = std::filesystem;

// The keys of the choices this module leaves to the plan under "auto", and its knobs' names.
constexpr const char* kKeepAttention = "keep_attention";
constexpr const char* kHeadGroups = "attention_head_groups";
constexpr const char* kMoeTileRows = "moe_tile_rows";

void fill_ones(Tensor& t) {
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) switch (t.dtype()) {
      case DType::f32: t.data_as<float>()[i] = 1.f; break;
      case DType::bf16: t.data_as<bf16>()[i] = float_to_bf16(1.f); break;
      default: t.data_as<f16>()[i] = float_to_f16(1.f); break;
    }
}

struct LayerParams {
  int index;  // the layer's number
  int input_norm, q, k, v, o, post_norm;
  int q_norm = -1, k_norm = -1;            // Qwen3's per-head norms
  int q_bias = -1, k_bias = -1, v_bias = -1;  // Qwen2's projection biases
  int o_bias = -1;                            // GPT-OSS's (with q, k, v's)
  int sinks = -1;                             // GPT-OSS's attention sinks [num_heads]
  int64_t window = 0;                         // a sliding_attention layer's window; 0: full
  bool own_rope = false;  // rotates with the sliding layers' tables (sliding_rope_parameters_json)
  // Gemma's sandwich: the norms of the attention's and of the MLP's outputs before their residuals
  // (post_attention_layernorm, post_feedforward_layernorm); post_norm is then the MLP's input norm
  // (pre_feedforward_layernorm).
  int attn_out_norm = -1, mlp_out_norm = -1;
  int gate = -1, up = -1, down = -1;  // the dense MLP's
  // A sparse layer's router [E,H] and every expert's gate, up [E,I,H] and down [E,H,I] stacked.
  bool sparse = false;
  int router = -1, experts_gate = -1, experts_up = -1, experts_down = -1;
  // The fused layout's (ExpertsLayout::fused): the router's bias, gate_up [E,H,2I] and the biases.
  int router_bias = -1, experts_gate_up = -1, experts_gate_up_bias = -1, experts_down_bias = -1;
};

// Whether a parameter is a sparse layer's stacked experts ("model.layers.3.mlp.experts.gate_proj.weight").
bool is_experts(const std::string& name) { return name.find(".mlp.experts.") != std::string::npos; }

// A stacked experts' parameter name ("model.layers.3.mlp.experts.gate_proj.weight") and the name
// of expert e's slice in a Hugging Face checkpoint ("model.layers.3.mlp.experts.5.gate_proj.weight").
std::string expert_name(const std::string& stacked, int64_t e) {
  const std::string marker = ".experts.";
  const size_t at = stacked.find(marker) + marker.size();
  return str(stacked.substr(0, at), e, ".", stacked.substr(at));
}

// One head group: query heads [q0, q0 + nq) and the kv heads [kv0, kv0 + nkv) they read.
struct HeadGroup {
  int64_t q0, nq, kv0, nkv;
};

// One head group's attention tensors, from its projections to its output.
struct GroupActs {
  Tensor q, k, v;         // projections [T,nq*d], [T,nkv*d], [T,nkv*d]
  Tensor qr, kr;          // per-head norm then rotary [T,nq,d], [T,nkv,d]
  Tensor rstd_q, rstd_k;  // fp32 [T*nq], [T*nkv]
  Tensor attn, lse;       // [T,nq,d], fp32 [nq,T]
};

// The Adapter slot's factors for one layer's attention half (null where a projection is not
// adapted) and the products the layer reuses: u^T = A h1^T of q, k and v stacked by rows [sum r, T]
// (one GEMM where the provider stacks their A's; shared by every head group, whose rows of B each
// group adds), and attn @ Ao^T [T, r] summed over the groups in fp32.
struct AttnLora {
  const LowRank *q = nullptr, *k = nullptr, *v = nullptr, *o = nullptr;
  std::vector<const LowRank*> in;  // q, k, v's adapted factors, in that order
  Tensor ut, uo;
  Tensor rows;  // StepContext::rows: the dropout masks' row indices
  // lr's rows of a tensor stacked as ut is.
  Tensor block(const Tensor& stacked, const LowRank* lr) const {
    const size_t i = static_cast<size_t>(std::find(in.begin(), in.end(), lr) - in.begin());
    return lowrank_block(stacked, in, i);
  }
};

class DecoderModel final : public Model {
 public:
  // head_groups: 0 for "auto" (one kv head per group on a single rank, see groups_for()).
  // keep_attention: -1 for "auto" (the recipe's choice), else 0 or 1.
  // moe_tile_rows: 0 for "auto" (the recipe's, else every token at once).
  // ep, ep_index: the expert-parallel group's size and this rank's place in it (the experts it holds).
  DecoderModel(Family family, bool check_finite, uint64_t max_shard_bytes, int64_t head_groups, bool keep_outputs,
               int keep_attention, int64_t moe_tile_rows, std::string table, int ep, int ep_index)
      : family_(std::move(family)), check_finite_(check_finite), max_shard_bytes_(max_shard_bytes), head_groups_(head_groups),
        keep_outputs_(keep_outputs), keep_attention_(keep_attention), moe_tile_rows_(moe_tile_rows),
        table_(std::move(table)), ep_(ep), ep_index_(ep_index) {}

  void load_hf(const std::string& dir, Device device, DType dtype) override {
    HfConfig hc = HfConfig::load(dir);
    ModelConfig cfg = family_.from_hf(hc);
    layout_ = family_.experts_layout ? family_.experts_layout(hc) : ExpertsLayout{};
    safetensors::Checkpoint ck = safetensors::Checkpoint::open(dir);
    build(cfg, device, dtype);
    // Refuse what does not belong before converting anything: a wrong folder fails in a second.
    const std::vector<safetensors::NamedTensor> entries = checkpoint_entries();
    std::set<std::string> expected;
    for (const auto& e : entries) expected.insert(e.name);
    // Under expert parallelism the other ranks' experts belong to the checkpoint too; this rank reads only its own.
    for (const auto& p : params_)
      if (is_experts(p.name) && !layout_.fused)
        for (int64_t e = 0; e < moe(cfg_).num_experts; ++e) expected.insert(expert_name(p.name, e));
    // MXFP4 experts: their blocks and scales stand in for the weights.
    for (const auto& p : params_)
      if (mxfp4_stored(p.name)) {
        expected.erase(p.name);
        expected.insert(p.name + "_blocks");
        expected.insert(p.name + "_scales");
      }
    // The stored name of each parameter (the family may store them under other names) and the
    // tensors the family leaves unread.
    std::map<std::string, std::string> stored_as;
    int64_t unread = 0;
    for (const auto& stored : ck.names()) {
      const std::string name = family_.checkpoint_name ? family_.checkpoint_name(stored) : stored;
      if (name.empty()) {
        ++unread;
        continue;
      }
      stored_as[name] = stored;
      if (expected.count(name)) continue;
      if (name == "lm_head.weight" && cfg_.tie_word_embeddings) continue;  // redundant copy of a tied head
      if (name.size() > 20 && name.substr(name.size() - 20) == ".rotary_emb.inv_freq") continue;  // old buffers
      throw Error(str(ck.file_of(stored), ": tensor '", stored, "' is unexpected in a ", cfg_.model_type, " checkpoint with ",
                      cfg_.num_layers, " layers", cfg_.tie_word_embeddings ? " and a tied head" : "",
                      moe(cfg_).num_experts > 0 ? str(", ", sparse_layers(cfg_), " of them sparse with ", moe(cfg_).num_experts, " experts") : ""),
                  {}, "check that config.json belongs to these weights");
    }
    std::vector<safetensors::LoadTarget> targets;
    std::vector<safetensors::NamedTensor> by_hand;  // dequantized, or this rank's rows of a whole tensor
    uint64_t stored = 0;  // bytes read
    for (const auto& p : entries) {
      if (mxfp4_stored(p.name) || (layout_.fused && is_experts(p.name) && p.value.size(0) != moe(cfg_).num_experts)) {
        by_hand.push_back(p);
        continue;
      }
      const auto at = stored_as.find(p.name);
      if (at == stored_as.end())
        throw Error(str(ck.path(), ": tensor '", p.name, "' is missing"), {},
                    p.name == "lm_head.weight" ? "an untied model needs lm_head.weight, or set tie_word_embeddings"
                                               : "the checkpoint is incomplete or belongs to another config");
      const std::string& name = at->second;
      const auto& info = ck.info(name);
      if (info.shape != p.value.shape())
        throw Error(str(ck.file_of(name), ": tensor '", name, "' has shape ", shape_str(info.shape), " but config.json implies ",
                        shape_str(p.value.shape())));
      targets.push_back({name, p.value});
      stored += info.end - info.begin;
    }
    if (unread > 0)
      log::info(str(family_.name, ": ", unread, " tensors of ", dir, " are not the language model's (a vision tower) "
                    "and are left unread; a save writes the language model alone"));
    const auto start = std::chrono::steady_clock::now();
    safetensors::LoadOptions opt;
    opt.check_finite = check_finite_;
    opt.progress = true;
    ck.load_into(targets, opt);
    for (auto& p : by_hand) load_experts_by_hand(ck, p);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    char took[64];
    std::snprintf(took, sizeof took, "%.1f s (%.2f GB/s)", s, s > 0 ? static_cast<double>(stored) / 1e9 / s : 0.0);
    log::info(str(family_.name, ": loaded ", dir, " (", cfg_.num_layers, " layers, hidden ", cfg_.hidden_size, ", ",
                  parameter_count(), " parameters, ", dtype_name(dtype), ") in ", took,
                  check_finite_ ? ", every weight checked finite" : ", finite check off"));
  }

  ModelConfig describe(const std::string& spec) const override {
    std::error_code ec;  // an init spec is JSON text, often longer than a path may be
    ModelConfig c;
    ExpertsLayout layout;
    if (std::filesystem::is_directory(spec, ec) || std::filesystem::path(spec).filename() == "config.json") {
      const HfConfig hc = HfConfig::load(spec);
      c = family_.from_hf(hc);
      if (family_.experts_layout) layout = family_.experts_layout(hc);
    } else {
      c = family_.from_spec(spec, nullptr);
      if (family_.experts_layout) layout = spec_layout(spec);
    }
    c.linear_modules = linear_modules(c, family_, layout);
    c.mlp_slot_layers = c.num_layers - sparse_layers(c);
    c.parameters = parameter_sizes(c, layout);
    return c;
  }
  // The experts' layout an init spec gives (its JSON keys; a preset name: the family's default).
  ExpertsLayout spec_layout(const std::string& spec) const {
    const auto first = spec.find_first_not_of(" \t\n");
    const bool json = first != std::string::npos && spec[first] == '{';
    ExpertsLayout layout = family_.experts_layout(HfConfig::parse(json ? spec : "{}", "model init spec"));
    layout.mxfp4 = false;
    return layout;
  }

  void init_random(const std::string& spec, uint64_t seed, Device device, DType dtype) override {
    double std = 0.02;
    ModelConfig cfg = family_.from_spec(spec, &std);
    if (family_.experts_layout) layout_ = spec_layout(spec);
    build(cfg, device, dtype);
    // transformers' _init_weights: Linear and Embedding ~ N(0, initializer_range), RMSNorm = 1
    // (its weight 0 where read as 1 + w), attention sinks ~ N(0, initializer_range) (GptOssAttention).
    for (auto& p : params_) {
      // An expert-parallel rank's experts are its rows of the whole layer's draw, so every ep
      // starts from the weights one rank would (the draw is per parameter, not per expert).
      Shape shape = p.value.shape();
      const bool slice = is_experts(p.name) && ep_ > 1;
      if (slice) shape[0] = moe(cfg).num_experts;
      Tensor host = Tensor::empty(shape, dtype, Device::cpu(), MemoryCategory::weights);
      const bool sinks = p.name.ends_with(".self_attn.sinks");
      if (p.value.dim() == 1 && !sinks && family_.unit_offset_norms)
        host.zero();  // (1 + w) norms start at w = 0, as transformers' Gemma3RMSNorm
      else if (p.value.dim() == 1 && !sinks)
        fill_ones(host);
      else
        fill_normal(host, init_key(seed, p.name), std);
      if (slice) {
        Tensor mine = Tensor::empty(p.value.shape(), dtype, Device::cpu(), MemoryCategory::weights);
        mine.copy_from(host.rows(first_expert_, first_expert_ + p.value.size(0)));
        host = mine;
      }
      p.value = device.is_cuda() ? host.to(device) : host;
    }
  }

  void save_hf(const std::string& dir, DType dtype, const std::string& rope_parameters_json) const override {
    fs::create_directories(dir);
    safetensors::write_checkpoint(dir, checkpoint_entries(), dtype, max_shard_bytes_);
    const std::string path = (fs::path(dir) / "config.json").string();
    std::ofstream out(path);
    out << (family_.to_json_with_experts ? family_.to_json_with_experts(cfg_, layout_, rope_parameters_json, dtype)
                                         : family_.to_json(cfg_, rope_parameters_json, dtype));
    if (!out) throw Error(str(path, ": write failed"));
  }

  const ModelConfig& config() const override { return cfg_; }

  std::vector<Parameter*> parameters() override {
    std::vector<Parameter*> out;
    for (auto& p : params_) out.push_back(&p);
    return out;
  }

  void zero_grad() override {
    for (auto& p : params_)
      if (p.grad.defined())
        p.grad.zero();
      else if (!p.frozen)
        p.grad = Tensor::zeros(p.value.shape(), DType::f32, p.value.device(), MemoryCategory::gradients);
  }

  void embed_forward(const Tensor& tokens, Tensor& x) override {
    ops::embedding_forward(tokens, W(embed_), x);
    if (family_.scaled_embedding) ops::scale_inplace(x, embed_scale());
    begin_pass(x);
  }

  void embed_backward(const Tensor& tokens, const Tensor& dx) override {
    if (!trains(embed_)) return;
    if (!family_.scaled_embedding) return ops::embedding_backward(tokens, dx, G(embed_));
    Tensor scaled = act(dx.shape(), dx);
    ops::cast(dx, scaled);
    ops::scale_inplace(scaled, embed_scale());
    ops::embedding_backward(tokens, scaled, G(embed_));
  }

  void layer_forward(int layer, const Tensor& x, Tensor& y, StepContext& ctx) override {
    const LayerParams& L = checked_layer(layer, ctx);
    Tensor x1;
    {
      Tensor rstd1;
      const Tensor h1 = input_norm(L, x, rstd1);
      std::vector<GroupActs> kept;
      const bool keep = keeps_attention(ctx);
      AttnLora lo = attn_lora(L, ctx, h1);
      x1 = attention_out(L, h1, ctx, groups_for(ctx), keep ? &kept : nullptr, true, lo);
      for (GroupActs& a : kept) {
        ctx.memory->keep(layer, a.attn);
        ctx.memory->keep(layer, a.lse);
      }
    }
    if (L.attn_out_norm >= 0) {
      Tensor rstd;
      x1 = normed(L.attn_out_norm, x1, rstd);
    }
    ops::add(x, x1, x1);  // x1 = x + o, in o's buffer
    Tensor rstd2;
    Tensor h2 = post_norm(L, x1, rstd2);
    if (L.sparse) {
      std::vector<int64_t> load(static_cast<size_t>(moe(cfg_).num_experts), 0);
      for (const auto& [t0, t1] : moe_tiles(h2.size(0), ctx)) {
        const Tensor h = h2.rows(t0, t1);
        Tensor out = y.rows(t0, t1);
        const MoeRouting r = route(L, h, ctx);
        if (pass_.open) count_pass(r, ctx, load);
        moe_forward(h, moe_weights(L), r, out, experts(ctx), moe_lora(L, ctx));
      }
      if (pass_.open) end_layer_count(load);
    } else {
      mlp(ctx).forward(h2, mlp_weights(L, ctx), y);
    }
    h2 = Tensor();
    if (L.mlp_out_norm >= 0) {
      Tensor rstd;
      const Tensor m = normed(L.mlp_out_norm, y, rstd);
      return ops::add(x1, m, y);
    }
    ops::add(x1, y, y);
  }

  void layer_backward(int layer, const Tensor& x, const Tensor& dy, Tensor& dx, StepContext& ctx) override {
    const LayerParams& L = checked_layer(layer, ctx);
    const int64_t T = x.size(0), d = cfg_.head_dim;
    const int64_t groups = groups_for(ctx);
    // Recompute up to the MLP's input: from the outputs kept in the forward (o_proj only), or
    // through the attention. Recomputed with one group, its tensors serve the attention backward;
    // with attention_keep_outputs every group's output and LSE do.
    std::vector<GroupActs> kept;
    const bool from_forward = keeps_attention(ctx);
    AttnLora lo = attn_lora(L, ctx, Tensor());
    Tensor x1;
    if (from_forward) {
      const std::vector<Tensor> outputs = ctx.memory->kept(layer);
      LCX_CHECK(static_cast<int64_t>(outputs.size()) == 2 * groups, family_.name, ": layer ", layer, " kept ", outputs.size(),
                " tensors, its ", groups, " head groups need ", 2 * groups);
      for (int64_t g = 0; g < groups; ++g)
        kept.push_back(GroupActs{.attn = outputs[static_cast<size_t>(2 * g)], .lse = outputs[static_cast<size_t>(2 * g + 1)]});
      x1 = act({T, cfg_.hidden_size}, x);
      for (int64_t g = 0; g < groups; ++g)
        project_out(L, head_group(g, groups), kept[static_cast<size_t>(g)].attn, x1, g, lo);
      finish_o(L, lo, x1);
    } else {
      Tensor rstd1;
      const Tensor h1 = input_norm(L, x, rstd1);
      adapter_inputs(lo, h1);
      x1 = attention_out(L, h1, ctx, groups, groups == 1 || keep_outputs_ ? &kept : nullptr, false, lo);
    }
    // Sandwich: the attention's output o before its norm, held for that norm's backward.
    Tensor o_raw, rstd_o;
    if (L.attn_out_norm >= 0) {
      o_raw = x1;
      x1 = normed(L.attn_out_norm, o_raw, rstd_o);
    }
    ops::add(x, x1, x1);
    Tensor rstd2;
    Tensor h2 = post_norm(L, x1, rstd2);

    // MLP: y = x1 + mlp(h2), or x1 + norm(mlp(h2)) whose backward needs mlp(h2) again. dx holds
    // dh2 until the attention's backward needs it for dh1.
    if (L.mlp_out_norm >= 0) {
      Tensor m = act({T, cfg_.hidden_size}, x);
      mlp(ctx).forward(h2, mlp_weights(L, ctx), m);
      Tensor rstd_m;
      normed(L.mlp_out_norm, m, rstd_m);
      Tensor dm = act({T, cfg_.hidden_size}, x);
      norm_backward(L.mlp_out_norm, m, rstd_m, dy, dm);
      m = Tensor();
      mlp_backward(L, h2, dm, dx, ctx);
    } else {
      mlp_backward(L, h2, dy, dx, ctx);
    }
    h2 = Tensor();
    // dx1 = dy (the residual path) + the post-norm's backward of dh2, written over dy: the caller
    // drops dy after this call (Model::layer_backward), so the attention's backward holds one
    // [T,H] less.
    Tensor dx1 = dy;
    {
      Tensor dn = act({T, cfg_.hidden_size}, x);
      norm_backward(L.post_norm, x1, rstd2, dx, dn);
      x1 = Tensor();
      ops::add(dx1, dn, dx1);
    }
    if (L.o_bias >= 0 && trains(L.o_bias)) {  // db_o += dx1^T 1
      Tensor gb = G(L.o_bias).view({cfg_.hidden_size, 1});
      ops::matmul(dx1, true, ones(T, dx1), false, gb, 1.f, 1.f);
    }
    rstd2 = Tensor();
    // The gradient of the attention's output: dx1, or through the sandwich's norm of it.
    Tensor dout = dx1;
    if (L.attn_out_norm >= 0) {
      dout = act({T, cfg_.hidden_size}, x);
      norm_backward(L.attn_out_norm, o_raw, rstd_o, dx1, dout);
      o_raw = rstd_o = Tensor();
    }

    // Attention: x1 = x + sum over groups of attn_g @ Wo[:, group's columns]^T. h1 is recomputed
    // (the same bits) rather than held through the MLP; dh1 accumulates in dx.
    Tensor rstd1;
    Tensor h1 = input_norm(L, x, rstd1);
    adapter_inputs(lo, h1);
    // o_proj's adapter: go = scale * dx1 @ Bo feeds each group's dattn through its columns of Ao.
    Tensor go;
    if (lo.o) {
      go = act({T, lo.o->rank()}, x);
      ops::matmul(dout, false, lo.o->b->value, false, go, lo.o->scale);
      if (!lo.o->b->frozen) {
        Tensor uo = act(go.shape(), x);
        ops::cast(lo.uo, uo);
        ops::matmul(dout, true, uo, false, lo.o->b->grad, lo.o->scale, 1.f);
      }
      lo.uo = Tensor();
    }
    // q/k/v's adapters: g^T = scale * Bq^T dq^T (and k, v) summed over the groups in fp32, stacked
    // as u^T is, then dx and the A's gradients after the loop (one GEMM each where stacked).
    Tensor gt32;
    for (int64_t g = 0; g < groups; ++g) {
      const HeadGroup hg = head_group(g, groups);
      GroupActs a;
      if (groups == 1 && !from_forward) {
        a = std::move(kept[0]);
      } else if (keep_outputs_ || from_forward) {
        a = group_inputs(L, h1, hg, ctx, lo);
        a.attn = std::move(kept[static_cast<size_t>(g)].attn);
        a.lse = std::move(kept[static_cast<size_t>(g)].lse);
      } else {
        a = group_forward(L, h1, hg, ctx, lo);
      }
      Tensor dattn = act({T, hg.nq, d}, x);
      {
        Tensor dattn2 = dattn.view({T, hg.nq * d});
        ops::matmul(dout, false, o_columns(W(L.o), hg), false, dattn2);
        if (lo.o && !lo.o->dropping()) {
          ops::matmul(go, false, o_columns(lo.o->a->value, hg), false, dattn2, 1.f, 1.f);
          if (!lo.o->a->frozen) accumulate_columns(lo.o->a->grad, hg, go, a.attn.view({T, hg.nq * d}), 1.f);
        } else if (lo.o) {  // through the mask: go @ Ao's columns dropped onto dattn, A's gradient from the dropped input
          Tensor buffer = act({T, hg.nq * d}, x);
          ops::matmul(go, false, o_columns(lo.o->a->value, hg), false, buffer);
          ops::dropout(buffer, lo.o->dropout, lo.o->dropout_key(), lo.rows, hg.q0 * d, dattn2, 1.f);
          if (!lo.o->a->frozen)
            accumulate_columns(lo.o->a->grad, hg, go, o_lora_input(lo, hg, a.attn.view({T, hg.nq * d}), buffer), 1.f);
        }
      }
      if (trains(L.o)) accumulate_columns(G(L.o), hg, dout, a.attn.view({T, hg.nq * d}), 1.f);
      Tensor dq = act({T, hg.nq, d}, x), dk = act({T, hg.nkv, d}, x), dv = act({T, hg.nkv, d}, x);
      // a.attn and a.lse carry the sinks (group_forward): the plain backward is then exact for q, k, v.
      if (L.sinks >= 0 && trains(L.sinks))
        ops::attention_sinks_backward(a.attn, a.lse, dattn, W(L.sinks), hg.q0, G(L.sinks));
      // A Parallelism may hold its forward's output and LSE for the backward, known by the tensors'
      // identity (sp_ulysses' head-sharded copies); the sinks changed both after that forward, so
      // it is handed a copy of the output and takes them anew.
      const Tensor attn = L.sinks >= 0 ? a.attn.clone() : a.attn;
      ctx.parallel->attention_backward(a.qr, a.kr, a.v.view({T, hg.nkv, d}), attn, a.lse, dattn, dq, dk, dv,
                                       args(ctx, L));
      dattn = Tensor();
      a.attn = a.lse = a.qr = a.kr = Tensor();
      const RopeTables& rope = rope_for(L, ctx);
      ops::rotary_backward(dq, rope.cos, rope.sin);
      ops::rotary_backward(dk, rope.cos, rope.sin);
      Tensor dq_raw, dk_raw;
      if (L.q_norm < 0) {
        dq_raw = dq.view({T * hg.nq, d});
        dk_raw = dk.view({T * hg.nkv, d});
        dq = a.q = dk = a.k = Tensor();
      } else {
        dq_raw = act({T * hg.nq, d}, x);
        norm_backward(L.q_norm, a.q.view({T * hg.nq, d}), a.rstd_q, dq.view({T * hg.nq, d}), dq_raw);
        dq = a.q = a.rstd_q = Tensor();
        dk_raw = act({T * hg.nkv, d}, x);
        norm_backward(L.k_norm, a.k.view({T * hg.nkv, d}), a.rstd_k, dk.view({T * hg.nkv, d}), dk_raw);
        dk = a.k = a.rstd_k = Tensor();
      }
      const Tensor dq2 = dq_raw.view({T, hg.nq * d}), dk2 = dk_raw.view({T, hg.nkv * d}),
                   dv2 = dv.view({T, hg.nkv * d});
      projections_backward(L, hg, g, h1, dq2, dk2, dv2, dx, lo, gt32);
    }
    if (!lo.in.empty()) {
      lo.ut = Tensor();
      Tensor gt = act(gt32.shape(), h1);
      ops::cast(gt32, gt);
      gt32 = Tensor();
      lowrank_input_backward(h1, gt, lo.in, dx, 1.f, lo.rows);
    }
    h1 = Tensor();
    Tensor dxn = act({T, cfg_.hidden_size}, x);
    norm_backward(L.input_norm, x, rstd1, dx, dxn);
    ops::add(dxn, dx1, dx);
  }

  // A sparse layer's or the MLP slot's backward from h2: dh2 into dx, the weights' gradients.
  void mlp_backward(const LayerParams& L, const Tensor& h2, const Tensor& dy, Tensor& dx, StepContext& ctx) {
    if (L.sparse) {
      MoeWeights grads = moe_grads(L);
      const Tensor aux = aux_grad(ctx, dy);
      for (const auto& [t0, t1] : moe_tiles(h2.size(0), ctx)) {
        const Tensor h = h2.rows(t0, t1);
        Tensor dh = dx.rows(t0, t1);
        const MoeRouting r = route(L, h, ctx);
        moe_backward(h, moe_weights(L), r, moe(cfg_).norm_topk_prob, dy.rows(t0, t1), aux.defined() ? &aux : nullptr, dh,
                     grads, experts(ctx), moe_lora(L, ctx));
      }
      return;
    }
    MlpWeights grads{G(L.gate), G(L.up), G(L.down)};
    mlp(ctx).backward(h2, mlp_weights(L, ctx), dy, dx, grads);
  }

  // Group g's q/k/v projections backward from the gradients of their outputs [T, rows]: the
  // weights' (and biases') gradients over the group's rows, dh1 into dx (written by group 0,
  // accumulated by the others), and the group's share of the adapters' backward.
  void projections_backward(const LayerParams& L, const HeadGroup& hg, int64_t g, const Tensor& h1, const Tensor& dq2,
                            const Tensor& dk2, const Tensor& dv2, Tensor& dx, const AttnLora& lo, Tensor& gt32) {
    if (trains(L.q)) {
      Tensor gq = q_rows(G(L.q), hg);
      ops::matmul(dq2, true, h1, false, gq, 1.f, 1.f);
    }
    if (trains(L.k)) {
      Tensor gk = kv_rows(G(L.k), hg);
      ops::matmul(dk2, true, h1, false, gk, 1.f, 1.f);
    }
    if (trains(L.v)) {
      Tensor gv = kv_rows(G(L.v), hg);
      ops::matmul(dv2, true, h1, false, gv, 1.f, 1.f);
    }
    if (L.q_bias >= 0) {  // db += dy^T 1
      const Tensor one = ones(h1.size(0), h1);
      auto bias_grad = [&](int i, const Tensor& dy2, bool q) {
        if (!trains(i)) return;
        Tensor gb = G(i).view({G(i).numel(), 1});
        gb = q ? q_rows(gb, hg) : kv_rows(gb, hg);
        ops::matmul(dy2, true, one, false, gb, 1.f, 1.f);
      };
      bias_grad(L.q_bias, dq2, true);
      bias_grad(L.k_bias, dk2, false);
      bias_grad(L.v_bias, dv2, false);
    }
    ops::matmul(dq2, false, q_rows(W(L.q), hg), false, dx, 1.f, g == 0 ? 0.f : 1.f);
    ops::matmul(dk2, false, kv_rows(W(L.k), hg), false, dx, 1.f, 1.f);
    ops::matmul(dv2, false, kv_rows(W(L.v), hg), false, dx, 1.f, 1.f);
    lowrank_group_backward(lo, lo.q, hg, true, dq2, gt32, g);
    lowrank_group_backward(lo, lo.k, hg, false, dk2, gt32, g);
    lowrank_group_backward(lo, lo.v, hg, false, dv2, gt32, g);
  }

  // The choices this module leaves to the plan where its keys are "auto": whether to keep each
  // layer's attention from the forward, and the head groups its attention half runs.
  std::vector<Knob> knobs(const PlanInputs& in) const override {
    std::vector<Knob> out;
    if (keep_attention_ < 0) {
      // Layers between checkpoints keep nothing (the step runs them without a memory strategy).
      const bool every_layer = in.recipe.checkpoint_every() == 1;
      Knob k;
      k.name = kKeepAttention;
      k.values = every_layer ? std::vector<int64_t>{1, 0} : std::vector<int64_t>{0};
      k.default_value = every_layer ? 1 : 0;
      k.boolean = true;
      k.means = "selective recompute: each layer's attention output and LSE kept from the forward, not recomputed";
      out.push_back(std::move(k));
    }
    // Under "auto", a sparse layer's tokens in tiles: larger tiles hold more of the experts' rows at
    // once and wait on the router less often; the largest that fits.
    if (moe_tile_rows_ == 0 && sparse_layers(in.model) > 0) {
      Knob k;
      k.name = kMoeTileRows;
      k.values = values_up_to({4096, 16384, 65536, std::numeric_limits<int64_t>::max()},
                              std::max<int64_t>(in.tokens_per_rank, 1));
      k.default_value = 0;  // every token at once
      k.search = KnobSearch::most_that_fits;
      k.means = "mixture of experts: tokens routed and run through the experts at once";
      out.push_back(std::move(k));
    }
    // A mesh that splits the heads across ranks runs them all at once: nothing to choose.
    if (head_groups_ == 0 && in.cp * in.sp == 1) {
      Knob k;
      k.name = kHeadGroups;
      for (int64_t g = 1; g <= std::max<int64_t>(1, in.model.num_kv_heads); g *= 2)
        if (in.model.num_kv_heads % g == 0) k.values.push_back(g);
      k.default_value = 0;  // one kv head per group
      k.means = "attention computed over groups of heads one after another (less memory, narrower projections)";
      out.push_back(std::move(k));
    }
    return out;
  }

  // Under expert parallelism, the experts a rank holds.
  std::string plan_summary(const PlanInputs& in) const override {
    const ModelConfig& m = in.model;
    if (in.ep <= 1 || sparse_layers(m) == 0) return {};
    return str("  experts: ", moe(m).num_experts / in.ep, " of ", moe(m).num_experts, " a rank (ep ", in.ep,
               "), their buffers for every token of the group's ranks on one rank's experts\n");
  }

  // The dense decoder's terms with this module's head groups (auto resolved as groups_for() does).
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    // Layers between checkpoints keep nothing (the step runs them without a memory strategy), so
    // kept attention would hold for the saved layers alone, a plan this module does not make.
    if (keep_attention_ == 1 && in.recipe.checkpoint_every() > 1)
      throw Error(str(table_, ".keep_attention = true does not combine with train.checkpoint_every = ",
                      in.recipe.checkpoint_every()),
                  str(table_, ".keep_attention"),
                  str("set ", table_, ".keep_attention = \"auto\" or false, or train.checkpoint_every = 1"));
    const int64_t tile = moe_tile_rows_ > 0 ? moe_tile_rows_ : in.recipe.get(table_, kMoeTileRows, 0);
    plan_dense_decoder(in, plan,
                       {resolve_groups(in.model.num_kv_heads, in.cp * in.sp == 1, in.recipe.get(table_, kHeadGroups, 0)),
                        keep_outputs_, keeps_attention(in.recipe)},
                       tile, {family_.qk_norm, family_.qkv_bias, family_.sinks, family_.sandwich_norms});
  }

  void final_norm_forward(const Tensor& x, Tensor& y) override {
    Tensor rstd = Tensor::empty({x.size(0)}, DType::f32, x.device());
    norm_forward(final_norm_, x, y, rstd);
    end_pass();
  }

  AuxLoss aux_loss() const override { return aux_; }

  void final_norm_backward(const Tensor& x, const Tensor& dy, Tensor& dx) override {
    Tensor rstd = Tensor::empty({x.size(0)}, DType::f32, x.device());
    Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
    norm_forward(final_norm_, x, y, rstd);
    norm_backward(final_norm_, x, rstd, dy, dx);
  }

  double step_flops(int64_t tokens, std::span<const int64_t> document_bounds) const override {
    return decoder_step_flops(cfg_, {family_.qk_norm, family_.qkv_bias, family_.sinks, family_.sandwich_norms}, tokens, document_bounds);
  }

  Tensor head_weight() override { return W(head_); }
  Tensor head_grad() override { return G(head_); }

 private:
  float eps() const { return static_cast<float>(cfg_.rms_norm_eps); }
  Tensor& W(int i) { return params_[static_cast<size_t>(i)].value; }
  Tensor& G(int i) { return params_[static_cast<size_t>(i)].grad; }
  bool trains(int i) const { return !params_[static_cast<size_t>(i)].frozen; }
  // A norm's weight gradient, or for a frozen norm a scratch tensor of its shape that the
  // backward's accumulation writes and nothing reads (the norm kernels always produce it).
  Tensor& norm_grad(int i) {
    if (trains(i)) return G(i);
    Tensor& t = norm_scratch_[W(i).numel()];
    if (!t.defined() || t.device() != W(i).device()) t = Tensor::zeros(W(i).shape(), DType::f32, W(i).device());
    return t;
  }
  const LowRank* lora(const StepContext& ctx, const LayerParams& L, Proj m) const {
    return ctx.adapter ? ctx.adapter->find(L.index, static_cast<int>(m)) : nullptr;
  }
  MlpWeights mlp_weights(const LayerParams& L, const StepContext& ctx) {
    return {W(L.gate), W(L.up), W(L.down), lora(ctx, L, Proj::gate_proj), lora(ctx, L, Proj::up_proj),
            lora(ctx, L, Proj::down_proj), ctx.rows, family_.activation};
  }
  // The layer's attention-half factors; with h1, also h1's products with q, k and v's A.
  AttnLora attn_lora(const LayerParams& L, const StepContext& ctx, const Tensor& h1) {
    AttnLora lo{lora(ctx, L, Proj::q_proj), lora(ctx, L, Proj::k_proj), lora(ctx, L, Proj::v_proj),
                lora(ctx, L, Proj::o_proj)};
    lo.rows = ctx.rows;
    for (const LowRank* lr : {lo.q, lo.k, lo.v})
      if (lr) lo.in.push_back(lr);
    if (h1.defined()) adapter_inputs(lo, h1);
    return lo;
  }
  void adapter_inputs(AttnLora& lo, const Tensor& h1) {
    if (!lo.in.empty() && !lo.ut.defined()) lo.ut = lowrank_inputs(h1, lo.in, lo.rows);
  }
  // One group's rows of a q/k/v adapter: dB's rows += scale * dy^T @ u, and its block of g^T (fp32
  // [r, T], summed over the groups) += scale * B's rows^T @ dy^T.
  void lowrank_group_backward(const AttnLora& lo, const LowRank* lr, const HeadGroup& hg, bool q, const Tensor& dy,
                              Tensor& gt32, int64_t group) {
    if (!lr) return;
    auto rows = [&](const Tensor& t) { return q ? q_rows(t, hg) : kv_rows(t, hg); };
    if (!lr->b->frozen) {
      Tensor gb = rows(lr->b->grad);
      ops::matmul(dy, true, lo.block(lo.ut, lr), true, gb, lr->scale, 1.f);
    }
    if (!gt32.defined()) gt32 = f32(lo.ut.shape(), dy);
    Tensor g = lo.block(gt32, lr);
    ops::matmul(rows(lr->b->value), true, dy, true, g, lr->scale, group == 0 ? 0.f : 1.f);
  }
  // After the last group: o_proj's bias (where the family has one), then its adapter's update.
  void finish_o(const LayerParams& L, AttnLora& lo, Tensor& o) {
    if (L.o_bias >= 0) ops::matmul(ones(o.size(0), o), false, W(L.o_bias).view({1, W(L.o_bias).numel()}), false, o, 1.f, 1.f);
    finish_o_lora(lo, o);
  }
  // o += scale * uo @ Bo^T, uo (attn @ Ao^T summed over the groups) rounded once.
  void finish_o_lora(AttnLora& lo, Tensor& o) {
    if (!lo.o) return;
    Tensor u = act(lo.uo.shape(), o);
    ops::cast(lo.uo, u);
    ops::matmul(u, false, lo.o->b->value, true, o, lo.o->scale, 1.f);
  }
  MlpStrategy& mlp(const StepContext& ctx) { return ctx.mlp ? *ctx.mlp : *whole_mlp_; }
  AttentionArgs args(const StepContext& ctx, const LayerParams& L) const {
    AttentionArgs a;
    a.scale = static_cast<float>(cfg_.attention_scale > 0 ? cfg_.attention_scale
                                                          : 1.0 / std::sqrt(static_cast<double>(cfg_.head_dim)));
    a.causal = true;
    a.documents = ctx.documents;
    a.window = L.window;
    return a;
  }
  // Gemma's embedding scale: sqrt(hidden_size) in fp32, rounded to the table's dtype, as
  // transformers' Gemma3TextScaledWordEmbedding multiplies.
  float embed_scale() const {
    const float s = static_cast<float>(std::sqrt(static_cast<double>(cfg_.hidden_size)));
    switch (params_[static_cast<size_t>(embed_)].value.dtype()) {
      case DType::bf16: return bf16_to_float(float_to_bf16(s));
      case DType::f16: return f16_to_float(float_to_f16(s));
      default: return s;
    }
  }
  // The rotary tables of layer L: the PositionalEncoding slot's, or for a sliding layer rotating
  // with its own base (Gemma 3's local 10000) the ones built here from the shard's positions, as
  // transformers computes them (fp32 position times fp32 inv_freq), once per shard.
  const RopeTables& rope_for(const LayerParams& L, const StepContext& ctx) {
    if (!L.own_rope) return *ctx.rope;
    if (!ctx.positions.defined())
      throw Error(str(family_.name, ": layer ", L.index, " rotates with the sliding layers' own base and needs the "
                      "shard's positions, which this caller's StepContext lacks"),
                  {}, "pass Shard::positions in StepContext::positions");
    const int64_t T = ctx.positions.numel();
    const int64_t* pos = ctx.positions.data_as<const int64_t>();
    if (own_rope_.cos.defined() && own_rope_.cos.device() == ctx.device && own_rope_positions_.size() == static_cast<size_t>(T) &&
        std::equal(own_rope_positions_.begin(), own_rope_positions_.end(), pos))
      return own_rope_;
    own_rope_positions_.assign(pos, pos + T);
    const int64_t half = static_cast<int64_t>(own_inv_freq_.size());
    Tensor cos = Tensor::empty({T, half}, DType::f32), sin = Tensor::empty({T, half}, DType::f32);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < half; ++i) {
        const float f = static_cast<float>(pos[t]) * own_inv_freq_[static_cast<size_t>(i)];
        cos.data_as<float>()[t * half + i] = std::cos(f);
        sin.data_as<float>()[t * half + i] = std::sin(f);
      }
    own_rope_.cos = ctx.device.is_cuda() ? cos.to(ctx.device) : cos;
    own_rope_.sin = ctx.device.is_cuda() ? sin.to(ctx.device) : sin;
    return own_rope_;
  }
  // Every tensor of a Hugging Face checkpoint of this model and the value it fills or is written
  // from: a parameter, or one expert's slice of a stacked experts' parameter.
  std::vector<safetensors::NamedTensor> checkpoint_entries() const {
    std::vector<safetensors::NamedTensor> out;
    for (const auto& p : params_) {
      if (p.name.find(".mlp.experts.") == std::string::npos || layout_.fused) {  // fused experts: whole tensors
        out.push_back({p.name, p.value});
        continue;
      }
      // This rank's experts under their Hub numbers: all of them without expert parallelism, or
      // where the run gathered the whole layer's around a save (Run::save).
      const int64_t first = p.value.size(0) == moe(cfg_).num_experts ? 0 : first_expert_;
      for (int64_t e = 0; e < p.value.size(0); ++e)
        out.push_back({expert_name(p.name, first + e), p.value.rows(e, e + 1).view({p.value.size(1), p.value.size(2)})});
    }
    return out;
  }

  // Mixture of experts. A sparse layer's routing, the same in its forward and its recompute.
  Tensor Wopt(int i) { return i >= 0 ? W(i) : Tensor(); }
  Tensor Gopt(int i) { return i >= 0 ? G(i) : Tensor(); }
  MoeWeights moe_weights(const LayerParams& L) {
    MoeWeights w{.router = W(L.router), .router_bias = Wopt(L.router_bias), .gate = Wopt(L.experts_gate),
                 .up = Wopt(L.experts_up), .down = W(L.experts_down), .gate_up = Wopt(L.experts_gate_up),
                 .gate_up_bias = Wopt(L.experts_gate_up_bias), .down_bias = Wopt(L.experts_down_bias)};
    w.alpha = layout_.swiglu_alpha;
    w.limit = layout_.swiglu_limit;
    return w;
  }
  MoeWeights moe_grads(const LayerParams& L) {
    return {.router = G(L.router), .router_bias = Gopt(L.router_bias), .gate = Gopt(L.experts_gate),
            .up = Gopt(L.experts_up), .down = G(L.experts_down), .gate_up = Gopt(L.experts_gate_up),
            .gate_up_bias = Gopt(L.experts_gate_up_bias), .down_bias = Gopt(L.experts_down_bias)};
  }
  // A fused experts' weight the checkpoint holds as MXFP4 blocks and scales.
  bool mxfp4_stored(const std::string& name) const {
    if (!layout_.mxfp4 || !is_experts(name)) return false;
    auto ends = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    return ends(".gate_up_proj") || ends(".down_proj");
  }
  // A fused experts' tensor this rank fills itself: dequantized from MXFP4, or its experts' rows of
  // the whole tensor (expert parallelism).
  void load_experts_by_hand(const safetensors::Checkpoint& ck, safetensors::NamedTensor& p) {
    const int64_t first = p.value.size(0) == moe(cfg_).num_experts ? 0 : first_expert_;
    if (mxfp4_stored(p.name)) {
      mxfp4_load_experts(ck, p.name, first, p.value, check_finite_);
      return;
    }
    const Tensor whole = ck.load(p.name, p.value.dtype(), Device::cpu(), check_finite_);
    if (whole.size(0) != moe(cfg_).num_experts)
      throw Error(str(ck.file_of(p.name), ": tensor '", p.name, "' holds ", whole.size(0), " experts, config.json says ",
                      moe(cfg_).num_experts));
    Tensor mine = Tensor::empty(p.value.shape(), p.value.dtype(), Device::cpu());
    mine.copy_from(whole.rows(first, first + p.value.size(0)));
    p.value.copy_from(mine);
  }
  // The experts' adapters (Adapter::find_experts); a sparse layer's MLP modules are experts
  // (LinearModule::experts), so an adapter answering find() for them is refused.
  MoeLora moe_lora(const LayerParams& L, const StepContext& ctx) const {
    if (!ctx.adapter) return {};
    auto find = [&](Proj m) { return ctx.adapter->find_experts(L.index, static_cast<int>(m)); };
    if (layout_.fused) return {find(Proj::gate_up_proj), nullptr, find(Proj::down_proj)};
    return {find(Proj::gate_proj), find(Proj::up_proj), find(Proj::down_proj)};
  }
  MoeRouting route(const LayerParams& L, const Tensor& h2, const StepContext& ctx) {
    for (const Proj m : {Proj::gate_proj, Proj::up_proj, Proj::down_proj, Proj::gate_up_proj})
      if (ctx.adapter && ctx.adapter->find(L.index, static_cast<int>(m)))
        throw Error(str(family_.name, ": layer ", L.index, " is sparse; its MLP modules are experts, adapted per expert (find_experts)"),
                    {}, "adapt the experts through Adapter::find_experts");
    return moe_route(h2, W(L.router), moe(cfg_).num_experts_per_tok, moe(cfg_).norm_topk_prob, Wopt(L.router_bias));
  }
  // The load-balancing loss over one forward pass, as transformers' load_balancing_loss_func with
  // no attention mask: the N = T x (sparse layers) rows of router probabilities p, the share f_e of
  // top-k picks each expert e took and its mean probability P_e,
  //   aux = E * sum_e f_e P_e,   f_e = count_e / N,   P_e = sum_n p[n,e] / N,
  // whose gradient with respect to p[n,e] is E * count_e / N^2 (the counts are not differentiated).
  // The counts come from the routings' offsets (on the host already); the probabilities' sums
  // stay on the device until the pass ends. Under cp or sp each rank routes its own tokens: the
  // sums (and N) are added over the sequence's ranks when the pass ends.
  struct Pass {
    bool open = false;
    int64_t rows = 0;              // N
    std::vector<double> counts;    // [E], summed over the pass's sparse layers
    Tensor prob_sum, ones;         // fp32 [1,E] and [T,1]
    int64_t min_load = 0, max_load = 0;
    Communicator* sequence = nullptr;  // the ranks sharing the sequence
  };
  void begin_pass(const Tensor& x) {
    pass_ = Pass{};
    if (moe(cfg_).num_experts <= 0) return;
    pass_.open = true;
    pass_.counts.assign(static_cast<size_t>(moe(cfg_).num_experts), 0.0);
    pass_.prob_sum = Tensor::zeros({1, moe(cfg_).num_experts}, DType::f32, x.device());
    Tensor ones = Tensor::empty({x.size(0), 1}, DType::f32, Device::cpu());
    for (int64_t i = 0; i < x.size(0); ++i) ones.data_as<float>()[i] = 1.f;
    pass_.ones = x.device().is_cuda() ? ones.to(x.device()) : ones;
    pass_.min_load = std::numeric_limits<int64_t>::max();
  }
  // One routing (a tile of a layer's tokens) into the pass's sums and the layer's load.
  void count_pass(const MoeRouting& r, const StepContext& ctx, std::vector<int64_t>& load) {
    pass_.sequence = ctx.sequence;
    const int64_t T = r.probs.size(0);
    pass_.rows += T;
    for (int64_t e = 0; e < moe(cfg_).num_experts; ++e) {
      const int64_t c = r.offsets[static_cast<size_t>(e + 1)] - r.offsets[static_cast<size_t>(e)];
      pass_.counts[static_cast<size_t>(e)] += static_cast<double>(c);
      load[static_cast<size_t>(e)] += c;
    }
    if (T == 0) return;
    Tensor ones = pass_.ones.rows(0, T);
    ops::matmul(ones, true, r.probs, false, pass_.prob_sum, 1.f, 1.f);  // [1,T] @ [T,E]
  }
  void end_layer_count(const std::vector<int64_t>& load) {
    for (int64_t c : load) {
      pass_.min_load = std::min(pass_.min_load, c);
      pass_.max_load = std::max(pass_.max_load, c);
    }
  }
  // The row ranges a sparse layer runs at once: every token, or tiles of the key's (or the
  // recipe's) rows. Routing is per token, so tiles give the same result; they bound the experts'
  // T*k-row buffers by the tile.
  std::vector<std::pair<int64_t, int64_t>> moe_tiles(int64_t T, const StepContext& ctx) const {
    const int64_t want = moe_tile_rows_ > 0 ? moe_tile_rows_ : ctx.recipe.get(table_, kMoeTileRows, 0);
    const int64_t rows = want > 0 ? std::min(want, T) : T;
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int64_t t = 0; t < T; t += std::max<int64_t>(rows, 1)) out.emplace_back(t, std::min(T, t + rows));
    // Every rank of an expert-parallel group takes part in every tile's exchanges, so all run as
    // many tiles as the one with the most (shards of other lengths, a dp rank's shorter sequence);
    // a rank past its tokens runs empty tiles, serving the others' rows to its experts.
    if (Communicator* group = experts(ctx)) {
      std::vector<double> tiles(static_cast<size_t>(group->size()), 0.0);
      tiles[static_cast<size_t>(group->rank())] = static_cast<double>(out.size());
      group->all_reduce(std::span<double>(tiles));
      const size_t most = static_cast<size_t>(*std::max_element(tiles.begin(), tiles.end()));
      while (out.size() < most) out.emplace_back(T, T);
    }
    return out;
  }
  // The expert-parallel group a sparse layer exchanges its rows through, or null where this rank
  // holds every expert; refused where the step's group is not the one the model was built for.
  Communicator* experts(const StepContext& ctx) const {
    if (ep_ <= 1) return nullptr;
    if (!ctx.partition || ctx.partition->size() != ep_ || ctx.partition->rank() != ep_index_)
      throw Error(str(family_.name, ": built as rank ", ep_index_, " of ", ep_, " expert-parallel ranks, but the step's group is ",
                      ctx.partition ? str("rank ", ctx.partition->rank(), " of ", ctx.partition->size()) : std::string("absent")),
                  "distributed.ep", "run the model on the mesh it was created for ([distributed] ep over that many ranks)");
    return ctx.partition;
  }
  void end_pass() {
    if (!pass_.open) return;
    pass_.open = false;
    aux_ = AuxLoss{};
    aux_.present = true;
    aux_.coef = moe(cfg_).output_router_logits ? moe(cfg_).router_aux_loss_coef : 0.0;
    if (pass_.rows == 0) return;
    const std::vector<float> probs = pass_.prob_sum.to_floats();
    std::vector<double> p(probs.begin(), probs.end());
    if (pass_.sequence && pass_.sequence->size() > 1) {
      std::vector<double> sums(pass_.counts);
      sums.insert(sums.end(), p.begin(), p.end());
      sums.push_back(static_cast<double>(pass_.rows));
      pass_.sequence->all_reduce(std::span<double>(sums));
      const size_t E = pass_.counts.size();
      std::copy(sums.begin(), sums.begin() + static_cast<std::ptrdiff_t>(E), pass_.counts.begin());
      std::copy(sums.begin() + static_cast<std::ptrdiff_t>(E), sums.begin() + static_cast<std::ptrdiff_t>(2 * E), p.begin());
      pass_.rows = static_cast<int64_t>(sums.back());
    }
    const double N = static_cast<double>(pass_.rows);
    double sum = 0;
    for (size_t e = 0; e < p.size(); ++e) sum += pass_.counts[e] / N * (p[e] / N);
    aux_.value = static_cast<double>(moe(cfg_).num_experts) * sum;
    // Rows an expert took, over layers and experts, and the busiest against the idlest (null when one
    // took nothing).
    const double lo = static_cast<double>(pass_.min_load), hi = static_cast<double>(pass_.max_load);
    aux_.stats = {{"expert_tokens_min", lo, AuxStat::Combine::min},
                  {"expert_tokens_max", hi, AuxStat::Combine::max},
                  {"expert_load_ratio", lo > 0 ? hi / lo : std::numeric_limits<double>::quiet_NaN(), AuxStat::Combine::max}};
    pass_.prob_sum = pass_.ones = Tensor();
  }
  // d(coef * aux)/dp[n,e] for this step's share (ctx.aux_weight); undefined when the loss does
  // not train.
  Tensor aux_grad(const StepContext& ctx, const Tensor& like) const {
    if (!moe(cfg_).output_router_logits || moe(cfg_).router_aux_loss_coef == 0 || pass_.rows == 0) return Tensor();
    const double N = static_cast<double>(pass_.rows), E = static_cast<double>(moe(cfg_).num_experts);
    std::vector<float> g(pass_.counts.size());
    for (size_t e = 0; e < g.size(); ++e)
      g[e] = static_cast<float>(ctx.aux_weight * moe(cfg_).router_aux_loss_coef * E * pass_.counts[e] / (N * N));
    return Tensor::from_floats(g, {moe(cfg_).num_experts}, DType::f32, like.device());
  }

  int64_t parameter_count() const {
    int64_t n = 0;
    for (const auto& p : params_) n += p.value.numel();
    return n;
  }

  // A parameter as the layer recipe declares it: its Hugging Face name and shape, whether its
  // gradient is a GEMM's, whether it is a sparse layer's stacked experts (reduced over the ranks
  // holding the same experts), and whether weight decay skips it although it is not 1-D (a bias).
  struct ParamSpec {
    std::string name;
    Shape shape;
    bool gemm = false, expert = false, no_decay = false;
  };
  struct Declared {
    std::vector<LayerParams> layers;
    int embed = -1, final_norm = -1, head = -1;
  };
  // Every parameter of the model in load order, each through add(ParamSpec) -> its index: build()
  // makes them, describe() lists them (ModelConfig::parameters) before any weight exists.
  template <class Add>
  Declared declare(const ModelConfig& cfg, const ExpertsLayout& layout, Add&& add) const {
    const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size, d = cfg.head_dim;
    const int64_t qd = cfg.num_heads * d, kvd = cfg.num_kv_heads * d;
    Declared out;
    out.embed = add({"model.embed_tokens.weight", {V, H}});
    for (int64_t l = 0; l < cfg.num_layers; ++l) {
      const std::string p = str("model.layers.", l, ".");
      LayerParams L;
      L.index = static_cast<int>(l);
      L.input_norm = add({p + "input_layernorm.weight", {H}});
      L.q = add({p + "self_attn.q_proj.weight", {qd, H}, true});
      L.k = add({p + "self_attn.k_proj.weight", {kvd, H}, true});
      L.v = add({p + "self_attn.v_proj.weight", {kvd, H}, true});
      L.o = add({p + "self_attn.o_proj.weight", {H, qd}, true});
      if (family_.o_bias) L.o_bias = add({p + "self_attn.o_proj.bias", {H}});
      if (family_.qkv_bias) {
        L.q_bias = add({p + "self_attn.q_proj.bias", {qd}});
        L.k_bias = add({p + "self_attn.k_proj.bias", {kvd}});
        L.v_bias = add({p + "self_attn.v_proj.bias", {kvd}});
      }
      if (family_.qk_norm) {
        L.q_norm = add({p + "self_attn.q_norm.weight", {d}});
        L.k_norm = add({p + "self_attn.k_norm.weight", {d}});
      }
      if (family_.sinks) L.sinks = add({p + "self_attn.sinks", {cfg.num_heads}});
      if (family_.sliding_window && cfg.layer_types[static_cast<size_t>(l)] == "sliding_attention") {
        if (cfg.sliding_window <= 0)
          throw Error(str(family_.name, ": layer ", l, " is sliding_attention but sliding_window is ", cfg.sliding_window),
                      "sliding_window", "set sliding_window in config.json to the layers' window (> 0)");
        L.window = cfg.sliding_window;
        L.own_rope = !own_inv_freq(cfg).empty();
      }
      if (family_.sandwich_norms) {
        L.attn_out_norm = add({p + "post_attention_layernorm.weight", {H}});
        L.post_norm = add({p + "pre_feedforward_layernorm.weight", {H}});
      } else {
        L.post_norm = add({p + "post_attention_layernorm.weight", {H}});
      }
      if (sparse(cfg, l)) {
        // The router stays whole (every rank routes its own tokens over every expert); the
        // experts are this rank's E/ep.
        const int64_t E = moe(cfg).num_experts, El = E / ep_, Im = moe(cfg).moe_intermediate_size;
        L.sparse = true;
        if (layout.fused) {
          L.router = add({p + "mlp.router.weight", {E, H}, true});
          L.router_bias = add({p + "mlp.router.bias", {E}, false, false, true});
          L.experts_gate_up = add({p + "mlp.experts.gate_up_proj", {El, H, 2 * Im}, true, true});
          L.experts_gate_up_bias = add({p + "mlp.experts.gate_up_proj_bias", {El, 2 * Im}, false, true, true});
          L.experts_down = add({p + "mlp.experts.down_proj", {El, Im, H}, true, true});
          L.experts_down_bias = add({p + "mlp.experts.down_proj_bias", {El, H}, false, true, true});
        } else {
          L.router = add({p + "mlp.gate.weight", {E, H}, true});
          L.experts_gate = add({p + "mlp.experts.gate_proj.weight", {El, Im, H}, true, true});
          L.experts_up = add({p + "mlp.experts.up_proj.weight", {El, Im, H}, true, true});
          L.experts_down = add({p + "mlp.experts.down_proj.weight", {El, H, Im}, true, true});
        }
      } else {
        L.gate = add({p + "mlp.gate_proj.weight", {I, H}, true});
        L.up = add({p + "mlp.up_proj.weight", {I, H}, true});
        L.down = add({p + "mlp.down_proj.weight", {H, I}, true});
      }
      if (family_.sandwich_norms) L.mlp_out_norm = add({p + "post_feedforward_layernorm.weight", {H}});
      out.layers.push_back(L);
    }
    out.final_norm = add({"model.norm.weight", {H}});
    out.head = cfg.tie_word_embeddings ? out.embed : add({"lm_head.weight", {V, H}});
    return out;
  }

  // The parameters' names and sizes, from the recipe without allocating them.
  std::vector<ParameterSize> parameter_sizes(const ModelConfig& cfg, const ExpertsLayout& layout) const {
    std::vector<ParameterSize> out;
    declare(cfg, layout, [&](const ParamSpec& spec) {
      int64_t n = 1;
      for (int64_t x : spec.shape) n *= x;
      out.push_back({spec.name, n, spec.gemm});
      return static_cast<int>(out.size() - 1);
    });
    return out;
  }

  // The parameter list in HF order, with zeroed fp32 grads and values to be filled.
  void build(const ModelConfig& cfg, Device device, DType dtype) {
    if (!is_floating(dtype)) throw Error(str(family_.name, ": weights must be a float dtype, not ", dtype_name(dtype)));
    resolve_groups(cfg.num_kv_heads, true, 0);  // an explicit count must divide the kv heads: refused before any weight
    if (ep_ > 1 && sparse_layers(cfg) == 0)
      throw Error(str("[distributed] ep = ", ep_, " but this ", cfg.model_type, " model has no experts to split"),
                  "distributed.ep", "set ep = 1 for a dense model");
    if (ep_ > 1 && moe(cfg).num_experts % ep_ != 0)
      throw Error(str("[distributed] ep = ", ep_, " does not divide the model's ", moe(cfg).num_experts, " experts"),
                  "distributed.ep", str("set ep to a divisor of ", moe(cfg).num_experts, " that divides the world size"));
    if (family_.sandwich_norms && sparse_layers(cfg) > 0)
      throw Error(str(family_.name, ": a mixture of experts under sandwich norms is not computed"), "num_experts",
                  "use a dense checkpoint");
    cfg_ = cfg;
    cfg_.linear_modules = linear_modules(cfg, family_, layout_);
    cfg_.mlp_slot_layers = cfg.num_layers - sparse_layers(cfg);
    cfg_.parameters = parameter_sizes(cfg, layout_);
    own_inv_freq_ = own_inv_freq(cfg);
    first_expert_ = ep_ > 1 ? ep_index_ * (moe(cfg).num_experts / ep_) : 0;
    params_.clear();
    auto add = [&](const ParamSpec& spec) {
      Parameter p;
      p.name = spec.name;
      p.gemm_grad = spec.gemm;
      p.value = Tensor::empty(spec.shape, dtype, device, MemoryCategory::weights);
      // No gradient yet: the run gives one to what it trains unsharded (Run::choose_grad_dtype),
      // after the adapter froze the base and ZeRO-3 took its shards, so a 30B model's fp32
      // gradients never sit beside its weights on a GPU that could not hold them.
      // Norms are not decayed, as transformers' Trainer does, nor any bias whatever its rank.
      p.decay = spec.shape.size() > 1 && !spec.no_decay;
      if (spec.expert) p.grad_group = ep_ > 1 ? GradGroup::partition_replicas : GradGroup::world;
      params_.push_back(std::move(p));
      return static_cast<int>(params_.size() - 1);
    };
    Declared d = declare(cfg, layout_, add);
    layers_ = std::move(d.layers);
    embed_ = d.embed;
    final_norm_ = d.final_norm;
    head_ = d.head;
    for (size_t l = 0; l < cfg.layer_types.size(); ++l)
      if (!computes(cfg.layer_types[l]))
        log::warn(str(family_.name, ": layer ", l, " is ", cfg.layer_types[l],
                      "; this module computes full causal attention only and will refuse to run it"));
  }

  // The sliding layers' own inv_freq where they rotate otherwise than the full ones (empty
  // otherwise): transformers' default rope with their rope_theta, 1 / theta ** (2i / d) in fp32.
  static std::vector<float> own_inv_freq(const ModelConfig& cfg) {
    if (cfg.sliding_rope_parameters_json.empty()) return {};
    const nlohmann::json j = nlohmann::json::parse(cfg.sliding_rope_parameters_json);
    const std::string type = j.value("rope_type", std::string("default"));
    if (type != "default" || !j.contains("rope_theta"))
      throw Error(str("the sliding layers' rope parameters ", cfg.sliding_rope_parameters_json,
                      " are not the default kind with a rope_theta"),
                  "rope_parameters.sliding_attention", "give them {\"rope_type\": \"default\", \"rope_theta\": ...}");
    const double theta = j.at("rope_theta").get<double>();
    const int64_t d = cfg.head_dim;
    std::vector<float> inv(static_cast<size_t>(d / 2));
    for (int64_t i = 0; i < d / 2; ++i)
      inv[static_cast<size_t>(i)] = static_cast<float>(
          1.0 / std::pow(theta, static_cast<double>(static_cast<float>(2 * i) / static_cast<float>(d))));
    return inv;
  }

  // Whether this family computes layers of `type`: full attention, and sliding windows where it has them.
  bool computes(const std::string& type) const {
    return type == "full_attention" || (family_.sliding_window && type == "sliding_attention");
  }

  const LayerParams& checked_layer(int layer, const StepContext& ctx) const {
    if (!computes(cfg_.layer_types[static_cast<size_t>(layer)]))
      throw Error(str(family_.name, ": layer ", layer, " is ", cfg_.layer_types[static_cast<size_t>(layer)],
                      ", which this module does not compute"),
                  "layer_types", "use a checkpoint with full attention in every layer (use_sliding_window false)");
    LCX_CHECK(ctx.rope && ctx.parallel, "layer_forward needs rope tables and a parallelism in its StepContext");
    return layers_.at(static_cast<size_t>(layer));
  }

  // The head groups of a run: as configured, or "auto": the recipe's count where the
  // Parallelism's attention takes any head subset (a single rank) and the count divides the kv
  // heads, else one kv head per group there, and one group otherwise, since a provider that splits
  // heads across ranks needs them all. The plan resolves the same way from the mesh (cp * sp == 1:
  // no provider shares the sequence).
  int64_t resolve_groups(int64_t kv_heads, bool any_heads, int64_t recipe_groups) const {
    if (head_groups_ == 0) {
      if (!any_heads) return 1;
      return recipe_groups > 0 && kv_heads % recipe_groups == 0 ? recipe_groups : kv_heads;
    }
    if (kv_heads % head_groups_ != 0)
      throw Error(str(table_, ".attention_head_groups = ", head_groups_, " does not divide the model's ", kv_heads,
                      " key/value heads"),
                  str(table_, ".attention_head_groups"), str("use \"auto\" or a divisor of ", kv_heads));
    return head_groups_;
  }
  int64_t groups_for(const StepContext& ctx) const {
    return resolve_groups(cfg_.num_kv_heads, ctx.parallel->attention_takes_head_groups(),
                          ctx.recipe.get(table_, kHeadGroups, 0));
  }
  // Whether a step of `recipe` keeps each layer's attention outputs from the forward: the key, or
  // the recipe's choice under "auto" where every layer's input is saved.
  bool keeps_attention(const Recipe& recipe) const {
    return keep_attention_ < 0 ? recipe.get(table_, kKeepAttention, 0) != 0 && recipe.checkpoint_every() == 1
                               : keep_attention_ == 1;
  }
  // ... and never without a memory strategy to hold them.
  bool keeps_attention(const StepContext& ctx) const { return ctx.memory && keeps_attention(ctx.recipe); }
  HeadGroup head_group(int64_t g, int64_t groups) const {
    const int64_t nq = cfg_.num_heads / groups, nkv = cfg_.num_kv_heads / groups;
    return {g * nq, nq, g * nkv, nkv};
  }
  // A group's rows of q_proj and of k_proj / v_proj (values or grads): contiguous views.
  Tensor q_rows(const Tensor& w, const HeadGroup& hg) const {
    return w.rows(hg.q0 * cfg_.head_dim, (hg.q0 + hg.nq) * cfg_.head_dim);
  }
  Tensor kv_rows(const Tensor& w, const HeadGroup& hg) const {
    return w.rows(hg.kv0 * cfg_.head_dim, (hg.kv0 + hg.nkv) * cfg_.head_dim);
  }
  // A group's columns of o_proj [H, Hq*d] (or of its adapter's A [r, Hq*d]): the weight itself
  // when the group holds every head, else a copy (strided columns; small beside the activations).
  Tensor o_columns(const Tensor& w, const HeadGroup& hg) const {
    if (hg.nq == cfg_.num_heads) return w;
    const int64_t cols = hg.nq * cfg_.head_dim;
    Tensor c = Tensor::empty({w.size(0), cols}, w.dtype(), w.device());
    ops::copy_columns(w, hg.q0 * cfg_.head_dim, c, 0, cols);
    return c;
  }
  // A gradient over a group's columns of o_proj (or of its adapter's A) += alpha * dy^T @ attn: in
  // place for one group, else through a copy of those columns, so the sum is the same beta = 1
  // accumulation.
  void accumulate_columns(Tensor& gw, const HeadGroup& hg, const Tensor& dy, const Tensor& attn2, float alpha) {
    if (hg.nq == cfg_.num_heads) return ops::matmul(dy, true, attn2, false, gw, alpha, 1.f);
    const int64_t cols = hg.nq * cfg_.head_dim, c0 = hg.q0 * cfg_.head_dim;
    Tensor part = Tensor::empty({gw.size(0), cols}, gw.dtype(), gw.device());
    ops::copy_columns(gw, c0, part, 0, cols);
    ops::matmul(dy, true, attn2, false, part, alpha, 1.f);
    ops::copy_columns(part, 0, gw, c0, cols);
  }

  static Tensor act(Shape s, const Tensor& like) { return Tensor::empty(std::move(s), like.dtype(), like.device()); }
  static Tensor f32(Shape s, const Tensor& like) { return Tensor::empty(std::move(s), DType::f32, like.device()); }
  // A bias [n] as the column [n, 1] whose rows a head group takes.
  Tensor bias_column(int i) { return W(i).view({W(i).numel(), 1}); }
  // [T, 1] of ones in like's dtype and device, for the biases' K = 1 GEMMs; kept for the next layer.
  Tensor ones(int64_t T, const Tensor& like) {
    if (!ones_.defined() || ones_.size(0) < T || ones_.dtype() != like.dtype() || ones_.device() != like.device()) {
      Tensor host = Tensor::empty({T, 1}, like.dtype(), Device::cpu());
      fill_ones(host);
      ones_ = like.device().is_cuda() ? host.to(like.device()) : host;
    }
    return ones_.rows(0, T);
  }

  Tensor input_norm(const LayerParams& L, const Tensor& x, Tensor& rstd) { return normed(L.input_norm, x, rstd); }
  Tensor post_norm(const LayerParams& L, const Tensor& x1, Tensor& rstd) { return normed(L.post_norm, x1, rstd); }
  // RMSNorm of rows x [T, n] by parameter w: the family's kind ((1 + w) or w), rstd fp32 [T].
  Tensor normed(int w, const Tensor& x, Tensor& rstd) {
    Tensor h = act(x.shape(), x);
    rstd = f32({x.numel() / x.size(-1)}, x);
    norm_forward(w, x, h, rstd);
    return h;
  }
  void norm_forward(int w, const Tensor& x, Tensor& y, Tensor& rstd) {
    if (family_.unit_offset_norms) return ops::rmsnorm_offset_forward(x, W(w), 1.f, eps(), y, rstd);
    ops::rmsnorm_forward(x, W(w), eps(), y, rstd);
  }
  // dx from dy; the weight's gradient accumulates (norm_grad).
  void norm_backward(int w, const Tensor& x, const Tensor& rstd, const Tensor& dy, Tensor& dx) {
    if (family_.unit_offset_norms) return ops::rmsnorm_offset_backward(x, W(w), 1.f, rstd, dy, dx, norm_grad(w));
    ops::rmsnorm_backward(x, W(w), rstd, dy, dx, norm_grad(w));
  }

  // q, k, v of one group (with the biases' rows of the group where the family has them), the
  // per-head norm where it has one (Qwen3's q_norm / k_norm, before rotary), rotary.
  GroupActs group_inputs(const LayerParams& L, const Tensor& h1, const HeadGroup& hg, StepContext& ctx,
                         const AttnLora& lo) {
    const int64_t T = h1.size(0), d = cfg_.head_dim;
    GroupActs a;
    a.q = act({T, hg.nq * d}, h1);
    a.k = act({T, hg.nkv * d}, h1);
    a.v = act({T, hg.nkv * d}, h1);
    // An adapter's update first (u @ B's rows of the group), the projection accumulating onto it.
    if (lo.q) lowrank_update(lo.block(lo.ut, lo.q), *lo.q, q_rows(lo.q->b->value, hg), a.q, 0.f);
    if (lo.k) lowrank_update(lo.block(lo.ut, lo.k), *lo.k, kv_rows(lo.k->b->value, hg), a.k, 0.f);
    if (lo.v) lowrank_update(lo.block(lo.ut, lo.v), *lo.v, kv_rows(lo.v->b->value, hg), a.v, 0.f);
    ops::matmul(h1, false, q_rows(W(L.q), hg), true, a.q, 1.f, lo.q ? 1.f : 0.f);
    ops::matmul(h1, false, kv_rows(W(L.k), hg), true, a.k, 1.f, lo.k ? 1.f : 0.f);
    ops::matmul(h1, false, kv_rows(W(L.v), hg), true, a.v, 1.f, lo.v ? 1.f : 0.f);
    if (L.q_bias >= 0) {  // y += 1 b^T: one K = 1 GEMM each, so every backend adds it
      const Tensor one = ones(T, h1);
      ops::matmul(one, false, q_rows(bias_column(L.q_bias), hg), true, a.q, 1.f, 1.f);
      ops::matmul(one, false, kv_rows(bias_column(L.k_bias), hg), true, a.k, 1.f, 1.f);
      ops::matmul(one, false, kv_rows(bias_column(L.v_bias), hg), true, a.v, 1.f, 1.f);
    }
    const RopeTables& rope = rope_for(L, ctx);
    if (L.q_norm < 0) {  // no per-head norm: rotary in place on the projections
      a.qr = a.q.view({T, hg.nq, d});
      a.kr = a.k.view({T, hg.nkv, d});
      ops::rotary_forward(a.qr, rope.cos, rope.sin);
      ops::rotary_forward(a.kr, rope.cos, rope.sin);
      return a;
    }
    a.qr = act({T * hg.nq, d}, h1);
    a.kr = act({T * hg.nkv, d}, h1);
    a.rstd_q = f32({T * hg.nq}, h1);
    a.rstd_k = f32({T * hg.nkv}, h1);
    norm_forward(L.q_norm, a.q.view({T * hg.nq, d}), a.qr, a.rstd_q);
    norm_forward(L.k_norm, a.k.view({T * hg.nkv, d}), a.kr, a.rstd_k);
    a.qr = a.qr.view({T, hg.nq, d});
    a.kr = a.kr.view({T, hg.nkv, d});
    ops::rotary_forward(a.qr, rope.cos, rope.sin);
    ops::rotary_forward(a.kr, rope.cos, rope.sin);
    return a;
  }

  // group_inputs, then the attention through the Parallelism slot.
  GroupActs group_forward(const LayerParams& L, const Tensor& h1, const HeadGroup& hg, StepContext& ctx,
                          const AttnLora& lo) {
    const int64_t T = h1.size(0), d = cfg_.head_dim;
    GroupActs a = group_inputs(L, h1, hg, ctx, lo);
    a.attn = act({T, hg.nq, d}, h1);
    a.lse = f32({hg.nq, T}, h1);
    ctx.parallel->attention_forward(a.qr, a.kr, a.v.view({T, hg.nkv, d}), a.attn, a.lse, args(ctx, L));
    // Sinks join the softmax once the attention has seen every key (after a ring's merge).
    if (L.sinks >= 0) ops::attention_sinks_forward(a.attn, a.lse, W(L.sinks), hg.q0);
    return a;
  }

  // o (+)= attn_g @ Wo[:, group's columns]^T: group g's share of the attention's projection; with
  // an o_proj adapter, its share of attn @ Ao^T too (finish_o_lora adds the update after the last).
  void project_out(const LayerParams& L, const HeadGroup& hg, const Tensor& attn, Tensor& o, int64_t g, AttnLora& lo) {
    const int64_t T = attn.size(0);
    const Tensor a2 = attn.view({T, hg.nq * cfg_.head_dim});
    ops::matmul(a2, false, o_columns(W(L.o), hg), true, o, 1.f, g == 0 ? 0.f : 1.f);
    if (!lo.o) return;
    if (g == 0) lo.uo = f32({T, lo.o->rank()}, attn);
    ops::matmul(o_lora_input(lo, hg, a2), false, o_columns(lo.o->a->value, hg), true, lo.uo, 1.f, g == 0 ? 0.f : 1.f);
  }
  // A group's attention output as o_proj's adapter reads it: itself, or where the adapter drops,
  // dropped by the mask of its columns of the whole [T, Hq*d] input (in `buffer` when given).
  Tensor o_lora_input(const AttnLora& lo, const HeadGroup& hg, const Tensor& a2, Tensor buffer = {}) const {
    const LowRank& lr = *lo.o;
    if (!lr.dropping()) return a2;
    Tensor ad = buffer.defined() ? buffer : act(a2.shape(), a2);
    ops::dropout(a2, lr.dropout, lr.dropout_key(), lo.rows, hg.q0 * cfg_.head_dim, ad);
    return ad;
  }

  // o = attention(h1) @ Wo^T [T,H], one group at a time, each group's tensors gone before the
  // next one's. `keep` takes them for the backward: all of them when there is one group (unless
  // outputs_only), else each group's output and LSE.
  Tensor attention_out(const LayerParams& L, const Tensor& h1, StepContext& ctx, int64_t groups,
                       std::vector<GroupActs>* keep, bool outputs_only, AttnLora& lo) {
    const int64_t T = h1.size(0);
    Tensor o = act({T, cfg_.hidden_size}, h1);
    for (int64_t g = 0; g < groups; ++g) {
      const HeadGroup hg = head_group(g, groups);
      GroupActs a = group_forward(L, h1, hg, ctx, lo);
      project_out(L, hg, a.attn, o, g, lo);
      if (!keep) continue;
      if (groups == 1 && !outputs_only)
        keep->push_back(std::move(a));
      else
        keep->push_back(GroupActs{.attn = std::move(a.attn), .lse = std::move(a.lse)});
    }
    finish_o(L, lo, o);
    return o;
  }

  Family family_;
  ModelConfig cfg_;
  std::vector<Parameter> params_;
  std::vector<LayerParams> layers_;
  int embed_ = 0, final_norm_ = 0, head_ = 0;
  bool check_finite_;
  uint64_t max_shard_bytes_;
  int64_t head_groups_;  // 0: auto
  bool keep_outputs_;    // keep each group's attention output and LSE from the backward's recompute
  int keep_attention_;   // keep them from the forward: -1 auto (the recipe's), 0 no, 1 yes
  int64_t moe_tile_rows_;  // a sparse layer's tokens at once: 0 auto (the recipe's, else all)
  std::string table_;    // the manifest's name for this module's table, for errors
  int ep_;               // expert parallelism: ranks splitting each sparse layer's experts
  int ep_index_;         // this rank's place among them
  int64_t first_expert_ = 0;  // the first expert (Hub number) this rank holds
  std::unique_ptr<MlpStrategy> whole_mlp_ = make_whole_mlp();  // for callers whose StepContext names no MLP
  std::map<int64_t, Tensor> norm_scratch_;  // frozen norms' discarded weight gradients, by size
  Tensor ones_;  // ones()'s, as long as the longest shard yet
  std::vector<float> own_inv_freq_;           // the sliding layers' own rotary frequencies, if any
  RopeTables own_rope_;                        // their tables for the shard of own_rope_positions_
  std::vector<int64_t> own_rope_positions_;
  Pass pass_;     // the forward pass under way (mixture of experts)
  ExpertsLayout layout_;  // the experts' layout (the family's, from the checkpoint or the init spec)
  AuxLoss aux_;   // the last pass's auxiliary loss
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

// attention_head_groups: "auto" (0 here) or a positive count; that it divides the model's kv
// heads is checked once the model's shape is known.
int64_t parse_head_groups(const ConfigView& cfg) {
  const char* key = kHeadGroups;
  const char* fix = "\"auto\" or a positive divisor of the model's key/value head count";
  const std::optional<int64_t> n = cfg.get_int_or_auto(key, fix);
  if (!n) return 0;
  if (*n < 1) cfg.fail(key, str(*n, " is not a positive count"), fix);
  return *n;
}

// A key that is true, false or "auto" (the default): 1, 0, or -1.
int parse_auto_bool(const ConfigView& cfg, const char* key) {
  cfg.describe(key, {}, "true, false, \"auto\"", "\"auto\"");
  try {
    const bool on = cfg.get_bool(key, false);
    return cfg.has(key) ? (on ? 1 : 0) : -1;
  } catch (const Error&) {  // not a bool: the one string it may be is "auto"
    const std::string text = cfg.get_string(key, "auto");
    if (text == "auto") return -1;
    cfg.fail(key, str("'", text, "' is neither true, false nor \"auto\""), "true, false or \"auto\" (the plan's choice)");
  }
}

}  // namespace

std::unique_ptr<Plugin> create_model(const PluginArgs& args, const Family& family) {
  const ConfigView& c = args.config;
  c.describe("check_finite", "refuse a checkpoint holding NaN or Inf (one pass over the weights)");
  c.describe("max_shard_size", "the size above which a saved checkpoint is split into shards, as transformers writes it",
             "a positive size: \"500MB\", \"1GiB\", bytes");
  c.describe("attention_head_groups", "head groups the attention half runs one at a time; auto: the plan's choice",
             "a divisor of the kv heads");
  c.describe("attention_keep_outputs",
             "with several head groups, keep each group's attention output and LSE from the backward's recompute");
  c.describe("keep_attention",
             "selective recompute: keep each layer's attention output from the forward, so the backward never reruns it");
  if (family.experts)
    c.describe(kMoeTileRows, "mixture of experts: tokens a sparse layer routes and runs through its experts at once",
               "\"auto\" (the plan's choice) or a positive count", "\"auto\"");
  const bool check_finite = args.config.get_bool("check_finite", true);
  const uint64_t shard = parse_size(args.config, "max_shard_size", args.config.get_string("max_shard_size", "5GB"));
  const int64_t groups = parse_head_groups(args.config);
  const bool keep_outputs = args.config.get_bool("attention_keep_outputs", false);
  const int keep_attention = parse_auto_bool(args.config, kKeepAttention);
  const std::optional<int64_t> moe_tile =
      family.experts ? c.get_int_or_auto(kMoeTileRows, "\"auto\" or a positive count of tokens") : std::nullopt;
  if (moe_tile && *moe_tile < 1) c.fail(kMoeTileRows, str(*moe_tile, " is not a positive count"), "\"auto\" or a count >= 1");
  const std::string table = args.config.name().empty() ? family.name : args.config.name();
  return std::make_unique<DecoderModel>(family, check_finite, shard, groups, keep_outputs, keep_attention, moe_tile.value_or(0), table,
                                      std::max(1, args.mesh.ep), expert_index(args.mesh, args.rank));
}

}  // namespace lcx::decoder
