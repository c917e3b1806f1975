// What the Hopper attention kernels (forward_sm90a.cu, backward_sm90a.cu) share: the
// mbarrier and TMA instructions, wgmma's shared-memory descriptors for 128-byte swizzled tiles, the
// warpgroup GEMMs themselves, and on the host the tensor maps of [rows, heads, 128] bf16 tensors.
// Only files compiled for sm_90a include it; the device half exists only there.
#pragma once
#include <cuda.h>  // CUtensorMap and its enums; the encoder comes from the driver at run time
#include <cudaTypedefs.h>

#include "kernels/attention/common.cuh"

namespace lcx::ops::cuda::attn::hopper {

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void bar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
// One arrival that also announces `bytes` of TMA writes the phase waits for.
__device__ __forceinline__ void bar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// Waits until the phase of the given parity has completed.
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// A box of {64 columns, 1 head, 128 rows} of a [rows, heads, 128] tensor into dst.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int col, int head,
                                         int row) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(col), "r"(head), "r"(row)
      : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) of global memory into dst, counted on bar.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// wgmma's shared-memory matrix descriptor for a 128-byte swizzled operand: start address, the
// leading and stride byte offsets (units of 16 bytes), swizzle mode 1 (128 B) in bits 62-63.
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr, uint32_t lead_bytes, uint32_t stride_bytes) {
  return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t((lead_bytes >> 4) & 0x3FFF) << 16 |
         uint64_t((stride_bytes >> 4) & 0x3FFF) << 32 | uint64_t(1) << 62;
}

// The 32 accumulator registers of an m64n64 wgmma, as above.
#define LCX_WGMMA_ACC32_REGS \
  "%0, %1, %2, %3, %4, %5, %6, %7, " \
  "%8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31"
#define LCX_WGMMA_ACC32_OPERANDS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

#define LCX_WGMMA_ACC32_RESULTS(d) \
  "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), \
  "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), \
  "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), \
  "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])

// d[64 x 64] += a[64 x 16] b[16 x 64], both from shared memory; kTransA / kTransB 1 reads an
// operand MN-major (its M or N contiguous), 0 K-major.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_ss64(float (&d)[32], uint64_t a, uint64_t b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" LCX_WGMMA_ACC32_REGS
               "}, %32, %33, 1, 1, 1, %34, %35;\n"
               : LCX_WGMMA_ACC32_OPERANDS(d)
               : "l"(a), "l"(b), "n"(kTransA), "n"(kTransB));
}
// d = a b, the same product overwriting d: its old values are dead to the compiler, so a chain's
// first step frees the accumulator's registers until then.
template <int kTransA, int kTransB>
__device__ __forceinline__ void wgmma_ss64_init(float (&d)[32], uint64_t a, uint64_t b) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" LCX_WGMMA_ACC32_REGS
               "}, %32, %33, 0, 1, 1, %34, %35;\n"
               : LCX_WGMMA_ACC32_RESULTS(d)
               : "l"(a), "l"(b), "n"(kTransA), "n"(kTransB));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pins registers an asynchronous wgmma reads or writes: the compiler may neither move their uses
// across this point nor reuse them before it.
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// The 64 fp32 accumulator registers of an m64n128 wgmma: their place-holders in the asm string
// and the operands behind them.
#define LCX_WGMMA_ACC_REGS \
  "%0, %1, %2, %3, %4, %5, %6, %7, " \
  "%8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"
#define LCX_WGMMA_ACC_OPERANDS(d) \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d[64 x 128] (+)= a[64 x 16] b[16 x 128], both from shared memory; kTransA / kTransB 1 reads an
// operand MN-major (its M or N contiguous), 0 K-major (accumulate 0: d is overwritten).
template <int kTransA = 0, int kTransB = 0>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t a, uint64_t b, uint32_t accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" LCX_WGMMA_ACC_REGS "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
      : LCX_WGMMA_ACC_OPERANDS(d)
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

// d[64 x 128] += a[64 x 16] (registers, A fragment layout) b[16 x 128] (shared memory, MN-major).
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" LCX_WGMMA_ACC_REGS "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : LCX_WGMMA_ACC_OPERANDS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(1));
}

// d[64 x 128] += a[64 x 16 kSteps] (registers: the accumulator layout of a 64-row product, which
// is wgmma's A fragment layout, four registers a step) b[16 kSteps x 128] (shared memory, MN-major:
// rows of 128 bytes, 16 of them a step; its two 64-column halves `half_bytes` apart).
template <int kSteps>
__device__ __forceinline__ void wgmma_rs_steps(float (&d)[64], const uint32_t (&frag)[4 * kSteps], uint32_t b,
                                               uint32_t half_bytes) {
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) {
    const uint32_t a[4] = {frag[4 * kk], frag[4 * kk + 1], frag[4 * kk + 2], frag[4 * kk + 3]};
    wgmma_rs(d, a, sw128_desc(b + kk * 16 * 128, half_bytes, 1024));
  }
}

// 2^x on the special-function unit alone: results below 2^-126 flush to zero (a probability that
// small adds nothing a bf16 P can hold), which spares exp2f's denormal fix-up around every call.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// The driver's tensor-map encoder, looked up through the runtime: liblcx_core does not link libcuda,
// which machines without a GPU (and CI) lack.
inline PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult status{};
    LCX_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &status));
    if (!f || status != cudaDriverEntryPointSuccess) throw Error("the CUDA driver has no cuTensorMapEncodeTiled");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// A [rows, heads, 128] bf16 tensor as TMA sees it: boxes of 64 columns (128 bytes, the swizzle's
// span) of one head over box_rows rows, 128-byte swizzled, rows past the end read as zeros.
inline CUtensorMap tensor_map(const void* base, int64_t rows, int64_t heads, uint32_t box_rows) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {128, static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {256, static_cast<cuuint64_t>(heads) * 256};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {64, 1, box_rows};
  const cuuint32_t unit[3] = {1, 1, 1};
  const CUresult r = encoder()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims,
                                            strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) throw Error(str("cuTensorMapEncodeTiled failed (CUresult ", int(r), ")"));
  return map;
}

// Compute capability 9.0 on the current device: the only one sm_90a code runs on.
inline bool hopper_device() {
  static int cached[64] = {};  // 0 unknown, 1 yes, 2 no
  int dev = 0;
  LCX_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev >= 64) return false;
  if (!cached[dev]) {
    int major = 0, minor = 0;
    LCX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    LCX_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
    cached[dev] = major == 9 && minor == 0 ? 1 : 2;
  }
  return cached[dev] == 1;
}

}  // namespace lcx::ops::cuda::attn::hopper
