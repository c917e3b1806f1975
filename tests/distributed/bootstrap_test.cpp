// The bootstrap that hands rank 0's NCCL id to every rank, over TCP and through a file, with a
// clear error when rank 0 never answers.
#include <gtest/gtest.h>

#include <filesystem>
#include <mutex>
#include <thread>

#include "distributed/bootstrap.h"
#include "lcx/error.h"
#include "support/test_util.h"

namespace lcx {
namespace {


void broadcast_on_threads(int world, DistEnv base) {
  const std::string id(128, '\0');
  std::string payload = id;
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 7 + 3);
  std::mutex mu;
  std::vector<std::string> got(static_cast<size_t>(world));
  std::vector<std::thread> ts;
  for (int r = world - 1; r >= 0; --r)  // clients first: they must wait for rank 0
    ts.emplace_back([&, r] {
      DistEnv e = base;
      e.rank = r;
      e.world_size = world;
      std::string v = bootstrap_broadcast(e, r == 0 ? payload : std::string(), payload.size(), 10);
      std::lock_guard lock(mu);
      got[static_cast<size_t>(r)] = v;
    });
  for (auto& t : ts) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(got[static_cast<size_t>(r)], payload) << "rank " << r;
}

TEST(Bootstrap, TcpHandsRankZerosBytesToEveryRank) {
  DistEnv e;
  e.master_addr = "127.0.0.1";
  e.master_port = free_local_port();
  broadcast_on_threads(4, e);
  e.master_addr = "localhost";
  e.master_port = free_local_port();
  broadcast_on_threads(2, e);
}

TEST(Bootstrap, FileHandsRankZerosBytesToEveryRank) {
  auto dir = test::temp_dir("bootstrap");
  DistEnv e;
  e.bootstrap_file = (dir / "nccl_id").string();
  broadcast_on_threads(3, e);
  std::filesystem::remove_all(dir);
}

TEST(Bootstrap, MissingRankZeroTimesOut) {
  DistEnv e;
  e.rank = 1;
  e.world_size = 2;
  e.master_port = free_local_port();
  try {
    bootstrap_broadcast(e, {}, 16, 0.3);
    FAIL() << "no error without rank 0";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("rank 1 could not get the id from rank 0 at 127.0.0.1:"), std::string::npos)
        << err.what();
    EXPECT_EQ(err.key(), "MASTER_ADDR");
  }
}

}  // namespace
}  // namespace lcx
