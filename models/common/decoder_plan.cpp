// The decoder's memory arithmetic (decoder_plan.h), counted from what decoder_model.cpp allocates: each
// term names the tensors it stands for. Bytes per token are exact for those tensors; what the
// kernels allocate beyond them is the attention provider's (attention workspace) or core's
// (cuBLASLt workspace, reserve).
#include "decoder_plan.h"

#include <algorithm>
#include <string>
#include <vector>

#include "lcx/attention_cost.h"
#include "lcx/error.h"
#include "decoder_config.h"
#include "decoder_model.h"

namespace lcx::decoder {
namespace {

struct DecoderDims {
  int64_t V, H, I, L, Hq, Hkv, d, qd, kvd;
  int64_t extra;  // a layer's q/k norms, q/k/v biases, sinks and sandwich norms
};

DecoderDims shape_of(const ModelConfig& c, const DecoderLayerShape& layer) {
  const int64_t d = c.head_dim > 0 ? c.head_dim : c.hidden_size / c.num_heads;
  const int64_t qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  return {c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, d, qd, kvd,
          (layer.qk_norm ? 2 * d : 0) + (layer.qkv_bias ? qd + 2 * kvd : 0) + (layer.sinks ? c.num_heads : 0) +
              (layer.sandwich_norms ? 2 * c.hidden_size : 0)};
}

// One decoder layer's parameters on a rank: input and post-attention norms, q/k/v/o projections,
// the per-head q_norm and k_norm and the q/k/v biases where the family has them, and its MLP: gate/up/down, or a sparse layer's router (whole on
// every rank) and its experts (E/ep of them under expert parallelism).
int64_t mlp_params(const ModelConfig& c, const DecoderDims& s, int64_t ep, int64_t layer) {
  return sparse(c, layer) ? moe(c).num_experts * s.H + 3 * (moe(c).num_experts / ep) * moe(c).moe_intermediate_size * s.H : 3 * s.I * s.H;
}
int64_t layer_params(const ModelConfig& c, const DecoderDims& s, int64_t ep, int64_t layer) {
  return 2 * s.H + s.qd * s.H + 2 * s.kvd * s.H + s.H * s.qd + s.extra + mlp_params(c, s, ep, layer);
}
// Of those, the GEMM weights (q, k, v, o and the MLP's): the ones whose gradients may be kept in
// PlanInputs::grad_dtype.
int64_t layer_gemm_params(const ModelConfig& c, const DecoderDims& s, int64_t ep, int64_t layer) {
  return 2 * s.qd * s.H + 2 * s.kvd * s.H + mlp_params(c, s, ep, layer);
}
int64_t all_layers(const ModelConfig& c, const DecoderDims& s, int64_t ep,
                   int64_t (*per_layer)(const ModelConfig&, const DecoderDims&, int64_t, int64_t)) {
  int64_t n = 0;
  for (int64_t l = 0; l < s.L; ++l) n += per_layer(c, s, ep, l);
  return n;
}
// Whether layer l attends within ModelConfig::sliding_window (a family computing sliding layers;
// the others refuse them before any plan).
bool sliding_layer(const ModelConfig& c, int64_t l) {
  return c.sliding_window > 0 && static_cast<size_t>(l) < c.layer_types.size() &&
         c.layer_types[static_cast<size_t>(l)] == "sliding_attention";
}
// Whether layer l attends within ModelConfig::sliding_window (a family computing sliding layers;
// the others refuse them before any plan).
bool windowed(const ModelConfig& c, int64_t l) {
  return c.sliding_window > 0 && static_cast<size_t>(l) < c.layer_types.size() &&
         c.layer_types[static_cast<size_t>(l)] == "sliding_attention";
}
int64_t largest_layer(const ModelConfig& c, const DecoderDims& s, int64_t ep) {
  int64_t n = 0;
  for (int64_t l = 0; l < s.L; ++l) n = std::max(n, layer_params(c, s, ep, l));
  return n;
}

// The rank of the factors an adapter puts on module m (plain, or a sparse layer's experts, one
// module each as Qwen3-MoE's) in any layer: the largest (0: none).
int64_t adapted_rank(const PlanInputs& in, Proj m, bool experts) {
  int64_t r = 0;
  for (size_t l = 0; l < in.model.linear_modules.size(); ++l) {
    const auto& mods = in.model.linear_modules[l];
    for (size_t i = 0; i < mods.size(); ++i)
      if (mods[i].id == static_cast<int>(m) && (mods[i].experts > 0) == experts && !mods[i].parameter)
        r = std::max(r, in.adapter_rank(static_cast<int64_t>(l), i));
  }
  return r;
}

// The [rows, r] products this decoder makes with the adapters' factors (PlanInputs::adapter_ranks;
// decoder_model.cpp, mlp_whole.cpp, moe.cpp), and the dropped inputs beside the calls that read
// them (adapter_none.cpp).
void plan_adapter_products(const PlanInputs& in, MemoryPlan& plan, int64_t moe_tile_rows) {
  const ModelConfig& c = in.model;
  const int64_t ab = static_cast<int64_t>(dtype_size(in.weight_dtype));
  const int64_t T = in.tokens_per_rank, H = c.hidden_size;
  // The experts' [rows, r] products (u = x A_e^T, g = scale dy B_e) live one at a time, each beside
  // buffers the sparse layer's plan ("moe_backward") already holds at its widest moment but one:
  // down's backward, beside the experts' inputs, gate, up, silu*up, dact and the outputs' gradients
  // (2H + 4I columns). There the product adds r columns, which raise the layer's peak only where
  // that moment is (or becomes) its widest; every other product comes where [rows, I] buffers
  // (I >= r) were just released, in the forward as in the backward.
  if (const int64_t rd = adapted_rank(in, Proj::down_proj, true); rd > 0 && sparse_layers(c) > 0) {
    const int64_t Im = moe(c).moe_intermediate_size;
    const int64_t tile = moe_tile_rows > 0 ? std::min<int64_t>(T, moe_tile_rows) : T;
    const int64_t tk = tile * std::max<int64_t>(1, moe(c).num_experts_per_tok), ep = std::max<int64_t>(1, in.ep), R = tk * ep;
    const int64_t widest = ep == 1 ? tk * std::max({3 * H + 3 * Im, 2 * H + 4 * Im, H + 5 * Im})
                                   : std::max({R * (2 * H + 3 * Im) + tk * H, R * (2 * H + 4 * Im), R * (H + 5 * Im)});
    const int64_t extra = std::max<int64_t>(0, R * (2 * H + 4 * Im + rd) - widest) * ab;
    if (extra > 0)
      plan.add("lora_expert_backward", "LoRA on the experts: down's [rows, r] product beside its backward's widest moment",
               PlanCategory::transient, extra, plan_phase::mlp_backward);
  }

  // A layer's [T, r] products (decoder_model.cpp): h1 @ A^T of q, k, v and the fp32 sum of
  // attn @ Ao^T live from the attention's recompute through the MLP's backward; the attention
  // backward adds scale * dx1 @ Bo and the fp32 sums of dq @ Bq (k, v) with their rounding.
  const int64_t q = adapted_rank(in, Proj::q_proj, false), k = adapted_rank(in, Proj::k_proj, false),
                v = adapted_rank(in, Proj::v_proj, false), o = adapted_rank(in, Proj::o_proj, false);
  const int64_t gate = adapted_rank(in, Proj::gate_proj, false), up = adapted_rank(in, Proj::up_proj, false),
                down = adapted_rank(in, Proj::down_proj, false);
  const int64_t qkv = (q + k + v) * T * ab, uo = o * T * 4;
  const int64_t mlp_tile = std::min<int64_t>(T, in.recipe.get("tiled_mlp", "tile_rows", 0) > 0
                                                    ? in.recipe.get("tiled_mlp", "tile_rows", 0) : T);
  const bool mlp = gate + up + down > 0 && sparse_layers(c) < c.num_layers;
  if (qkv + uo > 0)
    plan.add("lora_forward", "LoRA: h1 @ A^T of q, k, v [T,r], fp32 attn @ Ao^T [T,r] and its rounding",
             PlanCategory::transient, qkv + uo + o * T * ab, plan_phase::forward);
  // The MLP's backward holds gate's and up's u^T from its recompute to the end (with the
  // stacked g^T beside them at the end), and down's u and g while down's backward runs.
  const int64_t n_in = gate + up;
  const int64_t mlp_products = mlp ? std::max(n_in + 2 * down, 2 * n_in) * mlp_tile * ab : 0;
  if (qkv + uo + mlp_products > 0)
    plan.add("lora_mlp_backward", "LoRA: the attention's [T,r] products held through the MLP backward, the MLP's",
             PlanCategory::transient, qkv + uo + mlp_products, plan_phase::mlp_backward);
  const int64_t back = qkv + o * T * ab + (q + k + v) * T * 4 + std::max({q, k, v}) * T * ab;
  if (back > 0)
    plan.add("lora_attention_backward", "LoRA: h1 @ A^T, scale dx1 @ Bo, fp32 sums of dq @ Bq (k, v) [T,r]",
             PlanCategory::transient, back, plan_phase::backward);

  // Dropout: the dropped input of one projection at a time ([rows, in] beside the call that
  // reads it, adapter_none.cpp): h1's [T,H] or the attention's [T,Hq*d] (a head group's columns
  // of it, counted whole) in the forward and the attention backward, and the MLP's input [tile,H]
  // beside the MLP backward's widest moment, or act's [tile,I] beside the forward's MLP.
  if (in.adapter_dropout) {
    const int64_t d = c.head_dim > 0 ? c.head_dim : H / std::max<int64_t>(1, c.num_heads);
    const int64_t attn_in = std::max(q + k + v > 0 ? H : 0, o > 0 ? c.num_heads * d : 0);
    const bool mlp_in = mlp && gate + up > 0, mlp_down = mlp && down > 0;
    const int64_t fwd = std::max(T * attn_in, mlp_tile * std::max(mlp_in ? H : 0, mlp_down ? c.intermediate_size : 0)) * ab;
    if (fwd > 0)
      plan.add("lora_dropout_forward", "LoRA dropout: one projection's dropped input", PlanCategory::transient, fwd,
               plan_phase::forward);
    if (attn_in > 0)
      plan.add("lora_dropout_backward", "LoRA dropout: one attention projection's dropped input or its masked gradient",
               PlanCategory::transient, T * attn_in * ab, plan_phase::backward);
    // gate's and up's u^T are released just before (mlp_whole.cpp), so the input adds the rest.
    if (mlp_in)
      plan.add("lora_dropout_mlp_backward", "LoRA dropout: gate's or up's dropped input or its masked gradient",
               PlanCategory::transient, mlp_tile * std::max<int64_t>(0, H - n_in) * ab, plan_phase::mlp_backward);
  }
}

}  // namespace

void plan_dense_decoder(const PlanInputs& in, MemoryPlan& plan, const DenseDecoderAttention& attention,
                        int64_t moe_tile_rows, const DecoderLayerShape& layer) {
  const DecoderDims s = shape_of(in.model, layer);
  const int64_t G = attention.head_groups;
  if (G < 1 || s.Hkv % G != 0)
    throw Error(str("plan: ", G, " attention head groups do not divide ", s.Hkv, " key/value heads"),
                "attention_head_groups", str("use a divisor of ", s.Hkv));
  plan.attention_head_groups = G;
  const int64_t T = in.tokens_per_rank;
  const int64_t ab = static_cast<int64_t>(dtype_size(in.weight_dtype));  // activations take the weights' dtype
  const int64_t head = in.model.tie_word_embeddings ? 0 : s.V * s.H;
  // Under expert parallelism a rank holds E/ep of each sparse layer's experts (and their
  // gradients; the optimizer plans their state from plan.parameters): its parameters are these.
  const int64_t ep = sparse_layers(in.model) > 0 ? std::max<int64_t>(1, in.ep) : 1;
  const int64_t n = s.V * s.H + all_layers(in.model, s, ep, layer_params) + s.H + head;  // embedding, layers, final norm, head
  // ZeRO-3 over the whole mesh (core/src/distributed/sharded_params.h): a rank keeps 1/world of each
  // parameter's value and fp32 grad (and its master and moments: the optimizer's plan).
  const int64_t shards = parameter_shards(in);
  const int64_t per_rank = (n + shards - 1) / shards;
  // The optimizer plans its master weights and moments from these (lcx/slots/optimizer.h).
  plan.parameters = n;
  plan.gemm_parameters = all_layers(in.model, s, ep, layer_gemm_params);
  plan.add("parameters", "parameters (" + std::to_string(n) + ")", PlanCategory::weights, per_rank * ab,
           plan_phase::always);
  if (in.base_frozen) {
    // An adapter froze the base: gradients (and the optimizer's state) only for what it trains
    // whole; the adapter's plan adds its own factors.
    plan.parameters = in.base_trained_parameters;
    plan.gemm_parameters = 0;
    if (in.base_trained_parameters > 0)
      plan.add("gradients", "fp32 gradients of the modules trained whole", PlanCategory::gradients,
               (in.base_trained_parameters + shards - 1) / shards * 4, plan_phase::always);
    // The norm kernels always write a weight gradient: a frozen norm's goes to one discarded
    // buffer per norm size ([H] and [d]), made at the first backward and kept.
    plan.add("frozen_norm_scratch", "frozen norms' discarded weight gradients [H], [d] fp32", PlanCategory::gradients,
             (s.H + (layer.qk_norm && s.d != s.H ? s.d : 0)) * 4, plan_phase::always);
  } else if (in.grad_dtype == DType::f32 || shards > 1) {
    plan.add("gradients", "fp32 gradients", PlanCategory::gradients, per_rank * 4, plan_phase::always);
  } else {
    const int64_t gemm = plan.gemm_parameters;
    plan.add("gemm_gradients", str("GEMM weight gradients (", dtype_name(in.grad_dtype), ")"), PlanCategory::gradients,
             gemm * static_cast<int64_t>(dtype_size(in.grad_dtype)), plan_phase::always);
    plan.add("other_gradients", "embedding, head and norm gradients (fp32)", PlanCategory::gradients, (n - gemm) * 4,
             plan_phase::always);
  }
  if (shards > 1) {
    // Gathered around each layer: the full values for its forward, values and zeroed fp32 grads
    // for its recompute + backward until reduce_grads; the head's for the loss.
    // A frozen base gathers its values alone (the norms an adapter trains whole are left out: a
    // few [H] per layer).
    const int64_t lp = largest_layer(in.model, s, ep);
    const int64_t grad_bytes = in.base_frozen ? 0 : 4;
    plan.add("gathered_layer", "one layer's gathered weights", PlanCategory::communication, lp * ab,
             plan_phase::forward);
    for (const char* phase : {plan_phase::mlp_backward, plan_phase::backward})
      plan.add("gathered_layer_grads", in.base_frozen ? "one layer's gathered weights (frozen: no grads)"
                                                      : "one layer's gathered weights + full fp32 grads",
               PlanCategory::communication, lp * (ab + grad_bytes), phase);
    plan.add("gathered_head", in.head_frozen ? "gathered head weight (frozen: no grad)" : "gathered head weight + its full fp32 grad",
             PlanCategory::communication, s.V * s.H * (ab + (in.head_frozen ? 0 : 4)), plan_phase::loss);
  }

  // The attention half runs one head group at a time: nq query and nkv kv heads, per token q, qr,
  // attn (and their grads) of nq*d, k, kr, v (and grads) of nkv*d; fp32 q/k norm rstd and LSE.
  // Without q/k norms rotary runs in place on q and k: no normed copies, no rstd.
  const int64_t nq = s.Hq / G, nkv = s.Hkv / G, gq = nq * s.d, gkv = nkv * s.d;
  const int64_t normed = layer.qk_norm ? 1 : 0;
  const std::string heads = G == 1 ? std::string("all heads") : str("one of ", G, " head groups");
  const std::string qr = layer.qk_norm ? "normed q/k, " : "";
  const int64_t group_f32 = T * 4 * (nq + normed * (nq + nkv));

  // layer_forward at its worst: the attention moment (h1, o [T,H], one group's q, k, v, qr, kr,
  // attn and, with groups, its o_proj columns) and then the MLP's (x1 = o, h2 and the MLP slot's
  // buffers). Listed as one sum, an upper bound of both: the forward never holds the peak, as the
  // backward holds one [T,H] more and the larger group transient.
  plan.add("forward_residual", "layer forward: h1, o/x1 [T,H]", PlanCategory::transient, 2 * T * s.H * ab,
           plan_phase::forward);
  plan.add("forward_attention", "layer forward: q, k, v, " + qr + "attn out (" + heads + ")", PlanCategory::transient,
           T * ((2 + normed) * gq + (2 + normed) * gkv) * ab, plan_phase::forward);
  plan.add("forward_stats", std::string("layer forward: fp32 norm rstd, ") + (layer.qk_norm ? "q/k norm rstd and " : "") + "LSE (" + heads + ")",
           PlanCategory::transient, T * 4 + group_f32, plan_phase::forward);
  if (layer.sandwich_norms)
    plan.add("forward_sandwich", "layer forward: the attention's and the MLP's normed outputs [T,H]",
             PlanCategory::transient, T * (s.H * ab + 4), plan_phase::forward);
  if (G > 1)
    plan.add("forward_o_columns", "layer forward: one group's o_proj columns [H," + std::to_string(gq) + "]",
             PlanCategory::transient, s.H * gq * ab, plan_phase::forward);

  // layer_backward, first moment: the MLP slot's backward on the recomputed x1, h2 (dh2 goes to the
  // caller's dx). The recompute itself (h1, o and one group) holds less than the attention moment.
  // With one group its attention tensors stay for the attention backward, as nothing is cut; with
  // keep_outputs every group's output and LSE stay.
  const bool from_forward = attention.keep_from_forward;
  const bool keep = G > 1 && attention.keep_outputs && !from_forward;
  const int64_t outputs = T * (s.qd * ab + s.Hq * 4);  // every group's attn [T,nq,d] and fp32 LSE [nq,T]
  // Kept from the forward, they are the memory strategy's to hold (its plan places them); the
  // recompute is then o_proj alone, and the attention backward makes only q, k, v again.
  plan.kept_bytes_per_layer = from_forward ? outputs : 0;
  plan.add("mlp_backward_residual", "MLP backward: x1, h2 [T,H], fp32 rstd", PlanCategory::transient,
           T * (2 * s.H * ab + 4), plan_phase::mlp_backward);
  if (layer.sandwich_norms) {
    plan.add("mlp_backward_sandwich", "MLP backward: the attention's output before its norm, the MLP's output and its "
             "gradient [T,H], fp32 rstd", PlanCategory::transient, T * (3 * s.H * ab + 8), plan_phase::mlp_backward);
    plan.add("attention_backward_sandwich", "attention backward: the gradient of the attention's output [T,H]",
             PlanCategory::transient, T * s.H * ab, plan_phase::backward);
  }
  if (G == 1 && !from_forward)
    plan.add("mlp_backward_attention",
             "MLP backward: q, k, v, " + qr + "attn out, LSE kept for the attention backward",
             PlanCategory::transient, T * ((2 + normed) * gq + (2 + normed) * gkv) * ab + group_f32, plan_phase::mlp_backward);
  if (keep)
    plan.add("mlp_backward_kept_outputs",
             "MLP backward: every group's attn out and LSE, kept for the attention backward", PlanCategory::transient,
             outputs, plan_phase::mlp_backward);
  // Second moment: the attention backward of one group, beside the recomputed h1 (dx1 is written
  // over the caller's dy, dh1 accumulates in the caller's dx): the group's recomputed tensors and dattn, dq, dk, dv; with
  // keep_outputs the group's q, k, v, normed q/k beside every group's kept output (the first
  // group's backward holds them all).
  plan.add("attention_backward_residual", "attention backward: h1 [T,H], fp32 rstd", PlanCategory::transient,
           T * (s.H * ab + 4), plan_phase::backward);
  // With sinks, the Parallelism's backward takes a copy of the group's output (the sinks changed it
  // after that forward), beside the output itself.
  if (layer.sinks)
    plan.add("attention_backward_sinks_copy", "attention backward: the group's output copied for the Parallelism (sinks, " +
             heads + ")", PlanCategory::transient, T * gq * ab, plan_phase::backward);
  if (keep || from_forward) {
    if (keep)
      plan.add("attention_backward_kept_outputs",
               "attention backward: every group's attn out and LSE, kept from the recompute", PlanCategory::transient,
               outputs, plan_phase::backward);
    plan.add("attention_backward_tensors", "attention backward: q, k, v, " + qr + "dattn, dq, dk, dv (" + heads + ")",
             PlanCategory::transient, T * ((3 + normed) * gq + (4 + normed) * gkv) * ab, plan_phase::backward);
    if (layer.qk_norm)
      plan.add("attention_backward_stats", "attention backward: fp32 q/k norm rstd (" + heads + ")",
               PlanCategory::transient, T * 4 * (nq + nkv), plan_phase::backward);
  } else {
    plan.add("attention_backward_tensors",
             "attention backward: q, k, v, " + qr + "attn out, dattn, dq, dk, dv (" + heads + ")",
             PlanCategory::transient, T * ((4 + normed) * gq + (4 + normed) * gkv) * ab, plan_phase::backward);
    plan.add("attention_backward_stats",
             std::string("attention backward: fp32 ") + (layer.qk_norm ? "q/k norm rstd and " : "") + "LSE (" + heads + ")",
             PlanCategory::transient, group_f32, plan_phase::backward);
  }

  // The work, per layer: GEMMs of the forward, of the recompute (all of the attention half's
  // projections, or o_proj alone from kept outputs; gate and up of the MLP), again q/k/v for a
  // backward that cannot use the recompute's, and the backward's two per forward GEMM; attention
  // forwards run once, twice with a recompute, three times when groups recompute it again.
  {
    const double t = static_cast<double>(T), seq = static_cast<double>(in.seq_len);
    // The MLP's weights a token passes through, over the layers: 3 H I for a dense layer; the
    // router and k experts' 3 H I_moe for a sparse one. Its elementwise width likewise.
    const ModelConfig& c = in.model;
    const double sparse = static_cast<double>(sparse_layers(c)), dense = static_cast<double>(s.L) - sparse;
    const double k_moe = static_cast<double>(moe(c).num_experts_per_tok), i_moe = static_cast<double>(moe(c).moe_intermediate_size);
    // The experts' weights apart (expert): they run as grouped GEMMs, at their own rate.
    const double qkv = static_cast<double>(s.H * (s.qd + 2 * s.kvd)), o = static_cast<double>(s.qd * s.H),
                 mlp = (dense * 3.0 * static_cast<double>(s.H * s.I) +
                        sparse * static_cast<double>(s.H) * static_cast<double>(moe(c).num_experts)) /
                       static_cast<double>(s.L),
                 expert = sparse * static_cast<double>(s.H) * 3.0 * k_moe * i_moe / static_cast<double>(s.L);
    const double width = (dense * static_cast<double>(s.I) + sparse * k_moe * i_moe) / static_cast<double>(s.L);
    const double fwd = 2 * t * (qkv + o + mlp);
    // The backward's GEMMs per forward one: the input's gradient, and the weight's unless frozen.
    const double backward = in.base_frozen ? 1 : 2;
    double recompute = 2 * t * (from_forward ? o : qkv + o) + 2 * t * (2.0 / 3.0) * mlp;
    if (layer.sandwich_norms) recompute += 2 * t * mlp;  // the MLP's output again, for its norm's backward
    if (from_forward || G > 1) recompute += 2 * t * qkv;
    const int attention_forwards = from_forward ? 1 : (G > 1 && !keep ? 3 : 2);
    // Attention pairs over the layers: causal, half of T x seq per head; a sliding-window layer's
    // rows see at most W keys (causal_pairs), about T x W. `pairs` is the layers' mean.
    double layer_pairs = 0;
    for (int64_t l = 0; l < s.L; ++l)
      layer_pairs += windowed(c, l) ? t * static_cast<double>(causal_pairs(in.seq_len, c.sliding_window)) / seq : t * seq / 2;
    layer_pairs *= static_cast<double>(s.Hq);
    const double pairs = layer_pairs / static_cast<double>(s.L);
    StepWork& w = plan.work;
    // The attention half's projections run per head group: q/k/v in the forward, the recompute
    // and the backward (two per forward GEMM), o_proj likewise when there are groups.
    const double grouped = G > 1 ? 2 * t * (qkv + o) * (2 + backward) : 0;
    w.gemm_flops += static_cast<double>(s.L) * (fwd + recompute + backward * fwd) - static_cast<double>(s.L) * grouped;
    w.grouped_gemm_flops += static_cast<double>(s.L) * grouped;
    w.head_groups = G;
    w.attention_forward_flops += attention_forwards * layer_pairs * 4 * static_cast<double>(s.d);
    w.attention_backward_flops += 2.5 * layer_pairs * 4 * static_cast<double>(s.d);
    // Elementwise passes over [T,I] (SwiGLU forward, recompute, backward) and [T,H] (norms, adds,
    // rotary); the optimizer adds its own.
    w.memory_bytes += static_cast<double>(s.L) * t * static_cast<double>(ab) * (11.0 * width + 24.0 * s.H);
    // train.checkpoint_every = k: the backward runs the forward of every unsaved layer once more to
    // rebuild its input, or with train.rebuild_each each one's chain from the saved input (its
    // elementwise passes taken as a third of the layer's).
    const double rebuilt = static_cast<double>(in.recipe.rebuilt_forwards(s.L));
    const double grouped_forward = G > 1 ? 2 * t * (qkv + o) : 0;
    w.gemm_flops += rebuilt * (fwd - grouped_forward);
    w.grouped_gemm_flops += rebuilt * grouped_forward;
    w.attention_forward_flops += rebuilt * pairs * 4 * static_cast<double>(s.d);
    w.memory_bytes += rebuilt * t * static_cast<double>(ab) * (11.0 * width + 24.0 * s.H) / 3;
    // The experts: gate, up and down in the forward and all three again in the backward's recompute
    // (the combine's backward reads the experts' outputs), the backward's per forward GEMM, and a
    // rebuilt layer's forward once more.
    w.expert_gemm_flops += 2 * t * expert * (static_cast<double>(s.L) * (2 + backward) + rebuilt);
  }

  // A sparse layer's MLP (moe.cpp), in place of the MLP slot's: the routing (logits [T,E],
  // fp32 probabilities, top-k weights and experts, the sorted order and its inverse) and the
  // experts' rows. Every token's k rows are sorted whatever the experts they go to, so the buffers
  // are T*k rows however unevenly the tokens route (all to one expert included): the bound is exact.
  // With tiles, T is a tile's tokens.
  if (sparse_layers(in.model) > 0) {
    const ModelConfig& c = in.model;
    const int64_t Tm = moe_tile_rows > 0 ? std::min(moe_tile_rows, in.tokens_per_rank) : in.tokens_per_rank;
    const int64_t E = moe(c).num_experts, tk = Tm * moe(c).num_experts_per_tok, Im = moe(c).moe_intermediate_size;
    const int64_t routing = Tm * E * (ab + 4) + Tm * moe(c).num_experts_per_tok * 8 + tk * 8;
    // The backward's widest moment: the experts' inputs, gate, up and silu*up with their outputs
    // and those outputs' gradients (the combine's backward), or later dact beside them, or dgate
    // and dup beside gate, up and dact; then the router's gradient [T,E].
    const int64_t widest = std::max({3 * s.H + 3 * Im, 2 * s.H + 4 * Im, s.H + 5 * Im});
    if (ep == 1) {
      plan.add("moe_forward", "sparse MLP forward: routing, experts' inputs, gate, up, silu*up [T*k rows]",
               PlanCategory::transient, routing + tk * (s.H + 3 * Im) * ab, plan_phase::forward);
      plan.add("moe_backward", "sparse MLP backward: routing, experts' rows and their gradients [T*k rows]",
               PlanCategory::transient, routing + Tm * moe(c).num_experts_per_tok * 4 + tk * widest * ab + Tm * E * ab,
               plan_phase::mlp_backward);
    } else {
      // Expert parallelism: a rank's experts run the rows every rank of its group sends them. At
      // worst every token of the group's ep ranks routes to this rank's experts: R = T*k*ep rows
      // (no token is dropped, so nothing caps it below that). The experts' buffers are R rows, and
      // the rank's own T*k sorted rows are sent out and come back beside them: in the forward the
      // sorted inputs beside the received rows, or the received rows with gate, up and silu*up; in
      // the backward the experts' inputs, gate, up, silu*up and outputs while the outputs come
      // back (T*k rows), or later dact beside them, or dgate and dup beside gate, up and dact.
      const int64_t R = tk * ep;
      const int64_t widest_ep = std::max({R * (2 * s.H + 3 * Im) + tk * s.H, R * (2 * s.H + 4 * Im), R * (s.H + 5 * Im)});
      plan.add("moe_forward", str("sparse MLP forward, expert-parallel: routing, experts' rows of ep ", ep,
                                  " ranks (worst case T*k*ep rows), gate, up, silu*up"),
               PlanCategory::transient, routing + std::max(R * (s.H + 3 * Im), (tk + R) * s.H) * ab, plan_phase::forward);
      plan.add("moe_backward", str("sparse MLP backward, expert-parallel: routing, experts' rows of ep ", ep,
                                   " ranks (worst case T*k*ep rows) and their gradients, this rank's T*k returned"),
               PlanCategory::transient,
               routing + Tm * moe(c).num_experts_per_tok * 4 + widest_ep * ab + Tm * E * ab,
               plan_phase::mlp_backward);
    }
    // cuBLAS's grouped GEMM takes one dtype for all its operands: a 16-bit weight gradient is
    // made whole in the weights' dtype, then added to the fp32 gradient (ops::grouped_matmul_wgrad).
    if (ab < 4 && !in.base_frozen)
      plan.add("moe_wgrad_scratch", "sparse MLP backward: one stacked experts' weight gradient in the weights' dtype",
               PlanCategory::transient, (E / ep) * Im * s.H * ab, plan_phase::mlp_backward);
  }

  // The sliding layers' own rotary tables (ModelConfig::sliding_rope_parameters_json), built once
  // per shard and held through the step beside the PositionalEncoding slot's.
  bool any_windowed = false;
  for (int64_t l = 0; l < s.L; ++l) any_windowed = any_windowed || sliding_layer(in.model, l);
  if (any_windowed && !in.model.sliding_rope_parameters_json.empty())
    plan.add("sliding_rope_tables", "sliding layers' rope cos/sin [T,d/2] fp32", PlanCategory::transient,
             2 * T * (s.d / 2) * 4, plan_phase::step);

  // final_norm_backward recomputes the norm: y [T,H] and fp32 rstd [T].
  plan.add("final_norm_recompute", "final norm recompute: y [T,H], rstd", PlanCategory::transient, T * (s.H * ab + 4),
           plan_phase::final_norm);
  plan_adapter_products(in, plan, moe_tile_rows);
}

double decoder_step_flops(const ModelConfig& c, const DecoderLayerShape& layer, int64_t tokens,
                          std::span<const int64_t> document_bounds) {
  const DecoderDims s = shape_of(c, layer);
  auto f = [](int64_t n) { return static_cast<double>(n); };
  const double attention = f(s.qd * s.H + 2 * s.kvd * s.H + s.H * s.qd + (layer.qkv_bias ? s.qd + 2 * s.kvd : 0));
  double weights = f(s.V * s.H);
  for (int64_t l = 0; l < s.L; ++l)
    weights += attention + (sparse(c, l) ? f(moe(c).num_experts * s.H + 3 * moe(c).num_experts_per_tok * moe(c).moe_intermediate_size * s.H)
                                        : f(3 * s.I * s.H));
  const double T = f(tokens);
  // Per layer, the documents' squares (T x T, or per document): twice the causal pairs. A sliding
  // window's layer counts twice its pairs likewise, about 2 T x W.
  std::vector<int64_t> lengths;
  if (document_bounds.empty()) lengths.push_back(tokens);
  for (size_t i = 1; i < document_bounds.size(); ++i) lengths.push_back(document_bounds[i] - document_bounds[i - 1]);
  double squares = 0, band = 0;
  for (int64_t n : lengths) {
    squares += f(n) * f(n);
    band += 2 * f(causal_pairs(n, c.sliding_window));
  }
  double attention_flops = 0;
  for (int64_t l = 0; l < s.L; ++l) attention_flops += 6 * f(s.qd) * (windowed(c, l) ? band : squares);
  return 6 * weights * T + attention_flops;
}

}  // namespace lcx::decoder
