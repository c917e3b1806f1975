// One exception type for everything a user can cause: it carries the config key (when there is
// one) and the fix, so the CLI can print "file:line: key: message (fix)" and exit non-zero.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace lcx {

// Joins any streamable values into one string; the SDK's formatting helper, so plugins need
// no formatting library of their own.
template <typename... Args>
std::string str(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, std::string key = {}, std::string fix = {})
      : std::runtime_error(message), key_(std::move(key)), fix_(std::move(fix)) {}
  const std::string& key() const { return key_; }
  const std::string& fix() const { return fix_; }

 private:
  std::string key_;
  std::string fix_;
};

// A broken internal invariant, not a user mistake: names the condition, file and line.
#define LCX_CHECK(cond, ...)                                                                 \
  do {                                                                                       \
    if (!(cond))                                                                             \
      throw ::lcx::Error(::lcx::str("check failed: " #cond " at ", __FILE__, ":", __LINE__, \
                                    " " __VA_OPT__(, __VA_ARGS__)));                         \
  } while (0)

}  // namespace lcx
