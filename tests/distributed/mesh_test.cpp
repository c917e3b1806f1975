// The dp x cp x sp mesh: refused up front when it does not match the world, and each axis's
// communicator holds exactly the ranks that differ along that axis, under either placement order.
#include <gtest/gtest.h>

#include <mutex>

#include "lcx/comm.h"

namespace lcx {
namespace {

TEST(Mesh, ValidationNamesTheKeysAndTheWorldSize) {
  EXPECT_NO_THROW(Mesh::validate({2, 2, 2}, 8));
  EXPECT_NO_THROW(Mesh::validate({1, 1, 1}, 1));
  try {
    Mesh::validate({1, 2, 3}, 4);
    FAIL() << "accepted 1 x 2 x 3 on 4 ranks";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("[distributed] dp x cp x sp = 1 x 2 x 3 = 6"), std::string::npos) << m;
    EXPECT_NE(m.find("world size is 4"), std::string::npos) << m;
    EXPECT_EQ(e.key(), "distributed.dp");
    EXPECT_NE(e.fix().find("product is 4"), std::string::npos) << e.fix();
  }
  try {
    Mesh::validate({1, 0, 4}, 4);
    FAIL() << "accepted cp = 0";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "distributed.cp");
  }
}

TEST(Mesh, RefusedBeforeAnySplit) {
  try {
    run_in_process(2, [](Communicator& c) { Mesh m(c, {1, 4, 1}); }, CommOptions{5});
    FAIL() << "accepted cp = 4 on 2 ranks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("world size is 2"), std::string::npos) << e.what();
  }
}

// What each rank's coordinates and axis communicators hold; members are world ranks in axis order.
struct Seen {
  MeshCoord coord;
  int seq_rank = -1;
  std::vector<float> dp, cp, sp, seq;
};

std::vector<Seen> seen_on(const MeshShape& shape) {
  const int n = shape.dp * shape.cp * shape.sp;
  std::mutex mu;
  std::vector<Seen> seen(static_cast<size_t>(n));
  run_in_process(n, [&](Communicator& c) {
    Mesh mesh(c, shape);
    auto members = [&](Communicator& axis) {
      Tensor in = Tensor::from_floats({static_cast<float>(c.rank())}, {1}, DType::f32);
      Tensor out = Tensor::zeros({axis.size()}, DType::f32);
      axis.all_gather(in, out);
      return out.to_floats();
    };
    Seen s{mesh.coord(), mesh.seq().rank(), members(mesh.dp()), members(mesh.cp()), members(mesh.sp()),
           members(mesh.seq())};
    std::lock_guard lock(mu);
    seen[static_cast<size_t>(c.rank())] = s;
  }, CommOptions{20});
  return seen;
}

TEST(Mesh, AxesHoldTheRanksAlongThem) {
  const std::vector<Seen> seen = seen_on({2, 2, 2});
  for (int r = 0; r < 8; ++r) {
    const auto& s = seen[static_cast<size_t>(r)];
    const int d = r / 4, cc = (r / 2) % 2, sp = r % 2;
    EXPECT_EQ(s.coord.dp, d);
    EXPECT_EQ(s.coord.cp, cc);
    EXPECT_EQ(s.coord.sp, sp);
    auto at = [&](int dd, int c2, int s2) { return static_cast<float>((dd * 2 + c2) * 2 + s2); };
    EXPECT_EQ(s.dp, (std::vector<float>{at(0, cc, sp), at(1, cc, sp)})) << r;
    EXPECT_EQ(s.cp, (std::vector<float>{at(d, 0, sp), at(d, 1, sp)})) << r;
    EXPECT_EQ(s.sp, (std::vector<float>{at(d, cc, 0), at(d, cc, 1)})) << r;
    EXPECT_EQ(s.seq, (std::vector<float>{at(d, 0, 0), at(d, 0, 1), at(d, 1, 0), at(d, 1, 1)})) << r;
    EXPECT_EQ(s.seq_rank, r % 4) << r;
  }
}

// [distributed] order = "cp_inner": world rank = (dp * sp + sp_index) * cp + cp_index. On dp 2 x
// cp 2 x sp 3, ranks 0-1 are one ring and each sp group takes every other rank of its dp half; the
// sequence's communicator still ranks its members by their shards (cp_index * sp + sp_index).
TEST(Mesh, CpInnerPutsEachRingOnNeighbouringRanks) {
  const std::vector<Seen> seen = seen_on({.dp = 2, .cp = 2, .sp = 3, .order = MeshOrder::cp_inner});
  // Written out for two ranks, then the rule for all twelve.
  EXPECT_EQ(seen[0].cp, (std::vector<float>{0, 1}));
  EXPECT_EQ(seen[0].sp, (std::vector<float>{0, 2, 4}));
  EXPECT_EQ(seen[0].dp, (std::vector<float>{0, 6}));
  EXPECT_EQ(seen[0].seq, (std::vector<float>{0, 2, 4, 1, 3, 5}));
  EXPECT_EQ(seen[9].coord.dp, 1);
  EXPECT_EQ(seen[9].coord.cp, 1);
  EXPECT_EQ(seen[9].coord.sp, 1);
  EXPECT_EQ(seen[9].cp, (std::vector<float>{8, 9}));
  EXPECT_EQ(seen[9].sp, (std::vector<float>{7, 9, 11}));
  EXPECT_EQ(seen[9].seq_rank, 4);
  for (int r = 0; r < 12; ++r) {
    const Seen& s = seen[static_cast<size_t>(r)];
    const int d = r / 6, sp = (r / 2) % 3, cc = r % 2;
    EXPECT_EQ(s.coord.dp, d) << r;
    EXPECT_EQ(s.coord.cp, cc) << r;
    EXPECT_EQ(s.coord.sp, sp) << r;
    auto at = [&](int dd, int c2, int s2) { return static_cast<float>((dd * 3 + s2) * 2 + c2); };
    EXPECT_EQ(s.dp, (std::vector<float>{at(0, cc, sp), at(1, cc, sp)})) << r;
    EXPECT_EQ(s.cp, (std::vector<float>{at(d, 0, sp), at(d, 1, sp)})) << r;
    EXPECT_EQ(s.sp, (std::vector<float>{at(d, cc, 0), at(d, cc, 1), at(d, cc, 2)})) << r;
    EXPECT_EQ(s.seq, (std::vector<float>{at(d, 0, 0), at(d, 0, 1), at(d, 0, 2), at(d, 1, 0), at(d, 1, 1), at(d, 1, 2)}))
        << r;
    EXPECT_EQ(s.seq_rank, cc * 3 + sp) << r;
  }
}

}  // namespace
}  // namespace lcx
