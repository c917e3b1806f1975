// `lcx-train calibrate`: measures this GPU's row of the rates table (plan/rates.h) through
// lcx::ops, at the shapes of a full-depth Qwen3-4B step, and writes it into the user's rates file.
// Each rate is counted the way the plan counts the work (StepWork), so the plan's times on this GPU
// come from its own row:
// - gemm_flops: one layer's projections (q, k, v, o, gate, up, down) at T rows, each forward
//   (bf16 out), input gradient (bf16) and weight gradient accumulated in fp32: 6 T N K FLOPs each.
// - head_groups_at_half_rate: the attention half's projections cut into 8 head groups (1/8 as
//   wide) against the same at full width: a slowdown s at 8 groups gives 1 + 7 / (s - 1).
// - attention_forward_flops, attention_backward_flops: causal GQA attention, 32 query / 8 key-value
//   heads of 128, bf16, at 65,536 and 131,072 tokens (their mean rate): 4 d FLOPs per (query, key)
//   pair and head forward, 2.5x that backward.
// - memory_bytes: one layer's elementwise passes with a recompute (SwiGLU forward twice and
//   backward over [T,I]; RMSNorm forward four times and backward twice and two residual adds over
//   [T,H]; the q/k norms and rotary on [T,Hq,d] and [T,Hkv,d] forward twice and backward once),
//   counted as the plan counts a layer's: T x 2 bytes x (11 I + 24 H).
// - host_copy_bytes: pinned host -> GPU and GPU -> pinned host copies of 1 GiB, their mean rate.
// Each figure is the median of a few timed calls after a warm-up, the device synchronized around
// the host clock.
#include <algorithm>
#include <cmath>
#include <boost/program_options.hpp>
#include <chrono>
#include <cstdio>
#include <functional>
#include <iostream>
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

// Normal values, never all zero (a GEMM of zeros runs faster than one of data): a pool of a prime
// count drawn once, repeated, so that billions of elements take no time to make.
Tensor gpu_random(Shape shape, DType dtype, float scale = 1.f) {
  static const std::vector<float> pool = [] {
    std::mt19937 rng(1234);
    std::normal_distribution<float> dist(0.f, 1.f);
    std::vector<float> p(1'048'573);
    for (auto& x : p) x = dist(rng);
    return p;
  }();
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = scale * pool[i % pool.size()];
  return Tensor::from_floats(v, shape, dtype, Device::cuda());
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
  // Qwen3-4B: hidden 2560, 32 query and 8 key-value heads of 128, intermediate 9728.
  const int64_t H = 2560, qd = 4096, kvd = 1024, I = 9728, T = quick ? 8192 : 32768;

  double layer_flops = 0;
  const double layer_s = projections_seconds(
      T, {{qd, H}, {kvd, H}, {kvd, H}, {H, qd}, {I, H}, {I, H}, {H, I}}, reps, layer_flops);
  row.rates[rate_name::gemm] = layer_flops / layer_s;
  report("GEMM (bf16, cuBLASLt)", row.rates[rate_name::gemm], "TFLOP/s", 1e12, known, rate_name::gemm);

  constexpr int64_t kGroups = 8;
  double full_flops = 0, grouped_flops = 0;
  const double full_s = projections_seconds(T, {{qd, H}, {kvd, H}, {kvd, H}, {H, qd}}, reps, full_flops);
  const double grouped_s = kGroups * projections_seconds(T, {{qd / kGroups, H}, {kvd / kGroups, H}, {kvd / kGroups, H},
                                                            {H, qd / kGroups}},
                                                        reps, grouped_flops);
  const double slowdown = (grouped_s / (kGroups * grouped_flops)) / (full_s / full_flops);
  // At most 1000 groups: no slowdown measured (s <= 1) reads as groups that cost nothing.
  row.rates[rate_name::half_rate_groups] =
      slowdown > 1 + static_cast<double>(kGroups - 1) / 999 ? 1 + static_cast<double>(kGroups - 1) / (slowdown - 1) : 1000;
  std::printf("  %-28s %10.2f x the full width's time at %lld groups\n", "head-group projections", slowdown,
              static_cast<long long>(kGroups));
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
    Tensor gate = gpu_random({T, I}, DType::bf16), up = gpu_random({T, I}, DType::bf16), act = Tensor::empty({T, I}, DType::bf16, g);
    Tensor dgate = Tensor::empty({T, I}, DType::bf16, g), dup = Tensor::empty({T, I}, DType::bf16, g);
    Tensor x = gpu_random({T, H}, DType::bf16), w = gpu_random({H}, DType::bf16), y = Tensor::empty({T, H}, DType::bf16, g);
    Tensor rstd = Tensor::empty({T}, DType::f32, g), dy = gpu_random({T, H}, DType::bf16),
           dx = Tensor::empty({T, H}, DType::bf16, g), dw = Tensor::zeros({H}, DType::f32, g);
    // The q and k heads of 128, their norms and rotary tables.
    const int64_t d = 128, nq = qd / d, nkv = kvd / d;
    Tensor hq = gpu_random({T * nq, d}, DType::bf16), hk = gpu_random({T * nkv, d}, DType::bf16),
           wn = gpu_random({d}, DType::bf16);
    Tensor qn = Tensor::empty({T * nq, d}, DType::bf16, g), kn = Tensor::empty({T * nkv, d}, DType::bf16, g);
    Tensor rq = Tensor::empty({T * nq}, DType::f32, g), rk = Tensor::empty({T * nkv}, DType::f32, g);
    Tensor dq = Tensor::empty({T * nq, d}, DType::bf16, g), dk = Tensor::empty({T * nkv, d}, DType::bf16, g);
    Tensor dwn = Tensor::zeros({d}, DType::f32, g);
    Tensor cos = gpu_random({T, d / 2}, DType::f32), sin = gpu_random({T, d / 2}, DType::f32);
    Tensor q3 = qn.view({T, nq, d}), k3 = kn.view({T, nkv, d}), dq3 = dq.view({T, nq, d}), dk3 = dk.view({T, nkv, d});
    const double s = median_seconds(
        [&] {
          for (int i = 0; i < 2; ++i) ops::swiglu_forward(gate, up, act);
          ops::swiglu_backward(gate, up, act, dgate, dup);
          for (int i = 0; i < 4; ++i) ops::rmsnorm_forward(x, w, 1e-6f, y, rstd);
          for (int i = 0; i < 2; ++i) ops::rmsnorm_backward(x, w, rstd, dy, dx, dw);
          for (int i = 0; i < 2; ++i) ops::add(x, dy, y);
          for (int i = 0; i < 2; ++i) {
            ops::rmsnorm_forward(hq, wn, 1e-6f, qn, rq);
            ops::rmsnorm_forward(hk, wn, 1e-6f, kn, rk);
            ops::rotary_forward(q3, cos, sin);
            ops::rotary_forward(k3, cos, sin);
          }
          ops::rotary_backward(dq3, cos, sin);
          ops::rotary_backward(dk3, cos, sin);
          ops::rmsnorm_backward(hq, wn, rq, qn, dq, dwn);
          ops::rmsnorm_backward(hk, wn, rk, kn, dk, dwn);
        },
        reps);
    row.rates[rate_name::memory] = static_cast<double>(T) * 2 * static_cast<double>(11 * I + 24 * H) / s;
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
