// PositionalEncoding slot: rotary frequencies and the tables the attention applies. Positions are
// GLOBAL (a shard far into the sequence gets its true positions from the Parallelism slot).
#pragma once
#include <string>
#include <vector>

#include "lcx/plugin.h"
#include "lcx/tensor.h"

namespace lcx {

struct PlanInputs;
struct MemoryPlan;

struct RopeModelInfo {
  int64_t head_dim = 128;
  double rope_theta = 1e6;
  int64_t max_position_embeddings = 40960;
  // The HF rope parameters of the checkpoint's config.json as JSON text: transformers 5's
  // `rope_parameters` object, or transformers 4's `rope_scaling` (with rope_theta merged in).
  // "{}" when the config carries none.
  std::string rope_parameters_json = "{}";
};

struct RopeTables {
  Tensor cos;  // [T, head_dim/2] fp32, already multiplied by attention_scaling
  Tensor sin;
  double attention_scaling = 1.0;
};

class PositionalEncoding : public Plugin {
 public:
  virtual void configure(const RopeModelInfo& info) = 0;
  // inv_freq[i] for i in [0, head_dim/2), as transformers computes it (fp64 here, fp32 there).
  virtual std::vector<double> inv_freq() const = 0;
  virtual double attention_scaling() const = 0;
  // The positions the scheme places correctly; a longer sequence gets a loud warning.
  virtual int64_t effective_max_positions() const = 0;
  // The `rope_parameters` object written into an exported config.json (JSON text).
  virtual std::string hf_rope_parameters() const = 0;
  // positions: int64 [T] on the host. The default builds cos/sin from inv_freq in fp32 the way
  // transformers does (freqs = pos * inv_freq in fp32, then cos/sin, then * attention_scaling).
  virtual RopeTables tables(const Tensor& positions, Device device) const;
  // Adds what this provider holds during a step to `plan` (lcx/plan.h); the default adds nothing.
  virtual void plan(const PlanInputs& /*in*/, MemoryPlan& /*plan*/) const {}
};

}  // namespace lcx
