// MXFP4 experts, as the Hub's gpt-oss checkpoints store them (quantization_config quant_method
// "mxfp4"): each fused experts' weight W [E, in, out] (gate_up_proj [E,H,2I], down_proj [E,I,H]) is
// stored transposed, as `<name>_blocks` uint8 [E, out, in/32, 16] and `<name>_scales` uint8
// [E, out, in/32]. A block holds 32 values along `in`, two 4-bit codes per byte, the low nibble
// first; a code is an FP4 (e2m1) value, 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (codes
// 8..15); the block's scale is e8m0, 2^(scale - 127). So
//   W[e, i, o] = fp4(code of value i % 32 in block i / 32 of row (e, o)) * 2^(scales[e, o, i/32] - 127)
// which transformers' convert_moe_packed_tensors computes (then transposes) at load. The values are
// exact in bf16 (a 2-bit mantissa times a power of two), so a bf16 save of them is lossless.
#pragma once
#include <cstdint>
#include <string>

#include "lcx/safetensors.h"
#include "lcx/tensor.h"

namespace lcx::decoder {

// One expert's weight from its blocks [out, in/32, 16] and scales [out, in/32]: out_values fp32
// [in, out] (row-major), as the model holds it.
void mxfp4_dequantize_expert(const uint8_t* blocks, const uint8_t* scales, int64_t in, int64_t out, float* out_values);

// Fills dst [El, in, out] (any float dtype, any device) with experts first .. first + El of the
// checkpoint's `<name>_blocks` and `<name>_scales`, checking their dtypes and shapes by name; with
// check_finite, a value past fp32 (a scale of 255: 2^128) is refused naming the expert and element.
void mxfp4_load_experts(const safetensors::Checkpoint& ck, const std::string& name, int64_t first, Tensor& dst,
                        bool check_finite = true);

}  // namespace lcx::decoder
