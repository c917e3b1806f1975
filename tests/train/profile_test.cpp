// The step recorder on the CPU, where a steady clock stands in for CUDA events: nesting, phases,
// host gaps and the trace file, with sleeps long enough that the figures cannot pass by chance.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "support/test_util.h"
#include "profile/step_profiler.h"

namespace lcx {
namespace {

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

TEST(StepProfile, TimesOpsByKindPhaseAndGap) {
  {
    ProfileScope idle(OpKind::gemm, "matmul");
    EXPECT_FALSE(idle.recording()) << "a scope outside a profiled step must cost nothing";
  }
  const auto dir = test::temp_dir("profile");
  StepProfiler prof(Device::cpu(), 7);
  {
    ProfilePhase fwd(StepPhase::forward);
    ProfilePhase layer(StepPhase::forward, 3);
    {
      ProfileScope g(OpKind::gemm, "matmul");
      ASSERT_TRUE(g.recording());
      g.detail("M=1 N=2 K=3 fp32");
      sleep_ms(20);
    }
    sleep_ms(30);  // the host gap
    {
      ProfileScope n(OpKind::norm, "rmsnorm_forward");
      ProfileScope inner(OpKind::gemm, "matmul");
      EXPECT_FALSE(inner.recording()) << "the outer scope owns nested work";
      sleep_ms(10);
    }
  }
  {
    ProfilePhase opt(StepPhase::optimizer);
    ProfileScope o(OpKind::optimizer, "adamw_step");
    sleep_ms(5);
  }
  const ProfileReport r = prof.finish(dir.string());
  {
    ProfileScope after(OpKind::gemm, "matmul");
    EXPECT_FALSE(after.recording()) << "nothing is recorded after the profiled step";
  }
  EXPECT_GE(r.step_ms, 65);

  std::ifstream in(r.trace_path);
  ASSERT_TRUE(in) << r.trace_path;
  EXPECT_EQ(std::filesystem::path(r.trace_path).filename(), "trace-step7.json");
  const auto j = nlohmann::json::parse(in);
  const auto& sum = j.at("otherData");
  EXPECT_EQ(sum.at("kinds").at("gemm").at("count"), 1);
  EXPECT_GE(sum.at("kinds").at("gemm").at("ms").get<double>(), 20);
  EXPECT_LT(sum.at("kinds").at("gemm").at("ms").get<double>(), 30) << "the nested matmul must not count";
  EXPECT_EQ(sum.at("kinds").at("norm").at("count"), 1);
  EXPECT_GE(sum.at("host_gaps_ms").get<double>(), 30);
  const double fwd = sum.at("phases").at("forward").at("ms").get<double>();
  const double opt = sum.at("phases").at("optimizer").at("ms").get<double>();
  EXPECT_GE(fwd, 60);
  EXPECT_GE(opt, 5);
  EXPECT_LE(fwd + opt, sum.at("step_ms").get<double>());

  bool saw_gemm = false, saw_layer = false;
  for (const auto& e : j.at("traceEvents")) {
    if (e.at("ph") != "X") continue;
    for (const char* k : {"name", "cat", "ts", "dur", "pid", "tid", "args"}) ASSERT_TRUE(e.contains(k)) << e.dump();
    if (e.at("cat") == "gemm") {
      saw_gemm = true;
      EXPECT_EQ(e.at("args").at("phase"), "forward");
      EXPECT_EQ(e.at("args").at("layer"), 3);
      EXPECT_EQ(e.at("args").at("detail"), "M=1 N=2 K=3 fp32");
      EXPECT_GE(e.at("dur").get<double>(), 20000) << "microseconds";
    }
    if (e.at("cat") == "layer" && e.at("name") == "forward layer 3") saw_layer = true;
  }
  EXPECT_TRUE(saw_gemm);
  EXPECT_TRUE(saw_layer);

  std::string table;
  for (const auto& line : r.table) table += line + "\n";
  for (const char* want : {"profile of step 7", "gemm", "norm", "optimizer", "host gaps", "forward"})
    EXPECT_NE(table.find(want), std::string::npos) << want << " missing from\n" << table;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace lcx
