#include "train/step.h"

#include <algorithm>
#include <chrono>
#include <optional>
#include <vector>

#include "lcx/clock.h"
#include "lcx/memory.h"
#include "lcx/profile.h"

namespace lcx {
namespace {

// Device work is asynchronous; a phase's time is only true once the device has caught up.
void sync(Device d) {
  if (!d.is_cuda()) return;
  if (DeviceBackend* b = backend_for(d)) b->synchronize();
}

Tensor on(const Tensor& t, Device d) { return t.device() == d ? t : t.to(d); }

// The model's compute dtype: activations take the embedding's.
DType act_dtype(const StepSlots& s) {
  if (s.activation_dtype) return *s.activation_dtype;
  const Tensor head = s.model->head_weight();
  LCX_CHECK(head.defined(), "the head weight has no value (sharded between layers?): set StepSlots::activation_dtype");
  return head.dtype();
}

// StepContext::rows: the shard's row indices in its sequence on the device, 0 .. T-1 where the
// shard has none.
Tensor row_indices(const Shard& shard, Device device) {
  Tensor host = shard.indices;
  if (!host.defined()) {
    host = Tensor::empty({shard.tokens.size(0)}, DType::i64);
    fill_indices(host, 0, 0, shard.tokens.size(0));
  }
  return on(host, device);
}

// The plan's recipe to every slot's provider (Plugin::use_recipe), before it runs.
void hand_recipe(StepSlots& s) {
  for_each_slot([&]<class T>(const SlotRow<T>&) {
    if (T* provider = s.get<T>()) provider->use_recipe(s.recipe);
  });
}

// embed -> layers -> final norm, without saving anything: the evaluation and logits path. The
// caller ends the hooks' pass (end_forward_only) once it has read the head.
Tensor forward_only(StepSlots& s, StepHooks& hooks, const Shard& shard, Device device, const RopeTables& rope) {
  const ModelConfig& cfg = s.model->config();
  hand_recipe(s);
  const int64_t T = shard.tokens.size(0), H = cfg.hidden_size;
  StepContext ctx{&rope, s.parallel, device, s.mlp, nullptr, s.recipe, shard.document_bounds, s.adapter, 1.0,
                  s.mesh ? &s.mesh->seq() : nullptr, s.mesh ? s.mesh->partition() : nullptr, row_indices(shard, device)};
  const Tensor tokens = on(shard.tokens, device);
  Tensor x = Tensor::empty({T, H}, act_dtype(s), device, MemoryCategory::activations);
  s.optimizer->weights_needed(Optimizer::kNonLayer);
  hooks.begin_forward_only();
  s.model->embed_forward(tokens, x);
  for (int l = 0; l < cfg.num_layers; ++l) {
    s.optimizer->weights_needed(l);
    Tensor y = Tensor::empty({T, H}, x.dtype(), device, MemoryCategory::activations);
    hooks.before_layer_forward(l);
    s.model->layer_forward(l, x, y, ctx);
    hooks.after_layer_forward(l);
    x = y;
  }
  Tensor hidden = Tensor::empty({T, H}, x.dtype(), device);
  s.model->final_norm_forward(x, hidden);
  return hidden;
}

}  // namespace

StepSlots::StepSlots(Model& m, Loss& l, PositionalEncoding& r, MemoryStrategy& mem, Parallelism& p) {
  model = &m;
  loss = &l;
  positional = &r;
  memory = &mem;
  parallel = &p;
}

void StepSlots::fill_defaults() {
  LCX_CHECK(model, "a step needs a model");
  for_each_slot([&]<class T>(const SlotRow<T>& row) {
    if (get<T>() || !row.make_default) return;
    if (!defaults) defaults = std::make_shared<SlotTuple<std::shared_ptr>>();
    auto& made = defaults->get<T>();
    if (!made) made = row.make_default();
    get<T>() = made.get();
  });
}

void configure_slots(StepSlots& s) {
  s.fill_defaults();
  const ModelConfig& c = s.model->config();
  RopeModelInfo rope;
  rope.head_dim = c.head_dim;
  rope.rope_theta = c.rope_theta;
  rope.max_position_embeddings = c.max_position_embeddings;
  rope.rope_parameters_json = c.rope_parameters_json;
  s.positional->configure(rope);
  ParallelModelInfo par;
  par.num_heads = c.num_heads;
  par.num_kv_heads = c.num_kv_heads;
  par.head_dim = c.head_dim;
  par.layer_types = c.layer_types;
  par.sliding_window = c.sliding_window;
  s.parallel->configure(par, s.mesh);
}

StepResult train_step(StepSlots& s, const Shard& shard, double grad_scale, Device device, double aux_weight) {
  s.fill_defaults();
  StepHooks none;
  StepHooks& hooks = s.hooks ? *s.hooks : none;
  Model& model = *s.model;
  MemoryStrategy& memory = *s.memory;
  Optimizer& optimizer = *s.optimizer;
  const ModelConfig& cfg = model.config();
  const int L = static_cast<int>(cfg.num_layers);
  const int64_t T = shard.tokens.size(0), H = cfg.hidden_size;
  const DType dt = act_dtype(s);
  StepResult r;

  // Forward: each layer's input is handed to the memory strategy before the layer runs.
  const double t0 = now_s();
  std::optional<ProfilePhase> phase(std::in_place, StepPhase::forward);
  // The memory timeline's phases (plan/timeline.h): each allocation tagged with the phase it is of.
  MemoryRecorder& recorder = allocator_for(device).recorder();
  recorder.set_tag("forward");
  const RopeTables rope = s.positional->tables(shard.positions, device);
  StepContext ctx{&rope, s.parallel, device, s.mlp, &memory, s.recipe, shard.document_bounds, s.adapter, aux_weight,
                  s.mesh ? &s.mesh->seq() : nullptr, s.mesh ? s.mesh->partition() : nullptr, row_indices(shard, device)};
  // A layer whose input is not saved runs without the memory strategy: it keeps nothing, and its
  // backward recomputes everything from the rebuilt input.
  StepContext unsaved = ctx;
  unsaved.memory = nullptr;
  const int k = static_cast<int>(s.recipe.checkpoint_every());
  const Tensor tokens = on(shard.tokens, device);
  const Tensor targets = on(shard.targets, device);
  hand_recipe(s);
  memory.begin_step(L);
  optimizer.weights_needed(Optimizer::kNonLayer);
  hooks.begin_step();
  Tensor x = Tensor::empty({T, H}, dt, device, MemoryCategory::activations);
  model.embed_forward(tokens, x);
  for (int l = 0; l < L; ++l) {
    ProfilePhase layer(StepPhase::forward, l);
    const bool saved = s.recipe.saves(l);
    if (saved) memory.save(l, x);
    Tensor y = Tensor::empty({T, H}, dt, device, MemoryCategory::activations);
    optimizer.weights_needed(l);
    hooks.before_layer_forward(l);
    model.layer_forward(l, x, y, saved ? ctx : unsaved);
    hooks.after_layer_forward(l);
    x = y;
  }
  Tensor hidden = Tensor::empty({T, H}, dt, device);
  model.final_norm_forward(x, hidden);
  r.aux = model.aux_loss();
  sync(device);
  const double t1 = now_s();
  phase.emplace(StepPhase::loss);
  recorder.set_tag("loss");

  // Loss: forward and backward at once; the head's gradient accumulates (into the embedding's
  // when tied).
  Tensor dhidden = Tensor::empty({T, H}, dt, device);
  Tensor head_grad = model.head_grad();
  LossResult lr = s.loss->forward_backward(hidden, model.head_weight(), targets, grad_scale, dhidden, head_grad);
  r.loss_sum = lr.loss_sum;
  r.valid = lr.valid;
  phase.emplace(StepPhase::backward);
  recorder.set_tag("backward");
  Tensor dx = Tensor::empty({T, H}, dt, device);
  model.final_norm_backward(x, dhidden, dx);
  hidden = Tensor();
  dhidden = Tensor();
  x = Tensor();

  // Backward by segments, the last first: a segment starts at a saved layer s and runs to the next
  // one. Its other inputs are rebuilt from s's by the forward of layers s .. e-2 (the recipe's cost:
  // one more forward of every unsaved layer) and held for the segment's backward, k-1 x [T,H] at
  // most, each dropped after its layer's backward. Re-running the forward from s for each layer
  // instead would hold one rebuilt input but cost (k-1)k/2 forwards per segment, not k-1.
  // With train.rebuild_each the backward of each layer instead rebuilds its input from s again and
  // holds it alone: (n-1)n/2 forwards for a segment of n, one rebuilt input held rather than n-1.
  std::vector<Tensor> inputs;  // the segment's inputs, s first
  for (int first = (L - 1) / k * k; first >= 0; first -= k) {
    const int end = std::min(L, first + k);
    if (s.recipe.rebuild_each()) {
      Tensor saved = memory.fetch(first);
      if (first > 0) memory.prefetch(first - k);
      for (int l = end - 1; l >= first; --l) {
        Tensor in = saved;
        for (int j = first; j < l; ++j) {
          ProfilePhase layer(StepPhase::forward, j);
          Tensor y = Tensor::empty({T, H}, dt, device, MemoryCategory::activations);
          hooks.before_layer_forward(j);
          model.layer_forward(j, in, y, unsaved);
          hooks.after_layer_forward(j);
          in = y;  // the input it ran from is dropped (unless it is the saved one)
        }
        ProfilePhase layer(StepPhase::backward, l);
        Tensor dinput = Tensor::empty({T, H}, dt, device);
        hooks.before_layer_backward(l);
        model.layer_backward(l, in, dx, dinput, l == first ? ctx : unsaved);
        hooks.after_layer_backward(l);
        optimizer.grads_final(l);
        in = Tensor();
        if (l == first) {
          saved = Tensor();
          memory.release(l);
        }
        dx = dinput;
      }
      continue;
    }
    inputs.assign(1, memory.fetch(first));
    if (first > 0) memory.prefetch(first - k);
    for (int l = first; l + 1 < end; ++l) {
      ProfilePhase layer(StepPhase::forward, l);
      Tensor y = Tensor::empty({T, H}, dt, device, MemoryCategory::activations);
      hooks.before_layer_forward(l);
      model.layer_forward(l, inputs.back(), y, unsaved);
      hooks.after_layer_forward(l);
      inputs.push_back(y);
    }
    for (int l = end - 1; l >= first; --l) {
      ProfilePhase layer(StepPhase::backward, l);
      Tensor dinput = Tensor::empty({T, H}, dt, device);
      hooks.before_layer_backward(l);
      model.layer_backward(l, inputs.back(), dx, dinput, l == first ? ctx : unsaved);
      hooks.after_layer_backward(l);
      optimizer.grads_final(l);
      inputs.pop_back();
      if (l == first) memory.release(l);
      dx = dinput;
    }
  }
  model.embed_backward(tokens, dx);
  hooks.end_step();
  optimizer.grads_final(Optimizer::kNonLayer);
  memory.end_step();
  phase.reset();
  sync(device);
  r.forward_s = t1 - t0;
  r.backward_s = now_s() - t1;
  return r;
}

EvalResult eval_step(StepSlots& s, const Shard& shard, Device device, bool per_position) {
  s.fill_defaults();
  StepHooks none;
  StepHooks& hooks = s.hooks ? *s.hooks : none;
  const RopeTables rope = s.positional->tables(shard.positions, device);
  const Tensor hidden = forward_only(s, hooks, shard, device, rope);
  const Tensor targets = on(shard.targets, device);
  const Tensor head = s.model->head_weight();
  EvalResult r;
  if (!per_position) {
    LossResult lr = s.loss->forward(hidden, head, targets);
    r.loss_sum = lr.loss_sum;
    r.valid = lr.valid;
  } else {
    // One row at a time: the Loss slot returns sums, and a row's sum is that position's loss.
    const int64_t T = hidden.size(0);
    r.per_position.assign(static_cast<size_t>(T), 0.f);
    for (int64_t t = 0; t < T; ++t) {
      LossResult lr = s.loss->forward(hidden.rows(t, t + 1), head, targets.rows(t, t + 1));
      r.per_position[static_cast<size_t>(t)] = static_cast<float>(lr.loss_sum);
      r.loss_sum += lr.loss_sum;
      r.valid += lr.valid;
    }
  }
  hooks.end_forward_only();
  return r;
}

Tensor forward_hidden(StepSlots& s, const Shard& shard, Device device) {
  s.fill_defaults();
  StepHooks none;
  StepHooks& hooks = s.hooks ? *s.hooks : none;
  const RopeTables rope = s.positional->tables(shard.positions, device);
  Tensor hidden = forward_only(s, hooks, shard, device, rope);
  hooks.end_forward_only();
  return hidden;
}

}  // namespace lcx
