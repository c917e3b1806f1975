// Collective cases shared by the CPU suite and the virtual-rank GPU suite: each rank's data is a
// function of (rank, index), and every result is checked against the serial computation.
#pragma once
#include <gtest/gtest.h>

#include <mutex>
#include <vector>

#include "distributed/rank_data.h"
#include "lcx/comm.h"

namespace lcx::test {

// Runs fn on `world` ranks and records each rank's failures (gtest assertions are per thread).
inline void on_ranks(int world, const std::function<void(Communicator&)>& fn, double timeout_s = 20) {
  run_in_process(world, fn, CommOptions{timeout_s});
}

inline void check_all_reduce(int world, DType dt, Device dev) {
  const int64_t n = 1000;
  std::vector<float> want = serial_sum(world, n, dt);
  std::mutex mu;
  std::vector<std::vector<float>> got(static_cast<size_t>(world));
  on_ranks(world, [&](Communicator& c) {
    Tensor t = Tensor::from_floats(rank_values(c.rank(), n), {10, 100}, dt, dev);
    c.all_reduce(t);
    std::lock_guard lock(mu);
    got[static_cast<size_t>(c.rank())] = t.to_floats();
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(got[static_cast<size_t>(r)], want) << "rank " << r;
}

inline void check_reduce_scatter(int world, DType dt, Device dev) {
  const int64_t block = 48, n = block * world;
  std::mutex mu;
  std::vector<std::vector<float>> got(static_cast<size_t>(world));
  on_ranks(world, [&](Communicator& c) {
    Tensor in = Tensor::from_floats(rank_values(c.rank(), n), {n}, dt, dev);
    Tensor out = Tensor::zeros({block / 4, 4}, dt, dev);
    c.reduce_scatter(in, out);
    std::lock_guard lock(mu);
    got[static_cast<size_t>(c.rank())] = out.to_floats();
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(got[static_cast<size_t>(r)], serial_sum(world, n, dt, r * block, block)) << "rank " << r;
}

inline void check_all_gather(int world, DType dt, Device dev) {
  const int64_t n = 30;
  std::vector<float> want;
  for (int r = 0; r < world; ++r) {
    auto v = stored(rank_values(r, n), dt);
    want.insert(want.end(), v.begin(), v.end());
  }
  std::mutex mu;
  std::vector<std::vector<float>> got(static_cast<size_t>(world));
  on_ranks(world, [&](Communicator& c) {
    Tensor in = Tensor::from_floats(rank_values(c.rank(), n), {3, 10}, dt, dev);
    Tensor out = Tensor::zeros({3 * world, 10}, dt, dev);
    c.all_gather(in, out);
    std::lock_guard lock(mu);
    got[static_cast<size_t>(c.rank())] = out.to_floats();
  });
  for (int r = 0; r < world; ++r) EXPECT_EQ(got[static_cast<size_t>(r)], want) << "rank " << r;
}

inline void check_all_to_all(int world, DType dt, Device dev) {
  const int64_t block = 6, n = block * world;
  std::mutex mu;
  std::vector<std::vector<float>> got(static_cast<size_t>(world));
  on_ranks(world, [&](Communicator& c) {
    Tensor in = Tensor::from_floats(rank_values(c.rank(), n), {n, 1}, dt, dev);
    Tensor out = Tensor::zeros({n, 1}, dt, dev);
    c.all_to_all(in, out);
    std::lock_guard lock(mu);
    got[static_cast<size_t>(c.rank())] = out.to_floats();
  });
  for (int r = 0; r < world; ++r)
    for (int src = 0; src < world; ++src) {
      auto v = stored(rank_values(src, n), dt);
      std::vector<float> want(v.begin() + r * block, v.begin() + (r + 1) * block);
      std::vector<float> have(got[static_cast<size_t>(r)].begin() + src * block,
                              got[static_cast<size_t>(r)].begin() + (src + 1) * block);
      EXPECT_EQ(have, want) << "rank " << r << " block from " << src;
    }
}

// A ring step: every rank sends its block to the next and receives the previous rank's, `steps`
// times, as ring attention passes key/value blocks; after world steps each block is home again.
inline void check_ring(int world, DType dt, Device dev, bool async) {
  const int64_t n = 64;
  std::mutex mu;
  std::vector<std::vector<std::vector<float>>> seen(static_cast<size_t>(world));
  on_ranks(world, [&](Communicator& c) {
    const int next = (c.rank() + 1) % world, prev = (c.rank() + world - 1) % world;
    Tensor cur = Tensor::from_floats(rank_values(c.rank(), n), {n}, dt, dev);
    std::vector<std::vector<float>> mine;
    for (int step = 0; step < world; ++step) {
      Tensor in = Tensor::zeros({n}, dt, dev);
      if (async) {
        auto work = c.send_recv_async({P2POp::send(cur, next), P2POp::recv(in, prev)});
        mine.push_back(cur.to_floats());  // overlapped "compute" on the current block
        work->wait();
      } else {
        c.send_recv({P2POp::send(cur, next), P2POp::recv(in, prev)});
        mine.push_back(cur.to_floats());
      }
      cur = in;
    }
    mine.push_back(cur.to_floats());
    std::lock_guard lock(mu);
    seen[static_cast<size_t>(c.rank())] = std::move(mine);
  });
  for (int r = 0; r < world; ++r)
    for (int step = 0; step <= world; ++step) {
      const int owner = ((r - step) % world + world) % world;
      EXPECT_EQ(seen[static_cast<size_t>(r)][static_cast<size_t>(step)], stored(rank_values(owner, n), dt))
          << "rank " << r << " step " << step;
    }
}

}  // namespace lcx::test
