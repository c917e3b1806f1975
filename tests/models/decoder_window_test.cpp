// The decoder library's sliding-window accounting: Model::step_flops (decoder_step_flops) counts a
// sliding_attention layer's attention as twice its window's pairs (about 2 T x W) in place of the
// square, per document; a family's attention sinks count one logit per query head a layer.
#include <gtest/gtest.h>

#include <vector>

#include "decoder_plan.h"
#include "lcx/attention_cost.h"
#include "lcx/plan.h"

namespace lcx::decoder {
namespace {

ModelConfig two_layers() {
  ModelConfig c;
  c.vocab_size = 70;
  c.hidden_size = 48;
  c.intermediate_size = 100;
  c.num_layers = 2;
  c.num_heads = 6;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.layer_types = {"full_attention", "full_attention"};
  return c;
}

TEST(DecoderWindow, StepFlopsCountAWindowedLayersPairs) {
  ModelConfig full = two_layers();
  ModelConfig sliding = full;
  sliding.layer_types = {"sliding_attention", "full_attention"};
  sliding.sliding_window = 64;
  const double qd = 6 * 8;
  for (const std::vector<int64_t>& docs : {std::vector<int64_t>{}, std::vector<int64_t>{0, 40, 1000}}) {
    double squares = 0, windowed = 0;
    for (int64_t n : docs.empty() ? std::vector<int64_t>{1000} : std::vector<int64_t>{40, 960}) {
      squares += static_cast<double>(n * n);
      windowed += 2.0 * static_cast<double>(causal_pairs(n, 64));
    }
    const double a = decoder_step_flops(full, {}, 1000, docs), b = decoder_step_flops(sliding, {}, 1000, docs);
    EXPECT_DOUBLE_EQ(a - b, 6 * qd * (squares - windowed)) << docs.size() << " bounds";
  }
  EXPECT_EQ(causal_pairs(1000, 64), 64 * 65 / 2 + (1000 - 64) * 64);
  EXPECT_EQ(causal_pairs(10, 64), 55);
  EXPECT_EQ(causal_pairs(10), 55);
}

TEST(DecoderWindow, SinksAreOneLogitPerHeadALayer) {
  PlanInputs in;
  in.model = two_layers();
  in.seq_len = in.tokens_per_rank = 256;
  in.weight_dtype = DType::f32;
  MemoryPlan without, with;
  plan_dense_decoder(in, without, {}, 0, {true, false, false});
  plan_dense_decoder(in, with, {}, 0, {true, false, true});
  EXPECT_EQ(with.parameters - without.parameters, 2 * 6);
}

}  // namespace
}  // namespace lcx::decoder
