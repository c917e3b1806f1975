// CRC-32C (Castagnoli), the checksum of every file a checkpoint writes: SSE 4.2's crc32
// instruction where the CPU has it (about 8 GB/s a core, beside a disk's 1 to 3 GB/s of writing),
// a table otherwise.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace lcx {

// The CRC of `n` more bytes after `crc` (0 to start).
uint32_t crc32c(uint32_t crc, const void* data, size_t n);

struct FileChecksum {
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
};
// The file read whole; throws lcx::Error naming it when it cannot be read.
FileChecksum checksum_file(const std::string& path);

}  // namespace lcx
