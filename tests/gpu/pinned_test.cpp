// The pinned host memory pool: buffers are cached and reused, views read and write the bytes,
// statistics and release work, and (with a GPU) a pinned buffer round-trips through the device.
#include <gtest/gtest.h>

#include <cstring>

#include "gpu/gpu_test_util.h"
#include "lcx/pinned.h"
#include "support/test_util.h"

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

// What the host can give: MemAvailable, or less where the process's cgroup (v2, else v1) leaves less.
TEST(Pinned, HostMemoryIsTheSmallerOfMemAvailableAndTheCgroupsRoom) {
  const std::filesystem::path dir = temp_dir("host-memory");
  const std::string meminfo = (dir / "meminfo").string(), v2 = (dir / "v2").string(), v1 = (dir / "v1").string();
  write_file(meminfo, "MemTotal:       131072000 kB\nMemFree:  1000 kB\nMemAvailable:   125829120 kB\n");
  const int64_t machine = 125829120LL * 1024;  // 120 GiB
  EXPECT_EQ(host_memory_available(meminfo, (dir / "none").string()), machine);

  write_file(dir / "v2" / "memory.max", "34359738368\n");      // 32 GiB
  write_file(dir / "v2" / "memory.current", "8589934592\n");   // 8 GiB used
  EXPECT_EQ(host_memory_available(meminfo, v2), 24LL << 30);
  write_file(dir / "v2" / "memory.max", "max\n");              // no limit
  EXPECT_EQ(host_memory_available(meminfo, v2), machine);
  write_file(dir / "v2" / "memory.max", "274877906944\n");     // a limit above the machine's memory
  EXPECT_EQ(host_memory_available(meminfo, v2), machine);
  write_file(dir / "v2" / "memory.current", "300000000000\n");  // over the limit: nothing left
  EXPECT_EQ(host_memory_available(meminfo, v2), 0);

  write_file(dir / "v1" / "memory" / "memory.limit_in_bytes", "17179869184\n");  // 16 GiB
  write_file(dir / "v1" / "memory" / "memory.usage_in_bytes", "1073741824\n");
  EXPECT_EQ(host_memory_available(meminfo, v1), 15LL << 30);
  write_file(dir / "v1" / "memory" / "memory.limit_in_bytes", "9223372036854771712\n");  // v1's "no limit"
  EXPECT_EQ(host_memory_available(meminfo, v1), machine);
  // Without /proc/meminfo the cgroup alone; with neither, unknown.
  write_file(dir / "v1" / "memory" / "memory.limit_in_bytes", "17179869184\n");
  EXPECT_EQ(host_memory_available((dir / "absent").string(), v1), 15LL << 30);
  EXPECT_EQ(host_memory_available((dir / "absent").string(), (dir / "none").string()), -1);
  std::filesystem::remove_all(dir);
}

// A pin the host cannot give is an error naming the amount and the fix, not a crash.
TEST(Pinned, AFailedPinNamesTheBytesAndTheFix) {
  // 1 EiB: past any host's address space, so it fails even where the kernel overcommits.
  const size_t huge = size_t{1} << 60;
  try {
    PinnedBuffer b = pinned_alloc(huge);
    FAIL() << "a 1 EiB buffer was pinned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot pin 1073741824.00 GiB (1152921504606846976 bytes) of host memory"),
              std::string::npos)
        << e.what();
    EXPECT_NE(e.fix().find("lower data.seq_len"), std::string::npos) << e.fix();
  }
  PinnedBuffer after = pinned_alloc(1 << 20);  // the pool still serves
  EXPECT_NE(after.data(), nullptr);
}

}  // namespace
}  // namespace lcx::test
