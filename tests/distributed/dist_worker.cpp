// A stand-in worker for the launcher tests (not a test itself). Modes:
//   dist_worker launch N MODE ARGS...  supervise N copies of "dist_worker MODE ARGS..."
//   dist_worker fail K                 rank K writes to stderr and exits 7; the others sleep
//   dist_worker wait DIR               write DIR/ready.RANK, then wait for a signal and record it
//   dist_worker env DIR                write the launch variables to DIR/env.RANK
//   dist_worker step DIR               lcx-train's stop handling in a 3-second step 3 (checkpoint-2
//                                      saved): DIR/ready.RANK, then after a signal the step
//                                      finishes, DIR/saved.RANK is written and it exits 130
//   dist_worker nccl                   NCCL collectives on GPU LOCAL_RANK against the serial results
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "distributed/launcher.h"
#include "distributed/nccl_comm.h"
#include "distributed/rank_data.h"
#include "lcx/comm.h"
#include "lcx/error.h"
#include "train/stop_signal.h"

namespace {

volatile sig_atomic_t g_signal = 0;
void on_signal(int s) { g_signal = s; }

std::string var(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

#ifdef LCX_HAVE_CUDA
// Throws with the first difference beyond `tol` (relative to the magnitude of the expected value).
void expect_close(const std::vector<float>& have, const std::vector<float>& want, float tol, const std::string& what) {
  if (have.size() != want.size()) throw lcx::Error(lcx::str(what, ": ", have.size(), " values, expected ", want.size()));
  for (size_t i = 0; i < want.size(); ++i)
    if (std::abs(have[i] - want[i]) > tol * std::max(1.0f, std::abs(want[i])))
      throw lcx::Error(lcx::str(what, ": element ", i, " is ", have[i], ", expected ", want[i]));
}

int nccl_checks(const lcx::DistEnv& env) {
  using namespace lcx;
  LCX_CHECK(cuda_available(), "no GPU");
  const Device dev = Device::cuda(env.local_rank);
  auto comm = make_nccl_world(env, env.local_rank, CommOptions{60});
  const int w = comm->size(), r = comm->rank();
  for (DType dt : {DType::f32, DType::bf16}) {
    // NCCL sums in its own order (and bf16 in bf16), so only close to the serial sum.
    const float tol = dt == DType::f32 ? 1e-5f : 2e-2f;
    const std::string name = dtype_name(dt);
    Tensor t = Tensor::from_floats(test::rank_values(r, 1000), {10, 100}, dt, dev);
    comm->all_reduce(t);
    expect_close(t.to_floats(), test::serial_sum(w, 1000, dt), tol, "all_reduce " + name);
    Tensor in = Tensor::from_floats(test::rank_values(r, 48 * w), {48 * w}, dt, dev);
    Tensor out = Tensor::zeros({48}, dt, dev);
    comm->reduce_scatter(in, out);
    expect_close(out.to_floats(), test::serial_sum(w, 48 * w, dt, 48 * r, 48), tol, "reduce_scatter " + name);
    Tensor g = Tensor::zeros({30 * w}, dt, dev);
    comm->all_gather(Tensor::from_floats(test::rank_values(r, 30), {30}, dt, dev), g);
    std::vector<float> want;
    for (int q = 0; q < w; ++q) {
      auto v = test::stored(test::rank_values(q, 30), dt);
      want.insert(want.end(), v.begin(), v.end());
    }
    expect_close(g.to_floats(), want, 0, "all_gather " + name);
    Tensor a = Tensor::zeros({6 * w}, dt, dev);
    comm->all_to_all(Tensor::from_floats(test::rank_values(r, 6 * w), {6 * w}, dt, dev), a);
    want.clear();
    for (int q = 0; q < w; ++q) {
      auto v = test::stored(test::rank_values(q, 6 * w), dt);
      want.insert(want.end(), v.begin() + 6 * r, v.begin() + 6 * (r + 1));
    }
    expect_close(a.to_floats(), want, 0, "all_to_all " + name);
  }
  // Ring: after w steps every block is home again; each step the previous rank's block arrives.
  Tensor cur = Tensor::from_floats(test::rank_values(r, 64), {64}, DType::bf16, dev);
  for (int step = 1; step <= w; ++step) {
    Tensor next = Tensor::zeros({64}, DType::bf16, dev);
    auto work = comm->send_recv_async({P2POp::send(cur, (r + 1) % w), P2POp::recv(next, (r + w - 1) % w)});
    work->wait();
    cur = next;
    expect_close(cur.to_floats(), test::stored(test::rank_values(((r - step) % w + w) % w, 64), DType::bf16), 0,
                 str("ring step ", step));
  }
  double h[2] = {0.5 * (r + 1), 1.0};
  comm->all_reduce(std::span<double>(h, 2));
  if (h[0] != 0.25 * w * (w + 1) || h[1] != w) throw Error(str("host all_reduce gave ", h[0], ", ", h[1]));
  auto sub = comm->split(r % 2, r, "parity");
  Tensor mine = Tensor::from_floats({static_cast<float>(r)}, {1}, DType::f32, dev);
  Tensor all = Tensor::zeros({sub->size()}, DType::f32, dev);
  sub->all_gather(mine, all);
  std::vector<float> members;
  for (int q = r % 2; q < w; q += 2) members.push_back(static_cast<float>(q));
  expect_close(all.to_floats(), members, 0, "split all_gather");
  comm->barrier();
  std::fprintf(stderr, "rank %d: NCCL collectives on %d GPUs match\n", r, w);
  return 0;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty() || (args[0] != "nccl" && args.size() < 2)) return 2;
  if (args[0] == "launch") {
    std::vector<std::string> child = {lcx::self_executable()};
    child.insert(child.end(), args.begin() + 2, args.end());
    lcx::LaunchOptions opts;
    opts.kill_grace_s = 2;
    opts.tail_lines = 3;
    return lcx::launch_workers(std::stoi(args[1]), child, lcx::process_env(), opts);
  }
  const lcx::DistEnv env = lcx::read_dist_env(lcx::process_env());
  if (args[0] == "fail") {
    if (env.rank == std::stoi(args[1])) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      std::fprintf(stderr, "loading shard %d\nnoise line\nCUDA error: out of memory on rank %d\n", env.rank, env.rank);
      return 7;
    }
    std::this_thread::sleep_for(std::chrono::seconds(60));  // only the launcher's kill ends this in time
    return 0;
  }
  if (args[0] == "wait") {
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    std::ofstream(args[1] + "/ready." + std::to_string(env.rank)) << "ready";
    for (int i = 0; i < 3000 && !g_signal; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::ofstream(args[1] + "/signal." + std::to_string(env.rank)) << g_signal;
    return g_signal ? 0 : 3;
  }
  if (args[0] == "step") {
    lcx::StopSignals signals;
    lcx::StopSignals::speak(env.rank == 0);
    lcx::StopSignals::saved(2);
    lcx::StopSignals::step_running(3);
    std::ofstream(args[1] + "/ready." + std::to_string(env.rank)) << "ready";
    for (int i = 0; i < 3000 && !lcx::StopSignals::requested(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (!lcx::StopSignals::requested()) return 3;
    std::this_thread::sleep_for(std::chrono::seconds(3));  // longer than the launcher's grace of 2 s
    std::ofstream(args[1] + "/saved." + std::to_string(env.rank)) << "saved";
    return 130;
  }
  if (args[0] == "env") {
    std::ofstream(args[1] + "/env." + std::to_string(env.rank))
        << var("RANK") << " " << var("WORLD_SIZE") << " " << var("LOCAL_RANK") << " " << var("LOCAL_WORLD_SIZE") << " "
        << var("MASTER_ADDR") << " " << (var("MASTER_PORT").empty() ? "none" : "port") << " " << var("LCX_WORKER")
        << " " << var("NCCL_NVLS_ENABLE") << " " << env.rank << "/" << env.world_size;
    return 0;
  }
#ifdef LCX_HAVE_CUDA
  if (args[0] == "nccl") {
    try {
      return nccl_checks(env);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
  }
#endif
  return 2;
}
