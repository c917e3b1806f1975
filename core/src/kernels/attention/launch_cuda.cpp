// The GPU attention entry points (kernels/cuda/cuda_ops.h): each call described as the backends
// judge it (dispatch.h), its candidates tried in order under the run's [run] attention. cuDNN may
// decline at run time (a plan it refuses to build); every other backend, once chosen, runs. What
// a backend allocates (cuDNN's workspace, the Hopper backward's dQ accumulator, delta) is
// allocated here, before its work goes to `launch`.
#include <cuda_runtime.h>

#include <array>
#include <mutex>
#include <optional>
#include <set>

#include "cuda/check.h"
#include "cuda/stream.h"
#include "kernels/attention/cudnn/attention_cudnn.h"
#include "kernels/attention/dispatch.h"
#include "kernels/attention/params.h"
#include "kernels/cuda/cuda_ops.h"
#include "lcx/log.h"

namespace lcx::ops::cuda {
namespace {

using attention::Backend;

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

// The current device's capability, shared memory limit and whether cuDNN loads, read once per device.
attention::DeviceCaps device_caps() {
  static std::mutex mu;
  static std::array<std::optional<attention::DeviceCaps>, 64> cached;
  int dev = 0;
  LCX_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard lock(mu);
  auto& c = cached.at(static_cast<size_t>(dev));
  if (!c) {
    attention::DeviceCaps d;
    LCX_CUDA_CHECK(cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev));
    LCX_CUDA_CHECK(cudaDeviceGetAttribute(&d.minor, cudaDevAttrComputeCapabilityMinor, dev));
    int smem = 0;
    LCX_CUDA_CHECK(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    d.smem_per_block = smem;
    d.cudnn = !lcx::cuda::cudnn_version().empty();
    c = d;
  }
  return *c;
}

attention::Call forward_call(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                             const AttentionParams& ap) {
  attention::Call c;
  c.dtype = q.dtype();
  c.out_matches = out.dtype() == q.dtype();
  c.inputs_aligned = aligned16(q) && aligned16(k) && aligned16(v);
  c.out_aligned = aligned16(out);
  c.head_dim = q.size(2);
  c.rows = q.size(0);
  c.keys = k.size(0);
  c.causal = ap.causal;
  c.same_positions = q.size(0) == k.size(0) && ap.q_offset == ap.k_offset;
  c.window = ap.window;
  c.ends_aligned = q.size(0) <= k.size(0) && ap.q_offset + q.size(0) == ap.k_offset + k.size(0);
  return c;
}

attention::Call backward_call(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& dout, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                              const AttentionParams& ap) {
  attention::Call c = forward_call(q, k, v, out, ap);
  c.backward = true;
  c.dout_matches = dout.dtype() == q.dtype();
  c.grads_match = dq.dtype() == q.dtype() && dk.dtype() == q.dtype() && dv.dtype() == q.dtype();
  c.inputs_aligned = c.inputs_aligned && aligned16(dout);
  c.grads_aligned = aligned16(dq) && aligned16(dk) && aligned16(dv);
  return c;
}

// A large attention the automatic choice keeps off cuDNN is worth a line: lcx's own kernels are
// slower than cuDNN's, and the reason (most often fp32 activations) is usually an accident of the
// setup. Once per reason.
void note_off_cudnn(const attention::Call& c, const attention::DeviceCaps& d, Backend chosen) {
  if (chosen == Backend::cudnn || attention::choice() != attention::Choice::automatic) return;
  if (c.rows * c.keys < (int64_t{1} << 24)) return;
  const std::string why = attention::refusal(Backend::cudnn, c, d);
  if (why.empty()) return;  // the Hopper forward ahead of cuDNN, by choice
  static std::mutex mu;
  static std::set<std::string> told;
  std::lock_guard lock(mu);
  if (!told.insert(why).second) return;
  log::warn(str("attention of ", c.rows, " x ", c.keys, " rows (", dtype_name(c.dtype), ") runs on lcx's ",
                attention::name(chosen), " kernels, slower than cuDNN's: ", why,
                ". Later calls for this reason are not logged"));
}

attn::Params make_params(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionParams& ap) {
  attn::Params p{};
  p.T = q.size(0);
  p.Hq = q.size(1);
  p.d = q.size(2);
  p.S = k.size(0);
  p.Hkv = k.size(1);
  p.q_offset = ap.q_offset;
  p.k_offset = ap.k_offset;
  p.causal = ap.causal;
  p.window = ap.window;
  p.scale = ap.scale;
  p.scale_log2 = ap.scale * 1.4426950408889634f;  // log2(e): the kernels' scores live in the exp2 domain
  p.tq = q.dtype();
  p.tk = k.dtype();
  p.tv = v.dtype();
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  return p;
}

// The forward on `b`; false only where cuDNN declined the call's plan.
bool run_forward(Backend b, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                 const AttentionParams& ap, Launch launch) {
  if (b == Backend::cudnn) return lcx::cuda::cudnn_attention_forward(q, k, v, out, lse, ap, launch);
  launch([&] {
    attn::Params p = make_params(q, k, v, ap);
    p.o = out.data();
    p.to = out.dtype();
    p.lse_out = lse.data_as<float>();
    if (b == Backend::hopper)
      attn::hopper_forward(p);
    else if (b == Backend::mma)
      attn::mma_forward(p);
    else
      attn::reference_forward(p);
  });
  return true;
}

bool run_backward(Backend b, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                  const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& ap, Launch launch) {
  if (b == Backend::cudnn)
    return lcx::cuda::cudnn_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, ap, launch);
  attn::Params p = make_params(q, k, v, ap);
  p.out = out.data();
  p.to = out.dtype();
  p.dout = dout.data();
  p.tdo = dout.dtype();
  p.lse_in = lse.data_as<const float>();
  p.o = dq.data();
  p.tdq = dq.dtype();
  p.dk = dk.data();
  p.tdk = dk.dtype();
  p.dv = dv.data();
  p.tdv = dv.dtype();
  // The Hopper kernel brings its own per-row pass (the LSE and delta side by side) and its dQ
  // accumulator; the others take delta [Hq, T].
  Tensor delta, scratch;
  if (b == Backend::hopper) {
    scratch = Tensor::empty({(attn::hopper_backward_scratch(p.T, p.Hq) + 3) / 4}, DType::i32, q.device());
  } else {
    delta = Tensor::empty({p.Hq, p.T}, DType::f32, q.device());
    p.delta = delta.data_as<float>();
  }
  launch([&] {
    if (b == Backend::hopper) return attn::hopper_backward(p, scratch.data());
    attn::backward_delta(p);
    if (b == Backend::mma)
      attn::mma_backward(p);
    else
      attn::reference_backward(p);
  });
  return true;
}

void forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, const AttentionParams& ap,
             Launch launch, bool own) {
  if (q.size(0) == 0 || q.size(1) == 0) return;
  const attention::Call c = forward_call(q, k, v, out, ap);
  const attention::DeviceCaps d = device_caps();
  const std::vector<Backend> order = attention::candidates(attention::choice(), c, d, own);
  if (!own) note_off_cudnn(c, d, order.front());
  for (Backend b : order)
    if (run_forward(b, q, k, v, out, lse, ap, launch)) return;
  throw Error(str("no attention backend ran a ", attention::describe(c)), "run.attention",
              "attention = \"auto\" lets lcx's own kernels take what cuDNN refuses");
}

void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
              const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& ap, Launch launch,
              bool own) {
  if (q.size(0) == 0 || q.size(1) == 0) {  // no query sees anything: the keys get no gradient
    launch([&] {
      if (dk.nbytes()) LCX_CUDA_CHECK(cudaMemsetAsync(dk.data(), 0, dk.nbytes(), lcx::cuda::current_stream()));
      if (dv.nbytes()) LCX_CUDA_CHECK(cudaMemsetAsync(dv.data(), 0, dv.nbytes(), lcx::cuda::current_stream()));
    });
    return;
  }
  const attention::Call c = backward_call(q, k, v, out, dout, dq, dk, dv, ap);
  const attention::DeviceCaps d = device_caps();
  const std::vector<Backend> order = attention::candidates(attention::choice(), c, d, own);
  if (!own) note_off_cudnn(c, d, order.front());
  for (Backend b : order)
    if (run_backward(b, q, k, v, out, lse, dout, dq, dk, dv, ap, launch)) return;
  throw Error(str("no attention backend ran a ", attention::describe(c)), "run.attention",
              "attention = \"auto\" lets lcx's own kernels take what cuDNN refuses");
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       const AttentionParams& ap, Launch launch) {
  forward(q, k, v, out, lse, ap, launch, false);
}

void attention_forward_own(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                           const AttentionParams& ap, Launch launch) {
  forward(q, k, v, out, lse, ap, launch, true);
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& ap,
                        Launch launch) {
  backward(q, k, v, out, lse, dout, dq, dk, dv, ap, launch, false);
}

void attention_backward_own(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& ap,
                            Launch launch) {
  backward(q, k, v, out, lse, dout, dq, dk, dv, ap, launch, true);
}

attention::DeviceCaps attention_device_caps() { return device_caps(); }

bool attention_forward_hopper_applies(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out) {
  return attention::refusal(Backend::hopper, forward_call(q, k, v, out, AttentionParams{}), device_caps()).empty();
}

}  // namespace lcx::ops::cuda
