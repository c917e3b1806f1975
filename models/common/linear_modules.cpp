// The decoder's linear modules as a layer exposes them to adapters (ModelConfig::linear_modules):
// what decoder_model.cpp builds, named as transformers' modules are.
#include "decoder_config.h"
#include "decoder_model.h"

namespace lcx::decoder {

std::vector<std::vector<LinearModule>> linear_modules(const ModelConfig& c, const Family& family,
                                                      const ExpertsLayout& layout) {
  const int64_t d = c.head_dim > 0 ? c.head_dim : c.hidden_size / std::max<int64_t>(1, c.num_heads);
  const int64_t H = c.hidden_size, I = c.intermediate_size, qd = c.num_heads * d, kvd = c.num_kv_heads * d;
  auto module = [](const char* path, int64_t in, int64_t out, bool bias, Proj id, ProjInput input) {
    LinearModule m;
    m.path = path;
    m.in_features = in;
    m.out_features = out;
    m.bias = bias;
    m.id = static_cast<int>(id);
    m.input = static_cast<int>(input);
    return m;
  };
  std::vector<std::vector<LinearModule>> out(static_cast<size_t>(std::max<int64_t>(0, c.num_layers)));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    auto& layer = out[static_cast<size_t>(l)];
    layer.push_back(module("self_attn.q_proj", H, qd, family.qkv_bias, Proj::q_proj, ProjInput::attention_in));
    layer.push_back(module("self_attn.k_proj", H, kvd, family.qkv_bias, Proj::k_proj, ProjInput::attention_in));
    layer.push_back(module("self_attn.v_proj", H, kvd, family.qkv_bias, Proj::v_proj, ProjInput::attention_in));
    layer.push_back(module("self_attn.o_proj", qd, H, family.o_bias, Proj::o_proj, ProjInput::attention_out));
    if (!sparse(c, l)) {
      layer.push_back(module("mlp.gate_proj", H, I, false, Proj::gate_proj, ProjInput::mlp_in));
      layer.push_back(module("mlp.up_proj", H, I, false, Proj::up_proj, ProjInput::mlp_in));
      layer.push_back(module("mlp.down_proj", I, H, false, Proj::down_proj, ProjInput::mlp_act));
      continue;
    }
    const int64_t Im = moe(c).moe_intermediate_size;
    auto experts = [&](LinearModule m) {
      m.experts = moe(c).num_experts;
      m.experts_per_token = moe(c).num_experts_per_tok;
      m.parameter = layout.fused;
      return m;
    };
    if (layout.fused) {
      layer.push_back(experts(module("mlp.experts.gate_up_proj", H, 2 * Im, true, Proj::gate_up_proj, ProjInput::mlp_in)));
      layer.push_back(experts(module("mlp.experts.down_proj", Im, H, true, Proj::down_proj, ProjInput::mlp_act)));
    } else {
      layer.push_back(experts(module("mlp.experts.gate_proj", H, Im, false, Proj::gate_proj, ProjInput::mlp_in)));
      layer.push_back(experts(module("mlp.experts.up_proj", H, Im, false, Proj::up_proj, ProjInput::mlp_in)));
      layer.push_back(experts(module("mlp.experts.down_proj", Im, H, false, Proj::down_proj, ProjInput::mlp_act)));
    }
  }
  return out;
}

}  // namespace lcx::decoder
