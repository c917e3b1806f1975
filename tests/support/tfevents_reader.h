// Reads TensorBoard event files back by hand for the tests: the record framing, checked (length,
// masked CRC32C of the length and of the data), and protobuf messages as their raw fields.
#pragma once
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "log/tfevents.h"

namespace lcx::test {

// A protobuf message as field number -> raw values (varints as numbers, the rest as bytes).
struct Field {
  int wire = -1;
  uint64_t varint = 0;
  std::string bytes;
};
inline std::multimap<int, Field> decode(const std::string& m) {
  std::multimap<int, Field> out;
  size_t i = 0;
  auto read_varint = [&] {
    uint64_t v = 0;
    for (int shift = 0; i < m.size(); shift += 7) {
      const auto b = static_cast<uint8_t>(m[i++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) break;
    }
    return v;
  };
  while (i < m.size()) {
    const uint64_t key = read_varint();
    Field f;
    f.wire = static_cast<int>(key & 7);
    if (f.wire == 0) f.varint = read_varint();
    else if (f.wire == 1) f.bytes = m.substr(i, 8), i += 8;
    else if (f.wire == 5) f.bytes = m.substr(i, 4), i += 4;
    else if (f.wire == 2) {
      const uint64_t n = read_varint();
      f.bytes = m.substr(i, n);
      i += n;
    } else {
      ADD_FAILURE() << "wire type " << f.wire;
      break;
    }
    out.emplace(static_cast<int>(key >> 3), f);
  }
  return out;
}

template <typename T>
T as(const std::string& b) {
  T v;
  EXPECT_EQ(b.size(), sizeof(T));
  std::memcpy(&v, b.data(), sizeof(T));
  return v;
}

// The data of each record of a file, checking the framing.
inline std::vector<std::string> records(const std::string& file) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < file.size()) {
    EXPECT_GE(file.size() - at, 12u);
    const uint64_t n = as<uint64_t>(file.substr(at, 8));
    EXPECT_EQ(as<uint32_t>(file.substr(at + 8, 4)), tfevents::masked_crc32c(file.data() + at, 8));
    const std::string data = file.substr(at + 12, n);
    EXPECT_EQ(data.size(), n);
    EXPECT_EQ(as<uint32_t>(file.substr(at + 12 + n, 4)), tfevents::masked_crc32c(data.data(), data.size()));
    out.push_back(data);
    at += 12 + n + 4;
  }
  return out;
}

// The records of an events file.
inline std::vector<std::string> read_records(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return records(ss.str());
}

}  // namespace lcx::test
