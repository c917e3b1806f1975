// The worker supervisor. Each child runs in its own process group (so a terminal's Ctrl-C reaches
// it once, through us) and dies with us (PR_SET_PDEATHSIG). Its stderr comes through a pipe that
// we echo line by line and keep a tail of, so a failure can quote the failing rank's last words.
// Signals arrive through a self-pipe, so the handler only writes a byte and the poll loop does
// the rest.
#include "distributed/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>

#include "lcx/error.h"

extern char** environ;

namespace lcx {
namespace {

using Clock = std::chrono::steady_clock;

int parse_int(const EnvMap& env, const std::string& name, int fallback, int min_value) {
  auto it = env.find(name);
  if (it == env.end() || it->second.empty()) return fallback;
  try {
    size_t used = 0;
    int v = std::stoi(it->second, &used);
    if (used == it->second.size() && v >= min_value) return v;
  } catch (const std::exception&) {
  }
  throw Error(str("environment variable ", name, "=", it->second, " is not an integer >= ", min_value), name,
              "unset it or fix the job script that sets it");
}

bool has(const EnvMap& env, const std::string& name) {
  auto it = env.find(name);
  return it != env.end() && !it->second.empty();
}

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const unsigned char b = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &b, 1);
}

}  // namespace

int free_local_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw Error(str("socket() failed: ", std::strerror(errno)));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    throw Error(str("could not find a free port: ", std::strerror(errno)), "MASTER_PORT", "set MASTER_PORT");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

namespace {

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int err_fd = -1;  // read end of its stderr pipe; -1 once closed
  bool running = true;
  int status = 0;
  std::string partial;  // bytes after the last newline
  std::deque<std::string> tail;
};

void add_line(Child& c, std::string line, const LaunchOptions& opts) {
  if (opts.echo_stderr) {
    std::string out = str("[rank ", c.rank, "] ", line, "\n");
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, out.data(), out.size());
  }
  c.tail.push_back(std::move(line));
  while (static_cast<int>(c.tail.size()) > opts.tail_lines) c.tail.pop_front();
}

// Reads what is available; closes the pipe at EOF.
void drain(Child& c, const LaunchOptions& opts) {
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(c.err_fd, buf, sizeof(buf));
    if (n > 0) {
      c.partial.append(buf, static_cast<size_t>(n));
      size_t nl;
      while ((nl = c.partial.find('\n')) != std::string::npos) {
        add_line(c, c.partial.substr(0, nl), opts);
        c.partial.erase(0, nl + 1);
      }
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (!c.partial.empty()) add_line(c, std::move(c.partial), opts);
    c.partial.clear();
    ::close(c.err_fd);
    c.err_fd = -1;
    return;
  }
}

int exit_code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

EnvMap process_env() {
  EnvMap env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    size_t eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

DistEnv read_dist_env(const EnvMap& env) {
  DistEnv d;
  if (has(env, "RANK") || has(env, "WORLD_SIZE")) {
    d.rank = parse_int(env, "RANK", 0, 0);
    d.world_size = parse_int(env, "WORLD_SIZE", 1, 1);
    d.local_rank = parse_int(env, "LOCAL_RANK", d.rank, 0);
    d.local_world_size = parse_int(env, "LOCAL_WORLD_SIZE", d.world_size, 1);
  } else if (has(env, "SLURM_PROCID")) {
    d.rank = parse_int(env, "SLURM_PROCID", 0, 0);
    d.world_size = parse_int(env, "SLURM_NTASKS", 1, 1);
    d.local_rank = parse_int(env, "SLURM_LOCALID", 0, 0);
    // SLURM_NTASKS_PER_NODE may read "8" or "8(x2)"; the leading count is the local size.
    auto it = env.find("SLURM_NTASKS_PER_NODE");
    d.local_world_size = it != env.end() && !it->second.empty() ? std::atoi(it->second.c_str()) : 1;
    if (d.local_world_size < 1) d.local_world_size = 1;
    if (d.world_size > 1 && !has(env, "MASTER_ADDR"))
      throw Error(str("a Slurm job of ", d.world_size, " tasks needs MASTER_ADDR to bootstrap"), "MASTER_ADDR",
                  "in the sbatch script: export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)");
  }
  if (d.rank >= d.world_size)
    throw Error(str("rank ", d.rank, " is outside the world size ", d.world_size), "RANK",
                "RANK must be below WORLD_SIZE");
  if (has(env, "MASTER_ADDR")) d.master_addr = env.at("MASTER_ADDR");
  d.master_port = parse_int(env, "MASTER_PORT", d.master_port, 1);
  if (has(env, "LCX_BOOTSTRAP_FILE")) d.bootstrap_file = env.at("LCX_BOOTSTRAP_FILE");
  return d;
}

LaunchRole launch_role(int nproc_per_node, const EnvMap& env) {
  if (has(env, "LCX_WORKER") || has(env, "WORLD_SIZE")) return LaunchRole::worker;
  if (has(env, "SLURM_PROCID")) {
    const int tasks = parse_int(env, "SLURM_NTASKS", 1, 1), nodes = parse_int(env, "SLURM_NNODES", 1, 1);
    if (tasks > nodes) return LaunchRole::worker;  // srun started one task per GPU
  }
  return nproc_per_node > 1 ? LaunchRole::launcher : LaunchRole::single;
}

std::string self_executable() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

int launch_workers(int nproc, const std::vector<std::string>& argv, const EnvMap& env, const LaunchOptions& opts) {
  LCX_CHECK(nproc >= 1 && !argv.empty(), "launch_workers(", nproc, ", ", argv.size(), " args)");
  const int nnodes = has(env, "NNODES") ? parse_int(env, "NNODES", 1, 1) : parse_int(env, "SLURM_NNODES", 1, 1);
  const int node_rank = has(env, "NODE_RANK") ? parse_int(env, "NODE_RANK", 0, 0) : parse_int(env, "SLURM_NODEID", 0, 0);
  if (node_rank >= nnodes)
    throw Error(str("node rank ", node_rank, " is outside ", nnodes, " nodes"), "NODE_RANK", "NODE_RANK must be below NNODES");
  if (nnodes > 1 && !has(env, "MASTER_ADDR"))
    throw Error(str("a job of ", nnodes, " nodes needs MASTER_ADDR (the address of node 0)"), "MASTER_ADDR",
                "export MASTER_ADDR and MASTER_PORT on every node");
  EnvMap base = env;
  base["WORLD_SIZE"] = std::to_string(nnodes * nproc);
  base["LOCAL_WORLD_SIZE"] = std::to_string(nproc);
  if (!has(env, "MASTER_ADDR")) base["MASTER_ADDR"] = "127.0.0.1";
  if (!has(env, "MASTER_PORT")) base["MASTER_PORT"] = std::to_string(nnodes > 1 ? 29500 : free_local_port());
  base["LCX_WORKER"] = "1";
  base["NCCL_NVLS_ENABLE"] = "0";  // NVLink multicast stays off on these machines

  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) throw Error(str("pipe2 failed: ", std::strerror(errno)));
  struct sigaction sa{}, old_int{}, old_term{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);

  std::vector<Child> children(static_cast<size_t>(nproc));
  auto terminate_all = [&](int sig) {
    for (auto& c : children)
      if (c.running && c.pid > 0) ::kill(c.pid, sig);
  };

  std::vector<std::string> argv_store = argv;
  std::vector<char*> cargv;
  for (auto& a : argv_store) cargv.push_back(a.data());
  cargv.push_back(nullptr);

  std::string spawn_error;
  for (int i = 0; i < nproc; ++i) {
    Child& c = children[static_cast<size_t>(i)];
    c.rank = node_rank * nproc + i;
    EnvMap e = base;
    e["RANK"] = std::to_string(c.rank);
    e["LOCAL_RANK"] = std::to_string(i);
    std::vector<std::string> env_store;
    for (const auto& [k, v] : e) env_store.push_back(k + "=" + v);
    std::vector<char*> cenv;
    for (auto& s : env_store) cenv.push_back(s.data());
    cenv.push_back(nullptr);
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) {
      spawn_error = str("pipe2 failed: ", std::strerror(errno));
      break;
    }
    const pid_t parent = ::getpid();
    pid_t pid = ::fork();
    if (pid == 0) {
      // Only async-signal-safe calls between fork and exec.
      ::setpgid(0, 0);
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::dup2(fds[1], STDERR_FILENO);  // dup2 clears O_CLOEXEC on the copy
      ::execve(cargv[0], cargv.data(), cenv.data());
      const char msg[] = "exec of the worker executable failed\n";
      [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, msg, sizeof(msg) - 1);
      ::_exit(127);
    }
    ::close(fds[1]);
    if (pid < 0) {
      ::close(fds[0]);
      spawn_error = str("fork failed: ", std::strerror(errno));
      break;
    }
    ::fcntl(fds[0], F_SETFL, O_NONBLOCK);
    c.pid = pid;
    c.err_fd = fds[0];
  }
  for (auto& c : children)
    if (c.pid < 0) c.running = false;

  int failed = -1;         // index of the first child that failed
  int forwarded = 0;       // the signal we passed on
  int signals_seen = 0;
  bool stopping = !spawn_error.empty();
  if (stopping) terminate_all(SIGTERM);
  // No deadline while the workers finish their step after a first signal: that may take minutes.
  auto kill_deadline = stopping ? Clock::now() + std::chrono::duration<double>(opts.kill_grace_s) : Clock::time_point::max();
  bool killed = false;

  for (;;) {
    bool any_running = false, any_open = false;
    std::vector<pollfd> fds;
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    for (auto& c : children) {
      any_running |= c.running;
      if (c.err_fd >= 0) {
        any_open = true;
        fds.push_back({c.err_fd, POLLIN, 0});
      }
    }
    if (!any_running && !any_open) break;
    ::poll(fds.data(), fds.size(), 50);

    unsigned char sig;
    while (::read(g_signal_pipe[0], &sig, 1) == 1) {
      if (!forwarded) forwarded = sig;
      terminate_all(sig);
      // A second signal stops the workers at once; those that do not are killed after the grace.
      if (++signals_seen == 2) kill_deadline = Clock::now() + std::chrono::duration<double>(opts.kill_grace_s);
      stopping = true;
    }
    for (auto& c : children)
      if (c.err_fd >= 0) drain(c, opts);
    for (size_t i = 0; i < children.size(); ++i) {
      Child& c = children[i];
      if (!c.running) continue;
      if (::waitpid(c.pid, &c.status, WNOHANG) != c.pid) continue;
      c.running = false;
      // Once one worker has stopped after a signal, the others get the grace to follow.
      if (stopping && kill_deadline == Clock::time_point::max())
        kill_deadline = Clock::now() + std::chrono::duration<double>(opts.kill_grace_s);
      if (exit_code(c.status) != 0 && failed < 0 && !stopping) {
        failed = static_cast<int>(i);
        stopping = true;
        terminate_all(SIGTERM);
        kill_deadline = Clock::now() + std::chrono::duration<double>(opts.kill_grace_s);
      }
    }
    // A child that exited may leave its pipe open through grandchildren; stop reading once
    // every child is gone and the grace has passed.
    if (!any_running && Clock::now() > kill_deadline) {
      for (auto& c : children)
        if (c.err_fd >= 0) {
          ::close(c.err_fd);
          c.err_fd = -1;
        }
    }
    if (stopping && !killed && Clock::now() > kill_deadline) {
      terminate_all(SIGKILL);
      killed = true;
    }
  }

  sigaction(SIGINT, &old_int, nullptr);
  sigaction(SIGTERM, &old_term, nullptr);
  ::close(g_signal_pipe[0]);
  ::close(g_signal_pipe[1]);
  g_signal_pipe[0] = g_signal_pipe[1] = -1;

  if (!spawn_error.empty()) throw Error(str("could not start the workers: ", spawn_error));
  if (failed >= 0) {
    const Child& c = children[static_cast<size_t>(failed)];
    std::string msg = WIFSIGNALED(c.status)
                          ? str("rank ", c.rank, " was killed by signal ", WTERMSIG(c.status), " (", strsignal(WTERMSIG(c.status)), ")")
                          : str("rank ", c.rank, " exited with code ", exit_code(c.status));
    msg += c.tail.empty() ? std::string(" (no stderr output)") : std::string(":");
    for (const auto& line : c.tail) msg += "\n  " + line;
    std::string out = msg + "\n";
    [[maybe_unused]] ssize_t n = ::write(STDERR_FILENO, out.data(), out.size());
    if (opts.failure) *opts.failure = msg;
    return exit_code(c.status);
  }
  if (forwarded) return 128 + forwarded;
  return 0;
}

}  // namespace lcx
