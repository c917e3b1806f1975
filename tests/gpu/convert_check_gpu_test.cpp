// The weight loader's convert-and-check on the GPU against its CPU twin (kernels/convert_check.h),
// bit for bit: every stored encoding into every float dtype over raw bit patterns (NaNs with
// payloads, infinities, subnormals, halfway cases), the same first non-finite element, ranges
// that start mid-tensor; then a whole sharded checkpoint loaded onto the GPU against the same load
// on the host, and a NaN refused by name there.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "gpu/gpu_test_util.h"
#include "kernels/convert_check.h"
#include "lcx/safetensors.h"
#ifdef LCX_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace lcx::test {
namespace {

namespace st = safetensors;
using ops::StoredFloat;

const DType kFloats[] = {DType::f32, DType::bf16, DType::f16};

size_t stored_bytes(StoredFloat f) {
  switch (f) {
    case StoredFloat::f64: return 8;
    case StoredFloat::f32: return 4;
    default: return 2;
  }
}

// n values of `f` as raw bytes: random bit patterns (every class of value) mixed with ordinary
// numbers, so both the special cases and the rounding are exercised.
std::vector<uint8_t> raw_values(StoredFloat f, int64_t n, std::mt19937& rng) {
  const size_t es = stored_bytes(f);
  std::vector<uint8_t> out(static_cast<size_t>(n) * es);
  std::normal_distribution<double> normal(0, 100);
  for (int64_t i = 0; i < n; ++i) {
    uint8_t* p = out.data() + static_cast<size_t>(i) * es;
    if (i % 3 == 0) {
      for (size_t b = 0; b < es; ++b) p[b] = static_cast<uint8_t>(rng());
      continue;
    }
    const double v = normal(rng);
    if (f == StoredFloat::f64) std::memcpy(p, &v, 8);
    if (f == StoredFloat::f32) {
      const float x = static_cast<float>(v);
      std::memcpy(p, &x, 4);
    }
    if (f == StoredFloat::f16) {
      const f16 x = float_to_f16(static_cast<float>(v));
      std::memcpy(p, &x, 2);
    }
    if (f == StoredFloat::bf16) {
      const bf16 x = float_to_bf16(static_cast<float>(v));
      std::memcpy(p, &x, 2);
    }
  }
  return out;
}

TEST(ConvertCheckGpu, MatchesCpuBitForBit) {
  LCX_SKIP_WITHOUT_GPU();
#ifdef LCX_HAVE_CUDA
  const uint32_t seed = fresh_seed();
  SCOPED_TRACE(str("seed ", seed));
  std::mt19937 rng(seed);
  const int64_t n = 10007;  // not a multiple of any vector width
  for (StoredFloat from : {StoredFloat::f64, StoredFloat::f32, StoredFloat::f16, StoredFloat::bf16}) {
    const std::vector<uint8_t> raw = raw_values(from, n, rng);
    for (DType to : kFloats) {
      for (int64_t offset : {int64_t{0}, int64_t{3}}) {  // a range that starts mid-tensor, unaligned
        SCOPED_TRACE(str("from ", static_cast<int>(from), " to ", dtype_name(to), " offset ", offset));
        const int64_t count = n - offset;
        const uint8_t* src = raw.data() + static_cast<size_t>(offset) * stored_bytes(from);
        std::vector<uint8_t> want(static_cast<size_t>(count) * dtype_size(to));
        const int64_t want_bad = ops::cpu::convert_check(src, from, want.data(), to, count, true);
        ASSERT_GE(want_bad, 0) << "random bit patterns hold non-finite values";

        void *d_src = nullptr, *d_dst = nullptr;
        unsigned long long* d_bad = nullptr;
        ASSERT_EQ(cudaMalloc(&d_src, raw.size()), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_dst, want.size()), cudaSuccess);
        ASSERT_EQ(cudaMalloc(&d_bad, sizeof(unsigned long long)), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(d_src, src, static_cast<size_t>(count) * stored_bytes(from), cudaMemcpyHostToDevice), cudaSuccess);
        ASSERT_EQ(cudaMemset(d_bad, 0xff, sizeof(unsigned long long)), cudaSuccess);
        const bool same = (from == StoredFloat::f32 && to == DType::f32) || (from == StoredFloat::bf16 && to == DType::bf16) ||
                          (from == StoredFloat::f16 && to == DType::f16);
        if (same) {  // the loader's case: copied as is, then checked in place
          ASSERT_EQ(cudaMemcpy(d_dst, d_src, want.size(), cudaMemcpyDeviceToDevice), cudaSuccess);
          ops::cuda::convert_check(d_dst, from, d_dst, to, count, 1000, d_bad);
        } else {
          ops::cuda::convert_check(d_src, from, d_dst, to, count, 1000, d_bad);
        }
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        std::vector<uint8_t> got(want.size());
        unsigned long long bad = 0;
        ASSERT_EQ(cudaMemcpy(got.data(), d_dst, got.size(), cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(&bad, d_bad, sizeof bad, cudaMemcpyDeviceToHost), cudaSuccess);
        cudaFree(d_src);
        cudaFree(d_dst);
        cudaFree(d_bad);
        EXPECT_EQ(got, want);
        EXPECT_EQ(bad, static_cast<unsigned long long>(1000 + want_bad));
      }
    }
  }
#endif
}

TEST(ConvertCheckGpu, CheckpointOnTheGpuEqualsTheHostLoad) {
  LCX_SKIP_WITHOUT_GPU();
  std::mt19937 rng(fresh_seed());
  std::vector<st::NamedTensor> ts;
  for (int k = 0; k < 5; ++k)
    ts.push_back({"w" + std::to_string(k), host_normal({37 + k, 129}, DType::f32, rng)});
  for (DType stored : kFloats) {
    auto dir = temp_dir(str("st-gpu-", dtype_name(stored)));
    st::write_checkpoint(dir.string(), ts, stored, 30000);
    st::Checkpoint ck = st::Checkpoint::open(dir.string());
    for (DType to : kFloats) {
      SCOPED_TRACE(str(dtype_name(stored), " -> ", dtype_name(to)));
      std::vector<st::LoadTarget> host, gpu;
      for (const auto& t : ts) {
        host.push_back({t.name, Tensor::empty(t.value.shape(), to)});
        gpu.push_back({t.name, Tensor::empty(t.value.shape(), to, Device::cuda())});
      }
      st::LoadOptions o;
      o.check_finite = true;
      o.piece_bytes = 1024;  // many pieces per tensor, over several readers
      o.threads = 4;
      ck.load_into(host, o);
      ck.load_into(gpu, o);
      for (size_t k = 0; k < ts.size(); ++k) {
        const Tensor back = gpu[k].dst.to(Device::cpu());
        EXPECT_EQ(std::memcmp(back.data(), host[k].dst.data(), back.nbytes()), 0) << ts[k].name;
      }
    }
  }
  ts[3].value.data_as<float>()[1234] = NAN;
  auto dir = temp_dir("st-gpu-nan");
  st::write_checkpoint(dir.string(), ts, DType::bf16, 30000);
  st::Checkpoint ck = st::Checkpoint::open(dir.string());
  for (DType to : kFloats) {
    std::vector<st::LoadTarget> gpu;
    for (const auto& t : ts) gpu.push_back({t.name, Tensor::empty(t.value.shape(), to, Device::cuda())});
    st::LoadOptions o;
    o.check_finite = true;
    o.piece_bytes = 1024;
    const std::string e = error_of([&] { ck.load_into(gpu, o); });
    EXPECT_NE(e.find(ck.file_of("w3")), std::string::npos) << e;
    EXPECT_NE(e.find("tensor 'w3': element 1234 is nan"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace lcx::test
