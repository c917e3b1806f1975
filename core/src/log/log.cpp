// Routes lcx::log to spdlog. The CLI configures the sinks (terminal, run folder); a library user
// that configures nothing gets spdlog's default logger.
#include "lcx/log.h"

#include <spdlog/spdlog.h>

#include "log/detail.h"

namespace lcx::log {

void detail(const std::string& message) {
  if (auto file = spdlog::get(kDetailLogger))
    file->info(message);
  else
    spdlog::debug(message);
}

void write(Level level, const std::string& message) {
  switch (level) {
    case Level::debug: spdlog::debug(message); break;
    case Level::info: spdlog::info(message); break;
    case Level::warn: spdlog::warn(message); break;
    case Level::error: spdlog::error(message); break;
  }
}

}  // namespace lcx::log
