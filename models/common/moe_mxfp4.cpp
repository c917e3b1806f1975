#include "moe_mxfp4.h"

#include <cmath>
#include <map>
#include <memory>
#include <vector>

#include "lcx/error.h"

namespace lcx::decoder {
namespace {

constexpr float kFp4[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                            -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// The raw bytes of a uint8 tensor of the checkpoint, its shape checked against `want`.
const uint8_t* u8_bytes(const safetensors::Checkpoint& ck, std::map<std::string, std::shared_ptr<safetensors::File>>& files,
                        const std::string& name, const Shape& want) {
  if (!ck.has(name))
    throw Error(str(ck.path(), ": tensor '", name, "' is missing (an MXFP4 checkpoint stores each experts' weight as "
                    "_blocks and _scales)"),
                "quantization_config", "check that config.json belongs to these weights");
  const safetensors::TensorInfo& info = ck.info(name);
  if (info.dtype != "U8")
    throw Error(str(ck.file_of(name), ": tensor '", name, "' is ", info.dtype, "; MXFP4 blocks and scales are U8"),
                "quantization_config");
  if (info.shape != want)
    throw Error(str(ck.file_of(name), ": tensor '", name, "' has shape ", shape_str(info.shape), " but config.json implies ",
                    shape_str(want)),
                "quantization_config");
  const std::string& path = ck.file_of(name);
  auto& f = files[path];
  if (!f) f = std::make_shared<safetensors::File>(path);
  const safetensors::TensorInfo* t = f->find(name);
  LCX_CHECK(t, path, " lists no tensor ", name);
  return f->bytes(*t);
}

}  // namespace

void mxfp4_dequantize_expert(const uint8_t* blocks, const uint8_t* scales, int64_t in, int64_t out, float* out_values) {
  const int64_t groups = in / 32;
  for (int64_t o = 0; o < out; ++o)
    for (int64_t g = 0; g < groups; ++g) {
      const int exponent = static_cast<int>(scales[o * groups + g]) - 127;
      const uint8_t* b = blocks + (o * groups + g) * 16;
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t i = g * 32 + 2 * j;
        out_values[i * out + o] = std::ldexp(kFp4[b[j] & 0x0F], exponent);
        out_values[(i + 1) * out + o] = std::ldexp(kFp4[b[j] >> 4], exponent);
      }
    }
}

void mxfp4_load_experts(const safetensors::Checkpoint& ck, const std::string& name, int64_t first, Tensor& dst,
                        bool check_finite) {
  LCX_CHECK(dst.dim() == 3, "mxfp4_load_experts: ", name, " must be [experts, in, out]");
  const int64_t El = dst.size(0), in = dst.size(1), out = dst.size(2);
  if (in % 32 != 0)
    throw Error(str(name, ": its input dimension ", in, " is not a whole number of MXFP4 blocks of 32"),
                "quantization_config", "MXFP4 needs hidden_size and intermediate_size multiples of 32");
  const std::string blocks_name = name + "_blocks", scales_name = name + "_scales";
  // The checkpoint holds every expert; this rank takes first .. first + El.
  const int64_t E = ck.has(blocks_name) && !ck.info(blocks_name).shape.empty() ? ck.info(blocks_name).shape[0] : El;
  if (first + El > E)
    throw Error(str(ck.file_of(blocks_name), ": tensor '", blocks_name, "' holds ", E, " experts; this rank needs ",
                    first, " .. ", first + El - 1),
                "num_local_experts", "check that config.json belongs to these weights");
  std::map<std::string, std::shared_ptr<safetensors::File>> files;
  const uint8_t* blocks = u8_bytes(ck, files, blocks_name, {E, out, in / 32, 16});
  const uint8_t* scales = u8_bytes(ck, files, scales_name, {E, out, in / 32});
  std::vector<float> values(static_cast<size_t>(in * out));
  for (int64_t e = 0; e < El; ++e) {
    const int64_t x = first + e;
    mxfp4_dequantize_expert(blocks + x * out * (in / 32) * 16, scales + x * out * (in / 32), in, out, values.data());
    if (check_finite)
      for (size_t i = 0; i < values.size(); ++i)
        if (!std::isfinite(values[i]))
          throw Error(str(ck.file_of(scales_name), ": expert ", x, " of '", name, "' dequantizes to ", values[i],
                          " at [", static_cast<int64_t>(i) / out, ", ", static_cast<int64_t>(i) % out, "] (an e8m0 scale of 255)"),
                      "check_finite", "use a release without such scales, or check_finite = false to load it anyway");
    Tensor row = dst.rows(e, e + 1);
    row.copy_from(Tensor::from_floats(values, {1, in, out}, dst.dtype(), Device::cpu()));
  }
}

}  // namespace lcx::decoder
