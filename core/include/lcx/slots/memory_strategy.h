// MemoryStrategy slot: where each layer's checkpointed input waits between forward and backward.
// The step calls save() right after a layer input is final, fetch() when backward needs it (in
// reverse layer order), release() once that layer's backward is done. prefetch() is a hint for
// the layers coming next so a transfer can start before it is needed.
//
// A model may keep more of a layer than its input (selective recompute: the attention output and
// LSE, so the backward never runs the attention forward again): it hands each such tensor to
// keep() during the layer's forward, after save(), and gets them back, in the order kept, from
// kept() during the layer's backward, after fetch(). They live where the input lives and travel
// with it; release() drops them too.
#pragma once
#include <vector>

#include "lcx/plugin.h"
#include "lcx/tensor.h"

namespace lcx {

struct PlanInputs;
struct MemoryPlan;

class MemoryStrategy : public Plugin {
 public:
  // use_recipe (Plugin) comes before begin_step: which layers are saved (Recipe::saves) and the
  // values of the strategy's own knobs (where its inputs go, how many load ahead).
  virtual void begin_step(int num_layers) = 0;
  virtual void save(int layer, const Tensor& input) = 0;
  virtual Tensor fetch(int layer) = 0;
  virtual void keep(int layer, const Tensor& t) = 0;
  virtual std::vector<Tensor> kept(int layer) = 0;
  virtual void prefetch(int /*layer*/) {}
  virtual void release(int layer) = 0;
  virtual void end_step() = 0;
  // Seconds the compute waited on this strategy's transfers during the last step (0 when it
  // never waits); logged per step as time_memory_wait_s.
  virtual double wait_seconds() const { return 0; }
  // Adds the saved inputs' bytes, on the device and on the host, to `plan` (lcx/plan.h); a
  // strategy that adds nothing is planned as keeping nothing.
  virtual void plan(const PlanInputs& /*in*/, MemoryPlan& /*plan*/) const {}
};

}  // namespace lcx
