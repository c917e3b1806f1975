// Whole files read for the CLI and the loaders, refusing what is not a readable regular file (a
// folder opens as an empty stream on Linux and would read as an empty manifest or text).
#pragma once
#include <fstream>
#include <string>

namespace lcx {

// The bytes of `path`. Throws naming `key` (the option or config key that gave the path) when it
// is missing, a folder, not a regular file (a device, a pipe), or unreadable; `fix` is the error's fix line.
std::string read_file(const std::string& path, const std::string& key, const std::string& fix);
// `path` opened for reading in binary, after the same checks: for a file read in parts.
std::ifstream open_file(const std::string& path, const std::string& key, const std::string& fix);

}  // namespace lcx
