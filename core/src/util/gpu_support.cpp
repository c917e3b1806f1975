#include "util/gpu_support.h"

#include "lcx/error.h"

namespace lcx {

std::string sm_name(int major, int minor) { return str("sm_", major, minor); }

std::string gpu_refusal(std::string_view name, int major, int minor) {
  if (major >= kMinComputeMajor) return {};
  return str(name, " is ", sm_name(major, minor), "; lcx needs sm_80 or newer (Ampere)");
}

std::string gpu_build_refusal(std::string_view name, int major, int minor, std::string_view targets) {
  const int cc = major * 10 + minor;
  std::string_view rest = targets;
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    const std::string_view t = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    size_t digits = 0;
    while (digits < t.size() && t[digits] >= '0' && t[digits] <= '9') ++digits;
    if (digits == 0) continue;
    const int arch = std::stoi(std::string(t.substr(0, digits)));
    const std::string_view suffix = t.substr(digits);
    const bool specific = !suffix.empty() && (suffix[0] == 'a' || suffix[0] == 'f');
    const bool real = suffix.find("-virtual") == std::string_view::npos;
    const bool ptx = suffix.find("-real") == std::string_view::npos;
    if (real && (specific ? cc == arch : cc / 10 == arch / 10 && cc >= arch)) return {};
    if (ptx && !specific && cc >= arch) return {};
  }
  return str(name, " is ", sm_name(major, minor), ", and this lcx was built for CUDA targets ", targets,
             " only, none of which it runs");
}

}  // namespace lcx
