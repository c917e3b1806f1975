// The memory timeline of one step ([run] memory_timeline = true): the allocator recorder's events
// as JSON, and an SVG of live bytes stacked by category (weights, gradients, master weights,
// optimizer, saved activations, transient, communication) against the event index, with the
// plan's peak drawn across for comparison.
//
// The trainer enables allocator_for(device).recorder() at the start of the recorded step, takes
// stats() then (the bytes already live, by category, which the events do not repeat), and after
// the step calls write_memory_timeline with those stats and recorder().events().
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

}  // namespace lcx
