// `lcx-train calibrate`: measures this GPU's row of the rates table (plan/rates.h) through
// lcx::ops, at the shapes of a full-depth Qwen3-4B step, and writes it into the user's rates file.
// Each rate is counted the way the plan counts the work (StepWork), so the plan's times on this GPU
// come from its own row:
// - gemm_flops: one layer's projections (q, k, v, o, gate, up, down) at T rows, each forward
//   (bf16 out), input gradient (bf16) and weight gradient accumulated in fp32: 6 T N K FLOPs each.
// - head_groups_at_half_rate: the attention half around its attention calls (projections, q/k norms,
//   rotary, Wo's column copies) as the step runs it in 1 and in 8 head groups at 65,536 tokens: the
//   value that makes the plan's charge for 8 groups (rates.cpp) the measured difference.
// - attention_forward_flops, attention_backward_flops: causal GQA attention, 32 query / 8 key-value
//   heads of 128, bf16, at 65,536 and 131,072 tokens (their mean rate): 4 d FLOPs per (query, key)
//   pair and head forward, 2.5x that backward.
// - memory_bytes: one layer's elementwise kernels as the step launches them, with the recompute
//   (norms, q/k norms, rotary, SwiGLU forward twice and backward, residual adds, the backward's
//   norms), at 65,536 tokens, counted as the plan counts a layer's: T x 2 bytes x (11 I + 24 H).
// - host_copy_bytes: pinned host -> GPU and GPU -> pinned host copies of 1 GiB, their mean rate.
// - expert_gemm_flops: the grouped GEMMs of a mixture-of-experts layer at Qwen3-30B-A3B's shapes
//   (128 experts, 8 a token, hidden 2048, expert width 768) over 32,768 tokens routed with a
//   router's skew (every 32nd expert 4x the mean rows, every 16th none): the forward of gate, up
//   and down and their input gradients, as ops::grouped_matmul runs them by default (cuBLAS's
//   grouped GEMM), 2 R N K FLOPs each.
// Each figure is the median of a few timed calls after a warm-up, the device synchronized around
// the host clock.
#include <algorithm>
#include <cmath>
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
#include <map>
#include <random>

#include "app/cli.h"
#include "lcx/error.h"
#include "lcx/ops.h"
#include "lcx/pinned.h"
#include "lcx/tensor.h"
#include "plan/plan.h"

namespace po = boost::program_options;

namespace lcx {

namespace {

void sync() { backend_for(Device::cuda())->synchronize(); }

// After a second of warm-up calls: a step keeps the GPU busy for seconds, at the clocks it holds
// under sustained load, not those of a cold start.
double median_seconds(const std::function<void()>& fn, int reps) {
  const auto warm = std::chrono::steady_clock::now();
  do {
    fn();
    sync();
  } while (std::chrono::steady_clock::now() - warm < std::chrono::seconds(1));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    sync();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// The GPU pools gpu_random repeats, one per dtype and scale; measure() empties it before it returns,
// so that no GPU memory outlives the allocator at exit.
std::map<std::pair<DType, float>, Tensor>& random_pools() {
  static std::map<std::pair<DType, float>, Tensor> pools;
  return pools;
}

// Normal values, never all zero (a GEMM of zeros runs faster than one of data): a pool of a prime
// count drawn once and put on the GPU, repeated by device copies, so that billions of elements take
// no time to make.
Tensor gpu_random(Shape shape, DType dtype, float scale = 1.f) {
  constexpr int64_t kPool = 1'048'573;
  Tensor& pool = random_pools()[{dtype, scale}];
  if (!pool.data()) {
    std::mt19937 rng(1234);
    std::normal_distribution<float> dist(0.f, 1.f);
    std::vector<float> p(static_cast<size_t>(kPool));
    for (auto& x : p) x = scale * dist(rng);
    pool = Tensor::from_floats(p, {kPool}, dtype, Device::cuda());
  }
  Tensor t = Tensor::empty(shape, dtype, Device::cuda());
  const int64_t n = t.numel();
  Tensor flat = t.view({n});
  for (int64_t at = 0; at < n; at += kPool) {
    const int64_t len = std::min(kPool, n - at);
    Tensor part = flat.rows(at, at + len);
    part.copy_from(pool.rows(0, len));
  }
  return t;
}

// Rotary tables [T, d/2] as a step's are (a rotation per position and pair, so that repeated
// calls in place keep their data's size).
void rotary_tables(int64_t T, int64_t d, Tensor& cos, Tensor& sin) {
  std::vector<float> c(static_cast<size_t>(T * (d / 2))), s(c.size());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < d / 2; ++i) {
      const double f = static_cast<double>(t) * std::pow(1e6, -2.0 * static_cast<double>(i) / static_cast<double>(d));
      c[static_cast<size_t>(t * (d / 2) + i)] = static_cast<float>(std::cos(f));
      s[static_cast<size_t>(t * (d / 2) + i)] = static_cast<float>(std::sin(f));
    }
  cos = Tensor::from_floats(c, {T, d / 2}, DType::f32, Device::cuda());
  sin = Tensor::from_floats(s, {T, d / 2}, DType::f32, Device::cuda());
}

struct Projection {
  int64_t n, k;  // out features, in features
};

// Seconds of forward, input gradient and fp32 weight gradient of each projection at T rows; flops
// set to their 6 T N K.
double projections_seconds(int64_t T, const std::vector<Projection>& ps, int reps, double& flops) {
  const Device g = Device::cuda();
  double seconds = 0;
  flops = 0;
  for (const Projection& p : ps) {
    Tensor x = gpu_random({T, p.k}, DType::bf16), w = gpu_random({p.n, p.k}, DType::bf16, 0.02f),
           dy = gpu_random({T, p.n}, DType::bf16);
    Tensor y = Tensor::empty({T, p.n}, DType::bf16, g), dx = Tensor::empty({T, p.k}, DType::bf16, g),
           dw = Tensor::zeros({p.n, p.k}, DType::f32, g);
    seconds += median_seconds(
        [&] {
          ops::matmul(x, false, w, true, y);
          ops::matmul(dy, false, w, false, dx);
          ops::matmul(dy, true, x, false, dw, 1.f, 1.f);
        },
        reps);
    flops += 6.0 * static_cast<double>(T) * static_cast<double>(p.n) * static_cast<double>(p.k);
  }
  return seconds;
}

// Qwen3-4B: hidden 2560, 32 query and 8 key-value heads of 128, intermediate 9728.
struct Shape4B {
  int64_t H = 2560, I = 9728, nq = 32, nkv = 8, d = 128;
  int64_t qd() const { return nq * d; }
  int64_t kvd() const { return nkv * d; }
};

// One layer's elementwise kernels as the step launches them (models/qwen3 layer_forward and
// layer_backward, the MLP whole, one head group, the attention recomputed), in its order and at
// its shapes: the forward (input norm, q/k norms and rotary, residual add, post norm, SwiGLU,
// residual add); the backward's recompute up to the MLP's input; the MLP backward (SwiGLU again,
// its backward); the post norm's backward and the residual; the input norm again; rotary and q/k
// norm backwards; the input norm's backward and the residual. Every GEMM and the attention between
// them are left out: their rates are measured apart.
double layer_elementwise_seconds(int64_t T, const Shape4B& m, int reps) {
  const Device g = Device::cuda();
  const float eps = 1e-6f;
  auto bf16 = [&](Shape s) { return Tensor::empty(std::move(s), DType::bf16, g); };
  auto f32 = [&](Shape s) { return Tensor::empty(std::move(s), DType::f32, g); };
  const Tensor x = gpu_random({T, m.H}, DType::bf16), o = gpu_random({T, m.H}, DType::bf16),
               mlp_out = gpu_random({T, m.H}, DType::bf16), dy = gpu_random({T, m.H}, DType::bf16);
  const Tensor in_w = gpu_random({m.H}, DType::bf16), post_w = gpu_random({m.H}, DType::bf16),
               qn_w = gpu_random({m.d}, DType::bf16), kn_w = gpu_random({m.d}, DType::bf16);
  const Tensor q = gpu_random({T * m.nq, m.d}, DType::bf16), k = gpu_random({T * m.nkv, m.d}, DType::bf16);
  const Tensor gate = gpu_random({T, m.I}, DType::bf16), up = gpu_random({T, m.I}, DType::bf16),
               dact = gpu_random({T, m.I}, DType::bf16);
  Tensor dq = gpu_random({T, m.nq, m.d}, DType::bf16), dk = gpu_random({T, m.nkv, m.d}, DType::bf16);
  Tensor cos, sin;
  rotary_tables(T, m.d, cos, sin);
  Tensor g_in = Tensor::zeros({m.H}, DType::f32, g), g_post = Tensor::zeros({m.H}, DType::f32, g),
         g_qn = Tensor::zeros({m.d}, DType::f32, g), g_kn = Tensor::zeros({m.d}, DType::f32, g);
  // The forward's, and the recompute's, from the layer's input x to the MLP's input h2.
  auto to_mlp_input = [&](Tensor& h1, Tensor& rstd1, Tensor& x1, Tensor& h2, Tensor& rstd2) {
    h1 = bf16({T, m.H});
    rstd1 = f32({T});
    ops::rmsnorm_forward(x, in_w, eps, h1, rstd1);
    Tensor qr = bf16({T * m.nq, m.d}), kr = bf16({T * m.nkv, m.d});
    Tensor rq = f32({T * m.nq}), rk = f32({T * m.nkv});
    ops::rmsnorm_forward(q, qn_w, eps, qr, rq);
    ops::rmsnorm_forward(k, kn_w, eps, kr, rk);
    Tensor qr3 = qr.view({T, m.nq, m.d}), kr3 = kr.view({T, m.nkv, m.d});
    ops::rotary_forward(qr3, cos, sin);
    ops::rotary_forward(kr3, cos, sin);
    x1 = bf16({T, m.H});
    ops::add(x, o, x1);
    h2 = bf16({T, m.H});
    rstd2 = f32({T});
    ops::rmsnorm_forward(x1, post_w, eps, h2, rstd2);
    return std::pair{std::move(rq), std::move(rk)};
  };
  return median_seconds(
      [&] {
        Tensor h1, rstd1, x1, h2, rstd2;
        {
          to_mlp_input(h1, rstd1, x1, h2, rstd2);
          Tensor act = bf16({T, m.I});
          ops::swiglu_forward(gate, up, act);
          Tensor y = bf16({T, m.H});
          ops::add(x1, mlp_out, y);
        }
        auto [rq, rk] = to_mlp_input(h1, rstd1, x1, h2, rstd2);
        {
          Tensor act = bf16({T, m.I}), dgate = bf16({T, m.I}), dup = bf16({T, m.I});
          ops::swiglu_forward(gate, up, act);
          ops::swiglu_backward(gate, up, dact, dgate, dup);
        }
        Tensor dx1 = bf16({T, m.H});
        ops::rmsnorm_backward(x1, post_w, rstd2, dy, dx1, g_post);
        ops::add(dx1, dy, dx1);
        ops::rmsnorm_forward(x, in_w, eps, h1, rstd1);
        ops::rotary_backward(dq, cos, sin);
        ops::rotary_backward(dk, cos, sin);
        Tensor dq_raw = bf16({T * m.nq, m.d}), dk_raw = bf16({T * m.nkv, m.d});
        ops::rmsnorm_backward(q, qn_w, rq, dq.view({T * m.nq, m.d}), dq_raw, g_qn);
        ops::rmsnorm_backward(k, kn_w, rk, dk.view({T * m.nkv, m.d}), dk_raw, g_kn);
        Tensor dxn = bf16({T, m.H}), dx = bf16({T, m.H});
        ops::rmsnorm_backward(x, in_w, rstd1, dy, dxn, g_in);
        ops::add(dxn, dx1, dx);
      },
      reps);
}

// The attention half of one layer around its attention calls, as the step runs it in `groups` head
// groups (models/qwen3, the attention recomputed): per group the q/k/v projections, q/k norms and
// rotary, and o_proj over the group's columns of Wo (a copy of them when the group is not every
// head), in the forward and again in the backward's recompute; in the backward, with more than one
// group, each group's q/k/v made once more, then dattn and o_proj's gradient (through a copy of
// the group's columns), rotary and norm backwards, q/k/v's weight and input gradients. The
// attention calls are left out (their work does not depend on the grouping; a third forward with
// groups is the plan's own term), their outputs and input gradients stood in by data.
double attention_half_seconds(int64_t T, const Shape4B& m, int64_t groups, int reps) {
  const Device g = Device::cuda();
  const float eps = 1e-6f;
  auto bf16 = [&](Shape s) { return Tensor::empty(std::move(s), DType::bf16, g); };
  const int64_t nq = m.nq / groups, nkv = m.nkv / groups, d = m.d, qg = nq * d, kvg = nkv * d;
  const Tensor h1 = gpu_random({T, m.H}, DType::bf16), dx1 = gpu_random({T, m.H}, DType::bf16);
  const Tensor wq = gpu_random({m.qd(), m.H}, DType::bf16, 0.02f), wk = gpu_random({m.kvd(), m.H}, DType::bf16, 0.02f),
               wv = gpu_random({m.kvd(), m.H}, DType::bf16, 0.02f), wo = gpu_random({m.H, m.qd()}, DType::bf16, 0.02f);
  const Tensor qn_w = gpu_random({d}, DType::bf16), kn_w = gpu_random({d}, DType::bf16);
  Tensor gq = Tensor::zeros(wq.shape(), DType::f32, g), gk = Tensor::zeros(wk.shape(), DType::f32, g),
         gv = Tensor::zeros(wv.shape(), DType::f32, g), go = Tensor::zeros(wo.shape(), DType::f32, g);
  Tensor g_qn = Tensor::zeros({d}, DType::f32, g), g_kn = Tensor::zeros({d}, DType::f32, g);
  const Tensor attn = gpu_random({T, qg}, DType::bf16);
  Tensor dq = gpu_random({T, nq, d}, DType::bf16), dk = gpu_random({T, nkv, d}, DType::bf16);
  const Tensor dv = gpu_random({T, kvg}, DType::bf16);
  Tensor cos, sin;
  rotary_tables(T, d, cos, sin);
  struct Group {
    Tensor q, k, v, qr, kr, rq, rk;
  };
  auto inputs = [&](int64_t gi) {
    Group a{bf16({T, qg}), bf16({T, kvg}), bf16({T, kvg}), bf16({T * nq, d}), bf16({T * nkv, d}),
            Tensor::empty({T * nq}, DType::f32, g), Tensor::empty({T * nkv}, DType::f32, g)};
    ops::matmul(h1, false, wq.rows(gi * qg, (gi + 1) * qg), true, a.q);
    ops::matmul(h1, false, wk.rows(gi * kvg, (gi + 1) * kvg), true, a.k);
    ops::matmul(h1, false, wv.rows(gi * kvg, (gi + 1) * kvg), true, a.v);
    ops::rmsnorm_forward(a.q.view({T * nq, d}), qn_w, eps, a.qr, a.rq);
    ops::rmsnorm_forward(a.k.view({T * nkv, d}), kn_w, eps, a.kr, a.rk);
    Tensor qr3 = a.qr.view({T, nq, d}), kr3 = a.kr.view({T, nkv, d});
    ops::rotary_forward(qr3, cos, sin);
    ops::rotary_forward(kr3, cos, sin);
    return a;
  };
  auto o_columns = [&](int64_t gi) {
    if (groups == 1) return wo;
    Tensor c = bf16({m.H, qg});
    ops::copy_columns(wo, gi * qg, c, 0, qg);
    return c;
  };
  auto forward = [&](std::vector<Group>* keep) {
    Tensor o = bf16({T, m.H});
    for (int64_t gi = 0; gi < groups; ++gi) {
      Group a = inputs(gi);
      ops::matmul(attn, false, o_columns(gi), true, o, 1.f, gi == 0 ? 0.f : 1.f);
      if (keep) keep->push_back(std::move(a));
    }
  };
  return median_seconds(
      [&] {
        forward(nullptr);
        std::vector<Group> kept;
        forward(groups == 1 ? &kept : nullptr);
        Tensor dx = bf16({T, m.H});
        for (int64_t gi = 0; gi < groups; ++gi) {
          Group a = groups == 1 ? std::move(kept[0]) : inputs(gi);
          Tensor dattn = bf16({T, qg});
          ops::matmul(dx1, false, o_columns(gi), false, dattn);
          if (groups == 1) {
            ops::matmul(dx1, true, attn, false, go, 1.f, 1.f);
          } else {
            Tensor part = Tensor::empty({m.H, qg}, DType::f32, g);
            ops::copy_columns(go, gi * qg, part, 0, qg);
            ops::matmul(dx1, true, attn, false, part, 1.f, 1.f);
            ops::copy_columns(part, 0, go, gi * qg, qg);
          }
          ops::rotary_backward(dq, cos, sin);
          ops::rotary_backward(dk, cos, sin);
          Tensor dq_raw = bf16({T * nq, d}), dk_raw = bf16({T * nkv, d});
          ops::rmsnorm_backward(a.q.view({T * nq, d}), qn_w, a.rq, dq.view({T * nq, d}), dq_raw, g_qn);
          ops::rmsnorm_backward(a.k.view({T * nkv, d}), kn_w, a.rk, dk.view({T * nkv, d}), dk_raw, g_kn);
          const Tensor dq2 = dq_raw.view({T, qg}), dk2 = dk_raw.view({T, kvg});
          Tensor gq_g = gq.rows(gi * qg, (gi + 1) * qg), gk_g = gk.rows(gi * kvg, (gi + 1) * kvg),
                 gv_g = gv.rows(gi * kvg, (gi + 1) * kvg);
          ops::matmul(dq2, true, h1, false, gq_g, 1.f, 1.f);
          ops::matmul(dk2, true, h1, false, gk_g, 1.f, 1.f);
          ops::matmul(dv, true, h1, false, gv_g, 1.f, 1.f);
          ops::matmul(dq2, false, wq.rows(gi * qg, (gi + 1) * qg), false, dx, 1.f, gi == 0 ? 0.f : 1.f);
          ops::matmul(dk2, false, wk.rows(gi * kvg, (gi + 1) * kvg), false, dx, 1.f, 1.f);
          ops::matmul(dv, false, wv.rows(gi * kvg, (gi + 1) * kvg), false, dx, 1.f, 1.f);
        }
      },
      reps);
}

void report(const char* what, double value, const char* unit, double scale, const RatesRow* known, const char* key) {
  std::printf("  %-28s %10.1f %s", what, value / scale, unit);
  if (known)
    if (auto k = known->find(key)) std::printf("   (table: %.1f, %+.1f%%)", *k / scale, 100.0 * (value / *k - 1));
  std::printf("\n");
  std::fflush(stdout);
}

RatesRow measure(bool quick, const RatesRow* known) {
  RatesRow row;
  row.device = local_gpu_name().value_or("");
  if (auto mem = local_gpu_memory())
    row.rates[rate_name::memory_gib] = std::round(static_cast<double>(*mem) / static_cast<double>(int64_t{1} << 30));
  const int reps = quick ? 2 : 5;
  const Device g = Device::cuda();
  const Shape4B m;
  const int64_t H = m.H, qd = m.qd(), kvd = m.kvd(), I = m.I, T = quick ? 8192 : 32768;

  double layer_flops = 0;
  const double layer_s = projections_seconds(
      T, {{qd, H}, {kvd, H}, {kvd, H}, {H, qd}, {I, H}, {I, H}, {H, I}}, reps, layer_flops);
  row.rates[rate_name::gemm] = layer_flops / layer_s;
  report("GEMM (bf16, cuBLASLt)", row.rates[rate_name::gemm], "TFLOP/s", 1e12, known, rate_name::gemm);

  // What the plan charges head groups (rates.cpp predicted_step_seconds): the attention half's
  // projections, 4 x 2 T (qkv + o) FLOPs a layer (forward, recompute, two in the backward), at
  // gemm / (1 + (G - 1) / (h - 1)) in G groups, and with groups a third q/k/v projection (2 T qkv)
  // at the GEMM rate. The half timed in 1 and in 8 groups, h is what makes the plan's difference
  // between them the measured one.
  constexpr int64_t kGroups = 8;
  const int64_t Th = quick ? 8192 : 65536;
  const double qkv = static_cast<double>(m.H * (m.qd() + 2 * m.kvd())), o_proj = static_cast<double>(m.qd() * m.H);
  const double grouped_flops = 4 * 2 * static_cast<double>(Th) * (qkv + o_proj),
               third_qkv_flops = 2 * static_cast<double>(Th) * qkv;
  const double one_s = attention_half_seconds(Th, m, 1, reps), grouped_s = attention_half_seconds(Th, m, kGroups, reps);
  const double gemm = row.rates[rate_name::gemm];
  row.rates[rate_name::half_rate_groups] =
      half_rate_groups_for(grouped_flops, kGroups, grouped_s - one_s - third_qkv_flops / gemm, gemm);
  std::printf("  %-28s %10.1f / %.1f ms in 1 / %lld groups at %lld tokens\n", "attention half, no attention",
              one_s * 1e3, grouped_s * 1e3, static_cast<long long>(kGroups), static_cast<long long>(Th));
  report("head groups at half rate", row.rates[rate_name::half_rate_groups], "", 1, known, rate_name::half_rate_groups);

  double forward_rate = 0, backward_rate = 0;
  const std::vector<int64_t> lengths = quick ? std::vector<int64_t>{16384} : std::vector<int64_t>{65536, 131072};
  for (const int64_t L : lengths) {
    const int64_t Hq = 32, Hkv = 8, d = 128;
    Tensor q = gpu_random({L, Hq, d}, DType::bf16), k = gpu_random({L, Hkv, d}, DType::bf16),
           v = gpu_random({L, Hkv, d}, DType::bf16), dout = gpu_random({L, Hq, d}, DType::bf16);
    Tensor out = Tensor::empty({L, Hq, d}, DType::bf16, g), lse = Tensor::empty({Hq, L}, DType::f32, g);
    Tensor dq = Tensor::empty(q.shape(), DType::bf16, g), dk = Tensor::empty(k.shape(), DType::bf16, g),
           dv = Tensor::empty(v.shape(), DType::bf16, g);
    ops::AttentionParams p;
    const double pairs = static_cast<double>(L) * static_cast<double>(L) / 2 * static_cast<double>(Hq);
    const double forward_flops = pairs * 4 * static_cast<double>(d);
    const double f = median_seconds([&] { ops::attention_forward(q, k, v, out, lse, p); }, reps);
    const double b = median_seconds([&] { ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p); }, reps);
    forward_rate += forward_flops / f / static_cast<double>(lengths.size());
    backward_rate += 2.5 * forward_flops / b / static_cast<double>(lengths.size());
    std::printf("  %-28s %10.1f / %.1f TFLOP/s forward / backward at %lld tokens\n", "attention", forward_flops / f / 1e12,
                2.5 * forward_flops / b / 1e12, static_cast<long long>(L));
  }
  {
    row.rates[rate_name::attention_forward] = forward_rate;
    row.rates[rate_name::attention_backward] = backward_rate;
    report("attention forward", row.rates[rate_name::attention_forward], "TFLOP/s", 1e12, known,
           rate_name::attention_forward);
    report("attention backward", row.rates[rate_name::attention_backward], "TFLOP/s", 1e12, known,
           rate_name::attention_backward);
  }

  {
    // Counted as the plan counts a layer's passes (models/qwen3 plan): T x 2 bytes x (11 I + 24 H).
    const int64_t Te = quick ? 8192 : 65536;
    const double s = layer_elementwise_seconds(Te, m, reps);
    row.rates[rate_name::memory] = static_cast<double>(Te) * 2 * static_cast<double>(11 * m.I + 24 * m.H) / s;
    std::printf("  %-28s %10.2f ms a layer at %lld tokens\n", "elementwise kernels", s * 1e3,
                static_cast<long long>(Te));
    report("elementwise memory", row.rates[rate_name::memory], "GB/s", 1e9, known, rate_name::memory);
  }

  {
    const int64_t bytes = quick ? int64_t{256} << 20 : int64_t{1} << 30;
    PinnedBuffer host = pinned_alloc(static_cast<size_t>(bytes));
    Tensor h = host.view({bytes / 4}, DType::f32);
    Tensor d = Tensor::empty({bytes / 4}, DType::f32, g);
    const double up_s = median_seconds([&] { d.copy_from(h); }, reps);
    const double down_s = median_seconds([&] { h.copy_from(d); }, reps);
    row.rates[rate_name::host_copy] = (static_cast<double>(bytes) / up_s + static_cast<double>(bytes) / down_s) / 2;
    std::printf("  %-28s %10.1f / %.1f GB/s to / from the GPU\n", "pinned host copies", bytes / up_s / 1e9,
                bytes / down_s / 1e9);
    report("host copy (mean)", row.rates[rate_name::host_copy], "GB/s", 1e9, known, rate_name::host_copy);
  }
  {
    const int64_t E = 128, H = 2048, I = 768, R = (quick ? 8192 : 32768) * 8;
    std::vector<int64_t> off{0};
    double total = 0;
    std::vector<double> share(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) total += share[e] = e % 32 == 3 ? 4.0 : e % 16 == 7 ? 0.0 : 0.5 + (e * 37 % 64) / 64.0;
    for (int64_t e = 0; e < E; ++e)
      off.push_back(e + 1 == E ? R : std::min(R, off.back() + static_cast<int64_t>(share[e] / total * R)));
    Tensor x = gpu_random({R, H}, DType::bf16), h = gpu_random({R, I}, DType::bf16);
    Tensor w_in = gpu_random({E, I, H}, DType::bf16, 0.05f), w_out = gpu_random({E, H, I}, DType::bf16, 0.05f);
    Tensor y_in = Tensor::empty({R, I}, DType::bf16, g), y_out = Tensor::empty({R, H}, DType::bf16, g);
    const double s = median_seconds(
        [&] {
          ops::grouped_matmul(x, w_in, true, off, y_in);        // gate, up: x w[e]^T
          ops::grouped_matmul(x, w_in, true, off, y_in);
          ops::grouped_matmul(h, w_out, true, off, y_out);      // down
          ops::grouped_matmul(h, w_in, false, off, y_out);      // gate's, up's input gradients: dy w[e]
          ops::grouped_matmul(h, w_in, false, off, y_out, 1.f, 1.f);
          ops::grouped_matmul(x, w_out, false, off, y_in);      // down's
        },
        reps);
    row.rates[rate_name::expert_gemm] = 6 * 2 * static_cast<double>(R) * static_cast<double>(H * I) / s;
    std::printf("  %-28s %10.2f ms for 6 calls over %lld rows\n", "expert grouped GEMMs", s * 1e3,
                static_cast<long long>(R));
    report("expert grouped GEMMs", row.rates[rate_name::expert_gemm], "TFLOP/s", 1e12, known, rate_name::expert_gemm);
  }
  random_pools().clear();
  return row;
}

}  // namespace

int calibrate_main(int argc, char** argv) {
  std::string out;
  bool quick = false, help = false;
  po::options_description desc(
      "lcx-train calibrate: measures this GPU's rates (bf16 GEMMs, attention forward and backward, elementwise "
      "memory traffic, pinned host copies, head-group projections) in about a minute and writes its row of the "
      "rates table, which the plan's times and the MFU then use\n\n"
      "Usage: lcx-train calibrate [--out FILE] [--quick]\n\n"
      "Options");
  desc.add_options()
      ("out", po::value(&out)->value_name("FILE"),
       "the rates file to write the row into (its other rows kept); default: LCX_RATES, else "
       "$XDG_CONFIG_HOME/lcx/rates.toml, else ~/.config/lcx/rates.toml")
      ("quick", po::bool_switch(&quick), "smaller shapes and fewer repetitions: a check, not a row to plan by")
      ("help,h", po::bool_switch(&help), "print this help");
  parse_subcommand(desc, argc, argv, "calibrate");
  if (help) {
    std::cout << desc;
    return 0;
  }
  if (!local_gpu_name())
    throw Error("calibrate measures a GPU, and this machine has none (or this lcx was built without CUDA)", {},
                "run it on the GPU whose rates you want, or plan with --gpu-name naming a row of the rates table");
  if (out.empty()) out = user_rates_path();
  const RatesTable table = load_rates();
  const std::string device = *local_gpu_name();
  const RatesRow* known = table.find(device);
  std::printf("calibrating '%s'%s\n", device.c_str(),
              known ? str(" against its row (", known->source, ")").c_str() : " (no row in the rates table yet)");
  const auto start = std::chrono::steady_clock::now();
  RatesRow row = measure(quick, known);
  row.source = out;
  row.basis = kBasisCalibrate;
  write_rates_row(out, row);
  std::printf("wrote the '%s' row into %s (%.0f s)\n%s", row.device.c_str(), out.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
              format_rates_row(row).c_str());
  if (!row.find(rate_name::peak) && !(known && known->find(rate_name::peak)))
    std::printf("no peak_flops for this GPU: add its dense bf16 peak to the row (FLOP/s) or set [run] peak_tflops, "
                "for the MFU\n");
  return 0;
}

}  // namespace lcx
