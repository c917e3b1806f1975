// Seconds on the steady clock: how core and the plugins time host-side work (the step's phases,
// waits, the optimizer) without a device event.
#pragma once
#include <chrono>

namespace lcx {

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace lcx
