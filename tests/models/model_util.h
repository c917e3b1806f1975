// Shared by the model and parity suites: the qwen3 module loaded from the build's plugin folder,
// core's default slots around it, and sequences built from HF-style labels.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "config/manifest.h"
#include "lcx/defaults.h"
#include "lcx/slots/model.h"
#include "loader/plugin_loader.h"
#include "models/fixture_sequence.h"
#include "support/test_util.h"
#include "train/step.h"

namespace lcx::test {

// `table` is the body of the module's [qwen3] table (TOML), e.g. max_shard_size = "1MiB".
inline std::shared_ptr<Model> make_qwen3(const std::string& table = "") { return make_plugin<Model>("qwen3", table); }

// The core default slots (or another positional encoding), configured for `model`.
struct DefaultSlots {
  std::unique_ptr<Loss> loss = make_full_logits_loss();
  std::shared_ptr<PositionalEncoding> rope;
  std::unique_ptr<MemoryStrategy> memory = make_on_device_memory();
  std::unique_ptr<Parallelism> parallel = make_single_rank();
  StepSlots slots;
  explicit DefaultSlots(Model& model, std::shared_ptr<PositionalEncoding> pe = make_default_rope())
      : rope(std::move(pe)), slots{model, *loss, *rope, *memory, *parallel} {
    configure_slots(slots);
  }
};

// HF labels -> one rank's shard (sequence_from_labels).
inline Shard shard_from_labels(const std::vector<int64_t>& ids, const std::vector<int64_t>& labels) {
  return make_single_rank()->shard(sequence_from_labels(ids, labels), 0);
}

// A loss of transformers' kind: mean over valid targets, gradients scaled to match.
inline StepResult mean_loss_step(DefaultSlots& s, const Shard& shard, int64_t valid, Device device = Device::cpu()) {
  s.slots.model->zero_grad();
  return train_step(s.slots, shard, 1.0 / static_cast<double>(valid), device);
}

inline int64_t count_valid(const Shard& s) {
  int64_t n = 0;
  for (int64_t t = 0; t < s.targets.size(0); ++t) n += s.targets.data_as<int64_t>()[t] != -100;
  return n;
}

// The id layer `layer` of the model exposes its linear module `path` by ("self_attn.q_proj";
// LinearModule::id, what Adapter::find is asked by); throws where it lists none of that path.
inline int module_id(const Model& model, int64_t layer, const std::string& path) {
  const LinearModule* m = model.config().linear_module(layer, path);
  if (!m) throw Error(str("the model lists no ", path, " in layer ", layer));
  return m->id;
}

}  // namespace lcx::test
