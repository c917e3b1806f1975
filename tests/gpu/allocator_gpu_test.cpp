// The CUDA caching allocator: statistics, the recorder, reuse of cached blocks, release of the
// cache, a clean out-of-memory error, and the point of expandable segments: with the cache full
// of freed holes, one tensor larger than any hole but within free physical memory still fits.
#include <gtest/gtest.h>

#include <random>
#include <thread>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "lcx/memory.h"
#include "lcx/ops.h"

#ifdef LCX_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/caching_allocator.h"
#endif

namespace lcx::test {
namespace {

#ifdef LCX_HAVE_CUDA
size_t device_total() {
  size_t free_b = 0, total_b = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  return total_b;
}
#endif

class GpuAllocator : public ::testing::Test {
 protected:
  void SetUp() override { LCX_SKIP_WITHOUT_GPU(); }
  Allocator& alloc() { return allocator_for(Device::cuda()); }
};

TEST_F(GpuAllocator, StatisticsFollowLiveTensors) {
  const AllocatorStats before = alloc().stats();
  {
    Tensor a = Tensor::empty({1000, 1000}, DType::f32, Device::cuda(), MemoryCategory::weights);
    Tensor b = Tensor::empty({333}, DType::bf16, Device::cuda(), MemoryCategory::transient);
    const AllocatorStats s = alloc().stats();
    EXPECT_EQ(s.live_bytes - before.live_bytes, 4000000 + 666);
    EXPECT_EQ(s.live_by_category[static_cast<int>(MemoryCategory::weights)] -
                  before.live_by_category[static_cast<int>(MemoryCategory::weights)],
              4000000);
    EXPECT_GE(s.reserved_bytes, s.live_bytes);
    EXPECT_GE(s.peak_bytes, s.live_bytes);
    EXPECT_EQ(s.allocations - before.allocations, 2);
  }
  const AllocatorStats after = alloc().stats();
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(after.frees - before.frees, 2);
}

TEST_F(GpuAllocator, RecorderSeesEveryAllocationWithItsTag) {
  alloc().recorder().clear();
  alloc().recorder().enable(true);
  alloc().recorder().set_tag("layer 3");
  { Tensor a = Tensor::empty({4096}, DType::f32, Device::cuda(), MemoryCategory::activations); }
  alloc().recorder().enable(false);
  const auto events = alloc().recorder().events();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].delta, 16384);
  EXPECT_EQ(events[1].delta, -16384);
  EXPECT_EQ(events[0].address, events[1].address);
  EXPECT_EQ(events[0].tag, "layer 3");
  EXPECT_EQ(events[0].category, MemoryCategory::activations);
  alloc().recorder().clear();
}

TEST_F(GpuAllocator, FreedBlocksAreReusedFromTheCache) {
  std::mt19937 rng(fresh_seed());
  { Tensor warm = Tensor::empty({16 << 20}, DType::f32, Device::cuda()); }
  const int64_t reserved = alloc().stats().reserved_bytes;
  for (int i = 0; i < 3; ++i) {
    const Tensor host = host_normal({16 << 20}, DType::f32, rng);
    Tensor t = on_gpu(host);
    EXPECT_EQ(alloc().stats().reserved_bytes, reserved) << "round " << i << " mapped new memory";
    EXPECT_EQ(rel_l2(t, host), 0.0);
  }
}

TEST_F(GpuAllocator, OddSizesAndManyThreadsKeepTheBooks) {
  const AllocatorStats before = alloc().stats();
  std::vector<std::thread> pool;
  for (int w = 0; w < 4; ++w)
    pool.emplace_back([w] {
      std::mt19937 rng(w);
      std::uniform_int_distribution<int64_t> size(1, 3 << 20);
      std::vector<Tensor> keep;
      for (int i = 0; i < 200; ++i) {
        keep.push_back(Tensor::empty({size(rng)}, DType::bf16, Device::cuda()));
        if (i % 3 == 0) keep.erase(keep.begin() + static_cast<int64_t>(rng() % keep.size()));
      }
    });
  for (auto& t : pool) t.join();
  const AllocatorStats after = alloc().stats();
  EXPECT_EQ(after.live_bytes, before.live_bytes);
  EXPECT_EQ(after.allocations - before.allocations, after.frees - before.frees);
}

#ifdef LCX_HAVE_CUDA
TEST_F(GpuAllocator, ReleaseGivesCachedMemoryBack) {
  { Tensor a = Tensor::empty({256 << 20}, DType::f32, Device::cuda()); }
  const int64_t cached = alloc().stats().reserved_bytes;
  const size_t released = cuda::release_cached(0);
  EXPECT_GE(released, (size_t{1} << 30) - (size_t{4} << 20));  // less the pages shared with neighbours
  EXPECT_EQ(alloc().stats().reserved_bytes, cached - static_cast<int64_t>(released));
}

TEST_F(GpuAllocator, OutOfMemoryIsAnErrorAndLeavesTheAllocatorUsable) {
  // Within the reserved address range, beyond the physical memory.
  const int64_t too_much = static_cast<int64_t>(device_total()) * 3 / 2 / 4;
  try {
    Tensor t = Tensor::empty({too_much}, DType::i32, Device::cuda());
    ADD_FAILURE() << "allocating " << too_much * 4 << " bytes succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("GPU out of memory"), std::string::npos) << e.what();
  }
  Tensor ok = Tensor::zeros({1 << 20}, DType::f32, Device::cuda());
  EXPECT_EQ(ok.to_floats()[12345], 0.f);
}

// Holes of 1/40 of the device are left cached between live blocks; then one tensor of 55% of the
// device is asked for. No hole fits it and live + cached + new exceeds the device, so it fits only
// because the allocator unmaps the cached holes and maps their memory under a new address range.
TEST_F(GpuAllocator, LargeTensorFitsDespiteFragmentedCache) {
  cuda::release_cached(0);
  const size_t total = device_total();
  const int64_t hole = static_cast<int64_t>(total / 40 / 4);  // fp32 elements
  std::vector<Tensor> blocks;
  for (int i = 0; i < 20; ++i) blocks.push_back(Tensor::empty({hole}, DType::f32, Device::cuda()));
  for (size_t i = 0; i < blocks.size(); i += 2) blocks[i] = Tensor();  // 10 holes stay mapped
  const int64_t cached_before = alloc().stats().reserved_bytes - alloc().stats().live_bytes;
  EXPECT_GE(cached_before, 10 * hole * 4 - (64 << 20));

  const int64_t rows = static_cast<int64_t>(total * 55 / 100 / 4 / 1024);
  Tensor big = Tensor::empty({rows, 1024}, DType::f32, Device::cuda());
  const AllocatorStats s = alloc().stats();
  EXPECT_LE(s.reserved_bytes, static_cast<int64_t>(total));
  // The whole range is usable: fill it, scale it, read back both ends.
  big.zero();
  Tensor ones = Tensor::from_floats(std::vector<float>(1024, 1.f), {1, 1024}, DType::f32);
  big.rows(0, 1).copy_from(ones);
  big.rows(rows - 1, rows).copy_from(ones);
  ops::scale_inplace(big, 3.f);
  EXPECT_EQ(big.rows(0, 1).to_floats()[7], 3.f);
  EXPECT_EQ(big.rows(rows - 1, rows).to_floats()[1023], 3.f);
  EXPECT_EQ(big.rows(rows / 2, rows / 2 + 1).to_floats()[0], 0.f);
}
#endif

}  // namespace
}  // namespace lcx::test
