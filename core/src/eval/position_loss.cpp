// Loss by position: binning, CSV, SVG and the per-position loss itself (see position_loss.h).
#include "eval/position_loss.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <map>
#include <sstream>

#include "lcx/error.h"
#include "lcx/ops.h"

namespace lcx {

void PositionLoss::add(const std::vector<float>& loss, const Tensor& targets) {
  const Tensor t = targets.device().type == DeviceType::cpu ? targets : targets.to(Device::cpu());
  const auto n = static_cast<size_t>(t.numel());
  if (loss.size() != n) throw Error(str("per-position loss has ", loss.size(), " values for ", n, " targets"));
  if (sum.empty()) {
    sum.assign(n, 0.0);
    count.assign(n, 0);
  }
  if (sum.size() != n) throw Error(str("sequences of ", n, " positions mixed with ", sum.size()));
  const int64_t* tg = t.data_as<int64_t>();
  for (size_t i = 0; i < n; ++i) {
    if (tg[i] == -100) continue;
    sum[i] += loss[i];
    count[i] += 1;
  }
}

double PositionLoss::mean(int64_t begin, int64_t end) const {
  double s = 0;
  int64_t c = 0;
  for (int64_t i = std::max<int64_t>(begin, 0); i < std::min<int64_t>(end, static_cast<int64_t>(sum.size())); ++i) {
    s += sum[static_cast<size_t>(i)];
    c += count[static_cast<size_t>(i)];
  }
  return c ? s / static_cast<double>(c) : std::numeric_limits<double>::quiet_NaN();
}

std::vector<BinRow> bin_positions(const PositionLoss& pl, int bins) {
  const auto n = static_cast<int64_t>(pl.sum.size());
  if (bins < 1) throw Error("the number of bins must be at least 1", "--bins", "pass --bins 64");
  bins = static_cast<int>(std::min<int64_t>(bins, std::max<int64_t>(n, 1)));
  std::vector<BinRow> out;
  for (int b = 0; b < bins && n > 0; ++b) {
    BinRow r;
    r.start = n * b / bins;
    r.end = n * (b + 1) / bins;
    double s = 0;
    for (int64_t i = r.start; i < r.end; ++i) {
      s += pl.sum[static_cast<size_t>(i)];
      r.count += pl.count[static_cast<size_t>(i)];
    }
    r.mean_loss = r.count ? s / static_cast<double>(r.count) : std::numeric_limits<double>::quiet_NaN();
    out.push_back(r);
  }
  return out;
}

std::string bins_csv(const RunCurve& run) {
  if (run.label.find_first_of(",\n\"") != std::string::npos)
    throw Error(str("label '", run.label, "' holds a comma, quote or newline"), "--label", "pick a plain label");
  std::string s = "label,bin_start,bin_end,mean_loss,count\n";
  char buf[64];
  for (const auto& b : run.bins) {
    std::snprintf(buf, sizeof buf, "%.6f", b.mean_loss);
    s += str(run.label, ",", b.start, ",", b.end, ",", std::isnan(b.mean_loss) ? "nan" : buf, ",", b.count, "\n");
  }
  return s;
}

std::vector<RunCurve> parse_bins_csv(const std::string& text) {
  std::vector<RunCurve> runs;
  std::istringstream in(text);
  std::string line;
  bool header = true;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (header) {
      if (line.rfind("label,bin_start,bin_end,mean_loss,count", 0) != 0)
        throw Error("not a bins CSV (its header is not label,bin_start,bin_end,mean_loss,count)", {},
                    "give a CSV written by lcx-train eval");
      header = false;
      continue;
    }
    std::vector<std::string> f;
    std::istringstream ls(line);
    std::string cell;
    while (std::getline(ls, cell, ',')) f.push_back(cell);
    if (f.size() != 5) throw Error(str("bins CSV row '", line, "' has ", f.size(), " fields, not 5"));
    BinRow r;
    r.start = std::stoll(f[1]);
    r.end = std::stoll(f[2]);
    r.mean_loss = f[3] == "nan" ? std::numeric_limits<double>::quiet_NaN() : std::stod(f[3]);
    r.count = std::stoll(f[4]);
    if (runs.empty() || runs.back().label != f[0]) runs.push_back(RunCurve{f[0], {}});
    runs.back().bins.push_back(r);
  }
  return runs;
}

double unigram_entropy(const std::vector<int64_t>& counts) {
  double total = 0;
  for (auto c : counts) total += static_cast<double>(c);
  if (total <= 0) return std::numeric_limits<double>::quiet_NaN();
  double h = 0;
  for (auto c : counts)
    if (c > 0) {
      const double p = static_cast<double>(c) / total;
      h -= p * std::log(p);
    }
  return h;
}

namespace {

std::string xml_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&': o += "&amp;"; break;
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

// A tick step of 1, 2 or 5 times a power of ten giving about `target` ticks over `span`.
double nice_step(double span, int target) {
  const double raw = span / std::max(target, 1);
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  for (double m : {1.0, 2.0, 5.0})
    if (raw <= m * p) return m * p;
  return 10 * p;
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", v);
  return buf;
}

std::string tick_label(double v) {
  char buf[32];
  if (std::fabs(v - std::round(v)) < 1e-9) std::snprintf(buf, sizeof buf, "%.0f", v);
  else std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

std::string loss_plot_svg(const std::vector<RunCurve>& runs, double entropy_nats, const std::string& title,
                          int64_t mark_position, const std::string& mark_label) {
  static const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                                 "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"};
  const double W = 900, Hh = 520, left = 70, right = 230, top = 50, bottom = 60;
  const double pw = W - left - right, ph = Hh - top - bottom;
  // The y range spans the values, not zero to the top: runs that differ by hundredths of a nat
  // must stay apart.
  double xmax = 1, ymin = std::numeric_limits<double>::infinity(), ymax = -ymin;
  auto extend = [&](double v) {
    ymin = std::min(ymin, v);
    ymax = std::max(ymax, v);
  };
  for (const auto& r : runs)
    for (const auto& b : r.bins) {
      xmax = std::max(xmax, static_cast<double>(b.end));
      if (!std::isnan(b.mean_loss)) extend(b.mean_loss);
    }
  if (!std::isnan(entropy_nats)) extend(entropy_nats);
  if (ymin > ymax) ymin = 0, ymax = 1;
  const double ystep = nice_step(std::max(ymax - ymin, 0.1), 6);
  ymin = std::max(0.0, std::floor(ymin / ystep - 1e-9) * ystep);
  ymax = std::ceil(ymax / ystep + 1e-9) * ystep;
  if (ymax <= ymin) ymax = ymin + ystep;
  const double xstep = nice_step(xmax, 8);
  auto X = [&](double v) { return left + v / xmax * pw; };
  auto Y = [&](double v) { return top + ph - (v - ymin) / (ymax - ymin) * ph; };

  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << Hh << "\" viewBox=\"0 0 " << W
    << " " << Hh << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  o << "<rect x=\"0\" y=\"0\" width=\"" << W << "\" height=\"" << Hh << "\" fill=\"white\"/>\n";
  o << "<text x=\"" << W / 2 << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">" << xml_escape(title) << "</text>\n";
  // Grid and ticks.
  for (double v = ymin; v <= ymax + 1e-9; v += ystep) {
    o << "<line x1=\"" << num(left) << "\" y1=\"" << num(Y(v)) << "\" x2=\"" << num(left + pw) << "\" y2=\"" << num(Y(v))
      << "\" stroke=\"#e0e0e0\"/>\n";
    o << "<text x=\"" << num(left - 6) << "\" y=\"" << num(Y(v) + 4) << "\" text-anchor=\"end\">" << tick_label(v)
      << "</text>\n";
  }
  for (double v = 0; v <= xmax + 1e-9; v += xstep) {
    o << "<line x1=\"" << num(X(v)) << "\" y1=\"" << num(top + ph) << "\" x2=\"" << num(X(v)) << "\" y2=\""
      << num(top + ph + 5) << "\" stroke=\"black\"/>\n";
    o << "<text x=\"" << num(X(v)) << "\" y=\"" << num(top + ph + 19) << "\" text-anchor=\"middle\">" << tick_label(v)
      << "</text>\n";
  }
  // Axes and their names.
  o << "<line x1=\"" << num(left) << "\" y1=\"" << num(top) << "\" x2=\"" << num(left) << "\" y2=\"" << num(top + ph)
    << "\" stroke=\"black\"/>\n";
  o << "<line x1=\"" << num(left) << "\" y1=\"" << num(top + ph) << "\" x2=\"" << num(left + pw) << "\" y2=\""
    << num(top + ph) << "\" stroke=\"black\"/>\n";
  o << "<text x=\"" << num(left + pw / 2) << "\" y=\"" << num(Hh - 15) << "\" text-anchor=\"middle\">position (token)</text>\n";
  o << "<text x=\"18\" y=\"" << num(top + ph / 2) << "\" text-anchor=\"middle\" transform=\"rotate(-90 18 " << num(top + ph / 2)
    << ")\">mean loss (nats)</text>\n";
  // The unigram entropy.
  double ly = top + 10;
  const double lx = left + pw + 15;
  if (!std::isnan(entropy_nats)) {
    o << "<line x1=\"" << num(left) << "\" y1=\"" << num(Y(entropy_nats)) << "\" x2=\"" << num(left + pw) << "\" y2=\""
      << num(Y(entropy_nats)) << "\" stroke=\"#555\" stroke-dasharray=\"6,4\"/>\n";
    o << "<line x1=\"" << num(lx) << "\" y1=\"" << num(ly) << "\" x2=\"" << num(lx + 25) << "\" y2=\"" << num(ly)
      << "\" stroke=\"#555\" stroke-dasharray=\"6,4\"/>\n";
    char buf[64];
    std::snprintf(buf, sizeof buf, "unigram entropy %.2f", entropy_nats);
    o << "<text x=\"" << num(lx + 32) << "\" y=\"" << num(ly + 4) << "\">" << buf << "</text>\n";
    ly += 20;
  }
  if (mark_position > 0 && static_cast<double>(mark_position) <= xmax) {
    const double mx = X(static_cast<double>(mark_position));
    o << "<line x1=\"" << num(mx) << "\" y1=\"" << num(top) << "\" x2=\"" << num(mx) << "\" y2=\"" << num(top + ph)
      << "\" stroke=\"#555\" stroke-dasharray=\"2,3\"/>\n";
    o << "<text x=\"" << num(mx + 4) << "\" y=\"" << num(top + 12) << "\">" << xml_escape(mark_label) << "</text>\n";
  }
  // One polyline per run (bins without a value are left out), drawn at each bin's middle.
  for (size_t k = 0; k < runs.size(); ++k) {
    const char* c = colors[k % (sizeof colors / sizeof *colors)];
    o << "<polyline fill=\"none\" stroke=\"" << c << "\" stroke-width=\"1.8\" points=\"";
    bool first = true;
    for (const auto& b : runs[k].bins) {
      if (std::isnan(b.mean_loss)) continue;
      o << (first ? "" : " ") << num(X(0.5 * static_cast<double>(b.start + b.end))) << "," << num(Y(b.mean_loss));
      first = false;
    }
    o << "\"/>\n";
    o << "<line x1=\"" << num(lx) << "\" y1=\"" << num(ly) << "\" x2=\"" << num(lx + 25) << "\" y2=\"" << num(ly)
      << "\" stroke=\"" << c << "\" stroke-width=\"2\"/>\n";
    o << "<text x=\"" << num(lx + 32) << "\" y=\"" << num(ly + 4) << "\">" << xml_escape(runs[k].label) << "</text>\n";
    ly += 20;
  }
  o << "</svg>\n";
  return o.str();
}

std::vector<float> per_position_loss(StepSlots& s, const Shard& shard, Device device, int64_t chunk_rows) {
  const Tensor hidden = forward_hidden(s, shard, device);
  const Tensor head = s.model->head_weight();
  const int64_t T = hidden.size(0), V = head.size(0);
  const Tensor targets = shard.targets.device().type == DeviceType::cpu ? shard.targets : shard.targets.to(Device::cpu());
  const int64_t* tg = targets.data_as<int64_t>();
  std::vector<float> loss(static_cast<size_t>(T), 0.f);
  for (int64_t a = 0; a < T; a += chunk_rows) {
    const int64_t b = std::min(T, a + chunk_rows);
    Tensor logits = Tensor::empty({b - a, V}, hidden.dtype(), device);
    ops::matmul(hidden.rows(a, b), false, head, true, logits);
    const std::vector<float> f = logits.to_floats();
    for (int64_t r = 0; r < b - a; ++r) {
      const int64_t target = tg[a + r];
      if (target == -100) continue;
      if (target < 0 || target >= V) throw Error(str("target id ", target, " is outside the vocabulary of ", V));
      const float* row = f.data() + r * V;
      const float mx = *std::max_element(row, row + V);
      double z = 0;
      for (int64_t v = 0; v < V; ++v) z += std::exp(static_cast<double>(row[v] - mx));
      loss[static_cast<size_t>(a + r)] = static_cast<float>(std::log(z) + mx - row[target]);
    }
  }
  return loss;
}

}  // namespace lcx
