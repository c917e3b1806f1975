// The dp x cp x sp mesh: refused up front when it does not match the world, and each axis's
// communicator holds exactly the ranks that differ along that axis.
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

TEST(Mesh, AxesHoldTheRanksAlongThem) {
  const MeshShape shape{2, 2, 2};
  std::mutex mu;
  struct Seen {
    MeshCoord coord;
    std::vector<float> dp, cp, sp, seq;
  };
  std::vector<Seen> seen(8);
  run_in_process(8, [&](Communicator& c) {
    Mesh mesh(c, shape);
    auto members = [&](Communicator& axis) {
      Tensor in = Tensor::from_floats({static_cast<float>(c.rank())}, {1}, DType::f32);
      Tensor out = Tensor::zeros({axis.size()}, DType::f32);
      axis.all_gather(in, out);
      return out.to_floats();
    };
    Seen s{mesh.coord(), members(mesh.dp()), members(mesh.cp()), members(mesh.sp()), members(mesh.seq())};
    std::lock_guard lock(mu);
    seen[static_cast<size_t>(c.rank())] = s;
  }, CommOptions{20});
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
  }
}

}  // namespace
}  // namespace lcx
