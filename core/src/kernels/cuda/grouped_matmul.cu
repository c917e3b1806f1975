// Grouped GEMMs on the GPU: rows in groups, each group through its own weight (the CPU twin:
// kernels/cpu/grouped_matmul_cpu.cpp). On an H100/H200, lcx's Hopper kernels (grouped_gemm_sm90a.cu)
// take the calls they serve under [run] grouped_gemm = "hopper". Otherwise one
// cublasGemmGroupedBatchedEx call runs every group, each its own problem whose m, n or k is its row
// count: CUDA 13.1's cuBLASLt has no grouped GEMM, and a GEMM per group would be a host loop of 128
// small launches per projection. cuBLAS is column-major, so each row-major product is issued as its
// transpose, as matmul_cublaslt.cu does. The library reads the problems' matrix pointers from the
// device: they are built on the host and go up in one copy (upload) on the current stream into a
// tensor from the caching allocator, freed after the call (frees are stream-ordered: only work
// queued after the call can reuse the block). One handle and one 32 MiB workspace per device, kept
// for the process as matmul_cublaslt.cu keeps its own.
//
// The grouped GEMM takes 16-bit operands only into a result of their dtype (no bf16 x bf16 -> fp32,
// which cuBLASLt's single GEMM has): an fp32 y or dw from bf16 operands is the product in bf16, into
// scratch (for dw, G*Nout*K values: 400 MB for 128 groups of 768x2048), then added in fp32 to beta
// times the result. The weight gradient is thus rounded to bf16 once per call before it accumulates
// in fp32, as under transformers' bf16 autocast. cuBLAS asks that the matrices of a pointer-array
// GEMM on 16-bit data start 16-byte aligned (looser rules depend on each problem's k), else the
// device may fault on a misaligned access. Qwen3's dimensions (multiples of 8) meet that; shapes
// that do not (small test models of odd sizes) run one cuBLASLt GEMM per group instead, which
// takes any alignment and 16-bit operands into fp32 directly.
#include <cublas_v2.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>

#include "cuda/check_libs.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/grouped_gemm_hopper.h"
#include "kernels/grouped_gemm_choice.h"

namespace lcx::ops::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

struct DeviceBlas {
  cublasHandle_t handle = nullptr;
  // Held for the process: freeing it at exit would race the CUDA runtime's own teardown.
  void* workspace = nullptr;
  std::mutex mu;
};

DeviceBlas& blas_for(int device) {
  static std::mutex mu;
  static std::map<int, DeviceBlas*> all;
  std::lock_guard lock(mu);
  DeviceBlas*& blas = all[device];
  if (!blas) {
    auto fresh = std::make_unique<DeviceBlas>();
    LCX_CUBLAS_CHECK(cublasCreate(&fresh->handle));
    LCX_CUDA_CHECK(cudaMalloc(&fresh->workspace, kWorkspaceBytes));
    blas = fresh.release();
  }
  return *blas;
}

cudaDataType_t blas_type(DType t) {
  switch (t) {
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// A leading dimension as cuBLAS checks it: at least 1, even for a matrix with no columns.
int ld(int64_t n) { return static_cast<int>(std::max<int64_t>(n, 1)); }

void* element(const Tensor& t, int64_t i) { return static_cast<char*>(t.data()) + i * dtype_size(t.dtype()); }

// The problems of one call in cuBLAS's column-major terms: C = alpha * op(A) op(B) + beta * C, the
// transposes and leading dimensions common to all, the sizes and matrices each problem's own.
struct Problems {
  Problems(cublasOperation_t op_a_, cublasOperation_t op_b_, int lda_, int ldb_, int ldc_)
      : op_a(op_a_), op_b(op_b_), lda(lda_), ldb(ldb_), ldc(ldc_) {}
  cublasOperation_t op_a, op_b;
  int lda, ldb, ldc;
  std::vector<int> m, n, k;
  std::vector<void*> a, b, c;

  void add(int64_t m_, int64_t n_, int64_t k_, void* a_, void* b_, void* c_) {
    m.push_back(static_cast<int>(m_));
    n.push_back(static_cast<int>(n_));
    k.push_back(static_cast<int>(k_));
    a.push_back(a_);
    b.push_back(b_);
    c.push_back(c_);
  }
};

// Whether every group's matrices of a 16-bit call start 16-byte aligned, as the grouped GEMM needs:
// groups start at any row of x (and of y or dy) and at every matrix of w (or dw), so each tensor's
// start and its row (or matrix) size in bytes must be multiples of 16.
bool aligned(std::initializer_list<const Tensor*> tensors) {
  uintptr_t bits = 0;
  for (const Tensor* t : tensors) {
    if (t->dtype() == DType::f32) continue;
    bits |= reinterpret_cast<uintptr_t>(t->data());
    const int64_t row = t->numel() / std::max<int64_t>(1, t->size(0)) * static_cast<int64_t>(dtype_size(t->dtype()));
    bits |= static_cast<uintptr_t>(row);  // rows (or groups) at multiples of this
  }
  return bits % 16 == 0;
}

void run(const Problems& p, DType t, float alpha, float beta, Device device) {
  const size_t count = p.m.size();
  if (count == 0) return;
  std::vector<void*> pointers;  // every A, then every B, then every C
  for (const auto* v : {&p.a, &p.b, &p.c}) pointers.insert(pointers.end(), v->begin(), v->end());
  Tensor table = Tensor::empty({static_cast<int64_t>(pointers.size())}, DType::i64, device);
  upload(pointers.data(), table);
  void** on_device = table.data_as<void*>();
  const auto problems = static_cast<int>(count);
  const std::vector<cublasOperation_t> op_a(count, p.op_a), op_b(count, p.op_b);
  const std::vector<int> lda(count, p.lda), ldb(count, p.ldb), ldc(count, p.ldc), one(count, 1);
  const std::vector<float> alphas(count, alpha), betas(count, beta);
  const cudaDataType_t type = blas_type(t);

  DeviceBlas& blas = blas_for(device.index);
  // The lock covers the launch: the workspace is shared by the host threads of one GPU.
  std::lock_guard lock(blas.mu);
  LCX_CUBLAS_CHECK(cublasSetStream(blas.handle, lcx::cuda::current_stream()));
  // Setting the stream puts the handle back on cuBLAS's own workspace pool.
  LCX_CUBLAS_CHECK(cublasSetWorkspace(blas.handle, blas.workspace, kWorkspaceBytes));
  LCX_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(blas.handle, op_a.data(), op_b.data(), p.m.data(), p.n.data(), p.k.data(),
                                              alphas.data(), on_device, type, lda.data(), on_device + count, type,
                                              ldb.data(), betas.data(), on_device + 2 * count, type, ldc.data(),
                                              problems, one.data(), CUBLAS_COMPUTE_32F));
}

// dst = part + beta * dst: the 16-bit product added in dst's fp32.
void accumulate(const Tensor& part, float beta, Tensor& dst) {
  if (beta == 0.f) return cast(part, dst);
  if (beta != 1.f) scale_inplace(dst, beta);
  add_inplace(dst, part);
}

}  // namespace

void grouped_matmul(const Tensor& x, const Tensor& w, bool trans_w, std::span<const int64_t> offsets, Tensor& y,
                    float alpha, float beta) {
  if (y.numel() == 0) return;
  if (own_grouped_gemm() && grouped_hopper::grouped_matmul(x, w, trans_w, offsets, y, alpha, beta)) return;
  if (!aligned({&x, &w, &y})) {
    for (size_t g = 0; g + 1 < offsets.size(); ++g) {
      if (offsets[g + 1] == offsets[g]) continue;
      const Tensor wg = w.rows(static_cast<int64_t>(g), static_cast<int64_t>(g) + 1).view({w.size(1), w.size(2)});
      Tensor yg = y.rows(offsets[g], offsets[g + 1]);
      matmul(x.rows(offsets[g], offsets[g + 1]), false, wg, trans_w, yg, alpha, beta);
    }
    return;
  }
  if (y.dtype() != x.dtype()) {
    Tensor part = Tensor::empty(y.shape(), x.dtype(), y.device());
    grouped_matmul(x, w, trans_w, offsets, part, alpha, 0.f);
    accumulate(part, beta, y);
    return;
  }
  const int64_t K = x.size(1), Nout = y.size(1);
  // y_g^T [Nout, rows] = op(w_g)^T x_g^T: cuBLAS's A is w_g, its B is x_g, its C is y_g.
  Problems p(trans_w ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, ld(trans_w ? K : Nout), ld(K), ld(Nout));
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t begin = offsets[g], rows = offsets[g + 1] - begin;
    if (rows == 0) continue;
    p.add(Nout, rows, K, element(w, static_cast<int64_t>(g) * Nout * K), element(x, begin * K),
          element(y, begin * Nout));
  }
  run(p, x.dtype(), alpha, beta, y.device());
}

void grouped_matmul_wgrad(const Tensor& dy, const Tensor& x, std::span<const int64_t> offsets, Tensor& dw, float alpha,
                          float beta) {
  if (dw.numel() == 0) return;
  if (own_grouped_gemm() && grouped_hopper::grouped_matmul_wgrad(dy, x, offsets, dw, alpha, beta)) return;
  if (!aligned({&dy, &x, &dw})) {
    for (size_t g = 0; g + 1 < offsets.size(); ++g) {
      Tensor dwg = dw.rows(static_cast<int64_t>(g), static_cast<int64_t>(g) + 1).view({dw.size(1), dw.size(2)});
      if (offsets[g + 1] > offsets[g]) {
        matmul(dy.rows(offsets[g], offsets[g + 1]), true, x.rows(offsets[g], offsets[g + 1]), false, dwg, alpha, beta);
      } else if (beta == 0.f) {
        dwg.zero();
      } else if (beta != 1.f) {
        scale_inplace(dwg, beta);
      }
    }
    return;
  }
  if (dw.dtype() != x.dtype()) {
    Tensor part = Tensor::empty(dw.shape(), x.dtype(), dw.device());
    grouped_matmul_wgrad(dy, x, offsets, part, alpha, 0.f);
    accumulate(part, beta, dw);
    return;
  }
  const int64_t K = x.size(1), Nout = dy.size(1);
  // dw_g^T [K, Nout] = x_g^T dy_g: cuBLAS's A is x_g, its B is dy_g transposed, its C is dw_g. A
  // group without rows stays in the call with k = 0, which leaves beta * dw_g (zeros for beta 0).
  Problems p(CUBLAS_OP_N, CUBLAS_OP_T, ld(K), ld(Nout), ld(K));
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int64_t begin = offsets[g], rows = offsets[g + 1] - begin;
    p.add(K, Nout, rows, element(x, begin * K), element(dy, begin * Nout),
          element(dw, static_cast<int64_t>(g) * Nout * K));
  }
  run(p, x.dtype(), alpha, beta, dw.device());
}

}  // namespace lcx::ops::cuda
