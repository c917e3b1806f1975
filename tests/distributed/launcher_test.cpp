// The launcher with a stand-in worker: a failing rank ends the job in bounded time with its
// message; signals reach every worker; the launch variables are set; the environment is read the
// way torchrun and Slurm set it.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "distributed/launcher.h"
#include "lcx/error.h"
#include "support/test_util.h"

namespace lcx {
namespace {

std::string worker_exe() { return std::string(LCX_BUILD_DIR) + "/tests/dist_worker"; }

std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

TEST(Launcher, FailingRankEndsTheJobWithItsMessage) {
  std::string failure;
  LaunchOptions opts;
  opts.kill_grace_s = 2;
  opts.tail_lines = 2;
  opts.echo_stderr = false;
  opts.failure = &failure;
  const auto t0 = std::chrono::steady_clock::now();
  int rc = launch_workers(3, {worker_exe(), "fail", "1"}, process_env(), opts);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(rc, 7);
  EXPECT_EQ(failure, "rank 1 exited with code 7:\n  noise line\n  CUDA error: out of memory on rank 1");
  EXPECT_LT(s, 10.0) << "the sleeping ranks were not stopped";
}

TEST(Launcher, SetsTheLaunchVariables) {
  auto dir = test::temp_dir("launch-env");
  EnvMap env = process_env();
  for (const char* k : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "SLURM_NNODES", "SLURM_NODEID"})
    env.erase(k);
  LaunchOptions opts;
  opts.echo_stderr = false;
  ASSERT_EQ(launch_workers(2, {worker_exe(), "env", dir.string()}, env, opts), 0);
  EXPECT_EQ(slurp(dir / "env.0"), "0 2 0 2 127.0.0.1 port 1 0 0/2");
  EXPECT_EQ(slurp(dir / "env.1"), "1 2 1 2 127.0.0.1 port 1 0 1/2");
  // Node 1 of 2: global ranks continue after node 0's.
  env["NNODES"] = "2";
  env["NODE_RANK"] = "1";
  env["MASTER_ADDR"] = "10.0.0.1";
  ASSERT_EQ(launch_workers(2, {worker_exe(), "env", dir.string()}, env, opts), 0);
  EXPECT_EQ(slurp(dir / "env.2"), "2 4 0 2 10.0.0.1 port 1 0 2/4");
  EXPECT_EQ(slurp(dir / "env.3"), "3 4 1 2 10.0.0.1 port 1 0 3/4");
  std::filesystem::remove_all(dir);
}

TEST(Launcher, ForwardsSignalsToEveryWorker) {
  auto dir = test::temp_dir("launch-signal");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::execl(worker_exe().c_str(), "dist_worker", "launch", "3", "wait", dir.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  bool ready = false;
  for (int i = 0; i < 500 && !ready; ++i) {
    ready = std::filesystem::exists(dir / "ready.0") && std::filesystem::exists(dir / "ready.1") &&
            std::filesystem::exists(dir / "ready.2");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(ready) << "workers did not start";
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(slurp(dir / ("signal." + std::to_string(r))), std::to_string(SIGTERM)) << r;
  std::filesystem::remove_all(dir);
}

// Starts "dist_worker launch 3 step DIR" with its stderr in DIR/stderr; waits for every worker.
pid_t launch_stepping_workers(const std::filesystem::path& dir) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    FILE* err = std::freopen((dir / "stderr").c_str(), "w", stderr);
    if (!err) ::_exit(126);
    ::execl(worker_exe().c_str(), "dist_worker", "launch", "3", "step", dir.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  for (int i = 0; i < 500; ++i) {
    if (std::filesystem::exists(dir / "ready.0") && std::filesystem::exists(dir / "ready.1") &&
        std::filesystem::exists(dir / "ready.2"))
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pid;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(Launcher, FirstSignalLetsWorkersFinishTheirStepAndSave) {
  auto dir = test::temp_dir("launch-step");
  const pid_t pid = launch_stepping_workers(dir);
  ASSERT_TRUE(std::filesystem::exists(dir / "ready.2")) << "workers did not start";
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  // Each worker's step outlasted the kill grace, and still each finished and saved.
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(std::filesystem::exists(dir / ("saved." + std::to_string(r)))) << r;
  const std::string err = slurp(dir / "stderr");
  EXPECT_EQ(count(err, "SIGTERM received: step 3 will finish, then a checkpoint is saved"), 1u) << err;
  EXPECT_NE(err.find("[rank 0] lcx-train: SIGTERM received"), std::string::npos) << err;
  std::filesystem::remove_all(dir);
}

TEST(Launcher, SecondSignalStopsWorkersAtOnceSayingWhatIsLost) {
  auto dir = test::temp_dir("launch-step2");
  const pid_t pid = launch_stepping_workers(dir);
  ASSERT_TRUE(std::filesystem::exists(dir / "ready.2")) << "workers did not start";
  const auto t0 = std::chrono::steady_clock::now();
  ::kill(pid, SIGTERM);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 2.5) << "the workers finished their 3-second step instead of stopping";
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  for (int r = 0; r < 3; ++r) EXPECT_FALSE(std::filesystem::exists(dir / ("saved." + std::to_string(r)))) << r;
  const std::string err = slurp(dir / "stderr");
  EXPECT_EQ(count(err, "second SIGTERM: stopping now without saving; step 3 (in progress) is lost; --resume latest "
                       "continues from checkpoint-2"),
            1u)
      << err;
  std::filesystem::remove_all(dir);
}

TEST(DistEnv, ReadsTorchrunThenSlurmVariables) {
  DistEnv d = read_dist_env({});
  EXPECT_EQ(d.rank, 0);
  EXPECT_EQ(d.world_size, 1);
  d = read_dist_env({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                     {"MASTER_ADDR", "node0"}, {"MASTER_PORT", "1234"}, {"SLURM_PROCID", "2"}});
  EXPECT_EQ(d.rank, 5);
  EXPECT_EQ(d.world_size, 8);
  EXPECT_EQ(d.local_rank, 1);
  EXPECT_EQ(d.local_world_size, 4);
  EXPECT_EQ(d.master_addr, "node0");
  EXPECT_EQ(d.master_port, 1234);
  d = read_dist_env({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "16"}, {"SLURM_LOCALID", "3"},
                     {"SLURM_NTASKS_PER_NODE", "8(x2)"}, {"MASTER_ADDR", "n1"}});
  EXPECT_EQ(d.rank, 3);
  EXPECT_EQ(d.world_size, 16);
  EXPECT_EQ(d.local_rank, 3);
  EXPECT_EQ(d.local_world_size, 8);
  try {
    read_dist_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}});
    FAIL() << "a Slurm job without MASTER_ADDR was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "MASTER_ADDR");
    EXPECT_NE(e.fix().find("scontrol show hostnames"), std::string::npos);
  }
  try {
    read_dist_env({{"RANK", "x1"}, {"WORLD_SIZE", "2"}});
    FAIL() << "RANK=x1 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "RANK");
  }
  EXPECT_THROW(read_dist_env({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), Error);
}

TEST(DistEnv, LaunchRole) {
  EXPECT_EQ(launch_role(1, {}), LaunchRole::single);
  EXPECT_EQ(launch_role(4, {}), LaunchRole::launcher);
  EXPECT_EQ(launch_role(4, {{"LCX_WORKER", "1"}}), LaunchRole::worker);
  EXPECT_EQ(launch_role(4, {{"WORLD_SIZE", "8"}}), LaunchRole::worker);
  // srun with one task per node: this task launches the node's workers.
  EXPECT_EQ(launch_role(8, {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_NNODES", "2"}}), LaunchRole::launcher);
  // srun with one task per GPU: each task is a worker.
  EXPECT_EQ(launch_role(8, {{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "16"}, {"SLURM_NNODES", "2"}}), LaunchRole::worker);
}

}  // namespace
}  // namespace lcx
