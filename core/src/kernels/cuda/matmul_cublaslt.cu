// GEMM on the GPU through cuBLASLt: c = alpha * op(a) @ op(b) + beta * c, row-major, operands
// viewed as 2-D (leading dimensions folded into rows) as the CPU twin does. cuBLASLt is
// column-major, so the row-major product is issued as its transpose, c^T = op(b)^T op(a)^T, which
// reads the same bytes with no copy. bf16/fp16 operands with fp32 accumulation (c bf16, fp16 or
// fp32); fp32 operands with plain fp32 compute (no TF32, so the fp32 path matches the CPU to
// 1e-5). One handle and one 32 MiB workspace per device, created on first use and kept for the
// process; the chosen algorithm is cached per shape, layout and alignment.
#include <map>
#include <mutex>
#include <tuple>

#include "cuda/check_libs.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"

namespace lcx::ops::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
    case DType::f32: return CUDA_R_32F;
    default: throw Error(str("matmul on ", dtype_name(t), " tensors"), {}, "matmul takes bf16, fp16 or fp32");
  }
}

// Largest power of two up to 256 that divides the address: what cuBLASLt may assume of it.
uint32_t alignment(const void* p) {
  uint32_t a = 256;
  while (a > 1 && reinterpret_cast<uintptr_t>(p) % a) a /= 2;
  return a;
}

using AlgoKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, int, int, uint32_t, uint32_t, uint32_t>;

struct DeviceLt {
  cublasLtHandle_t handle = nullptr;
  // Held for the process: freeing it at exit would race the CUDA runtime's own teardown.
  void* workspace = nullptr;
  std::mutex mu;
  std::map<AlgoKey, cublasLtMatmulAlgo_t> algos;
};

DeviceLt& lt_for(int device) {
  static std::mutex mu;
  static std::map<int, DeviceLt*> all;
  std::lock_guard lock(mu);
  DeviceLt*& lt = all[device];
  if (!lt) {
    auto fresh = std::make_unique<DeviceLt>();
    LCX_CUBLAS_CHECK(cublasLtCreate(&fresh->handle));
    LCX_CUDA_CHECK(cudaMalloc(&fresh->workspace, kWorkspaceBytes));
    lt = fresh.release();
  }
  return *lt;
}

// Owns the descriptors of one call.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

}  // namespace

void matmul(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, float alpha, float beta) {
  const int64_t a_cols = a.size(-1), a_rows = a_cols ? a.numel() / a_cols : 0;
  const int64_t b_cols = b.size(-1), b_rows = b_cols ? b.numel() / b_cols : 0;
  const int64_t N = c.size(-1), M = N ? c.numel() / N : 0;
  const int64_t K = trans_a ? a_rows : a_cols;
  if (M == 0 || N == 0) return;
  cudaStream_t stream = lcx::cuda::current_stream();
  if (K == 0) {  // the product is empty: c = beta * c, and beta == 0 must not read c
    if (beta == 0.f)
      LCX_CUDA_CHECK(cudaMemsetAsync(c.data(), 0, c.nbytes(), stream));
    else
      scale_inplace(c, beta);
    return;
  }
  // cuBLASLt wants one operand dtype, and fp32 operands only into fp32: the rare other mixes go
  // through fp32 copies, so the GPU takes every combination the CPU twin takes.
  if (a.dtype() != b.dtype()) {
    Tensor a32 = Tensor::empty(a.shape(), DType::f32, a.device()), b32 = Tensor::empty(b.shape(), DType::f32, b.device());
    cast(a, a32);
    cast(b, b32);
    matmul(a32, trans_a, b32, trans_b, c, alpha, beta);
    return;
  }
  if (a.dtype() == DType::f32 && c.dtype() != DType::f32) {
    Tensor c32 = Tensor::empty(c.shape(), DType::f32, c.device());
    if (beta != 0.f) cast(c, c32);
    matmul(a, trans_a, b, trans_b, c32, alpha, beta);
    cast(c32, c);
    return;
  }
  const cudaDataType_t ab_type = cuda_type(a.dtype()), c_type = cuda_type(c.dtype());

  DeviceLt& lt = lt_for(c.device().index);
  Descriptors d;
  LCX_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major view: Lt's A is our b (N x K after its op), Lt's B is our a (K x M after its op).
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  LCX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)));
  LCX_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)));
  LCX_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.a, ab_type, static_cast<uint64_t>(b_cols),
                                              static_cast<uint64_t>(b_rows), b_cols));
  LCX_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.b, ab_type, static_cast<uint64_t>(a_cols),
                                              static_cast<uint64_t>(a_rows), a_cols));
  LCX_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.c, c_type, static_cast<uint64_t>(N), static_cast<uint64_t>(M), N));

  const uint32_t al_a = alignment(b.data()), al_b = alignment(a.data()), al_c = alignment(c.data());
  const AlgoKey key{M, N, K, trans_a, trans_b, static_cast<int>(a.dtype()), static_cast<int>(c.dtype()),
                    al_a, al_b, al_c};
  cublasLtMatmulAlgo_t algo;
  // The lock covers the launch too: the workspace is shared, and an algorithm of several kernels
  // (split-K: partial products, then their reduction) must not interleave with another host
  // thread's launches on the same stream (virtual ranks are threads sharing one GPU).
  std::lock_guard lock(lt.mu);
  {
    auto it = lt.algos.find(key);
    if (it != lt.algos.end()) {
      algo = it->second;
    } else {
      LCX_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.pref));
      const size_t ws = kWorkspaceBytes;
      LCX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                            sizeof(ws)));
      LCX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                            &al_a, sizeof(al_a)));
      LCX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                            &al_b, sizeof(al_b)));
      LCX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                            &al_c, sizeof(al_c)));
      LCX_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                            &al_c, sizeof(al_c)));
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      LCX_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt.handle, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &result, &found));
      if (found == 0)
        throw Error(str("cuBLASLt has no algorithm for a ", M, "x", N, "x", K, " ", dtype_name(a.dtype()), " -> ",
                        dtype_name(c.dtype()), " matmul"));
      algo = result.algo;
      lt.algos.emplace(key, algo);
    }
  }
  LCX_CUBLAS_CHECK(cublasLtMatmul(lt.handle, d.op, &alpha, b.data(), d.a, a.data(), d.b, &beta, c.data(), d.c,
                                  c.data(), d.c, &algo, lt.workspace, kWorkspaceBytes, stream));
}

}  // namespace lcx::ops::cuda
