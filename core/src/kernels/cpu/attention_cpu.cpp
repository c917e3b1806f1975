// Attention, CPU reference: causal or full GQA attention in the flash-attention style, so memory is
// O(T*d) and never a T x S score matrix.
// Forward, per query row: walk the visible keys in blocks of kKeyBlock, keep a running max m, a
// running sum l of exp(s - m) and an unnormalized output acc; when a block raises the max, rescale
// l and acc by exp(m_old - m_new). Then out = acc / l and lse = m + log(l); a row that sees no key
// gets out = 0 and lse = -inf.
// Backward, per query row: D = dout . out; for each visible key p = exp(s - lse) (recomputed from
// the saved lse), dv += p * dout, dp = dout . v, ds = p * (dp - D), dq += scale * ds * k,
// dk += scale * ds * q. Work is split by kv head, so each task owns its dk/dv rows (summed over
// the query heads of its group) and the dq rows of those heads.
// Positions: query i sits at q_offset + i, key j at k_offset + j; causal hides keys past the query.
// Document bounds narrow each query's keys to its own document's, so the work is the sum of the
// documents' squared lengths; a window narrows them to the W positions ending at the query's, so a
// windowed row walks at most W keys (work T x W). Both at once where both are given.
// Inputs are widened to fp32 once; outputs are rounded once into their dtypes.
#include <algorithm>
#include <cmath>

#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {
namespace {

constexpr int64_t kKeyBlock = 64;

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

struct Dims {
  int64_t T, S, Hq, Hkv, d, group;
  // Keys [begin, end) are visible to query row i.
  std::pair<int64_t, int64_t> keys(int64_t i, const AttentionParams& p) const {
    const int64_t pos = p.q_offset + i;
    int64_t begin = 0, end = p.causal ? pos - p.k_offset + 1 : S;
    if (!p.documents.empty()) {  // ops.cpp checked that the bounds cover every position
      const auto next = std::upper_bound(p.documents.begin(), p.documents.end(), pos);
      begin = std::max(begin, *(next - 1) - p.k_offset);
      end = std::min(end, *next - p.k_offset);
    }
    if (p.window > 0) begin = std::max(begin, pos - p.window + 1 - p.k_offset);
    begin = std::clamp<int64_t>(begin, 0, S);
    return {begin, std::clamp<int64_t>(end, begin, S)};
  }
};

Dims dims_of(const Tensor& q, const Tensor& k) {
  Dims m;
  m.T = q.size(0), m.Hq = q.size(1), m.d = q.size(2), m.S = k.size(0), m.Hkv = k.size(1);
  m.group = m.Hq / m.Hkv;
  return m;
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                       const AttentionParams& p) {
  const Dims m = dims_of(q, k);
  const std::vector<float> qf = to_f32(q), kf = to_f32(k), vf = to_f32(v);
  float* lse_p = lse.data_as<float>();
  parallel_tasks(m.Hq, [&](int64_t h) {
    const int64_t g = h / m.group;
    std::vector<float> acc(m.d), s(kKeyBlock);
    for (int64_t i = 0; i < m.T; ++i) {
      const float* qi = &qf[(i * m.Hq + h) * m.d];
      const auto [begin, end] = m.keys(i, p);
      float mx = -INFINITY, l = 0.f;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j0 = begin; j0 < end; j0 += kKeyBlock) {
        const int64_t n = std::min(kKeyBlock, end - j0);
        float bmax = -INFINITY;
        for (int64_t jj = 0; jj < n; ++jj) {
          s[jj] = p.scale * dot(qi, &kf[((j0 + jj) * m.Hkv + g) * m.d], m.d);
          bmax = std::max(bmax, s[jj]);
        }
        const float mnew = std::max(mx, bmax);
        const float corr = std::exp(mx - mnew);  // 0 on the first block, where mx = -inf
        l *= corr;
        for (auto& a : acc) a *= corr;
        for (int64_t jj = 0; jj < n; ++jj) {
          const float pj = std::exp(s[jj] - mnew);
          l += pj;
          const float* vj = &vf[((j0 + jj) * m.Hkv + g) * m.d];
          for (int64_t c = 0; c < m.d; ++c) acc[c] += pj * vj[c];
        }
        mx = mnew;
      }
      if (l > 0.f) {
        for (auto& a : acc) a /= l;
        lse_p[h * m.T + i] = mx + std::log(l);
      } else {
        lse_p[h * m.T + i] = -INFINITY;
      }
      store_f32(acc.data(), m.d, out, (i * m.Hq + h) * m.d);
    }
  });
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& p) {
  const Dims m = dims_of(q, k);
  const std::vector<float> qf = to_f32(q), kf = to_f32(k), vf = to_f32(v);
  const float* lse_p = lse.data_as<const float>();
  parallel_tasks(m.Hkv, [&](int64_t g) {
    std::vector<float> dk_acc(m.S * m.d, 0.f), dv_acc(m.S * m.d, 0.f);
    std::vector<float> o(m.d), dout_i(m.d), dq_i(m.d);
    for (int64_t h = g * m.group; h < (g + 1) * m.group; ++h) {
      for (int64_t i = 0; i < m.T; ++i) {
        const int64_t row = (i * m.Hq + h) * m.d;
        std::fill(dq_i.begin(), dq_i.end(), 0.f);
        const float lse_i = lse_p[h * m.T + i];
        auto [begin, end] = m.keys(i, p);
        if (std::isinf(lse_i)) end = begin;
        if (end > begin) {
          load_f32(out, row, m.d, o.data());
          load_f32(dout, row, m.d, dout_i.data());
        }
        const float D = end > begin ? dot(dout_i.data(), o.data(), m.d) : 0.f;
        const float* qi = &qf[row];
        for (int64_t j = begin; j < end; ++j) {
          const float* kj = &kf[(j * m.Hkv + g) * m.d];
          const float* vj = &vf[(j * m.Hkv + g) * m.d];
          const float pj = std::exp(p.scale * dot(qi, kj, m.d) - lse_i);
          const float ds = pj * (dot(dout_i.data(), vj, m.d) - D);
          float* dkj = &dk_acc[j * m.d];
          float* dvj = &dv_acc[j * m.d];
          for (int64_t c = 0; c < m.d; ++c) {
            dvj[c] += pj * dout_i[c];
            dkj[c] += ds * qi[c];
            dq_i[c] += ds * kj[c];
          }
        }
        for (auto& x : dq_i) x *= p.scale;
        store_f32(dq_i.data(), m.d, dq, row);
      }
    }
    for (int64_t j = 0; j < m.S; ++j) {
      for (int64_t c = 0; c < m.d; ++c) dk_acc[j * m.d + c] *= p.scale;
      store_f32(&dk_acc[j * m.d], m.d, dk, (j * m.Hkv + g) * m.d);
      store_f32(&dv_acc[j * m.d], m.d, dv, (j * m.Hkv + g) * m.d);
    }
  });
}

}  // namespace lcx::ops::cpu
