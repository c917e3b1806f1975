// The memory timeline files (see timeline.h). The SVG is written by hand, one closed polygon per
// category stacked in a fixed order, so the file opens in any browser with no plotting library.
#include "plan/timeline.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
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

using Live = std::array<int64_t, kMemoryCategories>;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
  if (!out) throw Error(str(path, ": write failed"), "run.output_dir", "check the folder is writable");
}

std::string svg_of(const std::vector<Live>& series, const std::vector<std::string>& tags, int64_t planned) {
  constexpr double W = 960, Hh = 420, left = 70, right = 190, top = 30, bottom = 40;
  const double pw = W - left - right, ph = Hh - top - bottom;
  int64_t measured = 0;
  for (const auto& l : series) {
    int64_t s = 0;
    for (int64_t v : l) s += v;
    measured = std::max(measured, s);
  }
  const int64_t peak = std::max(measured, planned);  // the y axis holds both
  // GiB for real runs, MiB for the small ones of tests and CPU runs.
  const bool big = peak >= (int64_t{2} << 30);
  const double gib = static_cast<double>(int64_t{1} << (big ? 30 : 20));
  const char* unit = big ? "GiB" : "MiB";
  const double ymax = std::max(1.0, static_cast<double>(peak) * 1.05);
  const size_t n = series.size();
  auto x = [&](size_t i) { return left + (n > 1 ? pw * static_cast<double>(i) / static_cast<double>(n - 1) : 0); };
  auto y = [&](double bytes) { return top + ph * (1.0 - bytes / ymax); };
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(1);
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << Hh
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << left << "\" y=\"18\" font-size=\"14\">Memory during one step, stacked by category (peak "
    << static_cast<double>(measured) / gib << " " << unit << ")</text>\n";
  // Stacked areas: each category's band between the running sums below and above it.
  std::vector<double> below(n, 0.0);
  for (size_t k = 0; k < kStackOrder.size(); ++k) {
    const auto c = static_cast<size_t>(kStackOrder[k]);
    bool any = false;
    for (const auto& l : series) any = any || l[c] != 0;
    if (!any) continue;
    std::vector<double> above(n);
    for (size_t i = 0; i < n; ++i) above[i] = below[i] + static_cast<double>(series[i][c]);
    o << "<polygon fill=\"" << kColors[k] << "\" fill-opacity=\"0.85\" points=\"";
    for (size_t i = 0; i < n; ++i) o << x(i) << "," << y(above[i]) << " ";
    for (size_t i = n; i-- > 0;) o << x(i) << "," << y(below[i]) << " ";
    o << "\"><title>" << memory_category_name(kStackOrder[k]) << "</title></polygon>\n";
    below = std::move(above);
  }
  // Axes and GiB ticks.
  o << "<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left << "\" y2=\"" << top + ph
    << "\" stroke=\"black\"/>\n<line x1=\"" << left << "\" y1=\"" << top + ph << "\" x2=\"" << left + pw << "\" y2=\""
    << top + ph << "\" stroke=\"black\"/>\n";
  const double step_gib = std::max(0.001, [&] {
    const double raw = ymax / gib / 6;
    const double p10 = std::pow(10.0, std::floor(std::log10(raw)));
    return raw / p10 < 2 ? 2 * p10 : raw / p10 < 5 ? 5 * p10 : 10 * p10;
  }());
  for (double g = 0; g * gib <= ymax; g += step_gib)
    o << "<text x=\"" << left - 6 << "\" y=\"" << y(g * gib) + 4 << "\" text-anchor=\"end\">" << g << "</text>\n";
  o << "<text x=\"16\" y=\"" << top + ph / 2 << "\" transform=\"rotate(-90 16 " << top + ph / 2
    << ")\" text-anchor=\"middle\">" << unit << "</text>\n";
  o << "<text x=\"" << left + pw / 2 << "\" y=\"" << Hh - 10 << "\" text-anchor=\"middle\">allocator event ("
    << (n ? n - 1 : 0) << " events)</text>\n";
  // Phase tags where they change, as thin marks along the bottom.
  for (size_t i = 1; i < tags.size() && i < n; ++i)
    if (tags[i] != tags[i - 1] && !tags[i].empty())
      o << "<line x1=\"" << x(i) << "\" y1=\"" << top + ph << "\" x2=\"" << x(i) << "\" y2=\"" << top + ph + 5
        << "\" stroke=\"#444\"><title>" << tags[i] << "</title></line>\n";
  if (planned > 0)
    o << "<line x1=\"" << left << "\" y1=\"" << y(static_cast<double>(planned)) << "\" x2=\"" << left + pw << "\" y2=\""
      << y(static_cast<double>(planned)) << "\" stroke=\"black\" stroke-dasharray=\"6 4\"/>\n<text x=\"" << left + pw - 4
      << "\" y=\"" << y(static_cast<double>(planned)) - 4 << "\" text-anchor=\"end\">plan "
      << static_cast<double>(planned) / gib << " " << unit << "</text>\n";
  // Legend, top category first as in the stack.
  double ly = top + 10;
  for (size_t k = kStackOrder.size(); k-- > 0;) {
    o << "<rect x=\"" << W - right + 16 << "\" y=\"" << ly - 10 << "\" width=\"12\" height=\"12\" fill=\"" << kColors[k]
      << "\"/><text x=\"" << W - right + 34 << "\" y=\"" << ly << "\">" << memory_category_name(kStackOrder[k])
      << "</text>\n";
    ly += 18;
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace

TimelineFiles write_memory_timeline(const std::string& dir, const AllocatorStats& at_start,
                                    const std::vector<MemoryEvent>& events, int64_t planned_peak_bytes) {
  std::filesystem::create_directories(dir);
  Live live{};
  for (int c = 0; c < kMemoryCategories; ++c) live[static_cast<size_t>(c)] = at_start.live_by_category[c];
  std::vector<Live> series{live};
  std::vector<std::string> tags{events.empty() ? std::string() : events.front().tag};
  nlohmann::json j;
  nlohmann::json start = nlohmann::json::object();
  for (int c = 0; c < kMemoryCategories; ++c)
    start[memory_category_name(static_cast<MemoryCategory>(c))] = at_start.live_by_category[c];
  j["live_at_start"] = start;
  j["planned_peak_bytes"] = planned_peak_bytes;
  nlohmann::json ev = nlohmann::json::array();
  int64_t peak = 0;
  for (const auto& e : events) {
    live[static_cast<size_t>(e.category)] += e.delta;
    int64_t total = 0;
    for (int64_t v : live) total += v;
    peak = std::max(peak, total);
    series.push_back(live);
    tags.push_back(e.tag);
    ev.push_back({{"t", e.time_s},
                  {"delta", e.delta},
                  {"live_after", e.live_after},
                  {"category", memory_category_name(e.category)},
                  {"tag", e.tag}});
  }
  int64_t first = 0;
  for (int64_t v : series.front()) first += v;
  j["peak_bytes"] = std::max(peak, first);
  j["events"] = std::move(ev);
  TimelineFiles files{(std::filesystem::path(dir) / "memory_timeline.json").string(),
                      (std::filesystem::path(dir) / "memory_timeline.svg").string()};
  write_text(files.json, j.dump(1) + "\n");
  write_text(files.svg, svg_of(series, tags, planned_peak_bytes));
  return files;
}

}  // namespace lcx
