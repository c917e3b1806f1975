// Every op of lcx/ops.h on every backend against its CPU twin, as ggml's test-backend-ops does it:
// one table lists each op with its cases (shapes and dtypes), one driver runs every case twice from
// the same seed, once on the CPU and once on the backend, and compares each output at its dtype's
// tolerance (gpu_test_util.h: fp32 1e-5, bf16/fp16 1e-2, relative L2) or bit for bit where the op
// only moves or rounds bytes. Outputs start as NaN on both sides, so an element an op forgot to
// write fails; accumulating outputs start from the same random values. A new op is one table row.
// The backends are the CUDA devices; without one every op skips, visibly.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gpu/attention_shapes.h"
#include "gpu/gpu_test_util.h"
#include "lcx/ops.h"
#include "lcx/sequence.h"
#include "support/moe_routing.h"

namespace lcx::test {
namespace {

constexpr double kExact = 0;  // Output::tolerance: bytes only, the values agree exactly

struct Output {
  std::string name;
  Tensor value;           // on the host
  double tolerance = -1;  // relative L2 bound; below 0: the dtype's (gpu_test_util.h)
};

// Runs one case on `device` from inputs drawn from `rng`; returns the outputs on the host.
using CaseBody = std::function<std::vector<Output>(Device device, std::mt19937& rng)>;

struct OpCase {
  std::string label;  // shapes and dtypes
  CaseBody run;
};

Tensor at(Device d, const Tensor& host) { return host.to(d); }  // a copy, also on the CPU

Tensor poisoned(Shape shape, DType t, Device d) {
  return Tensor::from_floats(std::vector<float>(static_cast<size_t>(shape_numel(shape)), NAN), shape, t, d);
}

Output out(std::string name, const Tensor& t, double tolerance = -1) {
  return {std::move(name), t.to(Device::cpu()), tolerance};
}

Output scalar(std::string name, double v, double tolerance = -1) {
  return {std::move(name), Tensor::from_floats({static_cast<float>(v)}, {1}, DType::f32), tolerance};
}

// NaN fails; an infinity must sit in the same place on both sides (attention's lse is -inf for a
// row that saw no key); the finite rest is held to the tolerance.
void expect_matches(const Output& got, const Output& want) {
  SCOPED_TRACE(want.name);
  ASSERT_EQ(got.value.shape(), want.value.shape());
  std::vector<float> g = got.value.to_floats(), w = want.value.to_floats();
  if (want.tolerance == kExact) {
    EXPECT_EQ(g, w);
    return;
  }
  for (size_t i = 0; i < g.size(); ++i) {
    if (!std::isinf(w[i]) && !std::isinf(g[i])) continue;
    ASSERT_EQ(g[i], w[i]) << "element " << i;
    g[i] = w[i] = 0.f;
  }
  const double bound = want.tolerance >= 0 ? want.tolerance : tolerance(want.value.dtype());
  const double err = rel_l2(g, w);
  EXPECT_LE(err, bound) << dtype_name(want.value.dtype()) << ": relative L2 " << err;
}

const DType kDtypes[] = {DType::f32, DType::bf16};

// ---- the table ---------------------------------------------------------------------------------

std::vector<OpCase> matmul_cases() {
  std::vector<OpCase> cases;
  struct Mnk {
    int64_t M, N, K;
  };
  for (Mnk s : {Mnk{67, 45, 129}, Mnk{256, 384, 512}, Mnk{1, 7, 3}})
    for (DType ab : kDtypes)
      for (DType ct : kDtypes) {
        if (ab == DType::f32 && ct == DType::bf16) continue;
        for (int ta = 0; ta < 2; ++ta)
          for (int tb = 0; tb < 2; ++tb)
            cases.push_back({str(s.M, "x", s.N, "x", s.K, " ", dtype_name(ab), "->", dtype_name(ct), " ta=", ta,
                                 " tb=", tb),
                             [=](Device d, std::mt19937& rng) {
                               const Tensor a = at(d, host_normal(ta ? Shape{s.K, s.M} : Shape{s.M, s.K}, ab, rng));
                               const Tensor b = at(d, host_normal(tb ? Shape{s.N, s.K} : Shape{s.K, s.N}, ab, rng));
                               Tensor c = at(d, host_normal({s.M, s.N}, ct, rng));
                               ops::matmul(a, ta, b, tb, c, 0.7f, 0.3f);
                               // beta = 0 must not read c: a NaN c stays out of the result.
                               Tensor c0 = poisoned({s.M, s.N}, ct, d);
                               ops::matmul(a, ta, b, tb, c0, 1.f, 0.f);
                               return std::vector<Output>{out("c (beta 0.3)", c), out("c (beta 0)", c0)};
                             }});
      }
  // [T, heads, d] as a [30, 32] matrix, against an fp32 weight, into bf16.
  cases.push_back({"[6,5,32] bf16 x [48,32]^T f32 -> bf16", [](Device d, std::mt19937& rng) {
                     const Tensor a = at(d, host_normal({6, 5, 32}, DType::bf16, rng));
                     const Tensor b = at(d, host_normal({48, 32}, DType::f32, rng));
                     Tensor c = poisoned({30, 48}, DType::bf16, d);
                     ops::matmul(a, false, b, true, c, 1.f, 0.f);
                     return std::vector<Output>{out("c", c)};
                   }});
  return cases;
}

// Few distinct ids among many rows: many repeats for the backward's accumulation.
Tensor repeated_ids(int64_t T, int64_t V, std::mt19937& rng) {
  std::uniform_int_distribution<int> pick(0, 40);
  std::vector<float> ids(static_cast<size_t>(T));
  for (auto& x : ids) x = static_cast<float>(pick(rng) * 23 % V);
  return Tensor::from_floats(ids, {T}, DType::i32);
}

std::vector<OpCase> embedding_cases(bool backward) {
  const int64_t V = 1000, H = 96, T = 300;
  std::vector<OpCase> cases;
  for (DType t : kDtypes)
    cases.push_back({str("V=", V, " H=", H, " T=", T, " ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                       const Tensor ids = at(d, repeated_ids(T, V, rng));
                       if (!backward) {
                         const Tensor table = at(d, host_normal({V, H}, t, rng));
                         Tensor y = poisoned({T, H}, t, d);
                         ops::embedding_forward(ids, table, y);
                         return std::vector<Output>{out("out", y)};
                       }
                       const Tensor grad_out = at(d, host_normal({T, H}, t, rng));
                       Tensor grad_table = at(d, host_normal({V, H}, DType::f32, rng));
                       ops::embedding_backward(ids, grad_out, grad_table);
                       return std::vector<Output>{out("grad_table", grad_table)};
                     }});
  return cases;
}

// d % 8 == 0 in bf16 takes the 8-wide kernels; d = 100 the scalar ones.
std::vector<OpCase> rmsnorm_cases(bool backward) {
  std::vector<OpCase> cases;
  for (Shape shape : {Shape{37, 1024}, Shape{50, 8, 128}, Shape{3, 2560}, Shape{9, 100}})
    for (DType t : kDtypes)
      cases.push_back({str(shape_str(shape), " ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                         const int64_t n = shape.back(), rows = shape_numel(shape) / n;
                         const Tensor xh = host_normal(shape, t, rng, 2.f);
                         std::vector<float> wv = normal(n, rng, 0.2f);
                         for (auto& w : wv) w += 1.f;
                         const Tensor wh = Tensor::from_floats(wv, {n}, t);
                         const Tensor x = at(d, xh), w = at(d, wh);
                         if (!backward) {
                           Tensor y = poisoned(shape, t, d), rstd = poisoned({rows}, DType::f32, d);
                           ops::rmsnorm_forward(x, w, 1e-6f, y, rstd);
                           return std::vector<Output>{out("y", y), out("rstd", rstd)};
                         }
                         // The saved rstd comes from the CPU on both sides: only the backward differs.
                         Tensor yh = Tensor::empty(shape, t), rstdh = Tensor::empty({rows}, DType::f32);
                         ops::rmsnorm_forward(xh, wh, 1e-6f, yh, rstdh);
                         const Tensor dy = at(d, host_normal(shape, t, rng));
                         Tensor dx = poisoned(shape, t, d), dw = at(d, host_normal({n}, DType::f32, rng));
                         ops::rmsnorm_backward(x, w, at(d, rstdh), dy, dx, dw);
                         return std::vector<Output>{out("dx", dx), out("dw", dw)};
                       }});
  return cases;
}

// Gemma's (1 + w) form: weights around 0, so the offset carries the scale.
std::vector<OpCase> rmsnorm_offset_cases(bool backward) {
  std::vector<OpCase> cases;
  for (Shape shape : {Shape{37, 1152}, Shape{50, 4, 256}, Shape{9, 100}})
    for (DType t : kDtypes)
      cases.push_back({str(shape_str(shape), " ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                         const int64_t n = shape.back(), rows = shape_numel(shape) / n;
                         const Tensor xh = host_normal(shape, t, rng, 2.f);
                         const Tensor wh = Tensor::from_floats(normal(n, rng, 0.3f), {n}, t);
                         const Tensor x = at(d, xh), w = at(d, wh);
                         if (!backward) {
                           Tensor y = poisoned(shape, t, d), rstd = poisoned({rows}, DType::f32, d);
                           ops::rmsnorm_offset_forward(x, w, 1.f, 1e-6f, y, rstd);
                           return std::vector<Output>{out("y", y), out("rstd", rstd)};
                         }
                         Tensor yh = Tensor::empty(shape, t), rstdh = Tensor::empty({rows}, DType::f32);
                         ops::rmsnorm_offset_forward(xh, wh, 1.f, 1e-6f, yh, rstdh);
                         const Tensor dy = at(d, host_normal(shape, t, rng));
                         Tensor dx = poisoned(shape, t, d), dw = at(d, host_normal({n}, DType::f32, rng));
                         ops::rmsnorm_offset_backward(x, w, 1.f, at(d, rstdh), dy, dx, dw);
                         return std::vector<Output>{out("dx", dx), out("dw", dw)};
                       }});
  return cases;
}

std::vector<OpCase> rotary_cases(bool backward) {
  const int64_t T = 50, heads = 6, n = 128;
  std::vector<OpCase> cases;
  for (DType t : kDtypes)
    cases.push_back({str("[", T, ",", heads, ",", n, "] ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                       std::vector<float> cv(T * n / 2), sv(T * n / 2);
                       for (int64_t p = 0; p < T; ++p)
                         for (int64_t i = 0; i < n / 2; ++i) {
                           const double angle = (p + 1000) * std::pow(1e6, -2.0 * i / n);
                           cv[p * n / 2 + i] = static_cast<float>(std::cos(angle));
                           sv[p * n / 2 + i] = static_cast<float>(std::sin(angle));
                         }
                       const Tensor cos = at(d, Tensor::from_floats(cv, {T, n / 2}, DType::f32));
                       const Tensor sin = at(d, Tensor::from_floats(sv, {T, n / 2}, DType::f32));
                       Tensor x = at(d, host_normal({T, heads, n}, t, rng));
                       if (backward)
                         ops::rotary_backward(x, cos, sin);
                       else
                         ops::rotary_forward(x, cos, sin);
                       return std::vector<Output>{out(backward ? "dx" : "x", x)};
                     }});
  return cases;
}

// As swiglu_cases, through gated_forward / gated_backward's GeGLU (tanh GELU).
std::vector<OpCase> geglu_cases(bool backward) {
  std::vector<OpCase> cases;
  for (Shape shape : {Shape{33, 3072}, Shape{7, 13}})
    for (DType t : kDtypes)
      cases.push_back({str(shape_str(shape), " ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                         const Tensor gate = at(d, host_normal(shape, t, rng, 3.f));
                         const Tensor up = at(d, host_normal(shape, t, rng));
                         if (!backward) {
                           Tensor y = poisoned(shape, t, d);
                           ops::gated_forward(ops::GateActivation::gelu_tanh, gate, up, y);
                           return std::vector<Output>{out("out", y)};
                         }
                         const Tensor dout = at(d, host_normal(shape, t, rng));
                         Tensor dg = poisoned(shape, t, d), du = poisoned(shape, t, d);
                         ops::gated_backward(ops::GateActivation::gelu_tanh, gate, up, dout, dg, du);
                         return std::vector<Output>{out("dgate", dg), out("dup", du)};
                       }});
  return cases;
}

// 7 x 13 = 91 elements: the 8-wide bf16 kernel takes 88, the scalar tail 3.
std::vector<OpCase> swiglu_cases(bool backward) {
  std::vector<OpCase> cases;
  for (Shape shape : {Shape{33, 3072}, Shape{7, 13}})
    for (DType t : kDtypes)
      cases.push_back({str(shape_str(shape), " ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                         const Tensor gate = at(d, host_normal(shape, t, rng, 3.f));
                         const Tensor up = at(d, host_normal(shape, t, rng));
                         if (!backward) {
                           Tensor y = poisoned(shape, t, d);
                           ops::swiglu_forward(gate, up, y);
                           return std::vector<Output>{out("out", y)};
                         }
                         const Tensor dout = at(d, host_normal(shape, t, rng));
                         Tensor dg = poisoned(shape, t, d), du = poisoned(shape, t, d);
                         ops::swiglu_backward(gate, up, dout, dg, du);
                         return std::vector<Output>{out("dgate", dg), out("dup", du)};
                       }});
  return cases;
}

// GPT-OSS's clamped SwiGLU over interleaved gate and up: scale 3 puts a share of both past the
// limit 2 (clamped, no gradient) and the rest inside.
std::vector<OpCase> swiglu_clamped_cases(bool backward) {
  std::vector<OpCase> cases;
  for (Shape shape : {Shape{33, 2 * 2880}, Shape{7, 26}})
    for (DType t : kDtypes)
      cases.push_back({str(shape_str(shape), " ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                         const Tensor gu = at(d, host_normal(shape, t, rng, 3.f));
                         const Shape half{shape[0], shape[1] / 2};
                         if (!backward) {
                           Tensor y = poisoned(half, t, d);
                           ops::swiglu_clamped_forward(gu, 1.702f, 2.f, y);
                           return std::vector<Output>{out("out", y)};
                         }
                         const Tensor dout = at(d, host_normal(half, t, rng));
                         Tensor dgu = poisoned(shape, t, d);
                         ops::swiglu_clamped_backward(gu, dout, 1.702f, 2.f, dgu);
                         return std::vector<Output>{out("dgate_up", dgu)};
                       }});
  return cases;
}

const Shape kElementwise{129, 257};

std::vector<OpCase> add_cases(bool inplace) {
  std::vector<OpCase> cases;
  for (DType ta : kDtypes)
    for (DType tb : kDtypes)
      cases.push_back({str(shape_str(kElementwise), " ", dtype_name(ta), " + ", dtype_name(tb)),
                       [=](Device d, std::mt19937& rng) {
                         Tensor a = at(d, host_normal(kElementwise, ta, rng));
                         const Tensor b = at(d, host_normal(kElementwise, tb, rng));
                         if (inplace) {
                           ops::add_inplace(a, b);
                           return std::vector<Output>{out("acc", a)};
                         }
                         Tensor y = poisoned(kElementwise, ta, d);
                         ops::add(a, b, y);
                         return std::vector<Output>{out("out", y)};
                       }});
  return cases;
}

std::vector<OpCase> scale_cases() {
  std::vector<OpCase> cases;
  for (DType t : kDtypes)
    cases.push_back({str(shape_str(kElementwise), " ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                       Tensor x = at(d, host_normal(kElementwise, t, rng));
                       ops::scale_inplace(x, -0.37f);
                       return std::vector<Output>{out("x", x)};
                     }});
  return cases;
}

// Casts round to nearest even on both sides: the stored values agree exactly.
std::vector<OpCase> cast_cases() {
  std::vector<OpCase> cases;
  for (const auto& [f, t] : {std::pair{DType::f32, DType::bf16}, std::pair{DType::bf16, DType::f32},
                            std::pair{DType::f32, DType::f16}, std::pair{DType::f16, DType::bf16}}) {
    const DType from = f, to = t;
    cases.push_back({str(shape_str(kElementwise), " ", dtype_name(from), " -> ", dtype_name(to)),
                     [=](Device d, std::mt19937& rng) {
                       const Tensor src = at(d, host_normal(kElementwise, from, rng, 10.f));
                       Tensor dst = poisoned(kElementwise, to, d);
                       ops::cast(src, dst);
                       return std::vector<Output>{out("dst", dst, kExact)};
                     }});
  }
  return cases;
}

// Dropout draws its mask from (key, row, column) by integer arithmetic and scales in fp32 with the
// CPU twin's operations in its order: the same bits, written fresh (beta 0) and added onto an
// output (beta 1, as onto an input's gradient), with rows of a sequence in a rank's zigzag order
// and the columns of a block inside a wider matrix, and with no row indices (0 .. n-1).
std::vector<OpCase> dropout_cases() {
  std::vector<OpCase> cases;
  for (DType t : kDtypes)
    for (float beta : {0.f, 1.f}) {
      for (bool indexed : {true, false})
        cases.push_back({str("[1031,4096] p 0.1 ", indexed ? "rows 70000.. in two chunks" : "rows 0..", ", columns from 4096, beta ",
                             beta, " ", dtype_name(t)),
                         [=](Device d, std::mt19937& rng) {
                           const Tensor x = at(d, host_normal({1031, 4096}, t, rng));
                           Tensor o = beta == 0.f ? poisoned({1031, 4096}, t, d) : at(d, host_normal({1031, 4096}, t, rng));
                           Tensor rows;
                           if (indexed) {
                             Tensor host = Tensor::empty({1031}, DType::i64);
                             fill_indices(host, 0, 900000, 500);
                             fill_indices(host, 500, 70000, 531);
                             rows = at(d, host);
                           }
                           ops::dropout(x, 0.1f, 0x1234abcdull, rows, 4096, o, beta);
                           return std::vector<Output>{out("out", o, kExact)};
                         }});
    }
  return cases;
}

// A head group's columns of a projection weight, gathered and scattered back: bytes only, so the
// GPU's pitched copy equals the CPU's row copies exactly.
std::vector<OpCase> copy_columns_cases() {
  std::vector<OpCase> cases;
  for (DType t : kDtypes)
    cases.push_back({str("[257,4096] cols 1536..2048 <-> [257,512] ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                       const Tensor w = at(d, host_normal({257, 4096}, t, rng));
                       Tensor part = poisoned({257, 512}, t, d);
                       ops::copy_columns(w, 1536, part, 0, 512);
                       Tensor back = at(d, host_normal({257, 4096}, t, rng));
                       ops::copy_columns(part, 0, back, 512, 512);
                       return std::vector<Output>{out("gathered", part, kExact), out("scattered", back, kExact)};
                     }});
  return cases;
}

// Mixture-of-experts routing: Qwen3-30B-A3B's 128 experts, top-8. The experts chosen and the
// permutation are integers and must agree exactly; the weights and the combine at fp32's
// tolerance (the GPU's expf and FMAs differ from the CPU's in the last bits).
std::vector<OpCase> moe_route_cases() {
  std::vector<OpCase> cases;
  for (DType t : kDtypes)
    for (bool norm : {true, false})
      cases.push_back({str("[1000,128] top-8", norm ? " renormalized " : " ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                         const Tensor logits = at(d, host_normal({1000, 128}, t, rng));
                         Tensor w = poisoned({1000, 8}, DType::f32, d), p = poisoned({1000, 128}, DType::f32, d);
                         Tensor ex = Tensor::zeros({1000, 8}, DType::i32, d);
                         ops::moe_route(logits, 8, norm, w, ex, &p);
                         return std::vector<Output>{out("weights", w), out("experts", ex.to(Device::cpu()).to(DType::f32), kExact),
                                                    out("probs", p)};
                       }});
  return cases;
}

Tensor random_experts(int64_t n, int64_t E, std::mt19937& rng, Device d) {
  Tensor ex = Tensor::empty({n}, DType::i32);
  for (int64_t i = 0; i < n; ++i) ex.data_as<int32_t>()[i] = static_cast<int32_t>(rng() % static_cast<uint32_t>(E));
  return ex.to(d);
}

std::vector<OpCase> moe_permute_cases() {
  std::vector<OpCase> cases;
  for (int64_t n : {int64_t{8000}, int64_t{65536 * 8 + 3}})
    cases.push_back({str(n, " slots over 128 experts"), [=](Device d, std::mt19937& rng) {
                       const Tensor ex = random_experts(n, 128, rng, d);
                       Tensor order = Tensor::zeros({n}, DType::i32, d), pos = Tensor::zeros({n}, DType::i32, d),
                              off = Tensor::zeros({129}, DType::i64, d);
                       ops::moe_permute(ex, 128, order, pos, off);
                       auto f = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::f32); };
                       return std::vector<Output>{out("order", f(order), kExact), out("position", f(pos), kExact),
                                                  out("offsets", f(off), kExact)};
                     }});
  return cases;
}

std::vector<OpCase> gather_rows_cases() {
  std::vector<OpCase> cases;
  for (DType t : kDtypes)
    cases.push_back({str("[1000,2048] by 8000 slots of top-8 ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                       const Tensor x = at(d, host_normal({1000, 2048}, t, rng));
                       const Tensor rows = random_experts(8000, 8000, rng, d);
                       Tensor o = poisoned({8000, 2048}, t, d);
                       ops::gather_rows(x, rows, 8, o);
                       return std::vector<Output>{out("out", o, kExact)};
                     }});
  return cases;
}

std::vector<OpCase> moe_combine_cases() {
  std::vector<OpCase> cases;
  for (DType t : kDtypes)
    cases.push_back({str("[8000,2048] -> [1000,2048] top-8 ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                       const Tensor y = at(d, host_normal({8000, 2048}, t, rng));
                       // Routing and permutation on the CPU, the same on both sides: the combine alone is compared.
                       const Routed r = route_on_host(host_normal({1000, 128}, DType::f32, rng), 8);
                       Tensor o = poisoned({1000, 2048}, t, d);
                       ops::moe_combine(y, r.position.to(d), r.weights.to(d), o);
                       return std::vector<Output>{out("out", o)};
                     }});
  return cases;
}

std::vector<OpCase> moe_combine_backward_cases() {
  std::vector<OpCase> cases;
  for (DType t : kDtypes)
    cases.push_back({str("[1000,2048] top-8 of 128 ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                       const Tensor dout = at(d, host_normal({1000, 2048}, t, rng)), y = at(d, host_normal({8000, 2048}, t, rng));
                       const Routed r = route_on_host(host_normal({1000, 128}, DType::f32, rng), 8);
                       Tensor dy = poisoned({8000, 2048}, t, d), dw = poisoned({1000, 8}, DType::f32, d);
                       ops::moe_combine_backward(dout, y, r.order.to(d), r.position.to(d), r.weights.to(d), dy, dw);
                       return std::vector<Output>{out("dy", dy), out("dweights", dw)};
                     }});
  return cases;
}

std::vector<OpCase> moe_route_backward_cases() {
  std::vector<OpCase> cases;
  for (bool norm : {true, false})
    cases.push_back({str("[1000,128] top-8", norm ? " renormalized" : "", " with the aux gradient"), [=](Device d, std::mt19937& rng) {
                       const Tensor logits = host_normal({1000, 128}, DType::f32, rng);
                       const Tensor dw = host_normal({1000, 8}, DType::f32, rng), aux = host_normal({128}, DType::f32, rng);
                       Tensor w = Tensor::zeros({1000, 8}, DType::f32), ex = Tensor::zeros({1000, 8}, DType::i32),
                              p = Tensor::zeros({1000, 128}, DType::f32);
                       ops::moe_route(logits, 8, norm, w, ex, &p);
                       Tensor dl = poisoned({1000, 128}, DType::f32, d);
                       const Tensor auxd = aux.to(d);
                       ops::moe_route_backward(p.to(d), ex.to(d), w.to(d), dw.to(d), norm, &auxd, dl);
                       return std::vector<Output>{out("dlogits", dl)};
                     }});
  return cases;
}

// The experts' grouped GEMMs at Qwen3-30B-A3B's shapes (128 experts, hidden 2048, expert width 768:
// the gate/up projections' [768,2048] and the down projection's [2048,768]) over a few thousand
// rows routed unevenly, in bf16 as they train; and a small case of 7 experts in both dtypes, odd
// group sizes with empty groups first, inside and last (odd dimensions in fp32; on the GPU bf16 rows
// must start 16-byte aligned, so multiples of 8 there). The library multiplies 16-bit operands into
// their own dtype before an fp32 result adds the product (grouped_matmul.cu), so fp32 results from
// bf16 operands are held to bf16's tolerance.
struct GroupedCase {
  std::string label;
  int64_t G, K, Nout;
  DType t;
  bool small;
};

const GroupedCase kGroupedCases[] = {{"128 experts, 2048 -> 768 (gate, up)", 128, 2048, 768, DType::bf16, false},
                                     {"128 experts, 768 -> 2048 (down)", 128, 768, 2048, DType::bf16, false},
                                     {"7 experts, 13 -> 7", 7, 13, 7, DType::f32, true},
                                     {"7 experts, 40 -> 24", 7, 40, 24, DType::bf16, true}};

// Every eighth expert gets no row, one gets 700, the rest up to 49 (or the small case's sizes).
std::vector<int64_t> routed_offsets(const GroupedCase& c, std::mt19937& rng) {
  std::vector<int64_t> off{0};
  if (c.small) {
    for (int64_t rows : {0, 5, 1, 0, 23, 2, 0}) off.push_back(off.back() + rows);
    return off;
  }
  for (int64_t g = 0; g < c.G; ++g)
    off.push_back(off.back() + (g % 8 == 5 ? 0 : g == 17 ? 700 : static_cast<int64_t>(rng() % 50)));
  return off;
}

std::vector<OpCase> grouped_matmul_cases() {
  std::vector<OpCase> cases;
  for (const GroupedCase& c : kGroupedCases)
    cases.push_back({str(c.label, " ", dtype_name(c.t)), [=](Device d, std::mt19937& rng) {
                       const std::vector<int64_t> off = routed_offsets(c, rng);
                       const int64_t N = off.back();
                       const Tensor x = at(d, host_normal({N, c.K}, c.t, rng));
                       const Tensor dy = at(d, host_normal({N, c.Nout}, c.t, rng));
                       const Tensor w = at(d, host_normal({c.G, c.Nout, c.K}, c.t, rng));
                       Tensor y = poisoned({N, c.Nout}, c.t, d), dx = poisoned({N, c.K}, c.t, d);
                       ops::grouped_matmul(x, w, true, off, y);     // the forward: x w[g]^T
                       ops::grouped_matmul(dy, w, false, off, dx);  // the input's gradient: dy w[g]
                       Tensor acc = at(d, host_normal({N, c.Nout}, DType::f32, rng));
                       ops::grouped_matmul(x, w, true, off, acc, 0.7f, 0.3f);
                       return std::vector<Output>{out("y = x w^T", y), out("dx = dy w", dx),
                                                  out("fp32 y (alpha 0.7, beta 0.3)", acc, tolerance(c.t))};
                     }});
  return cases;
}

std::vector<OpCase> grouped_matmul_wgrad_cases() {
  std::vector<OpCase> cases;
  for (const GroupedCase& c : kGroupedCases)
    cases.push_back({str(c.label, " ", dtype_name(c.t)), [=](Device d, std::mt19937& rng) {
                       const std::vector<int64_t> off = routed_offsets(c, rng);
                       const int64_t N = off.back();
                       const Tensor dy = at(d, host_normal({N, c.Nout}, c.t, rng));
                       const Tensor x = at(d, host_normal({N, c.K}, c.t, rng));
                       // Onto a step's fp32 gradient so far: empty experts keep theirs.
                       Tensor dw = at(d, host_normal({c.G, c.Nout, c.K}, DType::f32, rng));
                       ops::grouped_matmul_wgrad(dy, x, off, dw);
                       std::vector<Output> outs{out("fp32 dw (beta 1)", dw, tolerance(c.t))};
                       if (c.small) {
                         // beta = 0 must not read dw, and writes zeros for empty experts.
                         Tensor fresh = poisoned({c.G, c.Nout, c.K}, DType::f32, d);
                         ops::grouped_matmul_wgrad(dy, x, off, fresh, 0.5f, 0.f);
                         Tensor own = at(d, host_normal({c.G, c.Nout, c.K}, c.t, rng));
                         ops::grouped_matmul_wgrad(dy, x, off, own, 1.f, 0.5f);
                         outs.push_back(out("fp32 dw (alpha 0.5, beta 0)", fresh, tolerance(c.t)));
                         outs.push_back(out(str(dtype_name(c.t), " dw (beta 0.5)"), own));
                       }
                       return outs;
                     }});
  return cases;
}

using test::AttnCase;

// bf16/fp16 with head_dim 64 or 128 reach the fast kernels (cuDNN where it takes the call, else
// the tensor-core ones), everything else the fp32 ones; ops_gpu_test.cpp pins each kernel in turn.
// An attention call's outputs on device d: the forward's out and lse, or the backward's dq, dk, dv
// given the CPU's out and lse (so only the backward differs between the two sides).
std::vector<Output> attention_outputs(Device d, std::mt19937& rng, int64_t T, int64_t S, int64_t Hq, int64_t Hkv,
                                      int64_t dim, DType t, const ops::AttentionParams& p, bool backward) {
  const Tensor qh = host_normal({T, Hq, dim}, t, rng);
  const Tensor kh = host_normal({S, Hkv, dim}, t, rng);
  const Tensor vh = host_normal({S, Hkv, dim}, t, rng);
  const Tensor q = at(d, qh), k = at(d, kh), v = at(d, vh);
  if (!backward) {
    Tensor o = poisoned({T, Hq, dim}, t, d), lse = poisoned({Hq, T}, DType::f32, d);
    ops::attention_forward(q, k, v, o, lse, p);
    return {out("out", o), out("lse", lse)};
  }
  Tensor oh = Tensor::empty({T, Hq, dim}, t), lseh = Tensor::empty({Hq, T}, DType::f32);
  ops::attention_forward(qh, kh, vh, oh, lseh, p);
  const Tensor dout = at(d, host_normal({T, Hq, dim}, t, rng));
  Tensor dq = poisoned(q.shape(), t, d), dk = poisoned(k.shape(), t, d), dv = poisoned(v.shape(), t, d);
  ops::attention_backward(q, k, v, at(d, oh), at(d, lseh), dout, dq, dk, dv, p);
  return {out("dq", dq), out("dk", dk), out("dv", dv)};
}

std::vector<OpCase> attention_cases(bool backward) {
  std::vector<OpCase> cases;
  for (const AttnCase& c : test::kAttentionShapes)
    for (DType t : {DType::f32, DType::bf16, DType::f16})
      cases.push_back({str("T=", c.T, " S=", c.S, " Hq=", c.Hq, " Hkv=", c.Hkv, " d=", c.d,
                           c.causal ? " causal" : " full", " q_offset=", c.q_offset, " k_offset=", c.k_offset, " ",
                           dtype_name(t)),
                       [=](Device d, std::mt19937& rng) {
                         return attention_outputs(d, rng, c.T, c.S, c.Hq, c.Hkv, c.d, t, test::attention_params(c),
                                                  backward);
                       }});
  for (const test::DocCase& c : test::kDocumentShapes)
    for (DType t : {DType::f32, DType::bf16}) {
      std::string bounds;
      for (int64_t b : c.bounds) bounds += str(bounds.empty() ? "" : ",", b);
      cases.push_back({str("documents {", bounds, "} Hq=", c.Hq, " Hkv=", c.Hkv, " d=", c.d,
                           c.causal ? " causal " : " full ", dtype_name(t)),
                       [=](Device d, std::mt19937& rng) {
                         const int64_t T = c.bounds.back();
                         ops::AttentionParams p;
                         p.causal = c.causal;
                         p.documents = c.bounds;
                         return attention_outputs(d, rng, T, T, c.Hq, c.Hkv, c.d, t, p, backward);
                       }});
    }
  return cases;
}

// Sliding-window attention (Gemma 3's, GPT-OSS's layers): a window of 1 (the backward's 2), 17 and
// 128 keys over a sequence longer than a tile, head_dim 64 and 128, GQA; once more with packed
// documents, where a query sees the keys both its window and its document allow. A window of 1 has
// dq = dk = 0 exactly (each softmax is one 1, so dP - rowsum(dO * O) cancels): the CPU's zeros
// against the GPU's rounding (an L2 of 4.5e-5 on the H100) would hold noise to a relative bound.
std::vector<OpCase> attention_window_cases(bool backward) {
  struct Wc {
    int64_t T, Hq, Hkv, d, window;
    std::vector<int64_t> documents;
  };
  std::vector<OpCase> cases;
  for (const Wc& c : {Wc{300, 4, 2, 64, 1, {}}, Wc{300, 4, 2, 64, 17, {}}, Wc{333, 8, 2, 128, 128, {}},
                      Wc{300, 4, 2, 64, 17, {0, 40, 200, 300}}})
    for (DType t : {DType::f32, DType::bf16}) {
      cases.push_back({str("T=", c.T, " Hq=", c.Hq, " Hkv=", c.Hkv, " d=", c.d, " window=",
                           backward ? std::max<int64_t>(c.window, 2) : c.window,
                           c.documents.empty() ? "" : " documents", " ", dtype_name(t)),
                       [=](Device d, std::mt19937& rng) {
                         ops::AttentionParams p;
                         p.causal = true;
                         p.window = backward ? std::max<int64_t>(c.window, 2) : c.window;
                         p.documents = c.documents;
                         return attention_outputs(d, rng, c.T, c.T, c.Hq, c.Hkv, c.d, t, p, backward);
                       }});
    }
  return cases;
}

// int64 targets, every fourth row (from row 1) ignored.
Tensor targets_with_ignored(int64_t T, int64_t V, std::mt19937& rng) {
  std::uniform_int_distribution<int64_t> pick(0, V - 1);
  Tensor targets = Tensor::empty({T}, DType::i64);
  int64_t* p = targets.data_as<int64_t>();
  for (int64_t i = 0; i < T; ++i) p[i] = i % 4 == 1 ? -100 : pick(rng);
  return targets;
}

std::vector<OpCase> cross_entropy_cases() {
  struct Tv {
    int64_t T, V;
  };
  std::vector<OpCase> cases;
  for (Tv s : {Tv{37, 5003}, Tv{4, 151936}})
    for (DType t : kDtypes)
      cases.push_back({str(s.T, "x", s.V, " ", dtype_name(t)), [=](Device d, std::mt19937& rng) {
                         const Tensor logits = at(d, host_normal({s.T, s.V}, t, rng, 3.f));
                         const Tensor targets = at(d, targets_with_ignored(s.T, s.V, rng));
                         const double scale = 1.0 / 29;
                         Tensor dl = poisoned({s.T, s.V}, t, d);
                         int64_t valid = -1;
                         const double loss = ops::cross_entropy_forward_backward(logits, targets, scale, &dl, &valid);
                         const double loss_only = ops::cross_entropy_forward_backward(logits, targets, scale, nullptr, nullptr);
                         // The gradient written over the logits themselves.
                         Tensor inplace = logits.clone();
                         const double loss_inplace = ops::cross_entropy_forward_backward(inplace, targets, scale, &inplace, nullptr);
                         return std::vector<Output>{scalar("loss", loss, 1e-5),
                                                    scalar("valid", static_cast<double>(valid), kExact),
                                                    out("dlogits", dl),
                                                    scalar("loss without dlogits", loss_only, 1e-5),
                                                    scalar("loss in place", loss_inplace, 1e-5),
                                                    out("dlogits in place", inplace)};
                       }});
  return cases;
}

// Vocabularies on the 16-byte path (V % 4 == 0, the real 151,936 among them) and odd ones on the
// scalar path; the gradient in each storage the op can write (fp32, in place, bf16, none).
std::vector<OpCase> cross_entropy_chunk_cases() {
  std::vector<OpCase> cases;
  for (int64_t V : {int64_t{1}, int64_t{33}, int64_t{1000}, int64_t{4097}, int64_t{151936}}) {
    const int64_t n = V > 10000 ? 5 : 37;
    cases.push_back({str(n, "x", V, " f32"), [=](Device d, std::mt19937& rng) {
                       const Tensor logits = at(d, host_normal({n, V}, DType::f32, rng, 4.f));
                       const Tensor targets = at(d, targets_with_ignored(n, V, rng));
                       const float scale = 1.f / 300;
                       std::vector<Output> outs;
                       for (DType g : {DType::f32, DType::bf16}) {
                         Tensor loss = poisoned({n}, DType::f32, d), dl = poisoned({n, V}, g, d);
                         ops::cross_entropy_chunk(logits, targets, scale, loss, &dl);
                         outs.push_back(out(str("row loss (", dtype_name(g), " dlogits)"), loss));
                         outs.push_back(out(str("dlogits ", dtype_name(g)), dl));
                       }
                       Tensor inplace = logits.clone(), loss = poisoned({n}, DType::f32, d);
                       ops::cross_entropy_chunk(inplace, targets, scale, loss, &inplace);
                       outs.push_back(out("dlogits in place", inplace));
                       Tensor fwd = poisoned({n}, DType::f32, d);
                       ops::cross_entropy_chunk(logits, targets, scale, fwd, nullptr);
                       outs.push_back(out("row loss, forward only", fwd));
                       return outs;
                     }});
  }
  return cases;
}

// Attention sinks (GPT-OSS) on an attention output of a head group (heads 4.. of 12 sinks), with
// rows that saw no key (lse -inf); the backward accumulates onto a gradient already holding values.
std::vector<OpCase> attention_sinks_cases(bool backward) {
  std::vector<OpCase> cases;
  for (DType t : kDtypes)
    for (int64_t d : {64, 128})
      cases.push_back({str("[1031,8,", d, "] heads 4.. of 12 ", dtype_name(t)), [=](Device dev, std::mt19937& rng) {
                         const int64_t T = 1031, H = 8;
                         Tensor o = at(dev, host_normal({T, H, d}, t, rng));
                         std::vector<float> l = normal(H * T, rng, 2.f);
                         for (int64_t i = 0; i < H * T; i += 97) l[static_cast<size_t>(i)] = -INFINITY;
                         Tensor lse = at(dev, Tensor::from_floats(l, {H, T}, DType::f32));
                         const Tensor sinks = at(dev, host_normal({12}, t, rng, 2.f));
                         ops::attention_sinks_forward(o, lse, sinks, 4);
                         if (!backward) return std::vector<Output>{out("out", o), out("lse", lse)};
                         const Tensor dout = at(dev, host_normal({T, H, d}, t, rng));
                         Tensor ds = at(dev, host_normal({12}, DType::f32, rng));
                         ops::attention_sinks_backward(o, lse, dout, sinks, 4, ds);
                         // A sum over T x d products that cancel, in another order on each backend:
                         // measured 2.7e-5 apart on an H100 (bf16 inputs, fp32 sums), held to 1e-4.
                         return std::vector<Output>{out("dsinks", ds, 1e-4)};
                       }});
  return cases;
}

// One row per op of lcx/ops.h.
const std::map<std::string, std::vector<OpCase>>& op_table() {
  static const std::map<std::string, std::vector<OpCase>> table = {
      {"matmul", matmul_cases()},
      {"embedding_forward", embedding_cases(false)},
      {"embedding_backward", embedding_cases(true)},
      {"rmsnorm_forward", rmsnorm_cases(false)},
      {"rmsnorm_backward", rmsnorm_cases(true)},
      {"rotary_forward", rotary_cases(false)},
      {"rotary_backward", rotary_cases(true)},
      {"swiglu_forward", swiglu_cases(false)},
      {"swiglu_backward", swiglu_cases(true)},
      {"geglu_tanh_forward", geglu_cases(false)},
      {"geglu_tanh_backward", geglu_cases(true)},
      {"rmsnorm_offset_forward", rmsnorm_offset_cases(false)},
      {"rmsnorm_offset_backward", rmsnorm_offset_cases(true)},
      {"swiglu_clamped_forward", swiglu_clamped_cases(false)},
      {"swiglu_clamped_backward", swiglu_clamped_cases(true)},
      {"add", add_cases(false)},
      {"add_inplace", add_cases(true)},
      {"scale_inplace", scale_cases()},
      {"cast", cast_cases()},
      {"copy_columns", copy_columns_cases()},
      {"dropout", dropout_cases()},
      {"moe_route", moe_route_cases()},
      {"moe_permute", moe_permute_cases()},
      {"gather_rows", gather_rows_cases()},
      {"moe_combine", moe_combine_cases()},
      {"moe_combine_backward", moe_combine_backward_cases()},
      {"moe_route_backward", moe_route_backward_cases()},
      {"grouped_matmul", grouped_matmul_cases()},
      {"grouped_matmul_wgrad", grouped_matmul_wgrad_cases()},
      {"attention_forward", attention_cases(false)},
      {"attention_backward", attention_cases(true)},
      {"attention_window_forward", attention_window_cases(false)},
      {"attention_window_backward", attention_window_cases(true)},
      {"attention_sinks_forward", attention_sinks_cases(false)},
      {"attention_sinks_backward", attention_sinks_cases(true)},
      {"cross_entropy_forward_backward", cross_entropy_cases()},
      {"cross_entropy_chunk", cross_entropy_chunk_cases()},
  };
  return table;
}

std::vector<std::string> op_names() {
  std::vector<std::string> names;
  for (const auto& [name, cases] : op_table()) names.push_back(name);
  return names;
}

// ---- the driver --------------------------------------------------------------------------------

std::vector<Device> backends() {
  std::vector<Device> b;
  if (cuda_available()) b.push_back(Device::cuda());
  return b;
}

class BackendOps : public ::testing::TestWithParam<std::string> {};

TEST_P(BackendOps, MatchCpuTwin) {
  const std::vector<Device> others = backends();
  if (others.empty()) GTEST_SKIP() << "no backend beside the CPU (no CUDA device visible)";
  const uint32_t seed = fresh_seed();
  RecordProperty("seed", std::to_string(seed));
  SCOPED_TRACE(str("seed ", seed));
  for (Device device : others)
    for (const OpCase& c : op_table().at(GetParam())) {
      SCOPED_TRACE(str(GetParam(), " ", c.label, " on ", device_name(device)));
      std::mt19937 cpu_rng(seed), backend_rng(seed);
      const std::vector<Output> want = c.run(Device::cpu(), cpu_rng);
      const std::vector<Output> got = c.run(device, backend_rng);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < want.size(); ++i) expect_matches(got[i], want[i]);
    }
}

INSTANTIATE_TEST_SUITE_P(Table, BackendOps, ::testing::ValuesIn(op_names()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace lcx::test
