// matmul, CPU reference: c = alpha * op(a) @ op(b) + beta * c through OpenBLAS cblas_sgemm.
// Operands are viewed as 2-D (leading dimensions folded into rows). bf16/fp16 operands are
// widened into fp32 scratch first; an fp32 c is handed to BLAS in place, any other c goes through
// fp32 scratch (loaded only when beta reads it) and is rounded once on the way back.
#include <cblas.h>

#include "kernels/cpu/cpu_ops.h"

namespace lcx::ops::cpu {
namespace {

struct Matrix {
  int64_t rows, cols;
};
Matrix as_matrix(const Tensor& t) {
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) rows *= t.size(i);
  return {rows, t.size(-1)};
}

// fp32 pointer to t's data: the tensor itself when fp32, else a widened copy in scratch.
const float* f32_data(const Tensor& t, std::vector<float>& scratch) {
  if (t.dtype() == DType::f32) return t.data_as<const float>();
  scratch = to_f32(t);
  return scratch.data();
}

}  // namespace

void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, float alpha, float beta) {
  const Matrix ma = as_matrix(a), mb = as_matrix(b), mc = as_matrix(c);
  const int64_t M = mc.rows, N = mc.cols, K = trans_a ? ma.rows : ma.cols;
  if (M == 0 || N == 0) return;
  std::vector<float> sa, sb, sc;
  const float* pa = f32_data(a, sa);
  const float* pb = f32_data(b, sb);
  float* pc;
  if (c.dtype() == DType::f32) {
    pc = c.data_as<float>();
  } else {
    sc.assign(static_cast<size_t>(c.numel()), 0.f);
    if (beta != 0.f) load_f32(c, 0, c.numel(), sc.data());
    pc = sc.data();
  }
  if (K == 0) {  // an empty inner dimension makes a leading dimension 0, which BLAS rejects
    for (int64_t i = 0; i < M * N; ++i) pc[i] = beta == 0.f ? 0.f : beta * pc[i];
  } else {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), alpha, pa,
                static_cast<int>(ma.cols), pb, static_cast<int>(mb.cols), beta, pc, static_cast<int>(N));
  }
  if (c.dtype() != DType::f32) store_f32(sc.data(), c.numel(), c, 0);
}

}  // namespace lcx::ops::cpu
