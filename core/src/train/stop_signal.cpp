#include "train/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>

namespace lcx {
namespace {

std::atomic<int> g_signal{0};
std::atomic<bool> g_speak{true};
std::atomic<int64_t> g_running{0}, g_saved{0}, g_last{0};  // g_last: the step that finishes before the stop
struct sigaction g_old_int {}, g_old_term {};

// Only async-signal-safe calls below: write(2), _exit(2) and plain memory.
struct Line {
  char buf[512];
  size_t n = 0;
  Line& operator<<(const char* s) {
    while (*s && n < sizeof buf) buf[n++] = *s++;
    return *this;
  }
  Line& operator<<(int64_t v) {
    char digits[24];
    int k = 0;
    const bool neg = v < 0;
    uint64_t u = neg ? 0 - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
    do digits[k++] = static_cast<char>('0' + u % 10); while ((u /= 10) != 0);
    if (neg && n < sizeof buf) buf[n++] = '-';
    while (k > 0 && n < sizeof buf) buf[n++] = digits[--k];
    return *this;
  }
  void emit() const { [[maybe_unused]] ssize_t w = ::write(STDERR_FILENO, buf, n); }
};

const char* signal_name(int sig) { return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : "a signal"; }

extern "C" void on_stop_signal(int sig) {
  const bool speak = g_speak.load();
  const int64_t running = g_running.load(), saved = g_saved.load(), last = g_last.load();
  if (g_signal.exchange(sig) == 0) {
    if (speak) {
      Line l;
      l << "lcx-train: " << signal_name(sig) << " received: ";
      if (last > 0) l << "step " << last << " will finish, then a checkpoint is saved and the run stops";
      else l << "the run stops after its first step, saving a checkpoint";
      l << ". Send it again to stop at once without saving.\n";
      l.emit();
    }
    return;
  }
  if (speak) {
    Line l;
    l << "lcx-train: second " << signal_name(sig) << ": stopping now without saving; ";
    const int64_t done = running > 0 ? running - 1 : 0;
    if (done > saved) {
      if (done == saved + 1) l << "step " << done;
      else l << "steps " << saved + 1 << " to " << done;
      l << " (done, not saved) and step " << running << " (in progress) are lost";
    } else if (running > 0) {
      l << "step " << running << " (in progress) is lost";
    } else {
      l << "nothing was trained yet";
    }
    if (saved > 0) l << "; --resume latest continues from checkpoint-" << saved;
    l << "\n";
    l.emit();
  }
  ::_exit(128 + sig);
}

}  // namespace

StopSignals::StopSignals() {
  g_signal.store(0);
  g_running.store(0);
  g_saved.store(0);
  g_last.store(0);
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &g_old_int);
  sigaction(SIGTERM, &sa, &g_old_term);
}

StopSignals::~StopSignals() {
  sigaction(SIGINT, &g_old_int, nullptr);
  sigaction(SIGTERM, &g_old_term, nullptr);
}

int StopSignals::requested() { return g_signal.load(); }
void StopSignals::speak(bool yes) { g_speak.store(yes); }
void StopSignals::step_running(int64_t step) {
  g_running.store(step);
  g_last.store(step);
}
void StopSignals::request_read(int64_t step) { g_last.store(step + 1); }
void StopSignals::saved(int64_t step) { g_saved.store(step); }

}  // namespace lcx
