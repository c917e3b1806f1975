// The decoder's random init (models/common, every family's): counter-based, so the same seed gives
// the same weights whatever the thread count, and the numbers are N(0, std^2).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "decoder_init.h"

namespace lcx::decoder {
namespace {

// Odd, so the last pair's second half is cut; large enough that fill_normal uses several threads.
constexpr int64_t kElements = (int64_t{1} << 21) + 3;

TEST(Qwen3Init, SameSeedSameWeightsWithOneOrManyThreads) {
  const uint64_t key = init_key(7, "model.layers.0.mlp.up_proj.weight");
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor one = Tensor::empty({kElements}, dt), many = Tensor::empty({kElements}, dt), again = Tensor::empty({kElements}, dt);
    fill_normal(one, key, 0.02, 1);
    fill_normal(many, key, 0.02, 5);
    fill_normal(again, key, 0.02, 0);
    EXPECT_EQ(0, std::memcmp(one.data(), many.data(), one.nbytes())) << dtype_name(dt);
    EXPECT_EQ(0, std::memcmp(one.data(), again.data(), one.nbytes())) << dtype_name(dt);
  }
}

TEST(Qwen3Init, OtherSeedOrNameOtherWeights) {
  Tensor a = Tensor::empty({1024}, DType::f32), b = Tensor::empty({1024}, DType::f32), c = Tensor::empty({1024}, DType::f32);
  fill_normal(a, init_key(7, "w"), 0.02);
  fill_normal(b, init_key(8, "w"), 0.02);
  fill_normal(c, init_key(7, "v"), 0.02);
  int same_b = 0, same_c = 0;
  for (int64_t i = 0; i < 1024; ++i) {
    same_b += a.data_as<float>()[i] == b.data_as<float>()[i];
    same_c += a.data_as<float>()[i] == c.data_as<float>()[i];
  }
  EXPECT_LT(same_b, 4);
  EXPECT_LT(same_c, 4);
}

TEST(Qwen3Init, NormalWithTheModelsStd) {
  const double sd = 0.02;
  Tensor t = Tensor::empty({kElements}, DType::f32);
  fill_normal(t, init_key(3, "model.embed_tokens.weight"), sd);
  const float* x = t.data_as<float>();
  double sum = 0, sq = 0, quart = 0;
  int64_t beyond_2sd = 0;
  for (int64_t i = 0; i < kElements; ++i) {
    sum += x[i];
    sq += static_cast<double>(x[i]) * x[i];
    quart += std::pow(static_cast<double>(x[i]) / sd, 4);
    beyond_2sd += std::abs(x[i]) > 2 * sd;
  }
  const double n = static_cast<double>(kElements), mean = sum / n, std = std::sqrt(sq / n - mean * mean);
  // Standard errors at 2M samples: mean sd/1448, std sd/2048; kurtosis 3 (a normal's) within 0.02.
  EXPECT_NEAR(mean, 0.0, 5 * sd / 1448);
  EXPECT_NEAR(std, sd, 5 * sd / 2048);
  EXPECT_NEAR(quart / n, 3.0, 0.02);
  EXPECT_NEAR(static_cast<double>(beyond_2sd) / n, 0.0455, 0.001);  // P(|z| > 2)
}

}  // namespace
}  // namespace lcx::decoder
