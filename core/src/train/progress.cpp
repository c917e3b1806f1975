#include "train/progress.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "lcx/size_math.h"

namespace lcx {

std::string python_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // "-d.ddde[+-]XX"
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  auto e = sci.find('e');
  int exp = std::atoi(sci.c_str() + e + 1);
  std::string digits;
  for (size_t i = 0; i < e; ++i)
    if (sci[i] != '.') digits += sci[i];
  std::string out;
  if (exp >= -4 && exp < 16) {  // where repr() writes fixed notation
    if (exp < 0) {
      out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exp + 1) {
      out = digits + std::string(static_cast<size_t>(exp + 1) - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<size_t>(exp + 1)) + "." + digits.substr(static_cast<size_t>(exp + 1));
    }
  }
  if (out.empty()) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return neg ? "-" + out : out;
}

double python_round(double x, int digits) {
  // Python rounds the exact binary value half-to-even; formatting through the shortest
  // correctly-rounded decimal string does the same.
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return std::strtod(buf, nullptr);
}

std::string step_dict(const std::vector<std::pair<std::string, double>>& items) {
  std::string out = "{";
  for (size_t i = 0; i < items.size(); ++i)
    out += (i ? ", '" : "'") + items[i].first + "': " + python_float(items[i].second);
  return out + "}";
}

std::string tqdm_time(double seconds) {
  long s = std::lround(std::max(0.0, seconds));
  long h = s / 3600, m = (s % 3600) / 60, sec = s % 60;
  char buf[32];
  if (h > 0)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", h, m, sec);
  else
    std::snprintf(buf, sizeof buf, "%02ld:%02ld", m, sec);
  return buf;
}

std::string progress_line(int64_t done, int64_t total, double elapsed_s, int64_t done_here, const std::string& postfix) {
  if (done_here < 0) done_here = done;
  static const char* partial[] = {" ", "▏", "▎", "▍", "▌", "▋", "▊", "▉"};
  const int width = 10;
  double frac = total > 0 ? std::min(1.0, static_cast<double>(done) / static_cast<double>(total)) : 0.0;
  int eighths = static_cast<int>(frac * width * 8);
  std::string bar;
  for (int i = 0; i < eighths / 8; ++i) bar += "█";
  if (eighths / 8 < width) {
    bar += partial[eighths % 8];
    bar += std::string(static_cast<size_t>(width - eighths / 8 - 1), ' ');
  }
  char pct[8];
  std::snprintf(pct, sizeof pct, "%3d%%", static_cast<int>(frac * 100));
  std::string rate = "?it/s", remaining = "?";
  if (done_here > 0 && elapsed_s > 0) {
    double per = elapsed_s / static_cast<double>(done_here);
    char r[32];
    if (per >= 1.0)
      std::snprintf(r, sizeof r, "%.2fs/it", per);
    else
      std::snprintf(r, sizeof r, "%.2fit/s", 1.0 / per);
    rate = r;
    remaining = tqdm_time(per * static_cast<double>(total - done));
  }
  return std::string(pct) + "|" + bar + "| " + std::to_string(done) + "/" + std::to_string(total) + " [" +
         tqdm_time(elapsed_s) + "<" + remaining + ", " + rate + (postfix.empty() ? "" : ", " + postfix) + "]";
}

std::string step_postfix(double tokens_per_s, double mfu, const std::string& where, int64_t peak_bytes) {
  char rate[32];
  if (!(tokens_per_s >= 0) || std::isinf(tokens_per_s))
    std::snprintf(rate, sizeof rate, "? tok/s");
  else if (tokens_per_s >= 1e6)
    std::snprintf(rate, sizeof rate, "%.2fM tok/s", tokens_per_s / 1e6);
  else if (tokens_per_s >= 1e3)
    std::snprintf(rate, sizeof rate, "%.2fk tok/s", tokens_per_s / 1e3);
  else
    std::snprintf(rate, sizeof rate, "%.0f tok/s", tokens_per_s);
  std::string out = rate;
  if (mfu >= 0) {
    char m[32];
    std::snprintf(m, sizeof m, ", MFU %.1f%%", 100.0 * mfu);
    out += m;
  }
  if (peak_bytes > 0) out += ", " + where + " " + format_bytes(peak_bytes);
  return out;
}

ProgressBar::ProgressBar(int64_t total, bool terminal) : total_(total), terminal_(terminal) {}

void ProgressBar::update(int64_t done, double elapsed_s, int64_t done_here, const std::string& postfix) {
  last_ = progress_line(done, total_, elapsed_s, done_here, postfix);
  if (terminal_)
    std::fprintf(stderr, "\r%s\033[K", last_.c_str());
  else
    std::fprintf(stderr, "%s\n", last_.c_str());
  std::fflush(stderr);
}

void ProgressBar::message(const std::string& line) {
  if (terminal_) std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  std::fprintf(stdout, "%s\n", line.c_str());
  std::fflush(stdout);
  if (terminal_ && !last_.empty()) {
    std::fprintf(stderr, "%s", last_.c_str());
    std::fflush(stderr);
  }
}

void ProgressBar::finish() {
  if (terminal_ && !last_.empty()) std::fprintf(stderr, "\n");
}

}  // namespace lcx
