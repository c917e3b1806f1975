// Logging for core and plugins. Core routes these to spdlog (compact on a terminal, JSON lines in
// the run folder); plugins call them so they need no logging library of their own.
#pragma once
#include <string>

namespace lcx::log {

enum class Level { debug, info, warn, error };
void write(Level level, const std::string& message);
inline void debug(const std::string& m) { write(Level::debug, m); }
inline void info(const std::string& m) { write(Level::info, m); }
inline void warn(const std::string& m) { write(Level::warn, m); }
inline void error(const std::string& m) { write(Level::error, m); }

}  // namespace lcx::log
