// Lines only the run folder's log keeps (log.jsonl): what a run records for later (file hashes,
// the resolved config, the plan in bytes), which the terminal's summary (train/run_summary.h)
// says in short. Without a run folder's log they are debug lines.
#pragma once
#include <string>

namespace lcx::log {

// The spdlog logger the CLI gives the run folder's file alone.
inline constexpr const char* kDetailLogger = "lcx.detail";
void detail(const std::string& message);

}  // namespace lcx::log
