// host_adamw: AdamW with its fp32 master weights and moments in host memory and the update on
// the CPU, overlapped with the step on the GPU.
//
// The parameters fall into groups: the non-layer ones (embedding, final norm, head) and one per
// decoder layer ("model.layers.<l>."). Each group has one pinned staging buffer, a slot per
// parameter as large as the larger of its gradient and its compute copy.
//
// Backward, grads_final(l): the copy stream waits on an event recorded on the compute stream after
// the layer's backward and copies its gradients down into the staging, so the copies overlap the
// backward of the layers below; a norm thread then sums the squares of each group's gradients as
// they arrive, so grad_norm() after the backward only adds the groups' sums.
//
// step(lr) starts a worker thread and returns: group by group in the forward's order (non-layer
// first, for the embedding), threads update master and moments from the staged gradients
// (torch's AdamW in fp32, the order of core's AdamW), then round the new master into the staging
// as the compute copy and copy it up on the copy stream, recording `uploaded`. The next step's
// forward calls weights_needed(l) before layer l: the host waits only until the worker has issued
// layer l's copy, the compute stream only for that copy (an event), so the update of later layers
// hides behind the forward of earlier ones. The two waits are timed (wait_seconds) and the device
// one is a ProfileScope in the step trace.
//
// staging = "ring" keeps no gradient on the host between the backward and the update: the
// gradients stay on the GPU (where the model holds them anyway) and the update copies them down
// piece by piece through a small ring of pinned slots (ring_mib in all, 4 slots), three copies
// ahead of the threads; each piece's new weights go up from the slot it came down to. The norm is
// summed on the GPU (lcx::ops::sum_squares, lcx/grad_norm.h). This frees the staging's 4 bytes per
// parameter of pinned host memory (29.9 GiB for an 8B model) for the price of the update's host
// time before the next step: that step zeroes the gradients on the compute stream, so step()
// returns only once the last piece's copy down is issued, and the compute stream waits for it.
//
// On CPU tensors the same code runs: copies between host buffers, events always complete
// (lcx/stream.h), so CI runs the GPU's bookkeeping with a real worker thread.
#include <lcx/clock.h>
#include <lcx/adamw_scalars.h>
#include <lcx/defaults.h>
#include <lcx/error.h>
#include <lcx/grad_norm.h>
#include <lcx/ops.h>
#include <lcx/pinned.h>
#include <lcx/plan.h>
#include <lcx/plugin.h>
#include <lcx/profile.h>
#include <lcx/slots/optimizer.h>
#include <lcx/stream.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace lcx {
namespace {

// fn(i) for every i in [0, n), on up to `threads` threads (the caller is one of them); the first
// exception is rethrown once all have stopped.
template <class F>
void parallel_for(int threads, int64_t n, F&& fn) {
  std::atomic<int64_t> next{0};
  std::exception_ptr failed;
  std::mutex mu;
  auto run = [&] {
    try {
      for (int64_t i = next++; i < n; i = next++) fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu);
      if (!failed) failed = std::current_exception();
      next = n;
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::min<int64_t>(threads, n); ++t) pool.emplace_back(run);
  run();
  for (std::thread& t : pool) t.join();
  if (failed) std::rethrow_exception(failed);
}

inline float widen(float x) { return x; }
inline float widen(bf16 x) { return bf16_to_float(x); }
inline float widen(f16 x) { return f16_to_float(x); }
template <class T>
T narrow(float x);
template <>
inline float narrow<float>(float x) { return x; }
template <>
inline bf16 narrow<bf16>(float x) { return float_to_bf16(x); }
template <>
inline f16 narrow<f16>(float x) { return float_to_f16(x); }

struct Hyper {
  float lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt;
  float grad_scale;  // clipping's factor, applied as core's scale_grads would, rounded to the gradient's dtype
};

// One chunk of AdamW, element by element as core's CPU AdamW (train/adamw_kernel.cpp); plain
// loops over typed arrays that the compiler vectorizes.
template <class G>
void adamw_chunk(const G* grad, float* x, float* m, float* v, int64_t n, const Hyper& h) {
  const float decay = 1.0f - h.lr * h.weight_decay;
  for (int64_t i = 0; i < n; ++i) {
    const float g = widen(narrow<G>(widen(grad[i]) * h.grad_scale));
    float xi = x[i] * decay;
    const float mi = m[i] + (1.0f - h.beta1) * (g - m[i]);
    const float vi = v[i] * h.beta2 + (1.0f - h.beta2) * g * g;
    const float denom = std::sqrt(vi) / h.bias_correction2_sqrt + h.eps;
    xi -= h.step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    x[i] = xi;
  }
}

template <class G>
double sum_squares(const G* grad, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = widen(grad[i]);
    s += g * g;
  }
  return s;
}

template <class V>
void round_into(const float* x, V* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = narrow<V>(x[i]);
}

// Calls f with a null pointer of the C++ type of `d`.
template <class F>
void with_type(DType d, F&& f) {
  switch (d) {
    case DType::f32: return f(static_cast<float*>(nullptr));
    case DType::bf16: return f(static_cast<bf16*>(nullptr));
    case DType::f16: return f(static_cast<f16*>(nullptr));
    default: throw Error(str("host_adamw: no AdamW for ", dtype_name(d), " tensors"));
  }
}

constexpr int64_t kChunk = int64_t{1} << 16;  // elements per task: large enough to amortize, small enough to balance

class HostAdamW final : public Optimizer {
 public:
  HostAdamW(int threads, bool ring, size_t slot_bytes) : threads_(threads), ring_(ring), slot_bytes_(slot_bytes) {}
  // The parameters' memory may be reused once this is gone: no copy into it may still run.
  ~HostAdamW() override {
    if (worker_.joinable()) worker_.join();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    norm_cv_.notify_all();
    if (norm_thread_.joinable()) norm_thread_.join();
    try {
      for (const Group& g : groups_) g.uploaded.synchronize();
    } catch (const std::exception&) {  // a device already failed: nothing left to wait for
    }
  }

  void configure(std::vector<Parameter*> params, const OptimizerConfig& cfg, const OptimizerScope& scope) override {
    if (cfg.master_dtype != "fp32")
      throw Error(str("host_adamw keeps fp32 master weights and moments; [train] master_dtype = \"", cfg.master_dtype, "\""),
                  "train.master_dtype", "set master_dtype = \"fp32\", or drop host_adamw from [plugins] load");
    if (scope.world_size > 1)
      throw Error(str("host_adamw runs on one rank; this run has ", scope.world_size, " ranks",
                      scope.sharded ? " with ZeRO-3 shards" : ""),
                  "plugins.load",
                  "drop host_adamw from [plugins] load: core's AdamW runs over several ranks (and their shards)");
    synchronize();
    wait_for_norms();  // its queue points into the groups
    cfg_ = cfg;
    step_ = 0;
    groups_.clear();
    LCX_CHECK(!params.empty(), "host_adamw: no parameters");
    device_ = params.front()->value.device();
    copy_ = Stream::create_copy(device_);
    produced_ = Event::create(device_);
    grads_read_ = Event::create(device_);
    for (Event& e : slot_down_) e = Event::create(device_);
    pieces_.clear();
    // Group 0: the non-layer parameters; group 1 + l: layer l's.
    std::map<int, std::vector<Parameter*>> by_layer;
    for (Parameter* p : params) {
      LCX_CHECK(p->value.device() == device_, "host_adamw: ", p->name, " is on ", device_name(p->value.device()),
                ", the others on ", device_name(device_));
      by_layer[layer_of(p->name)].push_back(p);
    }
    const int layers = by_layer.rbegin()->first + 1;
    groups_.resize(static_cast<size_t>(layers + 1));
    for (auto& [layer, ps] : by_layer) {
      Group& g = groups_[static_cast<size_t>(layer + 1)];
      size_t offset = 0;
      for (Parameter* p : ps) {
        ParamState s;
        s.p = p;
        s.master = Tensor::empty(p->value.shape(), DType::f32, Device::cpu(), MemoryCategory::master_weights);
        s.m = Tensor::empty(p->value.shape(), DType::f32, Device::cpu(), MemoryCategory::optimizer);
        s.v = Tensor::empty(p->value.shape(), DType::f32, Device::cpu(), MemoryCategory::optimizer);
        fill_state(p->value.to(Device::cpu()), s.master, s.m, s.v);
        s.offset = offset;
        s.elem_bytes = elem_bytes(*p);
        offset += staging_bytes(*p);
        if (ring_) {  // pieces of at most a slot, in the update's order
          const int64_t per = std::max<int64_t>(1, static_cast<int64_t>(slot_bytes_ / s.elem_bytes));
          for (int64_t b = 0; b < p->value.numel(); b += per)
            pieces_.push_back({static_cast<size_t>(layer + 1), g.params.size(), b, std::min(p->value.numel(), b + per)});
        }
        g.params.push_back(std::move(s));
      }
      if (!ring_) g.staging = pinned_alloc(offset, MemoryCategory::optimizer);
      g.grads_copied = Event::create(device_);
      g.uploaded = Event::create(device_);
      g.wait_start = Event::create(device_, true);
      g.wait_end = Event::create(device_, true);
      for (size_t k = 0; k < g.params.size(); ++k)
        for (int64_t b = 0; b < g.params[k].p->value.numel(); b += kChunk)
          g.tasks.push_back({k, b, std::min(g.params[k].p->value.numel(), b + kChunk)});
    }
    if (ring_) ring_buffer_ = pinned_alloc(kSlots * slot_bytes_, MemoryCategory::optimizer);
    updated_ = groups_.size();
  }

  // The master from the weights (widened) and zero moments, in pieces on the update's threads, so
  // that the fresh pages of an 8B model's 96 GB of state are first touched by all of them, not one.
  void fill_state(const Tensor& host_value, Tensor& master_out, Tensor& m_out, Tensor& v_out) const {
    constexpr int64_t kPiece = 16 * kChunk;
    const int64_t n = master_out.numel();
    const Tensor src = host_value.view({n});
    Tensor master = master_out.view({n}), m = m_out.view({n}), v = v_out.view({n});
    parallel_for(threads_, (n + kPiece - 1) / kPiece, [&](int64_t i) {
      const int64_t b = i * kPiece, e = std::min(n, b + kPiece);
      Tensor part = master.rows(b, e);
      ops::cast(src.rows(b, e), part);
      m.rows(b, e).zero();
      v.rows(b, e).zero();
    });
  }

  void weights_needed(int layer) override {
    if (groups_.empty()) return;  // not configured: a run that only evaluates
    Group& g = group(layer);
    const size_t index = static_cast<size_t>(layer + 1);
    bool updating = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      updating = updated_ <= index || failed_;
    }
    if (!updating && !g.upload_pending) return;  // nothing of this layer in flight: no trace event
    ProfileScope scope(OpKind::optimizer, "wait for updated weights");
    const double t0 = now_s();
    wait_for(index);
    host_wait_s_ += now_s() - t0;
    if (!g.upload_pending) return;
    const Stream compute = Stream::compute(device_);
    g.wait_start.record(compute);
    compute.wait(g.uploaded);
    g.wait_end.record(compute);
    g.upload_pending = false;
    g.waited = true;
  }

  void grads_final(int layer) override {
    if (groups_.empty() || ring_) return;  // the ring reads the gradients on the GPU during step()
    Group& g = group(layer);
    wait_for(static_cast<size_t>(layer + 1));  // the staging is the update's until then
    wait_for_norm(g);                           // and the norm thread's, while it reads it
    stage_grads(g);
  }

  double grad_norm() override {
    synchronize();
    if (ring_) {
      double sq = 0;
      for (const Group& g : groups_)
        for (const ParamState& s : g.params) sq += ops::sum_squares(whole_grad(s));
      return std::sqrt(sq);
    }
    stage_missing_grads();
    wait_for_norms();
    std::lock_guard<std::mutex> lock(mu_);
    if (norm_failed_) {
      std::exception_ptr e = norm_failed_;
      norm_failed_ = nullptr;
      std::rethrow_exception(e);
    }
    double sq = 0;
    for (const Group& g : groups_) sq += g.grad_sq;  // in group order: the same norm whatever the timing
    return std::sqrt(sq);
  }

  void scale_grads(double scale) override { grad_scale_ = static_cast<float>(scale); }

  void step(double lr) override {
    synchronize();
    if (!ring_) stage_missing_grads();
    wait_for_norms();  // the update overwrites the staging the norm thread reads
    for (Group& g : groups_) g.grads_staged = false;  // the next step's come from its backward
    ++step_;
    const AdamWScalars a = adamw_scalars(cfg_, lr, step_);  // as core's AdamW
    Hyper h{a.lr, a.beta1, a.beta2, a.eps, 0.0f, a.step_size, a.bias_correction2_sqrt, 1.0f};
    h.grad_scale = grad_scale_;
    grad_scale_ = 1.0f;
    host_wait_s_ = 0;
    for (Group& g : groups_) g.waited = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      updated_ = 0;
      failed_ = nullptr;
      grads_read_issued_ = false;
    }
    if (!ring_) {
      worker_ = std::thread([this, h] { update_all(h); });
      return;
    }
    produced_.record(Stream::compute(device_));
    copy_.wait(produced_);
    worker_ = std::thread([this, h] { update_ring(h); });
    {
      std::unique_lock<std::mutex> lock(mu_);
      done_cv_.wait(lock, [&] { return grads_read_issued_ || failed_; });
      if (failed_) {
        lock.unlock();
        synchronize();
      }
    }
    Stream::compute(device_).wait(grads_read_);  // the next step's zeroing comes after the last copy down
  }

  int64_t steps() const override { return step_; }

  void synchronize() override {
    if (worker_.joinable()) worker_.join();
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) {
      std::exception_ptr e = failed_;
      failed_ = nullptr;
      updated_ = groups_.size();
      std::rethrow_exception(e);
    }
  }

  OptimizerState state() const override {
    const_cast<HostAdamW*>(this)->synchronize();
    for (const Group& g : groups_) g.uploaded.synchronize();
    OptimizerState st;
    st.step = step_;
    for (const Group& g : groups_)
      for (const ParamState& s : g.params) {
        st.tensors.emplace_back(s.p->name + ".master", s.master);
        st.tensors.emplace_back(s.p->name + ".exp_avg", s.m);
        st.tensors.emplace_back(s.p->name + ".exp_avg_sq", s.v);
      }
    return st;
  }

  void load_state(const OptimizerState& st) override {
    synchronize();
    for (const Group& g : groups_) g.uploaded.synchronize();
    std::map<std::string, const Tensor*> by_name;
    for (const auto& [n, t] : st.tensors) by_name[n] = &t;
    auto restore = [&](const std::string& name, Tensor& dst) {
      auto it = by_name.find(name);
      if (it == by_name.end())
        throw Error(str("optimizer state has no tensor '", name, "'"), {},
                    "resume from a checkpoint of the same model with master_dtype = \"fp32\"");
      if (it->second->shape() != dst.shape())
        throw Error(str("optimizer state '", name, "' has shape ", shape_str(it->second->shape()), ", the run needs ",
                        shape_str(dst.shape())),
                    {}, "resume from a checkpoint of the same model");
      dst.copy_from(it->second->dtype() == DType::f32 ? *it->second : it->second->to(DType::f32));
    };
    for (Group& g : groups_)
      for (ParamState& s : g.params) {
        restore(s.p->name + ".master", s.master);
        restore(s.p->name + ".exp_avg", s.m);
        restore(s.p->name + ".exp_avg_sq", s.v);
        s.p->value.copy_from(s.master.to(s.p->value.dtype()));
        g.upload_pending = false;
      }
    step_ = st.step;
  }

  double wait_seconds() const override {
    double total = host_wait_s_;
    for (const Group& g : groups_)
      if (g.waited) {
        g.wait_end.synchronize();
        total += g.wait_end.seconds_since(g.wait_start);
      }
    return total;
  }

  std::string plan_offer() const override { return "fp32 master weights and AdamW moments in host memory"; }

  // Host: the fp32 master and moments, and the pinned staging (per parameter the larger of its
  // gradient and its compute copy). Nothing more on the GPU: the gradients stay where the model
  // plans them, and the copies read and write the parameters' own tensors.
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    // The plan refuses what configure would, so --plan never offers a run that stops at its start.
    if (in.master_dtype != DType::f32)
      throw Error(str("host_adamw keeps fp32 master weights and moments; [train] master_dtype = \"",
                      dtype_name(in.master_dtype), "\""),
                  "train.master_dtype", "set master_dtype = \"fp32\", or drop host_adamw from [plugins] load");
    if (plan.parameters == 0) return;
    const int64_t n = plan.parameters, gemm = plan.gemm_parameters;
    const int64_t w = static_cast<int64_t>(dtype_size(in.weight_dtype));
    const int64_t gemm_grad = static_cast<int64_t>(dtype_size(in.grad_dtype));
    plan.add("master_weights", "fp32 master copy (host)", PlanCategory::master_weights, n * 4, plan_phase::always,
             true);
    plan.add("adamw_moments", "AdamW moments m, v fp32 (host)", PlanCategory::optimizer, 2 * n * 4, plan_phase::always,
             true);
    if (ring_)
      plan.add("pinned_staging", str("pinned staging ring (", kSlots, " slots): gradients down, new weights up"),
               PlanCategory::optimizer, static_cast<int64_t>(kSlots * slot_bytes_), plan_phase::always, true);
    else
      plan.add("pinned_staging", "pinned staging: gradients down, new weights up", PlanCategory::optimizer,
               gemm * std::max(gemm_grad, w) + (n - gemm) * std::max<int64_t>(4, w), plan_phase::always, true);
  }

 private:
  struct ParamState {
    Parameter* p = nullptr;
    Tensor master, m, v;  // fp32, host
    size_t offset = 0;    // its slot in the group's staging
    size_t elem_bytes = 4;  // an element's room in the staging: the larger of gradient and value
  };
  // staging = "ring": a parameter's elements [begin, end), at most a slot's worth.
  struct Piece {
    size_t group, param;
    int64_t begin, end;
  };
  static constexpr size_t kSlots = 4;
  struct Task {
    size_t param;
    int64_t begin, end;
  };
  struct Group {
    std::vector<ParamState> params;
    std::vector<Task> tasks;
    PinnedBuffer staging;
    Event grads_copied;      // the gradients are in the staging
    bool grads_staged = false;  // copied since the last step()
    double grad_sq = 0;         // the staged gradients' sum of squares, by the norm thread
    Event uploaded;          // the new weights are in the parameters
    bool upload_pending = false;  // uploaded not yet waited on by the compute stream
    Event wait_start, wait_end;   // around the compute stream's wait on `uploaded`
    bool waited = false;          // since the last step()
  };

  // Copies the group's gradients into its staging on the copy stream, after what the compute
  // stream has issued so far.
  void stage_grads(Group& g) {
    ProfileScope scope(OpKind::copy, "copy D2H gradients", copy_);
    produced_.record(Stream::compute(device_));
    copy_.wait(produced_);
    for (ParamState& s : g.params) {
      LCX_CHECK(s.p->grad.defined() && s.p->grad.numel() == s.p->value.numel(), "host_adamw: ", s.p->name,
                " has no whole gradient");
      LCX_CHECK(s.p->grad.nbytes() <= staging_bytes(*s.p), "host_adamw: ", s.p->name, "'s gradient became ",
                dtype_name(s.p->grad.dtype()), " after configure()");
      Tensor staged = staged_grad(g, s);
      copy_async(staged, s.p->grad, copy_);
    }
    g.grads_copied.record(copy_);
    g.grads_staged = true;
    {
      std::lock_guard<std::mutex> lock(mu_);
      norm_queue_.push_back(&g);
    }
    norm_cv_.notify_all();
    if (!norm_thread_.joinable()) norm_thread_ = std::thread([this] { sum_squares_loop(); });
  }

  // The norm thread: each staged group's sum of squares, once its copy is done (per task, then
  // summed in task order, so the same whatever the threads).
  void sum_squares_loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      norm_cv_.wait(lock, [&] { return stopping_ || !norm_queue_.empty(); });
      if (stopping_) return;
      Group* g = norm_queue_.front();
      norm_queue_.pop_front();
      norm_busy_ = true;
      lock.unlock();
      try {
        g->grads_copied.synchronize();
        std::vector<double> sums(g->tasks.size(), 0.0);
        parallel_for(threads_, static_cast<int64_t>(g->tasks.size()), [&](int64_t i) {
          const Task& t = g->tasks[static_cast<size_t>(i)];
          const Tensor staged = staged_grad(*g, g->params[t.param]);
          with_type(staged.dtype(), [&]<class G>(G*) {
            sums[static_cast<size_t>(i)] = sum_squares(staged.data_as<G>() + t.begin, t.end - t.begin);
          });
        });
        double sq = 0;
        for (double x : sums) sq += x;
        lock.lock();
        g->grad_sq = sq;
      } catch (...) {
        lock.lock();
        if (!norm_failed_) norm_failed_ = std::current_exception();
      }
      norm_busy_ = false;
      norm_cv_.notify_all();
    }
  }

  // The groups whose gradients the step never said were final (a caller without train_step's
  // hooks) are copied now, so the update never reads stale ones.
  void stage_missing_grads() {
    for (Group& g : groups_)
      if (!g.grads_staged) stage_grads(g);
  }

  // -1 for names outside "model.layers.<l>.".
  static int layer_of(const std::string& name) {
    const std::string prefix = "model.layers.";
    if (!name.starts_with(prefix)) return Optimizer::kNonLayer;
    size_t end = prefix.size();
    while (end < name.size() && std::isdigit(static_cast<unsigned char>(name[end]))) ++end;
    if (end == prefix.size() || end >= name.size() || name[end] != '.') return Optimizer::kNonLayer;
    return std::stoi(name.substr(prefix.size(), end - prefix.size()));
  }

  static size_t elem_bytes(const Parameter& p) {
    return std::max(p.grad.defined() ? dtype_size(p.grad.dtype()) : size_t{4}, dtype_size(p.value.dtype()));
  }

  const Tensor& whole_grad(const ParamState& s) const {
    LCX_CHECK(s.p->grad.defined() && s.p->grad.numel() == s.p->value.numel(), "host_adamw: ", s.p->name,
              " has no whole gradient");
    LCX_CHECK(dtype_size(s.p->grad.dtype()) <= s.elem_bytes, "host_adamw: ", s.p->name, "'s gradient became ",
              dtype_name(s.p->grad.dtype()), " after configure()");
    return s.p->grad;
  }

  // Elements [begin, end) of a contiguous tensor, as a 1-D tensor on its device.
  static Tensor flat_slice(const Tensor& t, int64_t begin, int64_t end) {
    return Tensor::borrow(static_cast<char*>(t.data()) + begin * static_cast<int64_t>(dtype_size(t.dtype())),
                          Shape{end - begin}, t.dtype(), t.device());
  }
  Tensor slot_view(size_t slot, DType dtype, int64_t n) const {
    return Tensor::borrow(static_cast<char*>(ring_buffer_.data()) + slot * slot_bytes_, Shape{n}, dtype, Device::cpu());
  }

  // Rounded to 4 bytes so that every slot holds fp32 aligned (a no-op for even sizes, as every
  // Qwen3 parameter has).
  static size_t staging_bytes(const Parameter& p) {
    const size_t grad = p.grad.defined() ? p.grad.nbytes() : static_cast<size_t>(p.value.numel()) * 4;
    return (std::max(grad, p.value.nbytes()) + 3) / 4 * 4;
  }

  Group& group(int layer) {
    const size_t index = static_cast<size_t>(layer + 1);
    LCX_CHECK(layer >= Optimizer::kNonLayer && index < groups_.size(), "host_adamw: layer ", layer, " of ",
              groups_.size() - 1);
    return groups_[index];
  }

  Tensor staged_grad(const Group& g, const ParamState& s) const {
    return Tensor::borrow(static_cast<char*>(g.staging.data()) + s.offset, s.p->grad.shape(), s.p->grad.dtype(),
                          Device::cpu());
  }
  Tensor staged_value(const Group& g, const ParamState& s) const {
    return Tensor::borrow(static_cast<char*>(g.staging.data()) + s.offset, s.p->value.shape(), s.p->value.dtype(),
                          Device::cpu());
  }

  void wait_for_norms() {
    std::unique_lock<std::mutex> lock(mu_);
    norm_cv_.wait(lock, [&] { return norm_queue_.empty() && !norm_busy_; });
  }

  void wait_for_norm(const Group& g) {
    std::unique_lock<std::mutex> lock(mu_);
    norm_cv_.wait(lock, [&] {
      return !norm_busy_ && std::find(norm_queue_.begin(), norm_queue_.end(), &g) == norm_queue_.end();
    });
  }

  // Blocks until the worker has finished group `index` (or failed).
  void wait_for(size_t index) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return updated_ > index || failed_; });
    if (failed_) {
      lock.unlock();
      synchronize();
    }
  }

  // The worker: every group in order, then its copy up.
  void update_all(Hyper h) {
    try {
      for (size_t gi = 0; gi < groups_.size(); ++gi) {
        Group& g = groups_[gi];
        g.grads_copied.synchronize();
        // Pass 1: master and moments from the staged gradients.
        parallel_for(threads_, static_cast<int64_t>(g.tasks.size()), [&](int64_t i) {
          const Task& t = g.tasks[static_cast<size_t>(i)];
          ParamState& s = g.params[t.param];
          Hyper ht = h;
          ht.weight_decay = s.p->decay ? static_cast<float>(cfg_.weight_decay) : 0.0f;
          const Tensor staged = staged_grad(g, s);
          const int64_t n = t.end - t.begin;
          with_type(staged.dtype(), [&]<class G>(G*) {
            adamw_chunk(staged.data_as<G>() + t.begin, s.master.data_as<float>() + t.begin,
                        s.m.data_as<float>() + t.begin, s.v.data_as<float>() + t.begin, n, ht);
          });
        });
        // Pass 2: the compute copies, rounded from the master into the staging the gradients
        // leave (a second pass, as a value's slot overlaps gradients other tasks still read).
        parallel_for(threads_, static_cast<int64_t>(g.tasks.size()), [&](int64_t i) {
          const Task& t = g.tasks[static_cast<size_t>(i)];
          const ParamState& s = g.params[t.param];
          Tensor staged = staged_value(g, s);
          with_type(staged.dtype(), [&]<class V>(V*) {
            round_into(s.master.data_as<float>() + t.begin, staged.data_as<V>() + t.begin, t.end - t.begin);
          });
        });
        for (ParamState& s : g.params) {
          const Tensor staged = staged_value(g, s);
          copy_async(s.p->value, staged, copy_);
        }
        g.uploaded.record(copy_);
        g.upload_pending = true;
        std::lock_guard<std::mutex> lock(mu_);
        updated_ = gi + 1;
        done_cv_.notify_all();
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      failed_ = std::current_exception();
      done_cv_.notify_all();
    }
  }

  // staging = "ring": piece i comes down to slot i % kSlots, kSlots - 1 copies ahead of the threads,
  // and its new weights go up from there; the copy stream's order keeps a slot's next copy down
  // behind its last copy up.
  void update_ring(Hyper h) {
    const size_t n = pieces_.size();
    auto copy_down = [&](size_t i) {
      const Piece& pc = pieces_[i];
      const ParamState& s = groups_[pc.group].params[pc.param];
      const Tensor& grad = whole_grad(s);
      Tensor slot = slot_view(i % kSlots, grad.dtype(), pc.end - pc.begin);
      copy_async(slot, flat_slice(grad, pc.begin, pc.end), copy_);
      slot_down_[i % kSlots].record(copy_);
      if (i + 1 == n) grads_read();
    };
    try {
      if (n == 0) grads_read();
      for (size_t i = 0; i + 1 < kSlots && i < n; ++i) copy_down(i);
      for (size_t i = 0; i < n; ++i) {
        if (i + kSlots - 1 < n) copy_down(i + kSlots - 1);
        const Piece& pc = pieces_[i];
        Group& g = groups_[pc.group];
        ParamState& s = g.params[pc.param];
        slot_down_[i % kSlots].synchronize();
        Hyper ht = h;
        ht.weight_decay = s.p->decay ? static_cast<float>(cfg_.weight_decay) : 0.0f;
        const int64_t len = pc.end - pc.begin, tasks = (len + kChunk - 1) / kChunk;
        const Tensor grad = slot_view(i % kSlots, s.p->grad.dtype(), len);
        parallel_for(threads_, tasks, [&](int64_t t) {
          const int64_t b = t * kChunk, e = std::min(len, b + kChunk);
          with_type(grad.dtype(), [&]<class G>(G*) {
            adamw_chunk(grad.data_as<G>() + b, s.master.data_as<float>() + pc.begin + b,
                        s.m.data_as<float>() + pc.begin + b, s.v.data_as<float>() + pc.begin + b, e - b, ht);
          });
        });
        Tensor value = slot_view(i % kSlots, s.p->value.dtype(), len);  // over the gradients just read
        parallel_for(threads_, tasks, [&](int64_t t) {
          const int64_t b = t * kChunk, e = std::min(len, b + kChunk);
          with_type(value.dtype(), [&]<class V>(V*) {
            round_into(s.master.data_as<float>() + pc.begin + b, value.data_as<V>() + b, e - b);
          });
        });
        Tensor dst = flat_slice(s.p->value, pc.begin, pc.end);
        copy_async(dst, value, copy_);
        if (i + 1 == n || pieces_[i + 1].group != pc.group) {
          g.uploaded.record(copy_);
          g.upload_pending = true;
          std::lock_guard<std::mutex> lock(mu_);
          updated_ = pc.group + 1;
          done_cv_.notify_all();
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      updated_ = groups_.size();
      done_cv_.notify_all();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      failed_ = std::current_exception();
      done_cv_.notify_all();
    }
  }

  // The last copy down is issued: step() may return.
  void grads_read() {
    grads_read_.record(copy_);
    std::lock_guard<std::mutex> lock(mu_);
    grads_read_issued_ = true;
    done_cv_.notify_all();
  }

  const int threads_;
  const bool ring_;
  const size_t slot_bytes_;  // staging = "ring": one slot's bytes
  std::vector<Piece> pieces_;
  PinnedBuffer ring_buffer_;
  std::array<Event, kSlots> slot_down_;  // the slot's gradients are down
  Event grads_read_;                     // the last gradient is down (ring)
  bool grads_read_issued_ = false;       // under mu_
  OptimizerConfig cfg_;
  int64_t step_ = 0;
  float grad_scale_ = 1.0f;
  Device device_;
  Stream copy_;
  Event produced_;  // a point on the compute stream the copy stream waits for
  std::vector<Group> groups_;
  std::thread worker_;
  std::mutex mu_;
  std::condition_variable done_cv_;
  size_t updated_ = 0;  // groups the worker has finished this update (all of them when idle)
  std::exception_ptr failed_;
  // The norm thread (started at the first staging) and its queue of staged groups, under mu_.
  std::thread norm_thread_;
  std::condition_variable norm_cv_;
  std::deque<Group*> norm_queue_;
  bool norm_busy_ = false;
  bool stopping_ = false;
  std::exception_ptr norm_failed_;
  double host_wait_s_ = 0;
};

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  args.config.describe("threads", "host threads running the update; 0: every core but one", "0 to 1024");
  const int64_t threads = args.config.get_int("threads", 0);
  if (threads < 0 || threads > 1024)
    args.config.fail("threads", str(threads, " is out of range"), "0 (every core but one) to 1024");
  args.config.describe("staging",
                       "where the gradients wait for the update: \"all\" (pinned host memory, 4 bytes a parameter, "
                       "copied during the backward) or \"ring\" (on the GPU, copied down through ring_mib during the "
                       "update)",
                       "all, ring");
  const std::string staging = args.config.get_string("staging", "all");
  if (staging != "all" && staging != "ring")
    args.config.fail("staging", str("\"", staging, "\" is not a staging"), "\"all\" or \"ring\"");
  args.config.describe("ring_mib", "staging = \"ring\": the ring's pinned MiB (4 slots)", "0.001 to 65536");
  const double ring_mib = args.config.get_double("ring_mib", 1024);
  if (!(ring_mib >= 0.001 && ring_mib <= 65536))
    args.config.fail("ring_mib", str(ring_mib, " is out of range"), "0.001 to 65536 (default 1024)");
  const size_t slot = std::max<size_t>(4, static_cast<size_t>(ring_mib * 1024 * 1024) / 4 / 4 * 4);
  // The thread that issues the step's kernels keeps a core: the update runs beside the forward.
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::make_unique<HostAdamW>(threads > 0 ? static_cast<int>(threads) : std::max(1, cores - 1), staging == "ring",
                                     slot);
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_OPTIMIZER, "host_adamw", "0.1.0", "AdamW with fp32 master and moments in host memory, updated on the CPU",
           "ready", lcx::create)
