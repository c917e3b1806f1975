#include "distributed/bootstrap.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "lcx/error.h"

namespace lcx {
namespace {

using Clock = std::chrono::steady_clock;
constexpr char kMagic[8] = {'L', 'C', 'X', 'B', 'O', 'O', 'T', '1'};

double seconds_left(Clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

// Writes or reads exactly n bytes before the deadline.
bool transfer(int fd, char* buf, size_t n, bool write_side, Clock::time_point deadline) {
  size_t done = 0;
  while (done < n) {
    pollfd p{fd, static_cast<short>(write_side ? POLLOUT : POLLIN), 0};
    const double left = seconds_left(deadline);
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left * 1000) + 1) <= 0) return false;
    ssize_t k = write_side ? ::send(fd, buf + done, n - done, MSG_NOSIGNAL) : ::recv(fd, buf + done, n - done, 0);
    if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (k <= 0) return false;
    done += static_cast<size_t>(k);
  }
  return true;
}

std::string serve(const DistEnv& env, const std::string& payload, Clock::time_point deadline) {
  int fd = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  bool v6 = fd >= 0;
  if (!v6) fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(str("bootstrap: socket() failed: ", std::strerror(errno)));
  int one = 1, zero = 0;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc;
  if (v6) {
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));  // accept IPv4 clients too
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<uint16_t>(env.master_port));
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(env.master_port));
    rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  }
  if (rc != 0 || ::listen(fd, env.world_size) != 0) {
    std::string why = std::strerror(errno);
    ::close(fd);
    throw Error(str("bootstrap: rank 0 cannot listen on port ", env.master_port, ": ", why), "MASTER_PORT",
                "choose a free MASTER_PORT");
  }
  std::string msg(kMagic, sizeof(kMagic));
  msg += payload;
  for (int served = 1; served < env.world_size; ++served) {
    pollfd p{fd, POLLIN, 0};
    const double left = seconds_left(deadline);
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left * 1000) + 1) <= 0) {
      ::close(fd);
      throw Error(str("bootstrap: rank 0 heard from ", served - 1, " of ", env.world_size - 1,
                      " ranks on port ", env.master_port, " before the timeout"),
                  "MASTER_ADDR", "start every rank with the same MASTER_ADDR and MASTER_PORT");
    }
    int c = ::accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (c < 0) {
      --served;
      continue;
    }
    const bool ok = transfer(c, msg.data(), msg.size(), true, deadline);
    ::close(c);
    if (!ok) --served;  // a stray connection: wait for another
  }
  ::close(fd);
  return payload;
}

std::string fetch(const DistEnv& env, size_t bytes, Clock::time_point deadline) {
  const std::string port = std::to_string(env.master_port);
  std::string last_error = "no attempt";
  while (seconds_left(deadline) > 0) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    int g = ::getaddrinfo(env.master_addr.c_str(), port.c_str(), &hints, &res);
    if (g != 0) {
      last_error = gai_strerror(g);
    } else {
      for (addrinfo* ai = res; ai; ai = ai->ai_next) {
        int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
        if (fd < 0) continue;
        if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
          std::string buf(sizeof(kMagic) + bytes, '\0');
          const bool ok = transfer(fd, buf.data(), buf.size(), false, deadline);
          ::close(fd);
          if (ok && std::memcmp(buf.data(), kMagic, sizeof(kMagic)) == 0) {
            ::freeaddrinfo(res);
            return buf.substr(sizeof(kMagic));
          }
          last_error = ok ? "the server is not an lcx rank 0" : "connection closed early";
        } else {
          last_error = std::strerror(errno);
          ::close(fd);
        }
      }
      ::freeaddrinfo(res);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 0 may not listen yet
  }
  throw Error(str("bootstrap: rank ", env.rank, " could not get the id from rank 0 at ", env.master_addr, ":",
                  env.master_port, " (", last_error, ")"),
              "MASTER_ADDR", "check that rank 0 runs and that MASTER_ADDR/MASTER_PORT reach it");
}

std::string via_file(const DistEnv& env, const std::string& payload, size_t bytes, Clock::time_point deadline) {
  namespace fs = std::filesystem;
  const fs::path path = env.bootstrap_file;
  if (env.rank == 0) {
    const fs::path tmp = path.string() + ".tmp";
    {
      std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
      f.write(payload.data(), static_cast<std::streamsize>(payload.size()));
      if (!f) throw Error(str("bootstrap: cannot write ", tmp.string()), "LCX_BOOTSTRAP_FILE", "point it at a writable folder");
    }
    fs::rename(tmp, path);  // atomic: readers see the whole id or nothing
    return payload;
  }
  while (seconds_left(deadline) > 0) {
    std::error_code ec;
    if (fs::file_size(path, ec) == bytes && !ec) {
      std::ifstream f(path, std::ios::binary);
      std::string buf(bytes, '\0');
      if (f.read(buf.data(), static_cast<std::streamsize>(bytes))) return buf;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  throw Error(str("bootstrap: rank ", env.rank, " waited for ", path.string(), " from rank 0 until the timeout"),
              "LCX_BOOTSTRAP_FILE", "every rank of one job must see the same file, written fresh by rank 0");
}

}  // namespace

std::string bootstrap_broadcast(const DistEnv& env, const std::string& payload, size_t bytes, double timeout_s) {
  if (env.rank == 0) LCX_CHECK(payload.size() == bytes, "bootstrap payload of ", payload.size(), " bytes, expected ", bytes);
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s));
  if (env.world_size == 1) return payload;
  if (!env.bootstrap_file.empty()) return via_file(env, payload, bytes, deadline);
  return env.rank == 0 ? serve(env, payload, deadline) : fetch(env, bytes, deadline);
}

}  // namespace lcx
