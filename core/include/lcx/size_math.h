// Byte and element counts in int64 that refuse to wrap: a product or sum past 2^63 - 1 throws
// naming what was being sized, where plain arithmetic would give a small or negative number that
// then "fits". The one place for it: allocations, the memory plan and the data use these.
#pragma once
#include <cstdint>
#include <string>

#include "lcx/error.h"

namespace lcx {

inline int64_t checked_mul(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw Error(str(what, ": ", a, " x ", b, " passes the largest size 64 bits hold (9.2e18)"));
  return r;
}

// "12.34 GiB", "512.0 MiB" or "4.0 KiB": how every message of lcx and its plugins shows a size.
std::string format_bytes(int64_t bytes);

inline int64_t checked_add(int64_t a, int64_t b, const std::string& what) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r))
    throw Error(str(what, ": ", a, " + ", b, " passes the largest size 64 bits hold (9.2e18)"));
  return r;
}

}  // namespace lcx
