#include "util/crc32c.h"

#include <fcntl.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <vector>

#include "lcx/error.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace lcx {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78;  // Castagnoli's, bit-reversed

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kTable = make_table();

uint32_t crc32c_table(uint32_t c, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) c = kTable[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t c, const uint8_t* p, size_t n) {
  uint64_t c64 = c;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
  }
  c = static_cast<uint32_t>(c64);
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(c, *p);
  return c;
}
#endif

}  // namespace

uint32_t crc32c(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  c = hardware ? crc32c_sse42(c, p, n) : crc32c_table(c, p, n);
#else
  c = crc32c_table(c, p, n);
#endif
  return ~c;
}

FileChecksum checksum_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(str("cannot read ", path, ": ", std::strerror(errno)), {}, "check the file and its permissions");
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  FileChecksum sum;
  std::vector<uint8_t> buf(size_t{8} << 20);
  for (;;) {
    const ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw Error(str("cannot read ", path, ": ", std::strerror(err)), {}, "check the file and the disk");
    }
    if (n == 0) break;
    sum.crc32c = crc32c(sum.crc32c, buf.data(), static_cast<size_t>(n));
    sum.bytes += static_cast<uint64_t>(n);
  }
  ::close(fd);
  return sum;
}

}  // namespace lcx
