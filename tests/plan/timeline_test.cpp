// The memory timeline: events to JSON and a stacked SVG, from a hand-made trace and from the CPU
// allocator's own recorder.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lcx/tensor.h"
#include "plan/timeline.h"
#include "support/test_util.h"

namespace lcx {
namespace {

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

TEST(MemoryTimeline, StacksCategoriesAndFindsThePeak) {
  AllocatorStats start;
  start.live_by_category[static_cast<int>(MemoryCategory::weights)] = 100;
  std::vector<MemoryEvent> events = {{0.1, 50, 150, 1, MemoryCategory::transient, "layer 0 forward"},
                                     {0.2, 30, 180, 2, MemoryCategory::activations, "layer 0 forward"},
                                     {0.3, -50, 130, 1, MemoryCategory::transient, "layer 0 backward"},
                                     {0.4, -30, 100, 2, MemoryCategory::activations, "layer 0 backward"}};
  const auto dir = test::temp_dir("timeline");
  const TimelineFiles f = write_memory_timeline(dir.string(), start, events, 170);
  const auto j = nlohmann::json::parse(read(f.json));
  EXPECT_EQ(j["peak_bytes"].get<int64_t>(), 180);
  EXPECT_EQ(j["planned_peak_bytes"].get<int64_t>(), 170);
  EXPECT_EQ(j["live_at_start"]["weights"].get<int64_t>(), 100);
  ASSERT_EQ(j["events"].size(), 4u);
  EXPECT_EQ(j["events"][1]["category"], "activations");
  EXPECT_EQ(j["events"][2]["tag"], "layer 0 backward");
  const std::string svg = read(f.svg);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_EQ(count(svg, "<polygon"), 3u);  // weights, activations, transient: empty categories are not drawn
  EXPECT_NE(svg.find("<title>saved activation 1</title>"), std::string::npos);
  EXPECT_NE(svg.find("plan "), std::string::npos);
  EXPECT_NE(svg.find("layer 0 backward"), std::string::npos);  // the phase mark where the tag changes
}

// Every text of the SVG lies inside its viewBox (the legend's longest label too), at an upper
// bound of 7 px a character of 12 px sans-serif; the step's phases are bands along the x axis.
TEST(MemoryTimeline, LegendInsideTheViewBoxAndPhaseBands) {
  AllocatorStats start;
  start.live_by_category[static_cast<int>(MemoryCategory::weights)] = 1000;
  std::vector<MemoryEvent> events;
  uint64_t address = 1;
  for (const char* tag : {"forward", "forward", "loss", "backward", "backward", "optimizer"}) {
    events.push_back({0, 100, 0, address, MemoryCategory::activations, tag});
    events.push_back({0, 50, 0, address + 1000, MemoryCategory::transient, tag});
    events.push_back({0, -50, 0, address + 1000, MemoryCategory::transient, tag});
    ++address;
  }
  events.push_back({0, 10, 0, 5000, MemoryCategory::optimizer, "optimizer"});
  const auto dir = test::temp_dir("timeline-legend");
  const std::string svg = read(write_memory_timeline(dir.string(), start, events, 900).svg);
  double vw = 0, vh = 0;
  const size_t vb = svg.find("viewBox=\"0 0 ");
  ASSERT_NE(vb, std::string::npos) << svg.substr(0, 300);
  ASSERT_EQ(std::sscanf(svg.c_str() + vb, "viewBox=\"0 0 %lf %lf", &vw, &vh), 2);
  auto attr = [](const std::string& tag, const std::string& name) -> std::string {
    const size_t at = tag.find(" " + name + "=\"");
    if (at == std::string::npos) return {};
    const size_t from = at + name.size() + 3;
    return tag.substr(from, tag.find('"', from) - from);
  };
  size_t texts = 0;
  bool legend_seen = false;
  for (size_t at = svg.find("<text"); at != std::string::npos; at = svg.find("<text", at + 1)) {
    const size_t close = svg.find('>', at), end = svg.find("</text>", close);
    const std::string tag = svg.substr(at, close - at), content = svg.substr(close + 1, end - close - 1);
    if (!attr(tag, "transform").empty()) continue;  // the rotated y-axis unit
    const double x = std::stod(attr(tag, "x")), y = std::stod(attr(tag, "y"));
    const std::string anchor = attr(tag, "text-anchor"), size = attr(tag, "font-size");
    const double width = 7.0 * static_cast<double>(content.size()) * (size.empty() ? 12.0 : std::stod(size)) / 12.0;
    const double left = anchor == "end" ? x - width : anchor == "middle" ? x - width / 2 : x;
    EXPECT_GE(left, 0) << content;
    EXPECT_LE(left + width, vw) << content << " runs past the viewBox's width " << vw;
    EXPECT_GT(y, 0) << content;
    EXPECT_LE(y, vh) << content;
    legend_seen = legend_seen || content == "saved activations (a band each)";
    ++texts;
  }
  EXPECT_TRUE(legend_seen);
  EXPECT_GT(texts, 8u);
  // One band per run of a phase, in step order.
  std::vector<std::string> phases;
  for (size_t at = svg.find("<rect class=\"phase\""); at != std::string::npos; at = svg.find("<rect class=\"phase\"", at + 1))
    phases.push_back(attr(svg.substr(at, svg.find('>', at) - at), "data-phase"));
  EXPECT_EQ(phases, (std::vector<std::string>{"forward", "loss", "backward", "optimizer"}));
}

TEST(MemoryTimeline, OneBandPerSavedActivation) {
  // Three layer inputs saved in the forward and released in reverse in the backward: three
  // bands, each as tall as its tensor while it lives.
  std::vector<MemoryEvent> events;
  for (uint64_t l = 0; l < 3; ++l) events.push_back({0, 10, 0, 100 + l, MemoryCategory::activations, "forward"});
  for (uint64_t l = 3; l-- > 0;) events.push_back({0, -10, 0, 100 + l, MemoryCategory::activations, "backward"});
  const auto dir = test::temp_dir("timeline-bands");
  const std::string svg = read(write_memory_timeline(dir.string(), AllocatorStats{}, events).svg);
  EXPECT_EQ(count(svg, "<polygon"), 3u);
  for (const char* t : {"saved activation 1", "saved activation 2", "saved activation 3"})
    EXPECT_NE(svg.find(t), std::string::npos) << t;
  EXPECT_EQ(svg.find("saved activation 4"), std::string::npos);
  EXPECT_NE(svg.find("peak 0.0 MiB"), std::string::npos);  // 30 bytes
}

TEST(MemoryTimeline, FromTheCpuAllocatorsRecorder) {
  Allocator& a = allocator_for(Device::cpu());
  const AllocatorStats start = a.stats();
  a.recorder().clear();
  a.recorder().enable(true);
  a.recorder().set_tag("step");
  {
    Tensor saved = Tensor::empty({1024}, DType::f32, Device::cpu(), MemoryCategory::activations);
    Tensor work = Tensor::empty({4096}, DType::f32, Device::cpu());
  }
  a.recorder().enable(false);
  const auto events = a.recorder().events();
  a.recorder().clear();
  const auto dir = test::temp_dir("timeline-cpu");
  const TimelineFiles f = write_memory_timeline(dir.string(), start, events);
  const auto j = nlohmann::json::parse(read(f.json));
  ASSERT_GE(j["events"].size(), 4u);
  int64_t activations = 0, transient = 0, net = 0;
  for (const auto& e : j["events"]) {
    const int64_t d = e["delta"].get<int64_t>();
    net += d;
    if (e["category"] == "activations" && d > 0) activations += d;
    if (e["category"] == "transient" && d > 0) transient += d;
  }
  EXPECT_GE(activations, 4096);
  EXPECT_GE(transient, 16384);
  EXPECT_EQ(net, 0);  // everything allocated in the step was freed
  EXPECT_GE(j["peak_bytes"].get<int64_t>(), start.live_bytes + 4096 + 16384);
  EXPECT_EQ(read(f.svg).find("plan "), std::string::npos);
}

}  // namespace
}  // namespace lcx
