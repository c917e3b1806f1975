// SHA-256, for the file hashes in run logs and cache keys (no crypto library needed for that).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace lcx {

class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  std::string hex();  // finishes the hash

 private:
  void block(const uint8_t* p);
  uint32_t h_[8];
  uint8_t buf_[64];
  size_t buf_len_ = 0;
  uint64_t total_ = 0;
};

std::string sha256_file(const std::string& path);  // "" when unreadable
std::string sha256_string(const std::string& s);

}  // namespace lcx
