// Sliding-window attention (ops::AttentionParams::window) on each GPU backend against a naive fp64
// reference written here: windows of 1, 17, 128 and 1000 keys over up to 4,096 tokens, head_dim 64,
// 128 and 256 (cuDNN and the tensor-core kernels on sm_90 take it), GQA, packed documents with both
// masks at once, and a ring's pieces whose queries and keys sit at other positions: the window
// reaching only some keys, or none; a chunk beside the rows before it that its window reaches, as
// cp_ring runs a windowed layer. Each backend forced in turn ([run] attention names it, so a call it
// cannot run is an error, never a silent fallback), then the automatic choice. Cases a backend does
// not take (its dtype, head size, device; cuDNN's band mask off a causal block of equal positions or
// of queries at the end of its keys) are left out by the dispatch's own rule, and a test where none
// is left skips visibly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "lcx/ops.h"
#include "support/test_util.h"

#ifdef LCX_HAVE_CUDA
#include "kernels/attention/cudnn/attention_cudnn.h"
#include "kernels/attention/dispatch.h"
#include "kernels/cuda/cuda_ops.h"
#endif

namespace lcx::test {
namespace {

struct WindowCase {
  const char* name;
  int64_t T, S, Hq, Hkv, d;
  bool causal;
  int64_t q_offset, k_offset, window;
  std::vector<int64_t> documents;  // empty: one document

  ops::AttentionParams params() const {
    ops::AttentionParams p;
    p.causal = causal;
    p.q_offset = q_offset;
    p.k_offset = k_offset;
    p.window = window;
    p.documents = documents;
    return p;
  }
};

const std::vector<WindowCase>& window_cases() {
  static const std::vector<WindowCase> cases = {
      {"W=1: each query sees itself alone", 300, 300, 4, 2, 128, true, 0, 0, 1, {}},
      {"W=17, GQA 4, ragged tiles", 1000, 1000, 8, 2, 128, true, 0, 0, 17, {}},
      {"W=128 at head_dim 64", 2048, 2048, 4, 1, 64, true, 0, 0, 128, {}},
      {"W=128 over 4096 tokens, 8 / 2 heads", 4096, 4096, 8, 2, 128, true, 0, 0, 128, {}},
      {"W=1000 over 4096 tokens", 4096, 4096, 4, 1, 128, true, 0, 0, 1000, {}},
      {"W=1000 over 4096 tokens at head_dim 64", 4096, 4096, 4, 2, 64, true, 0, 0, 1000, {}},
      {"W=1000, wider than the sequence", 500, 500, 2, 1, 128, true, 0, 0, 1000, {}},
      {"W=1000 with documents longer and shorter than it", 3000, 3000, 4, 2, 128, true, 0, 0, 1000,
       {0, 700, 701, 2200, 2263, 3000}},
      {"W=17 with documents, head_dim 64", 1500, 1500, 4, 1, 64, true, 0, 0, 17, {0, 5, 200, 203, 1100, 1500}},
      {"a ring piece: queries 500.. against keys 0..700, W=128", 200, 700, 4, 2, 128, true, 500, 0, 128, {}},
      {"a ring block wholly in the past, W=300", 256, 512, 4, 1, 128, true, 512, 0, 300, {}},
      {"a past block beyond the window: nothing seen", 128, 128, 2, 1, 128, true, 1000, 0, 200, {}},
      {"a ring piece with documents, W=17", 300, 600, 4, 2, 64, true, 300, 0, 17, {0, 250, 320, 450, 900}},
      // A ring's chunk beside its halo, the W - 1 rows before it (cp_ring's windowed layers): cuDNN
      // takes these with its masks aligned bottom-right.
      {"a ring chunk beside its halo, W=384", 512, 512 + 383, 4, 2, 128, true, 1000, 617, 384, {}},
      {"a ring chunk beside its halo, W=128 at head_dim 64", 1024, 1024 + 127, 8, 2, 64, true, 4096, 3969, 128, {}},
      {"a ring chunk beside a halo cut short, W=1000", 1200, 1500, 4, 1, 128, true, 2000, 1700, 1000, {}},
      {"a ring chunk beside its halo at head_dim 256, W=1024", 512, 1535, 2, 1, 256, true, 1023, 0, 1024, {}},
      {"W=128 at head_dim 256 (Gemma 3)", 1024, 1024, 4, 2, 256, true, 0, 0, 128, {}},
      {"W=1000 with documents at head_dim 256", 2048, 2048, 2, 1, 256, true, 0, 0, 1000, {0, 900, 2048}},
      {"a ring piece at head_dim 256, W=300", 256, 768, 2, 1, 256, true, 512, 0, 300, {}},
  };
  return cases;
}

std::string case_name(const WindowCase& c, DType t) {
  return str(c.name, " (T=", c.T, " S=", c.S, " Hq=", c.Hq, " Hkv=", c.Hkv, " d=", c.d, " W=", c.window, ", ",
             dtype_name(t), ")");
}

// The reference: every (query, key) pair the masks leave, in fp64, from the inputs as rounded.
class Reference {
 public:
  // The scale the ops resolve (1 / sqrt(d) in fp32).
  explicit Reference(const WindowCase& c) : c_(c), scale_(double(1.f / std::sqrt(static_cast<float>(c.d)))) {}

  bool sees(int64_t i, int64_t j) const {
    const int64_t qp = c_.q_offset + i, kp = c_.k_offset + j;
    if (c_.causal && kp > qp) return false;
    if (c_.window > 0 && kp <= qp - c_.window) return false;
    if (!c_.documents.empty() && doc(qp) != doc(kp)) return false;
    return true;
  }

  // out [T, Hq, d], lse [Hq, T] (natural log, -inf where nothing is seen).
  void forward(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
               std::vector<float>& out, std::vector<float>& lse) const {
    const int64_t T = c_.T, Hq = c_.Hq, Hkv = c_.Hkv, d = c_.d, g = Hq / Hkv;
    out.assign(size_t(T * Hq * d), 0.f);
    lse.assign(size_t(Hq * T), -INFINITY);
    parallel(Hq, [&](int64_t h) {
      std::vector<double> s, acc(static_cast<size_t>(d));
      for (int64_t i = 0; i < T; ++i) {
        const auto [lo, hi] = keys_of(i);
        s.assign(size_t(std::max<int64_t>(0, hi - lo)), -INFINITY);
        double m = -INFINITY;
        for (int64_t j = lo; j < hi; ++j) {
          if (!sees(i, j)) continue;
          s[size_t(j - lo)] = scale_ * dot(&q[size_t((i * Hq + h) * d)], &k[size_t((j * Hkv + h / g) * d)], d);
          m = std::max(m, s[size_t(j - lo)]);
        }
        if (m == -INFINITY) continue;
        std::fill(acc.begin(), acc.end(), 0.0);
        double l = 0;
        for (int64_t j = lo; j < hi; ++j) {
          if (s[size_t(j - lo)] == -INFINITY) continue;
          const double pr = std::exp(s[size_t(j - lo)] - m);
          l += pr;
          const float* vj = &v[size_t((j * Hkv + h / g) * d)];
          for (int64_t c = 0; c < d; ++c) acc[size_t(c)] += pr * vj[c];
        }
        for (int64_t c = 0; c < d; ++c) out[size_t((i * Hq + h) * d + c)] = float(acc[size_t(c)] / l);
        lse[size_t(h * T + i)] = float(m + std::log(l));
      }
    });
  }

  // dq, dk, dv from out and lse as the backward kernels take them.
  void backward(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
                const std::vector<float>& out, const std::vector<float>& lse, const std::vector<float>& dout,
                std::vector<float>& dq, std::vector<float>& dk, std::vector<float>& dv) const {
    const int64_t T = c_.T, S = c_.S, Hq = c_.Hq, Hkv = c_.Hkv, d = c_.d, g = Hq / Hkv;
    // A thread per query head, each with its own dk, dv sums, added up after.
    std::vector<double> gq(size_t(T * Hq * d), 0.0);
    std::vector<std::vector<double>> gk(size_t(Hq), std::vector<double>(size_t(S * Hkv * d), 0.0)), gv = gk;
    parallel(Hq, [&](int64_t h) {
      for (int64_t i = 0; i < T; ++i) {
        const double l = lse[size_t(h * T + i)];
        if (l == -INFINITY) continue;
        const float* qi = &q[size_t((i * Hq + h) * d)];
        const float* doi = &dout[size_t((i * Hq + h) * d)];
        const double delta = dot(doi, &out[size_t((i * Hq + h) * d)], d);
        const auto [lo, hi] = keys_of(i);
        for (int64_t j = lo; j < hi; ++j) {
          if (!sees(i, j)) continue;
          const int64_t kv = (j * Hkv + h / g) * d;
          const double pr = std::exp(scale_ * dot(qi, &k[size_t(kv)], d) - l);
          const double ds = pr * (dot(doi, &v[size_t(kv)], d) - delta);
          for (int64_t c = 0; c < d; ++c) {
            gq[size_t((i * Hq + h) * d + c)] += scale_ * ds * k[size_t(kv + c)];
            gk[size_t(h)][size_t(kv + c)] += scale_ * ds * qi[c];
            gv[size_t(h)][size_t(kv + c)] += pr * doi[c];
          }
        }
      }
    });
    dq.assign(gq.begin(), gq.end());
    dk.assign(size_t(S * Hkv * d), 0.f);
    dv.assign(size_t(S * Hkv * d), 0.f);
    for (size_t e = 0; e < dk.size(); ++e) {
      double sk = 0, sv = 0;
      for (int64_t h = 0; h < Hq; ++h) {
        sk += gk[size_t(h)][e];
        sv += gv[size_t(h)][e];
      }
      dk[e] = float(sk);
      dv[e] = float(sv);
    }
  }

 private:
  // fn(0 .. n-1), each on its own thread.
  template <class Fn>
  static void parallel(int64_t n, Fn fn) {
    std::vector<std::thread> threads;
    for (int64_t i = 0; i < n; ++i) threads.emplace_back([&fn, i] { fn(i); });
    for (std::thread& t : threads) t.join();
  }
  static double dot(const float* a, const float* b, int64_t n) {
    double acc = 0;
    for (int64_t c = 0; c < n; ++c) acc += double(a[c]) * double(b[c]);
    return acc;
  }
  int64_t doc(int64_t pos) const {
    return std::upper_bound(c_.documents.begin(), c_.documents.end(), pos) - c_.documents.begin();
  }
  // The key rows the window and the causal mask leave query row i: [lo, hi).
  std::pair<int64_t, int64_t> keys_of(int64_t i) const {
    const int64_t qp = c_.q_offset + i;
    int64_t lo = 0, hi = c_.S;
    if (c_.window > 0) lo = std::clamp<int64_t>(qp - c_.window + 1 - c_.k_offset, 0, c_.S);
    if (c_.causal) hi = std::clamp<int64_t>(qp + 1 - c_.k_offset, 0, c_.S);
    return {lo, std::max(lo, hi)};
  }

  const WindowCase& c_;
  double scale_;
};

// lse where finite within `tol` (relative L2), -inf in the same places.
void expect_same_lse(const Tensor& got, const std::vector<float>& want, double tol) {
  std::vector<float> g = got.to_floats(), w = want;
  ASSERT_EQ(g.size(), w.size());
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_EQ(std::isinf(g[i]), std::isinf(w[i])) << "lse element " << i << ": " << g[i] << " vs " << w[i];
    if (std::isinf(w[i])) g[i] = w[i] = 0.f;
  }
  EXPECT_LE(rel_l2(g, w), tol);
}

void expect_close(const Tensor& got, const std::vector<float>& want, DType t, const char* what) {
  const double err = rel_l2(got.to_floats(), want);
  EXPECT_LE(err, tolerance(t)) << what << " (" << dtype_name(t) << "): relative L2 " << err;
}

// A gradient that is zero in exact arithmetic (W = 1: each softmax has one term, so dS = dP - delta
// = 0 and dq = dk = 0) holds only rounding: its root mean square stays far below the O(0.1) of a
// real gradient's elements.
void expect_rounding_only(const Tensor& got, const char* what) {
  const std::vector<float> g = got.to_floats();
  double sum = 0;
  for (float x : g) sum += double(x) * x;
  const double rms = g.empty() ? 0 : std::sqrt(sum / double(g.size()));
  EXPECT_LE(rms, 1e-3) << what << " should be zero up to rounding: root mean square " << rms;
}

// A case's random inputs in one dtype and the reference's results on them, made once per process
// and shared by every backend's test (the reference is the slow part): the seed is in the trace.
struct Prepared {
  Tensor q, k, v, dout, out_t;  // out_t: the reference's out in the case's dtype
  std::vector<float> out, lse, dq, dk, dv;
};

uint32_t inputs_seed() {
  static const uint32_t seed = fresh_seed();
  return seed;
}

const Prepared& prepared(const WindowCase& c, DType t) {
  static std::map<std::pair<const WindowCase*, int>, Prepared> cache;
  static std::mt19937 rng(inputs_seed());
  auto [it, fresh] = cache.try_emplace({&c, static_cast<int>(t)});
  Prepared& r = it->second;
  if (!fresh) return r;
  r.q = host_normal({c.T, c.Hq, c.d}, t, rng);
  r.k = host_normal({c.S, c.Hkv, c.d}, t, rng);
  r.v = host_normal({c.S, c.Hkv, c.d}, t, rng);
  r.dout = host_normal({c.T, c.Hq, c.d}, t, rng);
  const std::vector<float> qf = r.q.to_floats(), kf = r.k.to_floats(), vf = r.v.to_floats();
  const Reference ref(c);
  ref.forward(qf, kf, vf, r.out, r.lse);
  r.out_t = Tensor::from_floats(r.out, {c.T, c.Hq, c.d}, t);
  ref.backward(qf, kf, vf, r.out_t.to_floats(), r.lse, r.dout.to_floats(), r.dq, r.dk, r.dv);
  return r;
}

// One case, forward and backward, on the GPU under the current choice against the reference. The
// backward starts from the reference's out (in the case's dtype) and lse. With `twice`, the
// backward runs again and must give the same dq bits (the Hopper backward's ordered additions).
void check_case(const WindowCase& c, DType t, bool twice = false) {
  SCOPED_TRACE(str(case_name(c, t), ", inputs seed ", inputs_seed()));
  const ops::AttentionParams p = c.params();
  const Prepared& r = prepared(c, t);
  const Tensor &q = r.q, &k = r.k, &v = r.v;
  const std::vector<float>&out = r.out, &lse = r.lse, &dq = r.dq, &dk = r.dk, &dv = r.dv;

  const Tensor gq = on_gpu(q), gk = on_gpu(k), gv = on_gpu(v);
  Tensor gout = poisoned_gpu({c.T, c.Hq, c.d}, t), glse = poisoned_gpu({c.Hq, c.T}, DType::f32);
  ops::attention_forward(gq, gk, gv, gout, glse, p);
  expect_close(gout, out, t, "out");
  expect_same_lse(glse, lse, t == DType::f32 ? 1e-5 : 1e-4);

  const Tensor gout_ref = on_gpu(r.out_t), glse_ref = on_gpu(Tensor::from_floats(lse, {c.Hq, c.T}, DType::f32)),
               gdout = on_gpu(r.dout);
  std::vector<float> first;
  for (int run = 0; run < (twice ? 2 : 1); ++run) {
    Tensor gdq = poisoned_gpu(q.shape(), t), gdk = poisoned_gpu(k.shape(), t), gdv = poisoned_gpu(v.shape(), t);
    ops::attention_backward(gq, gk, gv, gout_ref, glse_ref, gdout, gdq, gdk, gdv, p);
    if (run == 0 && c.window == 1) {
      expect_rounding_only(gdq, "dq");
      expect_rounding_only(gdk, "dk");
      expect_close(gdv, dv, t, "dv");
      first = gdq.to_floats();
    } else if (run == 0) {
      expect_close(gdq, dq, t, "dq");
      expect_close(gdk, dk, t, "dk");
      expect_close(gdv, dv, t, "dv");
      first = gdq.to_floats();
    } else {
      EXPECT_EQ(gdq.to_floats(), first) << "dq differs between two runs";
    }
  }
}

// The reference itself against the CPU op (kernels/cpu/attention_cpu.cpp, held to the explicit masked
// softmax by tests/kernels/attention_test.cpp) on the cases small enough for the CPU, in fp32: runs
// without a GPU.
TEST(WindowReference, AgreesWithTheCpuOp) {
  std::mt19937 rng(fresh_seed());
  int ran = 0;
  for (const WindowCase& c : window_cases()) {
    if (c.T * c.S * c.Hq > 4'000'000) continue;
    SCOPED_TRACE(case_name(c, DType::f32));
    const ops::AttentionParams p = c.params();
    const Tensor q = host_normal({c.T, c.Hq, c.d}, DType::f32, rng), k = host_normal({c.S, c.Hkv, c.d}, DType::f32, rng),
                 v = host_normal({c.S, c.Hkv, c.d}, DType::f32, rng), dout = host_normal({c.T, c.Hq, c.d}, DType::f32, rng);
    const Reference ref(c);
    std::vector<float> out, lse, dq, dk, dv;
    ref.forward(q.to_floats(), k.to_floats(), v.to_floats(), out, lse);
    ref.backward(q.to_floats(), k.to_floats(), v.to_floats(), out, lse, dout.to_floats(), dq, dk, dv);
    Tensor cout = Tensor::empty(q.shape(), DType::f32), clse = Tensor::empty({c.Hq, c.T}, DType::f32);
    ops::attention_forward(q, k, v, cout, clse, p);
    EXPECT_LE(rel_l2(cout.to_floats(), out), 1e-5);
    expect_same_lse(clse, lse, 1e-5);
    Tensor cdq = Tensor::empty(q.shape(), DType::f32), cdk = Tensor::empty(k.shape(), DType::f32),
           cdv = Tensor::empty(v.shape(), DType::f32);
    ops::attention_backward(q, k, v, Tensor::from_floats(out, q.shape(), DType::f32),
                            Tensor::from_floats(lse, {c.Hq, c.T}, DType::f32), dout, cdq, cdk, cdv, p);
    if (c.window != 1) {  // W = 1: both zero up to rounding
      EXPECT_LE(rel_l2(cdq.to_floats(), dq), 1e-5);
      EXPECT_LE(rel_l2(cdk.to_floats(), dk), 1e-5);
    }
    EXPECT_LE(rel_l2(cdv.to_floats(), dv), 1e-5);
    ++ran;
  }
  EXPECT_GT(ran, 5);
}

class GpuWindowAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    LCX_SKIP_WITHOUT_GPU();
    RecordProperty("seed", std::to_string(inputs_seed()));
  }
};

#ifdef LCX_HAVE_CUDA
using ops::attention::Backend;
using ops::attention::Choice;

// Selects the attention kernels for one test and restores the automatic choice after it.
struct KernelChoice {
  explicit KernelChoice(Choice k) { ops::attention::set_choice(k); }
  ~KernelChoice() { ops::attention::set_choice(Choice::automatic); }
};

// Whether the loaded cuDNN is older than major.minor.
bool cudnn_before(int major, int minor) {
  const std::string v = cuda::cudnn_version();
  const int got_major = std::atoi(v.c_str()), got_minor = std::atoi(v.c_str() + v.find('.') + 1);
  return got_major < major || (got_major == major && got_minor < minor);
}

// Whether `b` takes the case's calls on this GPU, by the dispatch's rules: the whole call, or with
// documents each document's rows (cuDNN's batches take the documents of a causal call of equal
// positions; what they leave runs on the own kernels, which a forced cuDNN allows).
bool serves(Backend b, const WindowCase& c, DType t) {
  ops::attention::Call call;
  call.dtype = t;
  call.head_dim = c.d;
  call.rows = c.T;
  call.keys = c.S;
  // As ops.cpp resolves the params: a window that hides nothing is dropped, and a causal block whose
  // keys all precede its first query is full attention unless a window still masks it.
  call.window = c.q_offset + c.T - c.window <= c.k_offset ? 0 : c.window;
  call.causal = c.causal && !(c.documents.empty() && call.window == 0 && c.k_offset + c.S <= c.q_offset + 1);
  call.same_positions = c.T == c.S && c.q_offset == c.k_offset;
  call.ends_aligned = c.T <= c.S && c.q_offset + c.T == c.k_offset + c.S;
  const ops::attention::DeviceCaps caps = ops::cuda::attention_device_caps();
  // cuDNN before 9.6 declines a window aligned bottom-right (attention_cudnn.cpp).
  if (b == Backend::cudnn && c.T != c.S && cudnn_before(9, 6)) return false;
  if (b == Backend::cudnn && !c.documents.empty()) return call.same_positions && ops::attention::refusal(b, call, caps).empty();
  for (bool backward : {false, true}) {
    call.backward = backward;
    if (!ops::attention::refusal(b, call, caps).empty()) return false;
  }
  return true;
}

void run_backend(Backend b, Choice choice, std::initializer_list<DType> dtypes, bool twice = false) {
  KernelChoice forced(choice);
  int ran = 0;
  for (const WindowCase& c : window_cases())
    for (DType t : dtypes) {
      if (!serves(b, c, t)) continue;
      check_case(c, t, twice);
      ++ran;
    }
  if (ran == 0) GTEST_SKIP() << "the " << ops::attention::name(b) << " kernels take none of the cases on this GPU";
}

TEST_F(GpuWindowAttention, ReferenceKernelsAgainstTheNaiveReference) {
  run_backend(Backend::reference, Choice::reference, {DType::f32, DType::bf16});
}

TEST_F(GpuWindowAttention, MmaKernelsAgainstTheNaiveReference) {
  run_backend(Backend::mma, Choice::mma, {DType::bf16, DType::f16});
}

// The Hopper backward adds each query step's dQ in key-block order, from the first key block the
// step's window reaches: the same bits twice.
TEST_F(GpuWindowAttention, HopperKernelsAgainstTheNaiveReference) {
  run_backend(Backend::hopper, Choice::hopper, {DType::bf16}, true);
}

// cuDNN's band mask ([run] attention = "cudnn": a plan cuDNN refuses is an error, so passing means
// its graphs ran), single calls and document batches.
TEST_F(GpuWindowAttention, CudnnBandMaskAgainstTheNaiveReference) {
  run_backend(Backend::cudnn, Choice::cudnn, {DType::bf16, DType::f16});
}

// What a run takes: every case under the automatic choice.
TEST_F(GpuWindowAttention, AutomaticChoiceAgainstTheNaiveReference) {
  KernelChoice automatic(Choice::automatic);
  for (const WindowCase& c : window_cases()) check_case(c, DType::bf16);
}
#else
TEST_F(GpuWindowAttention, NeedsTheCudaBuild) { GTEST_SKIP() << "built without the CUDA backend"; }
#endif

}  // namespace
}  // namespace lcx::test
