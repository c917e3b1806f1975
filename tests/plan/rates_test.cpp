// The rates table (plan/rates.h): the shipped file parses and times the plan as the H200's
// measured rates; refusals name the file; a GPU without a row gets the nearest one, and says so;
// calibrate's writer round-trips a row; [run] peak_tflops overrides the MFU's peak; --plan names
// the row it timed with.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "config/core_config.h"
#include "lcx/error.h"
#include "lcx/rates.h"
#include "plan/rates.h"
#include "support/test_util.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;


fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() / ("lcx_rates_test_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  return dir / name;
}

void write(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }

const char* kTwoRows = R"(
["NVIDIA H200"]
gemm_flops = 640e12
attention_forward_flops = 570e12
attention_backward_flops = 525e12
memory_bytes = 2.4e12
host_copy_bytes = 55e9
head_groups_at_half_rate = 8
memory_gib = 140

["NVIDIA A100-SXM4-80GB"]
gemm_flops = 250e12
attention_forward_flops = 200e12
attention_backward_flops = 180e12
memory_bytes = 1.5e12
host_copy_bytes = 25e9
head_groups_at_half_rate = 6
memory_gib = 80
)";

// The shipped table holds the H200's row as `lcx-train calibrate` measured it (docs/PERF.md), and
// the cost model reads every rate of it: one second of each kind of work at the row's own rates.
TEST(Rates, ShippedTableHoldsTheH200Row) {
  const RatesTable t = RatesTable::load(shipped_rates_path());
  const RatesRow* h200 = t.find(kDefaultRatesDevice);
  ASSERT_NE(h200, nullptr) << shipped_rates_path();
  EXPECT_EQ(h200->get(rate_name::gemm), 650.5e12);
  EXPECT_EQ(h200->get(rate_name::attention_forward), 577.2e12);
  EXPECT_EQ(h200->get(rate_name::attention_backward), 536.5e12);
  EXPECT_EQ(h200->get(rate_name::memory), 1.648e12);
  EXPECT_EQ(h200->get(rate_name::host_copy), 55.35e9);
  EXPECT_EQ(h200->get(rate_name::half_rate_groups), 14.86);
  EXPECT_EQ(h200->get(rate_name::peak), 989.4e12);
  StepWork w;
  w.gemm_flops = h200->get(rate_name::gemm);
  w.grouped_gemm_flops = h200->get(rate_name::gemm);
  w.head_groups = 8;
  w.attention_forward_flops = h200->get(rate_name::attention_forward);
  w.attention_backward_flops = h200->get(rate_name::attention_backward);
  w.memory_bytes = h200->get(rate_name::memory);
  w.exposed_copy_bytes = h200->get(rate_name::host_copy);
  // 1 s of each kind; eight head groups slow their projections by 1 + 7 / (14.86 - 1).
  EXPECT_NEAR(predicted_step_seconds(w, *h200), 5.0 + 1.0 + 7.0 / 13.86, 1e-12);
  // Without a row set, the plan times with the H200's (the CPU's default).
  EXPECT_EQ(active_rates().device, kDefaultRatesDevice);
  EXPECT_EQ(predicted_step_seconds(w), predicted_step_seconds(w, *h200));
  EXPECT_EQ(device_rate(rate_name::gemm, 1), 650.5e12);
  // A provider's own rate, which the row does not have, is its default.
  EXPECT_EQ(device_rate("cp_ring.call_cost_pairs", 570000), 570000);
  // The experts' grouped GEMMs at their own measured rate: a second of them adds a second.
  EXPECT_EQ(h200->get(rate_name::expert_gemm), 281.2e12);
  StepWork experts;
  experts.expert_gemm_flops = 281.2e12;
  EXPECT_NEAR(predicted_step_seconds(experts, *h200), 1.0, 1e-12);
}

// Every GPU lcx ships a row for is found by the name its device properties give, each row saying
// what it rests on: the H200's and the H100 SXM's measured, the others from datasheets.
TEST(Rates, ShippedTableHasARowPerGpuByItsDeviceName) {
  const RatesTable t = RatesTable::load(shipped_rates_path());
  const struct {
    const char* device;
    double peak_tflops;
    double compute_capability;
  } gpus[] = {{"NVIDIA A100-SXM4-40GB", 312, 8.0},        {"NVIDIA A100-SXM4-80GB", 312, 8.0},
              {"NVIDIA H100 PCIe", 756, 9.0},             {"NVIDIA H100 80GB HBM3", 989.4, 9.0},
              {"NVIDIA H200", 989.4, 9.0},                {"NVIDIA L40S", 362.05, 8.9},
              {"NVIDIA GeForce RTX 4090", 165.2, 8.9},    {"NVIDIA RTX 6000 Ada Generation", 364.2, 8.9},
              {"NVIDIA B200", 2250, 10.0}};
  for (const auto& g : gpus) {
    SCOPED_TRACE(g.device);
    const RatesTable::Choice c = t.choose(g.device, 0);
    EXPECT_TRUE(c.exact) << c.note;
    EXPECT_EQ(c.row.device, g.device);
    EXPECT_DOUBLE_EQ(c.row.get(rate_name::peak), g.peak_tflops * 1e12);
    EXPECT_DOUBLE_EQ(c.row.get(rate_name::compute_capability), g.compute_capability);
    EXPECT_TRUE(c.row.basis == kBasisCalibrate || c.row.basis == kBasisDatasheet) << c.row.basis;
    // Datasheet rows reach their peak as the measured rows do: GEMMs below it, attention below GEMMs.
    EXPECT_LT(c.row.get(rate_name::gemm), c.row.get(rate_name::peak));
    EXPECT_LT(c.row.get(rate_name::attention_backward), c.row.get(rate_name::gemm));
  }
  EXPECT_EQ(t.find("NVIDIA H200")->basis, kBasisCalibrate);
  EXPECT_EQ(t.find("NVIDIA H100 80GB HBM3")->basis, kBasisCalibrate);
  EXPECT_EQ(t.find("NVIDIA H100 PCIe")->basis, kBasisDatasheet);
  EXPECT_EQ(t.find("NVIDIA A100-SXM4-80GB")->basis, kBasisDatasheet);
  EXPECT_GT(t.find("NVIDIA A100-SXM4-80GB")->get(rate_name::memory), t.find("NVIDIA A100-SXM4-40GB")->get(rate_name::memory));
  EXPECT_GT(t.find("NVIDIA H100 PCIe")->get(rate_name::host_copy), t.find("NVIDIA L40S")->get(rate_name::host_copy));
}

TEST(Rates, RowSourceIsCalibrateOrDatasheet) {
  const RatesTable t = RatesTable::parse("[\"NVIDIA L4\"]\nsource = \"datasheet\"\nmemory_gib = 22\n", "l4.toml", false);
  EXPECT_EQ(t.rows.at(0).basis, kBasisDatasheet);
  EXPECT_FALSE(t.rows.at(0).find("source"));
  const test::Thrown e =
      test::thrown_by([] { RatesTable::parse("[\"NVIDIA L4\"]\nsource = \"guess\"\n", "l4.toml", false); });
  EXPECT_EQ(e.key, "NVIDIA L4.source");
  EXPECT_NE(e.message.find("must be \"calibrate\" or \"datasheet\""), std::string::npos) << e.message;
}

// A row without the experts' rate (a user's calibrated row of another GPU) charges their FLOPs at
// kExpertGemmShare of its dense GEMM rate, not at the dense rate itself.
TEST(Rates, ExpertGemmsWithoutTheirRateTakeAShareOfTheDenseRate) {
  const fs::path p = scratch("experts.toml");
  write(p, kTwoRows);
  const RatesTable t = RatesTable::load(p.string());
  const RatesRow* a100 = t.find("NVIDIA A100-SXM4-80GB");
  ASSERT_NE(a100, nullptr);
  StepWork w;
  w.expert_gemm_flops = 250e12 * kExpertGemmShare;
  EXPECT_NEAR(predicted_step_seconds(w, *a100), 1.0, 1e-12);
  w.gemm_flops = 250e12;
  EXPECT_NEAR(predicted_step_seconds(w, *a100), 2.0, 1e-12);
}

TEST(Rates, MissingOrMalformedFileIsRefusedNamingIt) {
  const fs::path missing = scratch("missing.toml");
  std::string msg = test::thrown_by([&] { RatesTable::load(missing.string()); }).message;
  EXPECT_NE(msg.find(missing.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;

  const fs::path bad = scratch("bad.toml");
  write(bad, "[\"NVIDIA H200\"\ngemm_flops = 640e12\n");
  msg = test::thrown_by([&] { RatesTable::load(bad.string()); }).message;
  EXPECT_NE(msg.find(bad.string() + ":"), std::string::npos) << msg;

  // A bad value, a key outside any row, a row without a rate the cost model reads: each refused by
  // its row and key, the file named.
  write(bad, "[\"NVIDIA H200\"]\ngemm_flops = \"fast\"\n");
  test::Thrown e = test::thrown_by([&] { RatesTable::load(bad.string(), false); });
  EXPECT_EQ(e.key, "NVIDIA H200.gemm_flops");
  EXPECT_NE(e.message.find(bad.string()), std::string::npos) << e.message;
  EXPECT_NE(e.message.find("is not a positive number"), std::string::npos) << e.message;

  write(bad, "gemm_flops = 640e12\n");
  e = test::thrown_by([&] { RatesTable::load(bad.string(), false); });
  EXPECT_EQ(e.key, "gemm_flops");
  EXPECT_NE(e.message.find("is not a table of rates"), std::string::npos) << e.message;

  write(bad, "[\"NVIDIA H200\"]\ngemm_flops = 640e12\n");
  e = test::thrown_by([&] { RatesTable::load(bad.string()); });
  EXPECT_EQ(e.key, "NVIDIA H200.attention_forward_flops");

  // LCX_RATES names a user file: it must exist.
  ::setenv("LCX_RATES", missing.string().c_str(), 1);
  msg = test::thrown_by([] { load_rates(); }).message;
  ::unsetenv("LCX_RATES");
  EXPECT_NE(msg.find(missing.string()), std::string::npos) << msg;
}

TEST(Rates, RowByNameAndNearestRowWithItsNote) {
  const RatesTable t = RatesTable::parse(kTwoRows, "two.toml");
  ASSERT_EQ(t.rows.size(), 2u);
  const RatesTable::Choice own = t.choose("NVIDIA A100-SXM4-80GB", 0);
  EXPECT_TRUE(own.exact);
  EXPECT_TRUE(own.note.empty()) << own.note;
  EXPECT_EQ(own.row.get(rate_name::gemm), 250e12);

  // By name: an A100 of 40 GB shares "a100" and "sxm4" with the 80 GB row.
  const RatesTable::Choice a100 = t.choose("NVIDIA A100-SXM4-40GB", int64_t{40} << 30);
  EXPECT_FALSE(a100.exact);
  EXPECT_EQ(a100.row.device, "NVIDIA A100-SXM4-80GB");
  EXPECT_NE(a100.note.find("no rates row for 'NVIDIA A100-SXM4-40GB'"), std::string::npos) << a100.note;
  EXPECT_NE(a100.note.find("estimates from the nearest row, 'NVIDIA A100-SXM4-80GB' (by name"), std::string::npos)
      << a100.note;
  EXPECT_NE(a100.note.find("two.toml"), std::string::npos) << a100.note;

  // No word in common: the nearest memory. 94 GiB is nearer 80 than 140 on a log scale; 128 nearer 140.
  const RatesTable::Choice h100 = t.choose("NVIDIA H100 NVL", int64_t{94} << 30);
  EXPECT_EQ(h100.row.device, "NVIDIA A100-SXM4-80GB");
  EXPECT_NE(h100.note.find("(by memory size"), std::string::npos) << h100.note;
  EXPECT_EQ(t.choose("NVIDIA GH200 480GB", int64_t{128} << 30).row.device, "NVIDIA H200");
}

// The user's rows override the shipped table key by key; rows of new GPUs are added.
TEST(Rates, UserRowsOverrideKeyByKey) {
  RatesTable t = RatesTable::parse(kTwoRows, "shipped.toml");
  t.merge(RatesTable::parse("[\"NVIDIA H200\"]\ngemm_flops = 650e12\n[\"NVIDIA L4\"]\nmemory_gib = 22\n", "mine.toml",
                            false));
  const RatesRow* h200 = t.find("NVIDIA H200");
  ASSERT_NE(h200, nullptr);
  EXPECT_EQ(h200->get(rate_name::gemm), 650e12);
  EXPECT_EQ(h200->get(rate_name::memory), 2.4e12);
  EXPECT_EQ(h200->source, "shipped.toml + mine.toml");
  ASSERT_NE(t.find("NVIDIA L4"), nullptr);
}

// Calibrate's head-group rate is the cost model's charge inverted: planned with the rate it derives,
// a step's grouped GEMMs cost the measured extra over one group, at any group count; the H200 row's
// 8 is the rate at which eight groups cost the same again as one.
TEST(Rates, HalfRateGroupsInvertTheCostModelsCharge) {
  RatesRow row = *RatesTable::parse(kTwoRows, "two.toml").find("NVIDIA H200");
  const double gemm = row.get(rate_name::gemm), flops = 3e15;  // 4.69 s at the row's GEMM rate
  StepWork w;
  w.grouped_gemm_flops = flops;
  for (const int64_t groups : {2, 4, 8, 16})
    for (const double extra : {0.5, 1.0, 7.5}) {
      w.head_groups = groups;
      row.rates[rate_name::half_rate_groups] = half_rate_groups_for(flops, groups, extra, gemm);
      EXPECT_NEAR(predicted_step_seconds(w, row) - flops / gemm, extra, 1e-9 * extra) << groups << " " << extra;
    }
  EXPECT_DOUBLE_EQ(half_rate_groups_for(flops, 8, flops / gemm, gemm), 8);
  // Nothing measured, or less than the cost model can tell from free groups: groups cost nothing.
  EXPECT_EQ(half_rate_groups_for(flops, 8, 0, gemm), 1000);
  EXPECT_EQ(half_rate_groups_for(flops, 8, -0.2, gemm), 1000);
  EXPECT_GT(half_rate_groups_for(flops, 8, 0.01 * flops / gemm, gemm), 100);
}

// What calibrate writes reads back as the same row, beside the file's other rows.
TEST(Rates, CalibrateWriterRoundTripsARow) {
  const fs::path out = scratch("sub/rates.toml");
  fs::remove_all(out.parent_path());
  RatesRow row;
  row.device = "NVIDIA H200";
  row.rates = {{rate_name::gemm, 652.3171e12},
               {rate_name::attention_forward, 575.5e12},
               {rate_name::attention_backward, 1.0 / 3.0 * 1.6e15},
               {rate_name::memory, 2.41e12},
               {rate_name::host_copy, 54.87e9},
               {rate_name::half_rate_groups, 8.25},
               {rate_name::memory_gib, 140}};
  row.basis = kBasisCalibrate;
  RatesRow other = row;
  other.device = "NVIDIA \"Quoted\" GPU";
  write_rates_row(out.string(), other);
  write_rates_row(out.string(), row);
  row.rates[rate_name::gemm] = 655e12;  // a second calibration replaces the row's rates
  write_rates_row(out.string(), row);
  const RatesTable back = RatesTable::load(out.string());
  ASSERT_EQ(back.rows.size(), 2u);
  const RatesRow* got = back.find("NVIDIA H200");
  ASSERT_NE(got, nullptr);
  EXPECT_EQ(got->rates, row.rates);
  EXPECT_EQ(got->basis, kBasisCalibrate);
  ASSERT_NE(back.find(other.device), nullptr);
  EXPECT_EQ(back.find(other.device)->rates, other.rates);
  fs::remove_all(out.parent_path());
}

TEST(Rates, PeakTflopsOverridesTheRowsPeak) {
  EXPECT_EQ(mfu_peak_flops(0), 989.4e12);  // the H200 row's
  Manifest m = Manifest::parse("[run]\npeak_tflops = 312\n", "peak.toml");
  CoreConfig cfg = read_core_config(m, {});
  EXPECT_EQ(cfg.run.peak_tflops, 312);
  EXPECT_EQ(mfu_peak_flops(cfg.run.peak_tflops), 312e12);
  // A row without a peak (a calibrated GPU lcx does not know): no MFU unless the key gives one.
  RatesRow row = RatesTable::parse(kTwoRows, "two.toml").rows[1];
  set_active_rates(row);
  EXPECT_EQ(mfu_peak_flops(0), 0);
  EXPECT_EQ(mfu_peak_flops(312), 312e12);
  m = Manifest::parse("[run]\npeak_tflops = -1\n", "peak.toml");
  const test::Thrown e = test::thrown_by([&] { read_core_config(m, {}); });
  EXPECT_EQ(e.key, "run.peak_tflops");
  EXPECT_FALSE(e.fix.empty());
}

// --plan says which row timed its recipes: the H200's on a machine without a GPU, the nearest
// for a GPU named without a row of its own.
TEST(Rates, PlanNamesTheRowItTimesWith) {
  const std::string plan = test::lcx_train() + " --plan --config " + std::string(LCX_SOURCE_DIR) +
                           "/configs/qwen3_8b_1m_8gpu.toml --gpu-memory 80GB";
  if (local_gpu_name()) GTEST_SKIP() << "this machine has a GPU, whose row --plan takes";
  auto r = test::run_command(plan);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("# rates: the 'NVIDIA H200' row (calibrate, " + shipped_rates_path()), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("no GPU here and none named"), std::string::npos) << r.output;
  // Which attention kernels its calls take there: cuDNN, and the Hopper forward for 1M causal rows.
  EXPECT_NE(r.output.find("# attention ([run] attention = auto, on sm_90 with cuDNN):"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("causal forward below 131072 rows: cudnn"), std::string::npos) << r.output;
  r = test::run_command(plan + " --gpu-name 'NVIDIA A100-SXM4-80GB'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("# rates: the 'NVIDIA A100-SXM4-80GB' row (datasheet, "), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("no rates row"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("on sm_80 with cuDNN"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(": hopper"), std::string::npos) << r.output;
  r = test::run_command(plan + " --gpu-name 'NVIDIA L4'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("no rates row for 'NVIDIA L4': its times are estimates from the nearest row, '"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("(by memory size"), std::string::npos) << r.output;
  // Named in the manifest: the same.
  r = test::run_command(plan + " --set \"run.gpu_name='NVIDIA H200'\"");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output.find("no GPU here"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("# rates: the 'NVIDIA H200' row"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace lcx
