// The batched, parallel weight load (Checkpoint::load_into): the same bytes as a serial conversion
// for every stored dtype into every target dtype, across shards and across pieces that cut tensors
// at odd places; a NaN or Inf in one tensor of one shard refused by name; the progress line.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "lcx/safetensors.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::error_of;
namespace st = safetensors;

const DType kFloats[] = {DType::f32, DType::bf16, DType::f16};

// Tensors of awkward sizes (odd counts, one larger than several pieces) whose values cover what a
// conversion can get wrong: normal values, subnormals of each format, values beyond fp16's range
// (Inf once in fp16, so only loaded unchecked) and exact halfway cases of the rounding.
std::vector<st::NamedTensor> awkward(bool with_overflow) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<st::NamedTensor> out;
  const std::vector<Shape> shapes = {{3, 5}, {1}, {4097}, {64, 33}, {7, 129}, {2, 3, 11}};
  for (size_t k = 0; k < shapes.size(); ++k) {
    std::vector<float> v(static_cast<size_t>(shape_numel(shapes[k])));
    for (size_t i = 0; i < v.size(); ++i) {
      switch (i % 7) {
        case 0: v[i] = normal(rng) * 1e-6f; break;   // fp16 subnormals
        case 1: v[i] = normal(rng) * 1e-39f; break;  // fp32 / bf16 subnormals
        case 2: v[i] = with_overflow ? 1e5f * normal(rng) : 3.f; break;
        case 3: v[i] = 1.f + 1.f / 256.f; break;     // halfway for bf16
        default: v[i] = normal(rng);
      }
    }
    out.push_back({"t" + std::to_string(k), Tensor::from_floats(v, shapes[k], DType::f32)});
  }
  return out;
}

void expect_same_bytes(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.dtype(), want.dtype()) << what;
  ASSERT_EQ(got.nbytes(), want.nbytes()) << what;
  EXPECT_EQ(std::memcmp(got.data(), want.data(), want.nbytes()), 0) << what;
}

TEST(SafetensorsLoad, ParallelMatchesSerialBitForBit) {
  const auto tensors = awkward(true);
  for (DType stored : kFloats) {
    auto dir = test::temp_dir(str("st-par-", dtype_name(stored)));
    // Small shards: the tensors spread over several files.
    auto files = st::write_checkpoint(dir.string(), tensors, stored, 4000);
    ASSERT_GT(files.size(), 3u) << "several shards and the index";
    st::Checkpoint ck = st::Checkpoint::open(dir.string());
    for (DType to : kFloats) {
      SCOPED_TRACE(str(dtype_name(stored), " -> ", dtype_name(to)));
      // The serial reference: each value as stored, converted element by element through fp32.
      std::vector<Tensor> want;
      for (const auto& t : tensors) want.push_back(t.value.to(stored).to(to));
      // Odd piece sizes cut tensors mid-row; one thread and several must agree with the reference.
      for (auto [threads, piece] : {std::pair<int, uint64_t>{1, 16ull << 20}, {4, 48}, {3, 4096}, {8, 16}}) {
        std::vector<st::LoadTarget> targets;
        for (const auto& t : tensors) targets.push_back({t.name, Tensor::empty(t.value.shape(), to)});
        st::LoadOptions o;
        o.threads = threads;
        o.piece_bytes = piece;
        ck.load_into(targets, o);
        for (size_t k = 0; k < tensors.size(); ++k)
          expect_same_bytes(targets[k].dst, want[k], str(tensors[k].name, ", ", threads, " threads, pieces of ", piece));
      }
      for (size_t k = 0; k < tensors.size(); ++k)
        expect_same_bytes(ck.load(tensors[k].name, to), want[k], tensors[k].name + " by load()");
    }
  }
}

TEST(SafetensorsLoad, FiniteCheckPassesFiniteWeights) {
  auto dir = test::temp_dir("st-par-finite");
  const auto tensors = awkward(false);
  st::write_checkpoint(dir.string(), tensors, DType::bf16, 9000);
  st::Checkpoint ck = st::Checkpoint::open(dir.string());
  for (DType to : kFloats) {
    std::vector<st::LoadTarget> targets;
    for (const auto& t : tensors) targets.push_back({t.name, Tensor::empty(t.value.shape(), to)});
    st::LoadOptions o;
    o.check_finite = true;
    o.threads = 4;
    o.piece_bytes = 64;
    EXPECT_EQ(error_of([&] { ck.load_into(targets, o); }), "(no error)") << dtype_name(to);
  }
}

TEST(SafetensorsLoad, NonFiniteInOneShardIsRefusedByName) {
  auto tensors = awkward(false);
  // One NaN deep inside the largest tensor (past its first pieces), and a second, later one in
  // another tensor: the first tensor in the caller's order is named, at its first bad element.
  tensors[2].value.data_as<float>()[3001] = NAN;
  tensors[2].value.data_as<float>()[4000] = INFINITY;
  tensors[4].value.data_as<float>()[5] = -INFINITY;
  for (DType stored : {DType::f32, DType::bf16}) {
    auto dir = test::temp_dir(str("st-par-nan-", dtype_name(stored)));
    st::write_checkpoint(dir.string(), tensors, stored, 9000);
    st::Checkpoint ck = st::Checkpoint::open(dir.string());
    const std::string shard = ck.file_of("t2");
    for (DType to : kFloats) {
      SCOPED_TRACE(str(dtype_name(stored), " -> ", dtype_name(to)));
      std::vector<st::LoadTarget> targets;
      for (const auto& t : tensors) targets.push_back({t.name, Tensor::empty(t.value.shape(), to)});
      st::LoadOptions o;
      o.check_finite = true;
      o.threads = 4;
      o.piece_bytes = 256;
      const std::string e = error_of([&] { ck.load_into(targets, o); });
      EXPECT_NE(e.find(shard), std::string::npos) << e;
      EXPECT_NE(e.find("tensor 't2'"), std::string::npos) << e;
      EXPECT_NE(e.find("element 3001 is nan"), std::string::npos) << e;
      EXPECT_NE(e.find("fix: the checkpoint is corrupt"), std::string::npos) << e;
      // Unchecked, the same load goes through.
      o.check_finite = false;
      EXPECT_EQ(error_of([&] { ck.load_into(targets, o); }), "(no error)");
    }
  }
}

TEST(SafetensorsLoad, OverflowIntoFp16IsRefused) {
  auto dir = test::temp_dir("st-par-overflow");
  const std::string path = (dir / "w.safetensors").string();
  std::vector<float> v(100, 1.f);
  v[77] = 1e6f;  // finite in fp32 and bf16, Inf once in fp16
  st::write_file(path, {{"w", Tensor::from_floats(v, {100}, DType::f32)}}, DType::f32);
  st::Checkpoint ck = st::Checkpoint::open(path);
  st::LoadOptions o;
  o.check_finite = true;
  std::vector<st::LoadTarget> bf = {{"w", Tensor::empty({100}, DType::bf16)}};
  EXPECT_EQ(error_of([&] { ck.load_into(bf, o); }), "(no error)");
  std::vector<st::LoadTarget> half = {{"w", Tensor::empty({100}, DType::f16)}};
  const std::string e = error_of([&] { ck.load_into(half, o); });
  EXPECT_NE(e.find("tensor 'w'"), std::string::npos) << e;
  EXPECT_NE(e.find("element 77 is inf"), std::string::npos) << e;
}

TEST(SafetensorsLoad, DestinationsAreCheckedBeforeReading) {
  auto dir = test::temp_dir("st-par-dst");
  const std::string path = (dir / "w.safetensors").string();
  st::write_file(path, {{"w", Tensor::from_floats({1.f, 2.f, 3.f, 4.f}, {2, 2}, DType::f32)}}, DType::f32);
  st::Checkpoint ck = st::Checkpoint::open(path);
  std::string e = error_of([&] { ck.load_into({{"w", Tensor::empty({4}, DType::f32)}}); });
  EXPECT_NE(e.find("tensor 'w'"), std::string::npos) << e;
  EXPECT_NE(e.find("has shape [2, 2] but its destination has [4]"), std::string::npos) << e;
  e = error_of([&] { ck.load_into({{"nope", Tensor::empty({4}, DType::f32)}}); });
  EXPECT_NE(e.find("tensor 'nope'"), std::string::npos) << e;
  e = error_of([&] { ck.load_into({{"w", Tensor::empty({2, 2}, DType::i32)}}); });
  EXPECT_NE(e.find("holds F32 but an integer tensor"), std::string::npos) << e;
}

TEST(SafetensorsLoad, ProgressLineShowsBytesAndRate) {
  auto dir = test::temp_dir("st-par-progress");
  const auto tensors = awkward(false);
  st::write_checkpoint(dir.string(), tensors, DType::bf16, 9000);
  st::Checkpoint ck = st::Checkpoint::open(dir.string());
  std::vector<st::LoadTarget> targets;
  for (const auto& t : tensors) targets.push_back({t.name, Tensor::empty(t.value.shape(), DType::bf16)});
  st::LoadOptions o;
  o.progress = true;
  testing::internal::CaptureStderr();
  ck.load_into(targets, o);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("loaded weights: 0.0 GB in "), std::string::npos) << err;
  EXPECT_NE(err.find(" GB/s"), std::string::npos) << err;
  o.progress = false;
  testing::internal::CaptureStderr();
  ck.load_into(targets, o);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

}  // namespace
}  // namespace lcx
