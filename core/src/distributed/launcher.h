// Starting and finding the ranks of a job.
//
// One node: `lcx-train` with [distributed] nproc_per_node = N calls launch_workers, which starts N
// copies of itself with the launch variables set and supervises them. Several nodes: run one
// launcher per node (NNODES / NODE_RANK, or Slurm's SLURM_NNODES / SLURM_NODEID with one task per
// node), or let srun / torchrun start every worker directly; workers read their place from the
// same variables torchrun and Slurm set:
//   RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   else SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (+ MASTER_ADDR/PORT)
#pragma once
#include <map>
#include <string>
#include <vector>

namespace lcx {

using EnvMap = std::map<std::string, std::string>;
EnvMap process_env();

struct DistEnv {
  int rank = 0, world_size = 1;
  int local_rank = 0, local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string bootstrap_file;  // LCX_BOOTSTRAP_FILE: one-node bootstrap through a file instead of TCP
};

// Where this process stands. Throws lcx::Error naming the variable when one is malformed or
// MASTER_ADDR is missing for a multi-rank Slurm job.
DistEnv read_dist_env(const EnvMap& env);

enum class LaunchRole {
  single,    // one rank, no launch variables: run in this process
  launcher,  // start nproc_per_node workers here and supervise them
  worker,    // started by a launcher, torchrun or srun (one task per GPU)
};
// A launcher's children carry LCX_WORKER=1; WORLD_SIZE (torchrun) or several Slurm tasks per node
// mean this process is a worker; otherwise nproc_per_node > 1 makes it a launcher.
LaunchRole launch_role(int nproc_per_node, const EnvMap& env);

struct LaunchOptions {
  double kill_grace_s = 10;  // after a failure or a forwarded signal, SIGKILL what still runs
  int tail_lines = 20;       // stderr lines of a failed rank quoted in the message
  bool echo_stderr = true;   // copy every child's stderr lines to ours, prefixed "[rank N] "
  std::string* failure = nullptr;  // receives "rank N exited with code C: ..." when a rank failed
};

// Starts nproc copies of argv[0] (a path; see self_executable) with `env` plus RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a free local port on one node when
// MASTER_PORT is unset), LCX_WORKER=1 and NCCL_NVLS_ENABLE=0. SIGINT and SIGTERM sent to this
// process are forwarded to every worker: after the first, the workers have as long as they need to
// finish their step and save (until one of them exits, then kill_grace_s for the rest); after a
// second, kill_grace_s. When a worker exits non-zero (or dies by a signal), the
// others get SIGTERM, then SIGKILL after kill_grace_s, and the failure is printed to stderr as
// "rank N exited with code C: <its last stderr lines>". Returns 0 when every worker succeeded,
// the failed rank's code (128 + signal when it was killed), or 128 + the forwarded signal.
// Installs its own SIGINT/SIGTERM handlers for its duration; one call at a time per process.
int launch_workers(int nproc, const std::vector<std::string>& argv, const EnvMap& env,
                   const LaunchOptions& opts = {});

std::string self_executable();  // /proc/self/exe resolved
int free_local_port();          // a TCP port free on 127.0.0.1 right now

}  // namespace lcx
