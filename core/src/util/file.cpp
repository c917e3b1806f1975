#include "util/file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "lcx/error.h"

namespace lcx {

std::string read_file(const std::string& path, const std::string& key, const std::string& fix) {
  std::ifstream in = open_file(path, key, fix);
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) throw Error(str(key, ": reading '", path, "' failed"), key, fix);
  return std::move(s).str();
}

std::ifstream open_file(const std::string& path, const std::string& key, const std::string& fix) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (std::filesystem::is_directory(status))
    throw Error(str(key, ": '", path, "' is a folder, not a file"), key, fix);
  if (!std::filesystem::exists(status)) throw Error(str(key, ": '", path, "' does not exist"), key, fix);
  // A device or pipe (/dev/zero) would be read without end.
  if (!std::filesystem::is_regular_file(status))
    throw Error(str(key, ": '", path, "' is not a regular file (a device, pipe or socket)"), key, fix);
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(str(key, ": cannot read '", path, "': ", std::strerror(errno)), key, fix);
  return in;
}

}  // namespace lcx
