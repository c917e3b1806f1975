// offload: checkpointed layer inputs wait in pinned host memory between forward and backward.
//
// Forward, save(l, x): the copy stream waits on an event recorded on the compute stream after x
// was written, copies x to layer l's part of the pinned pool and records `copied`. The device x
// is kept until that event completes, then dropped at a later save (never by stalling compute);
// if more than prefetch + 1 inputs would be held, the host waits for the oldest copy, which the
// GPU finished long ago unless the host ran far ahead of it.
//
// Backward, fetch(l): the inputs still on the device from the forward's tail are used as they
// are; the others were loaded ahead (prefetch layers below the one being fetched) into fresh
// device tensors on the copy stream, and the compute stream waits on their `copied` event
// (cudaStreamWaitEvent: no host sync). Timing events around that wait give wait_seconds().
// Fresh device tensors come from a stream-ordered allocator that may hand out memory compute
// work still reads, so each load first waits on an event recorded on the compute stream.
//
// The pool is one pinned buffer of (the moved layers) x bytes per input, pinned at the first step (its
// size logged, refused beyond the host's available memory) and reused by every later step.
//
// What the model keeps of a layer beside its input (keep(): its attention output and LSE) takes
// the same road: each tensor is copied out on the copy stream after the input, into a pinned
// buffer of its own (pinned at the first step, reused after), `copied` re-recorded so it covers
// them all, and loaded back with the input by fetch(). A layer's state is its whole bundle.
//
// Placement (gpu_layers = N, or the plan's choice under "auto"): the last N saved layers keep their
// input (and kept tensors) on the device for the whole step and never touch the pool, which holds
// only the others. The last ones, because their backward comes first (they are released first and
// never wait on a copy in) and the forward's tail already holds them, so the copies out that would
// be least hidden (nothing left to compute behind them) are the ones saved.
//
// Only the layers the step saves are placed: with train.checkpoint_every = k, every k-th.
//
// On CPU tensors the same code runs with copies between host buffers and events that are always
// complete (lcx/stream.h): the bookkeeping CI tests is the bookkeeping the GPU runs.
#include <lcx/log.h>
#include <lcx/pinned.h>
#include <lcx/plan.h>
#include <lcx/plugin.h>
#include <lcx/size_math.h>
#include <lcx/slots/memory_strategy.h>
#include <lcx/slots/model.h>
#include <lcx/stream.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <optional>
#include <vector>

namespace lcx {
namespace {

// The keys of the choices this strategy leaves to the plan under "auto", and its knobs' names.
constexpr const char* kGpuLayers = "gpu_layers";
constexpr const char* kPrefetch = "prefetch";

class Offload final : public MemoryStrategy {
 public:
  // gpu_layers: -1 for "auto" (the recipe's), else the saved inputs kept on the device.
  // prefetch: -1 for "auto" (the recipe's, else kDefaultPrefetch), else the inputs loaded ahead.
  // name: the provider's, by which the recipe names its knobs.
  Offload(int prefetch, int64_t max_host_bytes, int64_t gpu_layers, std::string name)
      : prefetch_key_(prefetch), max_host_bytes_(max_host_bytes), gpu_layers_(gpu_layers), name_(std::move(name)) {}

  // Under "auto": how far ahead the backward loads (the own rule first; nothing ahead only where
  // that does not fit: it frees the window's GPU bytes, and exposes each copy in), and how many
  // saved inputs stay on the GPU (each one more GPU bytes and fewer pinned: the most that fit).
  std::vector<Knob> knobs(const PlanInputs& in) const override {
    std::vector<Knob> out;
    if (prefetch_key_ < 0) {
      Knob k;
      k.name = kPrefetch;
      k.values = {kDefaultPrefetch, 0};
      k.default_value = kDefaultPrefetch;
      k.search = KnobSearch::until_fits;
      k.means = "activation offload: saved inputs loaded back ahead of the backward's use";
      out.push_back(std::move(k));
    }
    if (gpu_layers_ < 0) {
      Knob k;
      k.name = kGpuLayers;
      for (int64_t n = 0; n <= in.recipe.saved_layers(in.model.num_layers); ++n) k.values.push_back(n);
      k.default_value = -1;  // none
      k.search = KnobSearch::most_that_fits;
      k.means = "activation offload: saved layer inputs kept on the GPU, the others in pinned host memory";
      out.push_back(std::move(k));
    }
    return out;
  }

  void use_recipe(const Recipe& recipe) override {
    recipe_ = recipe;
    prefetch_ = ahead(recipe);
  }

  void begin_step(int num_layers) override {
    LCX_CHECK(num_layers >= 0, "offload: ", num_layers, " layers");
    // Events live across steps (creating them is not free); everything else starts clean.
    if (static_cast<int>(inputs_.size()) != num_layers) {
      inputs_.clear();
      inputs_.resize(static_cast<size_t>(num_layers));
    }
    for (LayerInput& s : inputs_) {
      drop(s);  // after a step that threw midway, copies may still touch the inputs it held
      s.waited = false;
    }
    // Which layers are saved, which of them stay on the device, and each moved one's pool slot.
    const int64_t saved = recipe_.saved_layers(num_layers);
    const int64_t resident = resident_layers(saved);
    int64_t slot = 0, seen = 0;
    for (int l = 0; l < num_layers; ++l) {
      LayerInput& s = inputs_[static_cast<size_t>(l)];
      s.saved = recipe_.saves(l);
      s.resident = s.saved && seen++ >= saved - resident;
      const int64_t was = s.slot;
      s.slot = s.saved && !s.resident ? slot++ : -1;
      if (s.slot != was) s.host = Tensor();
    }
    moved_ = static_cast<size_t>(slot);
    max_held_ = 0;
    misses_ = 0;
    host_wait_s_ = 0;
  }

  void save(int layer, const Tensor& x) override {
    LayerInput& s = input_of(layer);
    LCX_CHECK(s.saved, "offload: layer ", layer, " is saved, but the recipe saves every ", recipe_.checkpoint_every(),
              "-th layer only");
    prepare(x);
    reap();
    if (s.resident) {
      // The first resident input: the moved ones still copying out are waited for and dropped, so
      // the residents never sit beside the prefetch window (the plan counts the larger of the two).
      // The host waits for copies of inputs produced a layer or more ago; the GPU keeps its queue.
      for (LayerInput& o : inputs_)
        if (o.state == State::saving) {
          const auto t0 = std::chrono::steady_clock::now();
          o.copied.synchronize();
          host_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          o.device = Tensor();
          o.kept_device.clear();
          o.state = State::on_host;
        }
      s.device = x;
      s.kept_device.clear();
      s.kept = 0;
      s.state = State::resident;
      return;
    }
    while (held() >= prefetch_ + 1) {  // bound the inputs on the device: wait for the oldest copy out
      LayerInput* oldest = nullptr;
      for (LayerInput& o : inputs_)
        if (o.state == State::saving) {
          oldest = &o;
          break;
        }
      LCX_CHECK(oldest, "offload: ", held(), " inputs held on the device but none is being copied out");
      const auto t0 = std::chrono::steady_clock::now();
      oldest->copied.synchronize();
      host_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      oldest->device = Tensor();
      oldest->kept_device.clear();
      oldest->state = State::on_host;
    }
    if (s.host.shape() != x.shape() || s.host.dtype() != x.dtype())
      s.host = Tensor::borrow(static_cast<char*>(pool_.data()) + static_cast<size_t>(s.slot) * x.nbytes(), x.shape(),
                              x.dtype(), Device::cpu());
    const Stream compute = Stream::compute(device_);
    produced_.record(compute);
    copy_.wait(produced_);
    copy_async(s.host, x, copy_);
    s.copied.record(copy_);
    s.device = x;
    s.kept_device.clear();
    s.kept = 0;
    s.state = State::saving;
    note_held();
  }

  void keep(int layer, const Tensor& t) override {
    LayerInput& s = input_of(layer);
    if (s.state == State::resident) {  // stays beside its input
      ++s.kept;
      s.kept_device.push_back(t);
      return;
    }
    LCX_CHECK(s.state == State::saving, "offload: layer ", layer, " keeps a tensor before its input was saved");
    const size_t k = s.kept++;
    if (k == s.kept_host.size()) s.kept_host.emplace_back();
    Pinned& host = s.kept_host[k];
    if (host.view.shape() != t.shape() || host.view.dtype() != t.dtype()) {
      if (host.buffer.bytes() < t.nbytes()) {
        host.buffer = PinnedBuffer();
        host.buffer = pin(t.nbytes(), str("a kept tensor of layer ", layer, " (", shape_str(t.shape()), ")"));
      }
      host.view = host.buffer.view(t.shape(), t.dtype());
    }
    produced_.record(Stream::compute(device_));
    copy_.wait(produced_);
    copy_async(host.view, t, copy_);
    s.copied.record(copy_);  // later on the same stream: covers the input's copy too
    s.kept_device.push_back(t);
  }

  std::vector<Tensor> kept(int layer) override {
    LayerInput& s = input_of(layer);
    LCX_CHECK(s.state == State::fetched, "offload: kept tensors of layer ", layer, " asked before its fetch");
    return s.kept_device;
  }

  Tensor fetch(int layer) override {
    LayerInput& s = input_of(layer);
    LCX_CHECK(s.state != State::empty, "offload: layer ", layer, " input was never saved");
    if (s.state == State::on_host) {  // not loaded ahead: a miss, the wait below is the whole copy
      ++misses_;
      load(s);
    }
    if (s.state == State::loading) {
      const Stream compute = Stream::compute(device_);
      s.wait_start.record(compute);
      compute.wait(s.copied);
      s.wait_end.record(compute);
      s.waited = true;
    }
    // A saving or resident input still holds the input the forward wrote: nothing to wait for.
    s.state = State::fetched;
    // The next `prefetch` saved layers below start loading (those on the device need nothing).
    for (int k = layer - 1, n = 0; k >= 0 && n < prefetch_; --k)
      if (inputs_[static_cast<size_t>(k)].saved) {
        prefetch(k);
        ++n;
      }
    return s.device;
  }

  // prefetch = 0 loads nothing ahead, the step's hints included: a resident input and a moved one
  // loaded beside it would be two inputs where the plan (and the user who chose 0) count one.
  void prefetch(int layer) override {
    LayerInput& s = input_of(layer);
    if (prefetch_ > 0 && s.state == State::on_host && held() < prefetch_ + 1) load(s);
  }


  void release(int layer) override { drop(input_of(layer)); }

  void end_step() override {
    for (LayerInput& s : inputs_) drop(s);
    if (max_held_ > 0)
      log::debug(str("offload: at most ", max_held_, " layer inputs on ", device_name(device_), ", ", misses_,
                     " fetches not loaded ahead, host waited ", host_wait_s_, " s for copies out"));
  }

  std::string plan_offer() const override { return "saved layer inputs in pinned host memory"; }

  // The saved layers whose inputs stay on the device: the key, else the recipe's, of `saved`.
  int64_t resident_layers(int64_t saved) const {
    const int64_t want = gpu_layers_ >= 0 ? gpu_layers_ : recipe_.get(name_, kGpuLayers, -1);
    return std::clamp<int64_t>(want, 0, saved);
  }

  // The compute stream's waits on copies in, over the last step; read after the step's sync.
  double wait_seconds() const override {
    double total = 0;
    for (const LayerInput& s : inputs_)
      if (s.waited) {
        s.wait_end.synchronize();
        total += s.wait_end.seconds_since(s.wait_start);
      }
    return total;
  }

  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const int64_t saved = in.recipe.saved_layers(in.model.num_layers);
    const int64_t want = gpu_layers_ >= 0 ? gpu_layers_ : in.recipe.get(name_, kGpuLayers, -1);
    const int64_t resident = std::clamp<int64_t>(want, 0, saved), moved = saved - resident;
    const int prefetch = ahead(in.recipe);
    const int64_t window = std::min<int64_t>(moved, prefetch + 1);
    // The resident inputs are the last ones: the window of moved inputs has drained (save) before
    // the first of them is saved, and the backward loads moved ones ahead only as residents are
    // released (at resident layer j from the first: j + 1 residents, prefetch - j loaded ahead). So
    // the two never add up: at most the larger is on the device.
    const int64_t on_gpu = std::max(resident, window);
    const int64_t each = in.tokens_per_rank * in.model.hidden_size * static_cast<int64_t>(dtype_size(in.weight_dtype));
    if (on_gpu == 0) return;
    const std::string which = resident == 0   ? str("at most ", window, " moved (prefetch ", prefetch, ")")
                              : moved == 0    ? str("the last ", resident, " kept there (gpu_layers)")
                                              : str("the last ", resident, " kept there (gpu_layers) or at most ", window,
                                                    " moved (prefetch ", prefetch, "), never both");
    plan.add("saved_inputs", str("saved layer inputs on the GPU: ", on_gpu, " x [T,H], ", which),
             PlanCategory::activations_gpu, on_gpu * each, plan_phase::step);
    if (plan.kept_bytes_per_layer > 0)
      plan.add("kept_attention", str("kept attention on the GPU: ", on_gpu, " layers, beside their inputs"),
               PlanCategory::activations_gpu, on_gpu * plan.kept_bytes_per_layer, plan_phase::step);
    if (moved == 0) return;
    if (plan.kept_bytes_per_layer > 0)
      plan.add("kept_attention_host", str("kept attention in pinned host memory: ", moved, " layers"),
               PlanCategory::activations_host, moved * plan.kept_bytes_per_layer, plan_phase::always, true);
    // Pinned once and kept across steps.
    plan.add("saved_inputs_host", str("saved layer inputs in pinned host memory: ", moved, " x [T,H]"),
             PlanCategory::activations_host, moved * each, plan_phase::always, true);
    // Nothing loaded ahead: the backward waits for each moved layer's copy in.
    if (prefetch == 0) plan.work.exposed_copy_bytes += static_cast<double>(moved * (each + plan.kept_bytes_per_layer));
  }

 private:
  // empty -> saving (copy out in flight, device input kept) -> on_host -> loading (copy in
  // flight) -> fetched -> empty at release. A saving input may be fetched directly; a resident
  // one (gpu_layers) goes empty -> resident -> fetched.
  enum class State { empty, saving, on_host, loading, fetched, resident };
  struct Pinned {
    PinnedBuffer buffer;
    Tensor view;  // the kept tensor's shape over `buffer`
  };
  struct LayerInput {
    Tensor host;    // this layer's part of the pinned pool
    Tensor device;  // the input on the device, while the state holds one
    std::vector<Tensor> kept_device;  // the kept tensors on the device, beside `device`
    std::vector<Pinned> kept_host;    // their pinned copies, one buffer each
    size_t kept = 0;                  // how many the layer kept this step
    State state = State::empty;
    Event copied;  // the last copy out or in is done
    Event wait_start, wait_end;
    bool waited = false;  // the compute stream waited on `copied` this step
    bool has_events = false;  // the events above were made for device_
    bool saved = true;        // the step saves this layer's input (Recipe::checkpoint_every)
    bool resident = false;    // ... and it stays on the device (gpu_layers)
    int64_t slot = -1;        // its part of the pool, when moved
  };

  LayerInput& input_of(int layer) {
    LCX_CHECK(layer >= 0 && layer < static_cast<int>(inputs_.size()), "offload: layer ", layer, " of ",
              inputs_.size());
    return inputs_[static_cast<size_t>(layer)];
  }

  // The moved inputs on the device (resident ones are the plan's separate term).
  int held() const {
    int n = 0;
    for (const LayerInput& s : inputs_) n += s.device.defined() && !s.resident;
    return n;
  }

  void note_held() {
    max_held_ = std::max(max_held_, held());
    LCX_CHECK(max_held_ <= prefetch_ + 1, "offload: ", max_held_, " layer inputs on the device, more than prefetch + 1");
  }

  // The streams and events for the device of the first input, and the pool sized for this step.
  void prepare(const Tensor& x) {
    if (!copy_made_ || x.device() != device_) {
      device_ = x.device();
      copy_ = Stream::create_copy(device_);
      produced_ = Event::create(device_);
      for (LayerInput& s : inputs_) s.has_events = false;
      copy_made_ = true;
    }
    for (LayerInput& s : inputs_)
      if (!s.has_events) {
        s.copied = Event::create(device_);
        s.wait_start = Event::create(device_, true);
        s.wait_end = Event::create(device_, true);
        s.has_events = true;
      }
    const size_t need = moved_ * x.nbytes();
    if (pool_.bytes() >= need) return;
    if (pool_.bytes() > 0) {  // a smaller pool from an earlier, shorter step is unpinned first
      pool_ = PinnedBuffer();
      for (LayerInput& s : inputs_) s.kept_host.clear();
      release_cached_pinned();
    }
    const std::string what = str(moved_, " layer inputs of ", format_bytes(static_cast<int64_t>(x.nbytes())));
    const int64_t available = host_memory_available();  // before the pool takes its share
    pool_ = pin(need, what);
    for (LayerInput& s : inputs_) s.host = Tensor();
    log::info(str("offload: ", what, " in ", pinned_is_page_locked() ? "pinned" : "(unpinned) host",
                  " memory: ", format_bytes(need), " of ",
                  available < 0 ? std::string("unknown") : format_bytes(available),
                  " available; at most ", prefetch_ + 1, " of them on ", device_name(device_), ", ",
                  inputs_.size() - moved_, " layers not moved (kept on the device or not saved)"));
  }

  // `bytes` of pinned memory for `what`, refused with the fix where the host (or max_host_mib,
  // counting what this strategy pinned already) has less.
  PinnedBuffer pin(size_t bytes, const std::string& what) {
    const int64_t available = host_memory_available();
    int64_t limit = available;
    const bool capped = max_host_bytes_ > 0 && (limit < 0 || max_host_bytes_ - pinned_bytes() < limit);
    if (capped) limit = max_host_bytes_ - pinned_bytes();
    if (limit >= 0 && static_cast<int64_t>(bytes) > limit)
      throw Error(str("offload: ", what, " need ", format_bytes(bytes), " of pinned host memory, but only ",
                      format_bytes(std::max<int64_t>(limit, 0)), " is available (",
                      capped ? "offload.max_host_mib" : "MemAvailable in /proc/meminfo", ")"),
                  "offload", "shorten data.seq_len, free host memory, or drop offload from [plugins] load");
    return pinned_alloc(bytes, MemoryCategory::activations);
  }

  int64_t pinned_bytes() const {
    size_t n = pool_.bytes();
    for (const LayerInput& s : inputs_)
      for (const Pinned& p : s.kept_host) n += p.buffer.bytes();
    return static_cast<int64_t>(n);
  }

  // Drops the device inputs whose copy out has completed.
  void reap() {
    for (LayerInput& s : inputs_)
      if (s.state == State::saving && s.copied.done()) {
        s.device = Tensor();
        s.kept_device.clear();
        s.state = State::on_host;
      }
  }

  void load(LayerInput& s) {
    s.device = Tensor::empty(s.host.shape(), s.host.dtype(), device_, MemoryCategory::activations);
    s.kept_device.clear();
    for (size_t k = 0; k < s.kept; ++k)
      s.kept_device.push_back(Tensor::empty(s.kept_host[k].view.shape(), s.kept_host[k].view.dtype(), device_,
                                            MemoryCategory::activations));
    produced_.record(Stream::compute(device_));
    copy_.wait(produced_);
    copy_async(s.device, s.host, copy_);
    for (size_t k = 0; k < s.kept; ++k) copy_async(s.kept_device[k], s.kept_host[k].view, copy_);
    s.copied.record(copy_);
    s.state = State::loading;
    note_held();
  }

  // Gives the layer's device input back. Its last copy out (reading it) or in (writing it) may
  // still run, even after a fetch of an input the forward left on the device: the compute stream,
  // which reuses freed memory, waits for that copy first (a no-op once it has completed).
  void drop(LayerInput& s) {
    if (s.device.defined() && !s.resident) Stream::compute(device_).wait(s.copied);
    s.device = Tensor();
    s.kept_device.clear();
    s.state = State::empty;
  }

  static constexpr int kDefaultPrefetch = 2;  // hides the copies at every length measured
  int ahead(const Recipe& r) const {
    const int64_t chosen = r.get(name_, kPrefetch, -1);
    return prefetch_key_ >= 0 ? prefetch_key_ : chosen >= 0 ? static_cast<int>(chosen) : kDefaultPrefetch;
  }
  const int prefetch_key_;
  int prefetch_ = prefetch_key_ >= 0 ? prefetch_key_ : kDefaultPrefetch;  // this run's: ahead(recipe_)
  const int64_t max_host_bytes_;
  const int64_t gpu_layers_;
  const std::string name_;
  Recipe recipe_;
  std::vector<LayerInput> inputs_;
  size_t moved_ = 0;  // saved layers whose inputs go through the pool
  PinnedBuffer pool_;
  Device device_;
  bool copy_made_ = false;
  Stream copy_;
  Event produced_;  // a point on the compute stream the copy stream waits for
  int max_held_ = 0;
  int misses_ = 0;
  double host_wait_s_ = 0;
};

// A key that is "auto" (the plan's recipe decides: -1) or a count in [0, most].
int64_t auto_or_count(const ConfigView& config, const char* key, int64_t most, const char* fix) {
  const std::optional<int64_t> n = config.get_int_or_auto(key, fix);
  if (!n) return -1;
  if (*n < 0 || *n > most) config.fail(key, str(*n, " is out of range"), fix);
  return *n;
}

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  args.config.describe(kPrefetch, "saved layer inputs copied back ahead of the backward; 2 hides the copies", "0 to 64");
  args.config.describe("max_host_mib", "pinned host memory the offloaded inputs may take, MiB; 0: the host's MemAvailable", ">= 0");
  args.config.describe(kGpuLayers, "saved layer inputs kept on the GPU, the rest held in pinned host memory", ">= 0");
  const int64_t depth = auto_or_count(args.config, kPrefetch, 64,
                                      "\"auto\" (the plan's choice) or 0 to 64 inputs loaded ahead; 2 hides the copies");
  const int64_t max_mib = args.config.get_int("max_host_mib", 0);
  if (max_mib < 0) args.config.fail("max_host_mib", "must be >= 0", "0 means the host's MemAvailable");
  const int64_t gpu_layers =
      auto_or_count(args.config, kGpuLayers, std::numeric_limits<int32_t>::max(),
                    "\"auto\" (the plan's choice) or a count >= 0 of saved layer inputs kept on the GPU");
  return std::make_unique<Offload>(static_cast<int>(depth), max_mib * 1024 * 1024, gpu_layers, args.name);
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_MEMORY_STRATEGY, "offload", "0.2.0", "checkpointed activations in pinned host memory",
           "ready", lcx::create)
