// A stand-in worker for the launcher tests (not a test itself). Modes:
//   dist_worker launch N MODE ARGS...  supervise N copies of "dist_worker MODE ARGS..."
//   dist_worker fail K                 rank K writes to stderr and exits 7; the others sleep
//   dist_worker wait DIR               write DIR/ready.RANK, then wait for a signal and record it
//   dist_worker env DIR                write the launch variables to DIR/env.RANK
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "dist/launcher.h"
#include "lcx/error.h"

namespace {

volatile sig_atomic_t g_signal = 0;
void on_signal(int s) { g_signal = s; }

std::string var(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() < 2) return 2;
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
  if (args[0] == "env") {
    std::ofstream(args[1] + "/env." + std::to_string(env.rank))
        << var("RANK") << " " << var("WORLD_SIZE") << " " << var("LOCAL_RANK") << " " << var("LOCAL_WORLD_SIZE") << " "
        << var("MASTER_ADDR") << " " << (var("MASTER_PORT").empty() ? "none" : "port") << " " << var("LCX_WORKER")
        << " " << var("NCCL_NVLS_ENABLE") << " " << env.rank << "/" << env.world_size;
    return 0;
  }
  return 2;
}
