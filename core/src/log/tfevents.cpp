#include "log/tfevents.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "lcx/error.h"

namespace lcx::tfevents {
namespace {

constexpr uint32_t kCastagnoli = 0x82F63B78u;  // reflected polynomial of CRC-32C

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCastagnoli : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

// Protocol buffer wire format: a field's key is (number << 3) | wire type.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void key(std::string& out, int field, int wire) { varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire)); }
template <typename T>
void fixed(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // little endian, as the wire format wants
  out.append(b, sizeof(T));
}
void bytes_field(std::string& out, int field, const std::string& v) {
  key(out, field, 2);
  varint(out, v.size());
  out += v;
}

std::string event_head(double wall_time, int64_t step) {
  std::string e;
  key(e, 1, 1);
  fixed(e, wall_time);
  if (step != 0) {
    key(e, 2, 0);
    varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  const auto& t = crc_table();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = t[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xA282EAD8u;
}

std::string file_version_event(double wall_time) {
  std::string e = event_head(wall_time, 0);
  bytes_field(e, 3, "brain.Event:2");
  return e;
}

std::string scalars_event(double wall_time, int64_t step, const Scalars& scalars) {
  std::string summary;
  for (const auto& [tag, value] : scalars) {
    std::string v;
    bytes_field(v, 1, tag);
    key(v, 2, 5);
    fixed(v, value);
    bytes_field(summary, 1, v);
  }
  std::string e = event_head(wall_time, step);
  bytes_field(e, 5, summary);
  return e;
}

std::string start_event(double wall_time, int64_t step) {
  std::string session_log;
  key(session_log, 1, 0);
  varint(session_log, 1);  // SessionLog.START
  std::string e = event_head(wall_time, step);
  bytes_field(e, 6, session_log);
  return e;
}

std::string record(const std::string& data) {
  std::string r;
  const uint64_t n = data.size();
  fixed(r, n);
  fixed(r, masked_crc32c(&n, sizeof n));
  r += data;
  fixed(r, masked_crc32c(data.data(), data.size()));
  return r;
}

bool is_events_file(const std::string& filename) { return filename.starts_with("events.out.tfevents."); }

Writer::Writer(const std::string& dir) {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  path_ = (std::filesystem::path(dir) /
           str("events.out.tfevents.", std::chrono::duration_cast<std::chrono::seconds>(now).count(), ".", host))
              .string();
  f_ = std::fopen(path_.c_str(), "ab");
  if (!f_)
    throw Error(str("cannot write the TensorBoard events file ", path_, ": ", std::strerror(errno)), "run.output_dir",
                "make run.output_dir writable");
}

Writer::~Writer() {
  if (f_) std::fclose(f_);
}

void Writer::write(const std::string& event) {
  const std::string r = record(event);
  if (std::fwrite(r.data(), 1, r.size(), f_) != r.size() || std::fflush(f_) != 0)
    throw Error(str("writing ", path_, " failed: ", std::strerror(errno)), "run.output_dir", "free disk space");
}

}  // namespace lcx::tfevents
