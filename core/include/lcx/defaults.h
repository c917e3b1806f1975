// The plain default provider of each slot, so a manifest with no plugins trains. Part of the SDK
// so a plugin can wrap or delegate to a default (e.g. a strategy that only handles some layers).
#pragma once
#include <memory>

#include "lcx/slots/adapter.h"
#include "lcx/slots/loss.h"
#include "lcx/slots/memory_strategy.h"
#include "lcx/slots/mlp_strategy.h"
#include "lcx/slots/optimizer.h"
#include "lcx/slots/parallelism.h"
#include "lcx/slots/positional_encoding.h"

namespace lcx {

// Loss "nll": the whole logits matrix [T,V] at once, as transformers' plain loss does.
std::unique_ptr<Loss> make_full_logits_loss();
// PositionalEncoding "rope": rotary with rope_theta, no scaling.
std::unique_ptr<PositionalEncoding> make_default_rope();
// MemoryStrategy "on_device": each layer's checkpointed input stays where it was computed.
std::unique_ptr<MemoryStrategy> make_on_device_memory();
// Parallelism "single": one rank holds the whole sequence.
std::unique_ptr<Parallelism> make_single_rank();
// MlpStrategy "whole": the SwiGLU MLP over the whole sequence at once, as transformers runs it.
std::unique_ptr<MlpStrategy> make_whole_mlp();
// Optimizer "adamw": torch's AdamW where the parameters live, master weights and moments beside
// them (on the GPU for a GPU run), after the backward.
std::unique_ptr<Optimizer> make_adamw_optimizer();
// Adapter "none": nothing adapted, nothing frozen (full fine-tuning).
std::unique_ptr<Adapter> make_no_adapter();

}  // namespace lcx
