#include "util/gpu_support.h"

#include "lcx/error.h"

namespace lcx {

std::string sm_name(int major, int minor) { return str("sm_", major, minor); }

std::string gpu_refusal(std::string_view name, int major, int minor) {
  if (major >= kMinComputeMajor) return {};
  return str(name, " is ", sm_name(major, minor), "; lcx needs sm_80 or newer (Ampere)");
}

std::string gpu_build_refusal(std::string_view name, int major, int minor, std::string_view targets) {
  return str(name, " is ", sm_name(major, minor), ", and this lcx was built for CUDA targets ", targets,
             " only, none of which it runs");
}

}  // namespace lcx
