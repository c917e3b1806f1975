// The TensorBoard events file decoded by hand: record framing (length, masked CRC32C of the length
// and of the data, checked against the standard CRC-32C test vector) and the Event and Summary
// protobuf fields TensorBoard reads.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "log/tfevents.h"
#include "support/test_util.h"

namespace lcx {
namespace {

// A protobuf message as field number -> raw values (varints as numbers, the rest as bytes).
struct Field {
  int wire = -1;
  uint64_t varint = 0;
  std::string bytes;
};
std::multimap<int, Field> decode(const std::string& m) {
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
std::vector<std::string> records(const std::string& file) {
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

TEST(TfEvents, Crc32cMatchesTheStandardCheckValue) {
  EXPECT_EQ(tfevents::crc32c("123456789", 9), 0xE3069283u);  // RFC 3720's CRC-32C check value
  EXPECT_EQ(tfevents::crc32c("", 0), 0u);
  const uint32_t c = 0xE3069283u;
  EXPECT_EQ(tfevents::masked_crc32c("123456789", 9), ((c >> 15) | (c << 17)) + 0xA282EAD8u);
}

TEST(TfEvents, WriterFramesEventsThatDecodeToTheirFields) {
  const auto dir = test::temp_dir("tfevents");
  std::string path;
  {
    tfevents::Writer w(dir.string());
    path = w.path();
    w.write(tfevents::file_version_event(1700000000.5));
    w.write(tfevents::scalars_event(1700000001.25, 300, {{"train/loss", 2.5f}, {"train/learning_rate", 1e-5f}}));
    w.write(tfevents::start_event(1700000002.0, 7));
  }
  const std::string name = std::filesystem::path(path).filename().string();
  EXPECT_TRUE(name.starts_with("events.out.tfevents.")) << name;
  EXPECT_TRUE(tfevents::is_events_file(name));
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const auto recs = records(ss.str());
  ASSERT_EQ(recs.size(), 3u);

  auto first = decode(recs[0]);
  EXPECT_EQ(as<double>(first.find(1)->second.bytes), 1700000000.5);
  ASSERT_EQ(first.count(3), 1u);
  EXPECT_EQ(first.find(3)->second.bytes, "brain.Event:2");

  auto scalars = decode(recs[1]);
  EXPECT_EQ(as<double>(scalars.find(1)->second.bytes), 1700000001.25);
  EXPECT_EQ(scalars.find(2)->second.varint, 300u);
  ASSERT_EQ(scalars.count(5), 1u);
  auto summary = decode(scalars.find(5)->second.bytes);
  ASSERT_EQ(summary.count(1), 2u);
  std::vector<std::pair<std::string, float>> values;
  for (auto [it, end] = summary.equal_range(1); it != end; ++it) {
    auto v = decode(it->second.bytes);
    EXPECT_EQ(v.find(2)->second.wire, 5);
    values.emplace_back(v.find(1)->second.bytes, as<float>(v.find(2)->second.bytes));
  }
  EXPECT_EQ(values, (std::vector<std::pair<std::string, float>>{{"train/loss", 2.5f}, {"train/learning_rate", 1e-5f}}));

  auto start = decode(recs[2]);
  EXPECT_EQ(start.find(2)->second.varint, 7u);
  ASSERT_EQ(start.count(6), 1u);
  EXPECT_EQ(decode(start.find(6)->second.bytes).find(1)->second.varint, 1u);  // SessionLog.START
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace lcx
