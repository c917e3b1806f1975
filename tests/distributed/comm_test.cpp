// The in-process communicator on CPU tensors: every collective on 1, 2 and 4 thread-ranks equals
// the serial result bit for bit; timeouts name the ranks that never came; a rank that throws
// fails the others with its message; mismatched calls are refused.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "distributed/comm_cases.h"

namespace lcx {
namespace {

using test::on_ranks;

class CommWorld : public ::testing::TestWithParam<int> {};

TEST_P(CommWorld, AllReduceFp32) { test::check_all_reduce(GetParam(), DType::f32, Device::cpu()); }
TEST_P(CommWorld, AllReduceBf16) { test::check_all_reduce(GetParam(), DType::bf16, Device::cpu()); }
TEST_P(CommWorld, ReduceScatter) {
  test::check_reduce_scatter(GetParam(), DType::f32, Device::cpu());
  test::check_reduce_scatter(GetParam(), DType::bf16, Device::cpu());
}
TEST_P(CommWorld, AllGather) {
  test::check_all_gather(GetParam(), DType::f32, Device::cpu());
  test::check_all_gather(GetParam(), DType::bf16, Device::cpu());
}
TEST_P(CommWorld, AllToAll) { test::check_all_to_all(GetParam(), DType::bf16, Device::cpu()); }
TEST_P(CommWorld, RingSendRecv) { test::check_ring(GetParam(), DType::f32, Device::cpu(), false); }
TEST_P(CommWorld, RingSendRecvAsync) { test::check_ring(GetParam(), DType::bf16, Device::cpu(), true); }

TEST_P(CommWorld, AllReduceIntegersAndHostScalars) {
  const int world = GetParam();
  std::atomic<int> checked{0};
  on_ranks(world, [&](Communicator& c) {
    // Beyond fp32's exact range: integers must not pass through floats.
    Tensor t = Tensor::empty({2}, DType::i64);
    t.data_as<int64_t>()[0] = (int64_t{1} << 40) + c.rank();
    t.data_as<int64_t>()[1] = -c.rank();
    c.all_reduce(t);
    double h[2] = {0.1 * (c.rank() + 1), 1e-17};
    c.all_reduce(std::span<double>(h, 2));
    int64_t sum_r = world * (world - 1) / 2;
    if (t.data_as<int64_t>()[0] == world * (int64_t{1} << 40) + sum_r && t.data_as<int64_t>()[1] == -sum_r) {
      double want = 0;
      for (int r = 0; r < world; ++r) want += 0.1 * (r + 1);
      if (h[0] == want && h[1] == world * 1e-17) ++checked;
    }
  });
  EXPECT_EQ(checked.load(), world);
}

TEST_P(CommWorld, SplitFormsGroupsByColorOrderedByKey) {
  const int world = GetParam();
  std::mutex mu;
  std::vector<std::vector<float>> got(static_cast<size_t>(world));
  std::vector<std::pair<int, int>> ranks(static_cast<size_t>(world));
  on_ranks(world, [&](Communicator& c) {
    // Even and odd ranks, each group in reverse order of world rank.
    auto sub = c.split(c.rank() % 2, -c.rank(), "parity");
    Tensor in = Tensor::from_floats({static_cast<float>(c.rank())}, {1}, DType::f32);
    Tensor out = Tensor::zeros({sub->size()}, DType::f32);
    sub->all_gather(in, out);
    c.barrier();
    std::lock_guard lock(mu);
    got[static_cast<size_t>(c.rank())] = out.to_floats();
    ranks[static_cast<size_t>(c.rank())] = {sub->rank(), sub->size()};
    EXPECT_EQ(sub->name(), "parity");
  });
  for (int r = 0; r < world; ++r) {
    std::vector<float> want;
    for (int q = world - 1; q >= 0; --q)
      if (q % 2 == r % 2) want.push_back(static_cast<float>(q));
    EXPECT_EQ(got[static_cast<size_t>(r)], want) << "rank " << r;
    EXPECT_EQ(ranks[static_cast<size_t>(r)].second, static_cast<int>(want.size()));
    EXPECT_EQ(want[static_cast<size_t>(ranks[static_cast<size_t>(r)].first)], static_cast<float>(r));
  }
}

TEST_P(CommWorld, AsyncCollectivesCompleteInIssueOrder) {
  const int world = GetParam();
  std::atomic<int> checked{0};
  on_ranks(world, [&](Communicator& c) {
    Tensor part = Tensor::from_floats(test::rank_values(c.rank(), 8), {8}, DType::f32);
    Tensor gathered = Tensor::zeros({8 * world}, DType::f32);
    Tensor grads = Tensor::from_floats(test::rank_values(c.rank(), 4 * world), {4 * world}, DType::f32);
    Tensor block = Tensor::zeros({4}, DType::f32);
    auto g = c.all_gather_async(part, gathered);
    auto r = c.reduce_scatter_async(grads, block);
    Tensor t = Tensor::from_floats(test::rank_values(c.rank(), 5), {5}, DType::f32);
    c.all_reduce(t);  // a blocking call issued after both
    r->wait();
    g->wait();
    std::vector<float> want;
    for (int q = 0; q < world; ++q) {
      auto v = test::rank_values(q, 8);
      want.insert(want.end(), v.begin(), v.end());
    }
    if (gathered.to_floats() == want && block.to_floats() == test::serial_sum(world, 4 * world, DType::f32, 4 * c.rank(), 4) &&
        t.to_floats() == test::serial_sum(world, 5, DType::f32))
      ++checked;
  });
  EXPECT_EQ(checked.load(), world);
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommWorld, ::testing::Values(1, 2, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

std::string failure_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(CommFailure, MissingRanksTimeOutNamingThem) {
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg = failure_of([] {
    on_ranks(4, [](Communicator& c) {
      Tensor t = Tensor::zeros({4}, DType::f32);
      c.all_reduce(t);  // call #1: everyone
      if (c.rank() == 1 || c.rank() == 3) return;  // ranks 1 and 3 skip call #2
      c.all_reduce(t);
    }, 0.3);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(msg.find("all_reduce #2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("communicator 'world'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ranks missing: 1, 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("timed out after 0.3 s"), std::string::npos) << msg;
  EXPECT_LT(s, 5.0);
}

TEST(CommFailure, MissingSenderTimesOutNamingIt) {
  std::string msg = failure_of([] {
    on_ranks(3, [](Communicator& c) {
      Tensor t = Tensor::zeros({4}, DType::f32);
      if (c.rank() == 0) c.send_recv({P2POp::recv(t, 2), P2POp::recv(Tensor::zeros({4}, DType::f32), 1)});
      if (c.rank() == 1) c.send_recv({P2POp::send(t, 0)});
    }, 0.3);
  });
  EXPECT_NE(msg.find("send_recv #1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ranks missing: 2"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("ranks missing: 2, 1"), std::string::npos) << msg;
}

TEST(CommFailure, SubgroupTimeoutNamesWorldRanks) {
  std::string msg = failure_of([] {
    on_ranks(4, [](Communicator& c) {
      auto sub = c.split(c.rank() / 2, c.rank(), "cp");
      if (c.rank() == 3) return;
      sub->barrier();
    }, 0.3);
  });
  EXPECT_NE(msg.find("barrier #1 on communicator 'cp'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ranks missing: 1 (world rank 3)"), std::string::npos) << msg;
}

TEST(CommFailure, ThrowingRankFailsTheOthersPromptly) {
  std::atomic<int> secondary{0};
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg = failure_of([&] {
    on_ranks(4, [&](Communicator& c) {
      Tensor t = Tensor::zeros({8}, DType::f32);
      c.all_reduce(t);
      if (c.rank() == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others are waiting by now
        throw Error("out of memory in layer 7", "train.seq_len", "shorten the sequence");
      }
      try {
        c.all_reduce(t);
      } catch (const Error& e) {
        if (std::string(e.what()) == "rank 2 failed: out of memory in layer 7") ++secondary;
        throw;
      }
    }, 60);  // far beyond the test's bound: only the abort can end it in time
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(msg, "rank 2 failed: out of memory in layer 7");
  EXPECT_EQ(secondary.load(), 3);
  EXPECT_LT(s, 5.0);
  try {
    on_ranks(2, [](Communicator& c) {
      if (c.rank() == 1) throw Error("bad", "train.lr", "lower it");
      c.barrier();
    });
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "train.lr");
    EXPECT_EQ(e.fix(), "lower it");
  }
}

TEST(CommFailure, AbortWakesPendingReceives) {
  std::string msg = failure_of([] {
    on_ranks(2, [](Communicator& c) {
      if (c.rank() == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        c.abort("disk full");
        return;
      }
      c.send_recv({P2POp::recv(Tensor::zeros({1}, DType::f32), 0)});
    }, 60);
  });
  EXPECT_EQ(msg, "rank 0 failed: disk full");
}

TEST(CommFailure, MismatchedCallsAreRefused) {
  std::string msg = failure_of([] {
    on_ranks(2, [](Communicator& c) {
      Tensor t = Tensor::zeros({4}, DType::f32);
      if (c.rank() == 0)
        c.all_reduce(t);
      else
        c.barrier();
    }, 2);
  });
  EXPECT_NE(msg.find("as call #1"), std::string::npos) << msg;
  msg = failure_of([] {
    on_ranks(2, [](Communicator& c) {
      Tensor t = Tensor::zeros({4 + c.rank()}, DType::f32);
      c.all_reduce(t);
    }, 2);
  });
  EXPECT_NE(msg.find("rank 0 passed 4 fp32 elements, rank 1 5"), std::string::npos) << msg;
  msg = failure_of([] {
    on_ranks(2, [](Communicator& c) {
      Tensor out = Tensor::zeros({3}, DType::f32);
      c.all_gather(Tensor::zeros({2}, DType::f32), out);
    }, 2);
  });
  EXPECT_NE(msg.find("out.numel() == size() * in.numel()"), std::string::npos) << msg;
}

}  // namespace
}  // namespace lcx
