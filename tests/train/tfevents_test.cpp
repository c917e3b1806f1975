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
#include "support/tfevents_reader.h"

namespace lcx {
namespace {

using test::as;
using test::decode;
using test::records;

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
