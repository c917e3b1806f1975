// Memory sizes for the plan: the local GPU's total when there is one, and the host's budget and
// its check.
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

void check_cpu_memory(const MemoryPlan& plan, const PlanInputs& in, int64_t host_bytes, int64_t rank_extra_bytes) {
  const int64_t ranks = std::max<int64_t>(in.local_ranks, 1);
  const int64_t one = checked_add(checked_add(plan.peak(false).bytes, plan.host_peak(), "the step's host bytes"),
                                  rank_extra_bytes, "the step's host bytes");
  const int64_t need = checked_mul(one, ranks, "the step's host bytes, all thread-ranks counted");
  if (host_bytes < 0 || need <= host_bytes) return;
  throw Error(str("on the CPU the step needs ", format_bytes(need), " of host memory",
                  ranks > 1 ? str(" (", format_bytes(one), " x ", ranks, " thread-ranks",
                                  rank_extra_bytes > 0 ? str(", each with its tokenizer's ", format_bytes(rank_extra_bytes)) : "",
                                  ")")
                            : std::string(),
                  " but the host has ", format_bytes(host_bytes), ": short by ", format_bytes(need - host_bytes)),
              ranks > 1 ? "distributed.nproc_per_node" : "run.host_memory",
              str(ranks > 1 ? "run fewer thread-ranks (distributed.nproc_per_node), " : "",
                  "a smaller model or a shorter data.seq_len; on a GPU the plan fits the run to its memory "
                  "(lcx-train --plan shows the bytes)"));
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
