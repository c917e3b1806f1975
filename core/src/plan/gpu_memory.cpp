// Memory sizes for the plan: parsing --gpu-memory and --host-memory, the local GPU's total when
// there is one, and the host's budget and its check.
#include <algorithm>
#include <cctype>
#include <cmath>

#include "lcx/error.h"
#include "lcx/pinned.h"
#include "lcx/tensor.h"
#include "plan/plan.h"
#include "util/text.h"
#ifdef LCX_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace lcx {

int64_t parse_memory_size(const std::string& text, const std::string& option) {
  auto bad = [&]() -> Error {
    return Error(str(option, " '", text, "' is not a size"), option, "e.g. 80GB, 141GiB, 81920MiB or a byte count");
  };
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    throw bad();
  }
  std::string unit;
  for (size_t i = used; i < text.size(); ++i)
    if (!std::isspace(static_cast<unsigned char>(text[i])))
      unit += static_cast<char>(std::toupper(static_cast<unsigned char>(text[i])));
  int shift = -1;
  if (unit.empty() || unit == "B") shift = 0;
  else if (unit == "K" || unit == "KB" || unit == "KIB") shift = 10;
  else if (unit == "M" || unit == "MB" || unit == "MIB") shift = 20;
  else if (unit == "G" || unit == "GB" || unit == "GIB") shift = 30;
  else if (unit == "T" || unit == "TB" || unit == "TIB") shift = 40;
  if (shift < 0 || !(value > 0) || !std::isfinite(value)) throw bad();
  // Sums and multiples of budgets stay within int64: sizes past 2^62 bytes are refused.
  const double bytes = std::ldexp(value, shift);
  if (bytes > std::ldexp(1.0, 62))
    throw Error(str(option, " '", text, "' is ", bytes, " bytes, past the 4 EiB (2^62 bytes) lcx's 64-bit sizes hold"), option,
                "give the memory of the GPU or host, e.g. 80GB, 141GiB or 2TB");
  return static_cast<int64_t>(bytes);
}

int64_t host_memory_budget(const std::string& text, const RunConfig& run) {
  if (!text.empty()) return parse_memory_size(text, "--host-memory");
  if (run.host_memory != "auto") return parse_memory_size(run.host_memory, "run.host_memory");
  return host_memory_available();
}

std::string host_memory_source(const std::string& text, const RunConfig& run) {
  if (!text.empty()) return "--host-memory";
  if (run.host_memory != "auto") return "run.host_memory";
  return "this machine's available memory: MemAvailable and the cgroup's room";
}

int64_t node_host_bytes(const MemoryPlan& plan, const PlanInputs& in) {
  return plan.host_peak() * std::max<int64_t>(in.local_ranks, 1);
}

const char* const kHostMemoryFix =
    "lower data.seq_len, keep fewer layers' inputs in host memory (more of them on the GPU, or train.checkpoint_every "
    "= \"auto\" or k > 1 to save every k-th), "
    "or run on a node with more host memory (lcx-train --plan --host-memory SIZE plans for one)";

void check_host_memory(const MemoryPlan& plan, const PlanInputs& in, int64_t host_bytes) {
  const int64_t need = node_host_bytes(plan, in);
  if (host_bytes < 0 || need <= host_bytes) return;
  throw Error(str("the step pins ", format_bytes(need), " of host memory",
                  in.local_ranks > 1 ? str(" (", format_bytes(plan.host_peak()), " x ", in.local_ranks, " ranks on this node)")
                                     : std::string(),
                  " but the host has ", format_bytes(host_bytes), ": short by ", format_bytes(need - host_bytes)),
              "run.host_memory", kHostMemoryFix);
}

std::optional<int64_t> local_gpu_memory() {
#ifdef LCX_HAVE_CUDA
  if (!cuda_available()) return std::nullopt;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return std::nullopt;
  return static_cast<int64_t>(prop.totalGlobalMem);
#else
  return std::nullopt;
#endif
}

}  // namespace lcx
