// GPU micro-benchmarks for scripts/gpu_check.sh: the matrix-product ceiling through cuBLASLt,
// the Qwen3-4B projection shapes, attention forward and backward (cuDNN's fused kernel where it
// loads, and the own tensor-core kernels), and the memory-bound kernels against the copy bandwidth.
// Each figure is the median of several timed runs after a warm-up, timed by synchronizing the
// device around the host clock, on random (never zero) inputs. Prints one line per figure:
//   name | shape | ms | rate
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "lcx/ops.h"
#include "lcx/tensor.h"

#ifdef LCX_HAVE_CUDA
#include "kernels/attention/cudnn/attention_cudnn.h"
#include "kernels/attention/dispatch.h"
#include "kernels/cuda/grouped_gemm_hopper.h"
#endif
#include "kernels/grouped_gemm_choice.h"

namespace {

using lcx::DType;
using lcx::Tensor;

void sync() { lcx::backend_for(lcx::Device::cuda())->synchronize(); }

double median_ms(const std::function<void()>& fn, int reps) {
  fn();
  sync();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto a = std::chrono::steady_clock::now();
    fn();
    sync();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Random normal values generated on the host once per size and reused, cast on upload.
// Normal samples, at most 2^24 drawn and the rest repeated at a shifting offset: drawing every
// element of a 512k-token attention input on one host thread took most of a device call's limit,
// and the kernels' speed does not depend on the values being unrepeated.
Tensor gpu_random(lcx::Shape shape, DType t, float scale = 1.f) {
  static std::mt19937 rng(1234);
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(static_cast<size_t>(lcx::shape_numel(shape)));
  const size_t drawn = std::min(v.size(), size_t(1) << 24);
  for (size_t i = 0; i < drawn; ++i) v[i] = dist(rng);
  for (size_t i = drawn; i < v.size(); ++i) v[i] = v[(i + i / drawn * 7919) % drawn];
  return Tensor::from_floats(v, shape, t, lcx::Device::cuda());
}

void report(const std::string& name, const std::string& shape, double ms, double rate, const char* unit) {
  std::printf("%-28s | %-34s | %9.3f ms | %8.1f %s\n", name.c_str(), shape.c_str(), ms, rate, unit);
  std::fflush(stdout);
}

void bench_matmul(int64_t M, int64_t N, int64_t K, const char* name) {
  Tensor a = gpu_random({M, K}, DType::bf16), b = gpu_random({N, K}, DType::bf16);
  Tensor c = Tensor::empty({M, N}, DType::bf16, lcx::Device::cuda());
  const double ms = median_ms([&] { lcx::ops::matmul(a, false, b, true, c, 1.f, 0.f); }, 10);
  report(name, lcx::str(M, "x", N, "x", K, " bf16"), ms, 2.0 * M * N * K / ms / 1e9, "TFLOP/s");
}

void bench_attention(const char* kernel, int64_t T, int64_t Hq, int64_t Hkv, int64_t d, int reps) {
  Tensor q = gpu_random({T, Hq, d}, DType::bf16), k = gpu_random({T, Hkv, d}, DType::bf16),
         v = gpu_random({T, Hkv, d}, DType::bf16), dout = gpu_random({T, Hq, d}, DType::bf16);
  Tensor out = Tensor::empty({T, Hq, d}, DType::bf16, lcx::Device::cuda());
  Tensor lse = Tensor::empty({Hq, T}, DType::f32, lcx::Device::cuda());
  Tensor dq = Tensor::empty(q.shape(), DType::bf16, lcx::Device::cuda()), dk = Tensor::empty(k.shape(), DType::bf16, lcx::Device::cuda()),
         dv = Tensor::empty(v.shape(), DType::bf16, lcx::Device::cuda());
  lcx::ops::AttentionParams p;
  // Causal: half of the T x T score matrix, 2 products of 2 d FLOP each per score.
  const double fwd_flop = 4.0 * T * T * d * Hq / 2;
  const std::string shape = lcx::str("T=", T, " Hq=", Hq, " Hkv=", Hkv, " d=", d, " causal");
  const double f = median_ms([&] { lcx::ops::attention_forward(q, k, v, out, lse, p); }, reps);
  report(lcx::str("attention ", kernel, " fwd"), shape, f, fwd_flop / f / 1e9, "TFLOP/s");
  const double b =
      median_ms([&] { lcx::ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p); }, reps);
  report(lcx::str("attention ", kernel, " bwd"), shape, b, 2.5 * fwd_flop / b / 1e9, "TFLOP/s");
  report(lcx::str("attention ", kernel, " fwd+bwd"), shape, f + b, 3.5 * fwd_flop / (f + b) / 1e9, "TFLOP/s");
}

// The forward alone, causal or full, median of `reps`, on cuDNN and on the own kernel, from the
// same inputs (made once: at 256k tokens and more their host-side generation outlasts the timing).
void bench_attention_forward(int64_t T, bool causal, int reps, bool backward) {
  const int64_t Hq = 32, Hkv = 8, d = 128;
  Tensor q = gpu_random({T, Hq, d}, DType::bf16), k = gpu_random({T, Hkv, d}, DType::bf16),
         v = gpu_random({T, Hkv, d}, DType::bf16);
  Tensor out = Tensor::empty({T, Hq, d}, DType::bf16, lcx::Device::cuda());
  Tensor lse = Tensor::empty({Hq, T}, DType::f32, lcx::Device::cuda());
  Tensor dout = backward ? gpu_random({T, Hq, d}, DType::bf16) : Tensor();
  Tensor dq = backward ? Tensor::empty(q.shape(), DType::bf16, lcx::Device::cuda()) : Tensor();
  Tensor dk = backward ? Tensor::empty(k.shape(), DType::bf16, lcx::Device::cuda()) : Tensor();
  Tensor dv = backward ? Tensor::empty(v.shape(), DType::bf16, lcx::Device::cuda()) : Tensor();
  lcx::ops::AttentionParams p;
  p.causal = causal;
  const double flop = 4.0 * T * T * d * Hq / (causal ? 2 : 1);
#ifdef LCX_HAVE_CUDA
  // own: the best of lcx's kernels this GPU has (Hopper's on an H100); mma: the sm_80 kernels an
  // Ampere or Ada GPU without cuDNN runs.
  using lcx::ops::attention::Choice;
  for (const auto kind : {Choice::cudnn, Choice::own, Choice::mma}) {
    if (kind == Choice::cudnn && lcx::cuda::cudnn_version().empty()) continue;
    lcx::ops::attention::set_choice(kind);
    const char* name = kind == Choice::cudnn ? "cudnn" : kind == Choice::own ? "own" : "mma";
    const std::string shape = lcx::str("T=", T, " Hq=32 Hkv=8 d=128", causal ? " causal" : " full");
    try {
      const double f = median_ms([&] { lcx::ops::attention_forward(q, k, v, out, lse, p); }, reps);
      report(lcx::str("attention ", name, " fwd"), shape, f, flop / f / 1e9, "TFLOP/s");
      if (!backward) continue;
      const double b =
          median_ms([&] { lcx::ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p); }, reps);
      report(lcx::str("attention ", name, " bwd"), shape, b, 2.5 * flop / b / 1e9, "TFLOP/s");
    } catch (const std::exception& e) {
      std::printf("attention %s %s: refused: %s\n", name, shape.c_str(), e.what());
    }
  }
  lcx::ops::attention::set_choice(lcx::ops::attention::Choice::automatic);
#endif
}

// A windowed layer (ops::AttentionParams::window) beside full causal attention of the same shape
// (T tokens, 32 query heads, 8 key/value heads of 128), forward, backward and both, on each backend
// forced in turn: cuDNN's band mask, the Hopper kernels, the sm_80 tensor-core kernels (`backends`:
// a comma-separated subset of cudnn,hopper,mma,reference). A windowed call's work is T x W (query,
// key) pairs, full causal attention's T (T + 1) / 2; `ratio` is the windowed time over what T x W
// pairs take at the backend's full causal rate: 1 is work proportional to the window with no loss
// of rate; the bar is 1.25. Tiles bound it from below: a block of B query rows walks the key
// tiles of W + B - 1 positions, so 128-row blocks compute about (W + 128) / W of the pairs (2 at
// W = 128, 1.03 at 4096) and 64-row ones (W + 64) / W.
void bench_window_attention(int64_t T, const std::vector<int64_t>& windows, const std::string& backends, int reps) {
#ifdef LCX_HAVE_CUDA
  const int64_t Hq = 32, Hkv = 8, d = 128;
  const lcx::Device g = lcx::Device::cuda();
  Tensor q = gpu_random({T, Hq, d}, DType::bf16), k = gpu_random({T, Hkv, d}, DType::bf16),
         v = gpu_random({T, Hkv, d}, DType::bf16), dout = gpu_random({T, Hq, d}, DType::bf16);
  Tensor out = Tensor::empty({T, Hq, d}, DType::bf16, g), lse = Tensor::empty({Hq, T}, DType::f32, g);
  Tensor dq = Tensor::empty(q.shape(), DType::bf16, g), dk = Tensor::empty(k.shape(), DType::bf16, g),
         dv = Tensor::empty(v.shape(), DType::bf16, g);
  using lcx::ops::attention::Choice;
  const std::pair<const char*, Choice> kinds[] = {
      {"cudnn", Choice::cudnn}, {"hopper", Choice::hopper}, {"mma", Choice::mma}, {"reference", Choice::reference}};
  const double full_pairs = 0.5 * double(T) * double(T + 1);
  for (const auto& [name, kind] : kinds) {
    if (("," + backends + ",").find(lcx::str(",", name, ",")) == std::string::npos) continue;
    if (kind == Choice::cudnn && lcx::cuda::cudnn_version().empty()) {
      std::printf("window %s: libcudnn.so.9 is not loadable here\n", name);
      continue;
    }
    lcx::ops::attention::set_choice(kind);
    double full[2] = {0, 0};  // forward, backward ms of full causal attention
    std::vector<int64_t> all{0};  // full causal first: the rate the windows are held to
    all.insert(all.end(), windows.begin(), windows.end());
    for (const int64_t W : all) {
      lcx::ops::AttentionParams p;
      p.window = W;
      const std::string shape = lcx::str("T=", T, " Hq=32 Hkv=8 d=128", W ? lcx::str(" W=", W) : std::string(" causal"));
      const double pairs = W ? double(T) * double(W) : full_pairs;
      try {
        const double f = median_ms([&] { lcx::ops::attention_forward(q, k, v, out, lse, p); }, reps);
        const double b =
            median_ms([&] { lcx::ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p); }, reps);
        const double flop = 4.0 * d * Hq * pairs;
        if (W == 0) {
          full[0] = f;
          full[1] = b;
        }
        const double times[3] = {f, b, f + b}, flops[3] = {flop, 2.5 * flop, 3.5 * flop};
        const char* parts[3] = {"fwd", "bwd", "fwd+bwd"};
        for (int i = 0; i < 3; ++i) {
          const double full_ms = i < 2 ? full[i] : full[0] + full[1];
          const double ratio = full_ms > 0 ? times[i] / (full_ms * pairs / full_pairs) : 0;
          std::printf("window %-9s %-7s | %-34s | %9.3f ms | %7.1f TFLOP/s | ratio %.3f\n", name, parts[i],
                      shape.c_str(), times[i], flops[i] / times[i] / 1e9, ratio);
        }
        std::fflush(stdout);
      } catch (const std::exception& e) {
        std::printf("window %s | %s: refused: %s\n", name, shape.c_str(), e.what());
      }
    }
  }
  lcx::ops::attention::set_choice(Choice::automatic);
#else
  (void)T, (void)windows, (void)backends, (void)reps;
#endif
}

void bench_memory_bound(int64_t T, int64_t H, int64_t I, int64_t V) {
  const lcx::Device g = lcx::Device::cuda();
  {
    Tensor src = gpu_random({T, I}, DType::bf16), dst = Tensor::empty({T, I}, DType::f32, g);
    const double ms = median_ms([&] { lcx::ops::cast(src, dst); }, 10);
    report("cast bf16->fp32", lcx::str(T, "x", I), ms, T * I * 6.0 / ms / 1e6, "GB/s");
  }
  {
    Tensor x = gpu_random({T, H}, DType::bf16), w = gpu_random({H}, DType::bf16), y = Tensor::empty({T, H}, DType::bf16, g);
    Tensor rstd = Tensor::empty({T}, DType::f32, g);
    const double ms = median_ms([&] { lcx::ops::rmsnorm_forward(x, w, 1e-6f, y, rstd); }, 10);
    report("rmsnorm fwd", lcx::str(T, "x", H, " bf16"), ms, T * H * 4.0 / ms / 1e6, "GB/s");
    Tensor dy = gpu_random({T, H}, DType::bf16), dx = Tensor::empty({T, H}, DType::bf16, g), dw = Tensor::zeros({H}, DType::f32, g);
    const double mb = median_ms([&] { lcx::ops::rmsnorm_backward(x, w, rstd, dy, dx, dw); }, 10);
    report("rmsnorm bwd", lcx::str(T, "x", H, " bf16"), mb, T * H * 2.0 * 5 / mb / 1e6, "GB/s");
  }
  {
    Tensor gate = gpu_random({T, I}, DType::bf16), up = gpu_random({T, I}, DType::bf16), out = Tensor::empty({T, I}, DType::bf16, g);
    const double ms = median_ms([&] { lcx::ops::swiglu_forward(gate, up, out); }, 10);
    report("swiglu fwd", lcx::str(T, "x", I, " bf16"), ms, T * I * 6.0 / ms / 1e6, "GB/s");
    Tensor dg = Tensor::empty({T, I}, DType::bf16, g), du = Tensor::empty({T, I}, DType::bf16, g);
    const double mb = median_ms([&] { lcx::ops::swiglu_backward(gate, up, out, dg, du); }, 10);
    report("swiglu bwd", lcx::str(T, "x", I, " bf16"), mb, T * I * 10.0 / mb / 1e6, "GB/s");
  }
  {
    const int64_t rows = 4096;
    Tensor logits = gpu_random({rows, V}, DType::bf16, 3.f);
    std::vector<float> tv(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i) tv[static_cast<size_t>(i)] = static_cast<float>((i * 7919) % V);
    Tensor targets = Tensor::from_floats(tv, {rows}, DType::i64, g);
    const double ms = median_ms(
        [&] { lcx::ops::cross_entropy_forward_backward(logits, targets, 1.0 / rows, &logits, nullptr); }, 10);
    report("cross entropy fwd+bwd", lcx::str(rows, "x", V, " bf16 in place"), ms, rows * V * 6.0 / ms / 1e6, "GB/s");
  }
}


// The experts' grouped GEMMs at Qwen3-30B-A3B's shapes (128 experts, 8 a token, hidden 2048,
// expert width 768) over `tokens` tokens routed with a real router's skew (every 32nd expert 4x the
// mean rows, every 16th none, the rest the mean +-50%): each direction (the forward and the input
// gradient of gate/up and down, the weights' gradients into fp32) through lcx's Hopper kernels and
// through cuBLAS's grouped GEMM ([run] grouped_gemm = "cublas"), and a dense GEMM of the same
// total work; the two grouped results are compared (largest difference over the largest value).
void bench_grouped(int64_t tokens, int reps, const std::string& designs) {
  const int64_t G = 128, H = 2048, I = 768, R = tokens * 8;
  std::mt19937 rng(7);
  std::vector<double> share(G);
  double total = 0;
  for (int64_t g = 0; g < G; ++g) {
    share[g] = g % 32 == 3 ? 4.0 : g % 16 == 7 ? 0.0 : 0.5 + (rng() % 1000) / 1000.0;
    total += share[g];
  }
  std::vector<int64_t> off{0};
  for (int64_t g = 0; g < G; ++g)
    off.push_back(g + 1 == G ? R : std::min(R, off.back() + static_cast<int64_t>(share[g] / total * R)));
  int64_t biggest = 0;
  for (int64_t g = 0; g < G; ++g) biggest = std::max(biggest, off[g + 1] - off[g]);
  std::printf("grouped GEMMs: %lld tokens, %lld rows, largest expert %lld rows (mean %lld)\n", (long long)tokens,
              (long long)R, (long long)biggest, (long long)(R / G));
  const auto gpu = lcx::Device::cuda();
  struct Dir {
    const char* name;
    int64_t K, N;  // reduction and result widths (wgrad: N result rows of K columns per expert)
    int kind;      // 0: x w^T, 1: dy w, 2: dw += dy^T x
  };
  const Dir dirs[] = {{"gate or up fwd 2048->768", H, I, 0}, {"down fwd 768->2048", I, H, 0},
                      {"gate or up dx 768->2048", I, H, 1},  {"down dx 2048->768", H, I, 1},
                      {"gate or up dw [768,2048]", H, I, 2}, {"down dw [2048,768]", I, H, 2}};
  // Drawn once: rows of each width, the weights both ways ([G, I, H] and [G, H, I]).
  const Tensor rows_h = gpu_random({R, H}, DType::bf16), rows_i = gpu_random({R, I}, DType::bf16);
  const Tensor w_ih = gpu_random({G, I, H}, DType::bf16, 0.05f), w_hi = gpu_random({G, H, I}, DType::bf16, 0.05f);
  auto rows_of = [&](int64_t width) { return width == H ? rows_h : rows_i; };
  auto weights = [&](int64_t first, int64_t second) { return first == I && second == H ? w_ih : w_hi; };
  for (const Dir& d : dirs) {
    const double flops = 2.0 * R * d.K * d.N;
    // Forward: a [R, K], w [G, N, K]; input gradient: a [R, K], w [G, K, N]; weights' gradient:
    // a = dy [R, N], b = x [R, K].
    const Tensor a = rows_of(d.kind == 2 ? d.N : d.K), b = rows_of(d.K);
    const Tensor w = d.kind == 0 ? weights(d.N, d.K) : weights(d.K, d.N);
    auto run = [&](Tensor& out) {
      if (d.kind == 2) {
        lcx::ops::grouped_matmul_wgrad(a, b, off, out, 1.f, 1.f);
      } else {
        lcx::ops::grouped_matmul(a, w, d.kind == 0, off, out);
      }
    };
    const lcx::Shape out_shape = d.kind == 2 ? lcx::Shape{G, d.N, d.K} : lcx::Shape{R, d.N};
    const DType out_type = d.kind == 2 ? DType::f32 : DType::bf16;
    // cuBLAS's grouped GEMM, then lcx's kernels of either design (cooperative, ping-pong).
    double ms[3];
    std::vector<float> reference;
    double diff[3] = {0, 0, 0}, top = 0;
    for (int v = 0; v < 3; ++v) {
      if ((v == 1 && designs.find("coop") == std::string::npos) || (v == 2 && designs.find("ping") == std::string::npos)) {
        ms[v] = 0;
        continue;
      }
      lcx::ops::set_own_grouped_gemm(v > 0);
#ifdef LCX_HAVE_CUDA
      lcx::ops::cuda::grouped_hopper::set_ping_pong(v == 2);
#endif
      Tensor out = Tensor::empty(out_shape, out_type, gpu);
      out.zero();
      ms[v] = median_ms([&] { run(out); }, reps);
      out.zero();
      run(out);  // once onto zeros, to compare
      std::vector<float> got = out.to_floats();
      if (v == 0) {
        reference = std::move(got);
        for (float r : reference) top = std::max(top, static_cast<double>(std::fabs(r)));
        continue;
      }
      for (size_t i = 0; i < got.size(); ++i)
        diff[v] = std::max(diff[v], static_cast<double>(std::fabs(got[i] - reference[i])));
    }
    lcx::ops::set_own_grouped_gemm(false);
#ifdef LCX_HAVE_CUDA
    lcx::ops::cuda::grouped_hopper::set_ping_pong(false);
#endif
    // The dense GEMM of the same work: [R, K] x [K, N] (wgrad: [N, R] x [R, K]).
    double dense_ms;
    if (d.kind == 2) {
      Tensor c = Tensor::empty({d.N, d.K}, DType::f32, gpu);
      dense_ms = median_ms([&] { lcx::ops::matmul(a, true, b, false, c, 1.f, 1.f); }, reps);
    } else {
      const Tensor wd = weights(d.N, d.K).rows(0, 1).view({d.N, d.K});
      Tensor c = Tensor::empty({R, d.N}, DType::bf16, gpu);
      dense_ms = median_ms([&] { lcx::ops::matmul(a, false, wd, true, c, 1.f, 0.f); }, reps);
    }
    const double blas_rate = flops / ms[0] / 1e9, dense_rate = flops / dense_ms / 1e9;
    for (int v = 1; v < 3; ++v) {
      if (ms[v] == 0) continue;
      const double rate = flops / ms[v] / 1e9;
      std::printf("%-26s | %-11s %7.3f ms %6.1f TFLOP/s | cuBLAS grouped %7.3f ms %6.1f | dense %7.3f ms %6.1f | "
                  "%.2fx cuBLAS, %.0f%% of dense | diff %.1e of %.2e\n",
                  d.name, v == 1 ? "cooperative" : "ping-pong", ms[v], rate, ms[0], blas_rate, dense_ms, dense_rate,
                  rate / blas_rate, 100 * rate / dense_rate, diff[v], top);
    }
    std::fflush(stdout);
  }
}
}  // namespace

int main(int argc, char** argv) {
  if (!lcx::cuda_available()) {
    std::printf("no CUDA device visible: nothing to measure\n");
    return 0;
  }
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  // --grouped [tokens [reps [designs]]]: the experts' grouped GEMMs (bench_grouped), by default at
  // 32,768 tokens, 10 runs, both designs of lcx's kernels (coop,ping).
  if (argc > 1 && std::strcmp(argv[1], "--grouped") == 0) {
    try {
      bench_grouped(argc > 2 ? std::atoll(argv[2]) : 32768, argc > 3 ? std::atoi(argv[3]) : 10,
                    argc > 4 ? argv[4] : "coop,ping");
    } catch (const std::exception& e) {
      std::printf("bench failed: %s\n", e.what());
      return 1;
    }
    return 0;
  }
  // --window-attention [T [W,W,... [backends [reps]]]]: windowed layers beside full causal attention
  // (bench_window_attention), by default at 131,072 tokens, W 128 (GPT-OSS), 1024 (Gemma 3) and 4096,
  // on cudnn,hopper,mma, 3 runs.
  if (argc > 1 && std::strcmp(argv[1], "--window-attention") == 0) {
    const int64_t T = argc > 2 ? std::atoll(argv[2]) : 131072;
    std::vector<int64_t> windows;
    for (const char* w = argc > 3 ? argv[3] : "128,1024,4096";; ++w) {
      char* end = nullptr;
      windows.push_back(std::strtoll(w, &end, 10));
      if (*end != ',') break;
      w = end;
    }
    const std::string backends = argc > 4 ? argv[4] : "cudnn,hopper,mma";
    const int reps = argc > 5 ? std::atoi(argv[5]) : 3;
    try {
      bench_window_attention(T, windows, backends, reps);
    } catch (const std::exception& e) {
      std::printf("bench failed: %s\n", e.what());
      return 1;
    }
    return 0;
  }
  // --attention-forward [T causal|full [reps]]: cuDNN's forward beside the own one at 16k-128k
  // tokens (or the one shape given), nothing else; --attention the backward too.
  const bool attention_only = argc > 1 && (std::strcmp(argv[1], "--attention-forward") == 0 || std::strcmp(argv[1], "--attention") == 0);
  if (attention_only) {
    const bool backward = std::strcmp(argv[1], "--attention") == 0;
    try {
#ifdef LCX_HAVE_CUDA
      std::vector<std::pair<int64_t, bool>> shapes = {{16384, true}, {32768, true}, {65536, true}, {131072, true}, {32768, false}};
      if (argc > 3) shapes = {{std::atoll(argv[2]), std::strcmp(argv[3], "full") != 0}};
      const int reps = argc > 4 ? std::atoi(argv[4]) : 10;
      for (const auto& [T, causal] : shapes) bench_attention_forward(T, causal, reps, backward);
#endif
    } catch (const std::exception& e) {
      std::printf("bench failed: %s\n", e.what());
      return 1;
    }
    return 0;
  }
  try {
    bench_matmul(8192, 8192, 8192, "matmul (ceiling)");
    bench_matmul(8192, 9728, 2560, "matmul 4B gate/up proj");
    bench_matmul(8192, 2560, 9728, "matmul 4B down proj");
    bench_memory_bound(32768, 2560, 9728, 151936);
#ifdef LCX_HAVE_CUDA
    // cuDNN's fused kernel (where it loads), then the own tensor-core kernels.
    if (!lcx::cuda::cudnn_version().empty()) {
      lcx::ops::attention::set_choice(lcx::ops::attention::Choice::cudnn);
      std::printf("cuDNN %s\n", lcx::cuda::cudnn_version().c_str());
      for (int64_t T : {4096, 16384, 32768, 65536}) bench_attention("cudnn", T, 32, 8, 128, 5);
    }
    lcx::ops::attention::set_choice(lcx::ops::attention::Choice::own);
#endif
    bench_attention("own", 4096, 32, 8, 128, 5);
    if (!quick) {
      bench_attention("own", 16384, 32, 8, 128, 3);
      bench_attention("own", 32768, 32, 8, 128, 3);
    }
  } catch (const std::exception& e) {
    std::printf("bench failed: %s\n", e.what());
    return 1;
  }
  return 0;
}
