// The memory timeline files (see timeline.h). The SVG is written by hand, one closed polygon per
// category stacked in a fixed order, so the file opens in any browser with no plotting library.
#include "plan/timeline.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lcx/error.h"
#include "util/text.h"

namespace lcx {
namespace {

// Bottom to top: what lives all run, then what a step builds and frees.
constexpr std::array<MemoryCategory, kMemoryCategories> kStackOrder = {
    MemoryCategory::weights,     MemoryCategory::gradients,  MemoryCategory::master_weights,
    MemoryCategory::optimizer,   MemoryCategory::activations, MemoryCategory::communication,
    MemoryCategory::transient,   MemoryCategory::other};
constexpr std::array<const char*, kMemoryCategories> kColors = {"#4c72b0", "#55a868", "#8172b3", "#937860",
                                                                "#dd8452", "#da8bc3", "#c44e52", "#8c8c8c"};
constexpr const char* kActivationShade = "#f0b27a";  // every other saved tensor, so layers stand apart

// The step's phases, as the step tags the allocator's events (train/step.cpp, trainer.cpp), each
// a band along the x axis; a tag names its phase by containing its name ("layer 3 backward").
constexpr std::array<std::pair<const char*, const char*>, 5> kPhases = {
    {{"forward", "#cfe0f3"}, {"loss", "#f6d5c3"}, {"backward", "#d5ecd4"}, {"communication", "#eadcf2"},
     {"optimizer", "#efe3c8"}}};
// An upper bound of a 12px sans-serif character's width, so the legend's box holds its labels.
constexpr double kCharWidth = 7;

// The index of the phase a tag names, or -1.
int phase_of(const std::string& tag) {
  for (size_t p = 0; p < kPhases.size(); ++p)
    if (tag.find(kPhases[p].first) != std::string::npos) return static_cast<int>(p);
  return -1;
}

// One stacked band: a category, or one saved-activation tensor (its own band, so the per-layer
// staircase of checkpoints shows).
struct Band {
  MemoryCategory category;
  std::string title;
  const char* color;
};

struct Series {
  std::vector<Band> bands;                   // bottom to top
  std::vector<std::vector<int64_t>> live;    // [event + 1][band]
  std::vector<std::string> tags;             // [event + 1]
  int64_t measured_peak = 0;
};

Series build_series(const AllocatorStats& at_start, const std::vector<MemoryEvent>& events) {
  // Saved activations: one band per allocation made while recording, in allocation order; what
  // was live before recording shares one band.
  std::map<uint64_t, size_t> open;  // address -> activation band ordinal
  std::vector<size_t> ordinal_of(events.size(), 0);
  size_t activation_bands = 1;
  for (size_t i = 0; i < events.size(); ++i) {
    const MemoryEvent& e = events[i];
    if (e.category != MemoryCategory::activations) continue;
    if (e.delta > 0) {
      open[e.address] = activation_bands;
      ordinal_of[i] = activation_bands++;
    } else if (auto it = open.find(e.address); it != open.end()) {
      ordinal_of[i] = it->second;
      open.erase(it);
    }
  }
  Series s;
  std::array<size_t, kMemoryCategories> first_band{};
  for (size_t k = 0; k < kStackOrder.size(); ++k) {
    const MemoryCategory c = kStackOrder[k];
    first_band[static_cast<size_t>(c)] = s.bands.size();
    if (c != MemoryCategory::activations) {
      s.bands.push_back({c, memory_category_name(c), kColors[k]});
      continue;
    }
    s.bands.push_back({c, "activations live before the step", kColors[k]});
    for (size_t a = 1; a < activation_bands; ++a)
      s.bands.push_back({c, str("saved activation ", a), a % 2 ? kActivationShade : kColors[k]});
  }
  std::vector<int64_t> live(s.bands.size(), 0);
  for (int c = 0; c < kMemoryCategories; ++c) live[first_band[static_cast<size_t>(c)]] = at_start.live_by_category[c];
  auto total = [](const std::vector<int64_t>& v) {
    int64_t n = 0;
    for (int64_t b : v) n += b;
    return n;
  };
  s.live.push_back(live);
  s.tags.push_back(events.empty() ? std::string() : events.front().tag);
  s.measured_peak = total(live);
  for (size_t i = 0; i < events.size(); ++i) {
    const MemoryEvent& e = events[i];
    live[first_band[static_cast<size_t>(e.category)] + ordinal_of[i]] += e.delta;
    s.measured_peak = std::max(s.measured_peak, total(live));
    s.live.push_back(live);
    s.tags.push_back(e.tag);
  }
  return s;
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) throw Error(str(path, ": write failed"), "run.output_dir", "check the folder is writable");
}

// The legend's labels, top of the stack first, for the categories drawn.
std::vector<std::pair<const char*, std::string>> legend_of(const std::array<bool, kMemoryCategories>& drawn) {
  std::vector<std::pair<const char*, std::string>> out;
  for (size_t k = kStackOrder.size(); k-- > 0;)
    if (drawn[static_cast<size_t>(kStackOrder[k])])
      out.emplace_back(kColors[k], kStackOrder[k] == MemoryCategory::activations ? "saved activations (a band each)"
                                                                                 : memory_category_name(kStackOrder[k]));
  return out;
}

std::string svg_of(const Series& series, int64_t planned) {
  std::array<bool, kMemoryCategories> drawn{};
  for (size_t b = 0; b < series.bands.size(); ++b)
    for (const auto& l : series.live) drawn[static_cast<size_t>(series.bands[b].category)] |= l[b] != 0;
  const auto legend = legend_of(drawn);
  size_t longest = 0;
  for (const auto& [color, label] : legend) longest = std::max(longest, label.size());
  // The legend's column is as wide as its longest label, so none is clipped.
  constexpr double pw = 700, Hh = 430, left = 70, top = 30, bottom = 60, strip = 14;
  const double right = 34 + kCharWidth * static_cast<double>(longest) + 16, W = left + pw + right, ph = Hh - top - bottom;
  const int64_t measured = series.measured_peak;
  const int64_t peak = std::max(measured, planned);  // the y axis holds both
  // GiB for real runs, MiB for the small ones of tests and CPU runs.
  const bool big = peak >= (int64_t{2} << 30);
  const double gib = static_cast<double>(int64_t{1} << (big ? 30 : 20));
  const char* unit = big ? "GiB" : "MiB";
  const double ymax = std::max(1.0, static_cast<double>(peak) * 1.05);
  const size_t n = series.live.size();
  auto x = [&](size_t i) { return left + (n > 1 ? pw * static_cast<double>(i) / static_cast<double>(n - 1) : 0); };
  auto y = [&](double bytes) { return top + ph * (1.0 - bytes / ymax); };
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(1);
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << Hh << "\" viewBox=\"0 0 " << W
    << " " << Hh << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << left << "\" y=\"18\" font-size=\"14\">Memory during one step, stacked by category (peak "
    << static_cast<double>(measured) / gib << " " << unit << ")</text>\n";
  // Stacked areas: each band between the running sums below and above it.
  std::vector<double> below(n, 0.0);
  for (size_t b = 0; b < series.bands.size(); ++b) {
    bool any = false;
    for (const auto& l : series.live) any = any || l[b] != 0;
    if (!any) continue;
    std::vector<double> above(n);
    for (size_t i = 0; i < n; ++i) above[i] = below[i] + static_cast<double>(series.live[i][b]);
    o << "<polygon fill=\"" << series.bands[b].color << "\" fill-opacity=\"0.85\" points=\"";
    for (size_t i = 0; i < n; ++i) o << x(i) << "," << y(above[i]) << " ";
    for (size_t i = n; i-- > 0;) o << x(i) << "," << y(below[i]) << " ";
    o << "\"><title>" << series.bands[b].title << "</title></polygon>\n";
    below = std::move(above);
  }
  // Axes and ticks.
  o << "<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left << "\" y2=\"" << top + ph
    << "\" stroke=\"black\"/>\n<line x1=\"" << left << "\" y1=\"" << top + ph << "\" x2=\"" << left + pw << "\" y2=\""
    << top + ph << "\" stroke=\"black\"/>\n";
  const double raw = ymax / gib / 6;
  const double p10 = std::pow(10.0, std::floor(std::log10(std::max(raw, 1e-9))));
  const double tick = raw / p10 < 2 ? 2 * p10 : raw / p10 < 5 ? 5 * p10 : 10 * p10;
  for (double g = 0; g * gib <= ymax; g += tick)
    o << "<text x=\"" << left - 6 << "\" y=\"" << y(g * gib) + 4 << "\" text-anchor=\"end\">" << g << "</text>\n";
  o << "<text x=\"16\" y=\"" << top + ph / 2 << "\" transform=\"rotate(-90 16 " << top + ph / 2
    << ")\" text-anchor=\"middle\">" << unit << "</text>\n";
  o << "<text x=\"" << left + pw / 2 << "\" y=\"" << Hh - 10 << "\" text-anchor=\"middle\">allocator event ("
    << (n ? n - 1 : 0) << " events), by phase of the step</text>\n";
  // The phases as bands under the x axis: each run of events of one phase, named where it is wide
  // enough for its name.
  const double sy = top + ph + 8;
  for (size_t i = 1; i < n;) {
    const int p = i < series.tags.size() ? phase_of(series.tags[i]) : -1;
    size_t end = i + 1;
    while (end < n && end < series.tags.size() && phase_of(series.tags[end]) == p) ++end;
    if (p >= 0) {
      const double x0 = x(i - 1), x1 = x(end - 1), w = std::max(1.0, x1 - x0);
      const char* name = kPhases[static_cast<size_t>(p)].first;
      o << "<rect class=\"phase\" data-phase=\"" << name << "\" x=\"" << x0 << "\" y=\"" << sy << "\" width=\"" << w
        << "\" height=\"" << strip << "\" fill=\"" << kPhases[static_cast<size_t>(p)].second << "\"><title>" << name
        << "</title></rect>\n";
      if (w >= kCharWidth * static_cast<double>(std::strlen(name)) + 4)
        o << "<text x=\"" << x0 + w / 2 << "\" y=\"" << sy + strip - 3 << "\" text-anchor=\"middle\" font-size=\"10\">"
          << name << "</text>\n";
    }
    i = end;
  }
  // Phase tags where they change, as marks along the bottom.
  for (size_t i = 1; i < series.tags.size() && i < n; ++i)
    if (series.tags[i] != series.tags[i - 1] && !series.tags[i].empty())
      o << "<line x1=\"" << x(i) << "\" y1=\"" << top + ph << "\" x2=\"" << x(i) << "\" y2=\"" << top + ph + 5
        << "\" stroke=\"#444\"><title>" << series.tags[i] << "</title></line>\n";
  if (planned > 0)
    o << "<line x1=\"" << left << "\" y1=\"" << y(static_cast<double>(planned)) << "\" x2=\"" << left + pw << "\" y2=\""
      << y(static_cast<double>(planned)) << "\" stroke=\"black\" stroke-dasharray=\"6 4\"/>\n<text x=\"" << left + pw - 4
      << "\" y=\"" << y(static_cast<double>(planned)) - 4 << "\" text-anchor=\"end\">plan "
      << static_cast<double>(planned) / gib << " " << unit << "</text>\n";
  // Legend of the categories drawn, top of the stack first.
  double ly = top + 10;
  for (const auto& [color, label] : legend) {
    o << "<rect x=\"" << left + pw + 16 << "\" y=\"" << ly - 10 << "\" width=\"12\" height=\"12\" fill=\"" << color
      << "\"/><text x=\"" << left + pw + 34 << "\" y=\"" << ly << "\">" << label << "</text>\n";
    ly += 18;
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace

TimelineFiles write_memory_timeline(const std::string& dir, const AllocatorStats& at_start,
                                    const std::vector<MemoryEvent>& events, int64_t planned_peak_bytes) {
  std::filesystem::create_directories(dir);
  const Series series = build_series(at_start, events);
  nlohmann::json j;
  nlohmann::json start = nlohmann::json::object();
  for (int c = 0; c < kMemoryCategories; ++c)
    start[memory_category_name(static_cast<MemoryCategory>(c))] = at_start.live_by_category[c];
  j["live_at_start"] = start;
  j["planned_peak_bytes"] = planned_peak_bytes;
  j["peak_bytes"] = series.measured_peak;
  nlohmann::json ev = nlohmann::json::array();
  for (const auto& e : events)
    ev.push_back({{"t", e.time_s},
                  {"delta", e.delta},
                  {"live_after", e.live_after},
                  {"category", memory_category_name(e.category)},
                  {"tag", e.tag}});
  j["events"] = std::move(ev);
  TimelineFiles files{(std::filesystem::path(dir) / "memory_timeline.json").string(),
                      (std::filesystem::path(dir) / "memory_timeline.svg").string()};
  write_text(files.json, j.dump(1) + "\n");
  write_text(files.svg, svg_of(series, planned_peak_bytes));
  return files;
}

StepTimeline::StepTimeline(Device device) : device_(device) {
  MemoryRecorder& r = allocator_for(device_).recorder();
  r.clear();
  start_ = allocator_for(device_).stats();
  r.enable(true);
}

StepTimeline::~StepTimeline() {
  if (!written_) {
    allocator_for(device_).recorder().enable(false);
    allocator_for(device_).recorder().clear();
  }
}

TimelineFiles StepTimeline::write(const std::string& dir, int64_t planned_peak_bytes) {
  MemoryRecorder& r = allocator_for(device_).recorder();
  r.enable(false);
  written_ = true;
  const std::vector<MemoryEvent> events = r.events();
  r.clear();
  return write_memory_timeline(dir, start_, events, planned_peak_bytes);
}

}  // namespace lcx
