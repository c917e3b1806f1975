// The pinned host memory pool: buffers are cached and reused, views read and write the bytes,
// statistics and release work, and (with a GPU) a pinned buffer round-trips through the device.
#include <gtest/gtest.h>

#include <cstring>

#include "gpu/gpu_test_util.h"
#include "lcx/pinned.h"

namespace lcx::test {
namespace {

TEST(Pinned, BuffersAreCachedAndReused) {
  release_cached_pinned();
  void* first;
  {
    PinnedBuffer b = pinned_alloc(3 << 20);
    first = b.data();
    ASSERT_NE(first, nullptr);
    std::memset(b.data(), 0x5a, b.bytes());
  }
  const int64_t held = pinned_allocator().stats().reserved_bytes;
  EXPECT_GE(held, 3 << 20);
  PinnedBuffer again = pinned_alloc((3 << 20) - 100);  // fits the cached block
  EXPECT_EQ(again.data(), first);
  EXPECT_EQ(pinned_allocator().stats().reserved_bytes, held);
  PinnedBuffer small = pinned_alloc(1 << 20);  // less than half of it: a new block
  EXPECT_NE(small.data(), first);
}

TEST(Pinned, StatisticsMovesAndRelease) {
  release_cached_pinned();
  const AllocatorStats before = pinned_allocator().stats();
  PinnedBuffer a = pinned_alloc(1000, MemoryCategory::activations);
  EXPECT_EQ(pinned_allocator().stats().live_bytes - before.live_bytes, 1000);
  PinnedBuffer b = std::move(a);
  EXPECT_EQ(a.data(), nullptr);
  EXPECT_EQ(b.bytes(), 1000u);
  b = PinnedBuffer();
  EXPECT_EQ(pinned_allocator().stats().live_bytes, before.live_bytes);
  EXPECT_GE(release_cached_pinned(), 1000u);
  EXPECT_EQ(pinned_allocator().stats().reserved_bytes, before.reserved_bytes);
}

TEST(Pinned, ViewsAndDeviceRoundTrip) {
  PinnedBuffer buf = pinned_alloc(64 * 4);
  Tensor v = buf.view({8, 8}, DType::f32);
  for (int i = 0; i < 64; ++i) v.data_as<float>()[i] = static_cast<float>(i) - 7.5f;
  EXPECT_THROW(buf.view({65}, DType::f32), Error);
  if (!cuda_available()) return;
  EXPECT_TRUE(pinned_is_page_locked());
  Tensor g = v.to(Device::cuda());
  PinnedBuffer back = pinned_alloc(64 * 4);
  Tensor w = back.view({8, 8}, DType::f32);
  w.copy_from(g);
  EXPECT_EQ(w.to_floats(), v.to_floats());
}

}  // namespace
}  // namespace lcx::test
