// The step trace behind lcx/profile.h: a StepProfiler made at the start of the chosen step turns
// the thread's ProfileScopes on; finish() (after the step's device work) resolves their times,
// writes <dir>/trace-step<N>.json (Chrome trace-event JSON, for Perfetto and chrome://tracing)
// and returns the summary table the trainer logs.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "lcx/profile.h"
#include "lcx/tensor.h"

namespace lcx {

struct ProfileReport {
  std::string trace_path;
  double step_ms = 0;
  std::vector<std::string> table;  // one log line each
};

class StepProfiler {
 public:
  // Records the step's start on `device` and installs itself on this thread.
  StepProfiler(Device device, int64_t step);
  ~StepProfiler();  // uninstalls; an unfinished profile (the step threw) writes nothing
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  ProfileReport finish(const std::string& dir);

 private:
  std::unique_ptr<profile_detail::Recorder> rec_;
};

}  // namespace lcx
