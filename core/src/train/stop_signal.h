// SIGINT and SIGTERM during a run. The first one asks the run to stop after the step in progress:
// the step finishes, a checkpoint is saved, the process exits 130. The handler says so on stderr
// at once, since a step may take minutes. A second one ends the process at once (exit 128 +
// signal) without saving, and says which steps are lost. In a job of several processes only the
// one that speaks for the job (rank 0) writes these lines.
#pragma once
#include <cstdint>

namespace lcx {

class StopSignals {
 public:
  StopSignals();  // installs the handlers; the previous ones come back on destruction
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  static int requested();  // the first signal received, 0 when none
  static void speak(bool yes);
  // What a second signal would lose: the step now running (1-based) and the last one saved.
  static void step_running(int64_t step);
  // The ranks have read the stop request of `step` (they agree on it once, at its reduce): a
  // signal from now on stops the run after the next step, and the handler says that one.
  static void request_read(int64_t step);
  static void saved(int64_t step);
};

}  // namespace lcx
