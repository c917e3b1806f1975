// Safetensors reading and writing: round trips in every dtype, sharded folders, and each kind of
// bad file refused with an error that names the file and the tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lcx/safetensors.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::error_of;

namespace fs = std::filesystem;
namespace st = safetensors;

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const fs::path& p, const std::string& b) { std::ofstream(p, std::ios::binary) << b; }

// A file image from a header object and raw data, as the format lays it out.
std::string image(const nlohmann::json& header, const std::string& data) {
  std::string h = header.dump();
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(h.size() >> (8 * i));
  return out + h + data;
}

std::vector<st::NamedTensor> sample() {
  return {{"w", Tensor::from_floats({1.5f, -2.25f, 3.f, 0.1f, 1e-3f, -7.f}, {2, 3}, DType::f32)},
          {"n", Tensor::from_floats({1.f, 2.f, 3.f}, {3}, DType::f32)}};
}

TEST(Safetensors, RoundTripsEveryFloatDtype) {
  auto dir = test::temp_dir("st");
  for (DType disk : {DType::f32, DType::bf16, DType::f16}) {
    const std::string path = (dir / (std::string(dtype_name(disk)) + ".safetensors")).string();
    st::write_file(path, sample(), disk);
    st::Checkpoint ck = st::Checkpoint::open(path);
    EXPECT_EQ(ck.names(), (std::vector<std::string>{"n", "w"}));
    EXPECT_EQ(ck.info("w").shape, (Shape{2, 3}));
    EXPECT_EQ(ck.info("w").dtype, disk == DType::f32 ? "F32" : disk == DType::bf16 ? "BF16" : "F16");
    for (DType want : {DType::f32, DType::bf16, DType::f16}) {
      Tensor t = ck.load("w", want);
      EXPECT_EQ(t.dtype(), want);
      // What the value becomes after the disk dtype, then the wanted dtype: the exact rounding chain.
      std::vector<float> expect = Tensor::from_floats(sample()[0].value.to_floats(), {2, 3}, disk).to_floats();
      expect = Tensor::from_floats(expect, {2, 3}, want).to_floats();
      EXPECT_EQ(t.to_floats(), expect) << dtype_name(disk) << " -> " << dtype_name(want);
    }
  }
}

TEST(Safetensors, HeaderIsPaddedAndMetadataKept) {
  auto dir = test::temp_dir("st");
  const auto path = dir / "m.safetensors";
  st::write_file(path.string(), sample(), DType::f32, {{"format", "pt"}, {"who", "lcx"}});
  std::string bytes = read_bytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  EXPECT_EQ((8 + n) % 8, 0u);
  st::File f(path.string());
  EXPECT_EQ(f.header().metadata.at("who"), "lcx");
  EXPECT_EQ(f.header().tensors.size(), 2u);
}

TEST(Safetensors, IntegerTensorsKeepTheirKindEitherWay) {
  auto dir = test::temp_dir("st");
  const auto path = dir / "i.safetensors";
  Tensor ids = Tensor::empty({3}, DType::i64);
  ids.data_as<int64_t>()[0] = 5;
  ids.data_as<int64_t>()[1] = -100;
  ids.data_as<int64_t>()[2] = 1ll << 40;
  st::write_file(path.string(), {{"ids", ids}, {"w", sample()[0].value}}, DType::bf16);
  st::Checkpoint ck = st::Checkpoint::open(path.string());
  EXPECT_EQ(ck.info("ids").dtype, "I64");  // integers keep their dtype whatever the float dtype
  EXPECT_EQ(ck.load("ids", DType::i64).data_as<int64_t>()[2], 1ll << 40);
  EXPECT_NE(error_of([&] { ck.load("ids", DType::i32); }).find("does not fit int32"), std::string::npos);
  // An integer tensor asked for as a floating-point weight is refused, as is the other way.
  for (DType want : {DType::f32, DType::bf16, DType::f16}) {
    const std::string e = error_of([&] { ck.load("ids", want); });
    EXPECT_NE(e.find("tensor 'ids': holds I64 but a floating-point tensor"), std::string::npos) << e;
  }
  EXPECT_NE(error_of([&] { ck.load("w", DType::i64); }).find("integer tensor"), std::string::npos);
}

TEST(Safetensors, WeightRelabelledAsIntegerIsRefused) {
  // F32 -> I32 keeps every size and offset valid: only the dtype check can tell.
  auto dir = test::temp_dir("st-relabel");
  const auto path = dir / "model.safetensors";
  st::write_file(path.string(), sample(), DType::f32);
  std::string bytes = read_bytes(path);
  const size_t at = bytes.find("\"F32\"");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 5, "\"I32\"");
  write_bytes(path, bytes);
  st::Checkpoint ck = st::Checkpoint::open(path.string());
  int refused = 0;
  for (const char* name : {"w", "n"}) {
    if (ck.info(name).dtype != "I32") continue;
    const std::string e = error_of([&] { ck.load(name, DType::f32); });
    EXPECT_NE(e.find(str("tensor '", name, "': holds I32 but a floating-point tensor (fp32)")), std::string::npos) << e;
    ++refused;
  }
  EXPECT_EQ(refused, 1);
}

// A damaged header is named as a damaged file, with a fix, not the JSON parser's text.
TEST(Safetensors, DamagedHeaderSaysTheFileIsDamaged) {
  auto dir = test::temp_dir("st-damaged");
  const auto path = dir / "optimizer.safetensors";
  st::write_file(path.string(), sample(), DType::f32);
  std::string bytes = read_bytes(path);
  bytes[8 + 5] = '\x01';
  write_bytes(path, bytes);
  const test::Thrown t = test::thrown_by([&] { st::Checkpoint::open(path.string()); });
  ASSERT_TRUE(t.thrown);
  EXPECT_NE(t.message.find(path.string() + ": the header is not valid JSON (from byte "), std::string::npos) << t.message;
  EXPECT_NE(t.message.find("): the file is damaged"), std::string::npos) << t.message;
  EXPECT_EQ(t.message.find("json.exception"), std::string::npos) << t.message;
  EXPECT_FALSE(t.fix.empty());
}

TEST(Safetensors, ShardedFolderWithIndex) {
  auto dir = test::temp_dir("st-shard");
  std::vector<st::NamedTensor> ts;
  for (int i = 0; i < 5; ++i)
    ts.push_back({"t" + std::to_string(i), Tensor::from_floats(std::vector<float>(64, static_cast<float>(i)), {8, 8}, DType::f32)});
  // 64 bf16 values are 128 bytes: two per 300-byte shard.
  auto files = st::write_checkpoint(dir.string(), ts, DType::bf16, 300);
  EXPECT_EQ(files.size(), 4u);  // three shards and the index
  EXPECT_TRUE(fs::exists(dir / "model-00001-of-00003.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors"));
  st::Checkpoint ck = st::Checkpoint::open(dir.string());
  EXPECT_EQ(ck.names().size(), 5u);
  EXPECT_EQ(ck.load("t4", DType::f32).to_floats()[63], 4.f);
  EXPECT_NE(ck.file_of("t4").find("model-00003-of-00003"), std::string::npos);
  // Writing again as one file removes the shards, so nothing stale is read.
  st::write_checkpoint(dir.string(), ts, DType::bf16);
  EXPECT_TRUE(fs::exists(dir / "model.safetensors"));
  EXPECT_FALSE(fs::exists(dir / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(dir / "model-00001-of-00003.safetensors"));
}

TEST(Safetensors, IndexAndShardsMustAgree) {
  auto dir = test::temp_dir("st-index");
  std::vector<st::NamedTensor> ts;
  for (const char* n : {"a", "b", "c"}) ts.push_back({n, Tensor::from_floats({1.f, 2.f}, {2}, DType::f32)});
  st::write_checkpoint(dir.string(), ts, DType::f32, 16);  // {a, b} and {c}
  const auto index = dir / "model.safetensors.index.json";
  nlohmann::json j = nlohmann::json::parse(read_bytes(index));
  ASSERT_EQ(j["weight_map"]["b"], "model-00001-of-00002.safetensors");
  // An index naming a tensor its shard lacks.
  nlohmann::json missing = j;
  missing["weight_map"]["ghost"] = "model-00002-of-00002.safetensors";
  write_bytes(index, missing.dump());
  std::string e = error_of([&] { st::Checkpoint::open(dir.string()); });
  EXPECT_NE(e.find("'ghost'"), std::string::npos) << e;
  EXPECT_NE(e.find("model-00002-of-00002.safetensors"), std::string::npos) << e;
  // A shard holding a tensor the index does not map there.
  nlohmann::json unmapped = j;
  unmapped["weight_map"].erase("b");
  write_bytes(index, unmapped.dump());
  e = error_of([&] { st::Checkpoint::open(dir.string()); });
  EXPECT_NE(e.find("tensor 'b'"), std::string::npos) << e;
  EXPECT_NE(e.find("does not map"), std::string::npos) << e;
  // A shard name that would reach outside the folder.
  nlohmann::json escape = j;
  escape["weight_map"]["c"] = "../x.safetensors";
  write_bytes(index, escape.dump());
  EXPECT_NE(error_of([&] { st::Checkpoint::open(dir.string()); }).find("not a plain file name"), std::string::npos);
  write_bytes(index, j.dump());
  EXPECT_EQ(st::Checkpoint::open(dir.string()).names().size(), 3u);
  EXPECT_NE(error_of([&] { st::Checkpoint::open((dir / "nope").string()); }).find("does not exist"), std::string::npos);
  fs::remove(index);
  EXPECT_NE(error_of([&] { st::Checkpoint::open(dir.string()); }).find("holds neither"), std::string::npos);
}

// Each bad file: the error names the file and (where there is one) the tensor.
TEST(Safetensors, BadFilesAreRefusedByName) {
  auto dir = test::temp_dir("st-bad");
  const std::string good_path = (dir / "good.safetensors").string();
  st::write_file(good_path, sample(), DType::f32);
  const std::string good = read_bytes(good_path);
  auto check = [&](const std::string& name, const std::string& bytes, const std::vector<std::string>& needles) {
    const auto p = dir / (name + ".safetensors");
    write_bytes(p, bytes);
    std::string e = error_of([&] { st::Checkpoint::open(p.string()); });
    EXPECT_NE(e.find(p.string()), std::string::npos) << name << ": " << e;
    for (const auto& n : needles) EXPECT_NE(e.find(n), std::string::npos) << name << ": " << e;
  };
  check("truncated", good.substr(0, good.size() - 4), {"tensor '", "run past the data section"});
  check("tiny", good.substr(0, 5), {"truncated"});
  check("empty", "", {"truncated"});
  std::string longer = good;
  longer[0] = static_cast<char>(0xff);
  longer[1] = static_cast<char>(0xff);
  check("header_too_long", longer, {"larger than the file"});
  auto f32 = [](std::vector<float> v) { return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4); };
  check("out_of_range", image({{"a", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {8, 16}}}}}, f32({1, 2})),
        {"tensor 'a'", "run past"});
  check("overlap",
        image({{"a", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {0, 8}}}},
               {"b", {{"dtype", "F32"}, {"shape", {2}}, {"data_offsets", {4, 12}}}}},
              f32({1, 2, 3})),
        {"tensor 'b'", "overlap tensor 'a'"});
  check("dtype_bytes", image({{"a", {{"dtype", "BF16"}, {"shape", {3}}, {"data_offsets", {0, 8}}}}}, f32({1, 2})),
        {"tensor 'a'", "needs 3 x 2 bytes"});
  check("shape_bytes", image({{"a", {{"dtype", "F32"}, {"shape", {2, 2}}, {"data_offsets", {0, 8}}}}}, f32({1, 2})),
        {"tensor 'a'", "[2, 2]"});
  check("unknown_dtype", image({{"a", {{"dtype", "Q4"}, {"shape", {2}}, {"data_offsets", {0, 8}}}}}, f32({1, 2})),
        {"tensor 'a'", "unknown dtype 'Q4'"});
  check("overflow",
        image({{"a", {{"dtype", "F64"}, {"shape", {1ull << 40, 1ull << 40}}, {"data_offsets", {0, 8}}}}}, f32({1, 2})),
        {"tensor 'a'", "overflows"});
  check("gap", image({{"a", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {4, 8}}}}}, f32({1, 2})),
        {"tensor 'a'", "gap"});
  check("trailing", image({{"a", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}}}}, f32({1, 2})),
        {"tensors cover 4"});
  check("not_json", std::string("\x04\0\0\0\0\0\0\0{{{{", 12), {"not valid JSON"});
  check("extra_key", image({{"a", {{"dtype", "F32"}, {"shape", {1}}, {"data_offsets", {0, 4}}, {"x", 1}}}}, f32({1})),
        {"tensor 'a'", "unexpected key 'x'"});
}

TEST(Safetensors, NonFiniteValuesFailOnlyWhenChecked) {
  auto dir = test::temp_dir("st-nan");
  const std::string path = (dir / "nan.safetensors").string();
  st::write_file(path, {{"bad", Tensor::from_floats({1.f, NAN, 2.f}, {3}, DType::f32)},
                        {"inf", Tensor::from_floats({INFINITY}, {1}, DType::f32)}},
                 DType::bf16);
  st::Checkpoint ck = st::Checkpoint::open(path);
  EXPECT_TRUE(std::isnan(ck.load("bad", DType::f32).to_floats()[1]));
  std::string e = error_of([&] { ck.load("bad", DType::f32, Device::cpu(), true); });
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("tensor 'bad'"), std::string::npos) << e;
  EXPECT_NE(e.find("element 1"), std::string::npos) << e;
  EXPECT_NE(error_of([&] { ck.load("inf", DType::bf16, Device::cpu(), true); }).find("tensor 'inf'"), std::string::npos);
}

TEST(Safetensors, CorpusFilesParseOrFailCleanly) {
  const fs::path corpus = fs::path(LCX_TEST_DATA_DIR) / "io" / "corpus";
  int ok = 0, bad = 0;
  for (const auto& e : fs::directory_iterator(corpus)) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() != ".safetensors") continue;
    std::string err = error_of([&] { st::File f(e.path().string()); });
    if (name.rfind("ok_", 0) == 0) {
      EXPECT_EQ(err, "(no error)") << name;
      ++ok;
    } else {
      EXPECT_NE(err, "(no error)") << name;
      EXPECT_NE(err.find(name), std::string::npos) << err;
      ++bad;
    }
  }
  EXPECT_GE(ok, 4);
  EXPECT_GE(bad, 10);
}

}  // namespace
}  // namespace lcx
