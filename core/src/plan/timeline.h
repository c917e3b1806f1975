// The memory timeline of one step ([run] memory_timeline = true): the allocator recorder's events
// as JSON, and an SVG of live bytes stacked by category (weights, gradients, master weights,
// optimizer, saved activations, transient, communication) against the event index, with the
// plan's peak drawn across for comparison.
//
// The trainer records one step with StepTimeline: construct it right before the step (it takes
// the bytes already live, by category, which the events do not repeat, and starts the device
// allocator's recorder), call write() right after. Saved activations get a band per tensor, so
// the per-layer checkpoints show as a staircase.
#pragma once
#include <string>
#include <vector>

#include "lcx/memory.h"

namespace lcx {

struct TimelineFiles {
  std::string json;  // <dir>/memory_timeline.json
  std::string svg;   // <dir>/memory_timeline.svg
};

// planned_peak_bytes: the plan's allocated peak (0 leaves the line out).
TimelineFiles write_memory_timeline(const std::string& dir, const AllocatorStats& at_start,
                                    const std::vector<MemoryEvent>& events, int64_t planned_peak_bytes = 0);

class StepTimeline {
 public:
  explicit StepTimeline(Device device);
  StepTimeline(const StepTimeline&) = delete;
  StepTimeline& operator=(const StepTimeline&) = delete;
  ~StepTimeline();  // stops recording if write() was never called (the step threw)
  TimelineFiles write(const std::string& dir, int64_t planned_peak_bytes = 0);

 private:
  Device device_;
  AllocatorStats start_;
  bool written_ = false;
};

}  // namespace lcx
