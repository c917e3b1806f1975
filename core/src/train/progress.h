// What a user of the reference recipe reads: the step dict in Python's repr and a tqdm-style bar.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lcx {

// Python's repr() of a float: shortest round-trip digits, fixed for 1e-4 <= |x| < 1e16, else
// scientific with a signed two-digit exponent (2e-05, 1049000.0, 1e+16, nan, inf).
std::string python_float(double x);
// Python's round(x, digits), as the reference rounds the logged loss.
double python_round(double x, int digits);

// {'loss': 4.311, 'grad_norm': 29.25, ...} from ordered key/value pairs.
std::string step_dict(const std::vector<std::pair<std::string, double>>& items);

// "  8%|▊         | 1/12 [06:20<1:09:41, 380.10s/it]", and `postfix` after the rate as tqdm puts
// it: "[06:20<1:09:41, 380.10s/it, 2.15k tok/s, MFU 41.3%, GPU 31.20 GiB]".
// `done_here` counts the steps timed by elapsed_s (fewer than `done` after a resume).
std::string progress_line(int64_t done, int64_t total, double elapsed_s, int64_t done_here = -1,
                          const std::string& postfix = {});
// The bar's postfix for a step: tokens per second over all ranks, the MFU where known (a negative
// `mfu` is unknown: on the CPU, or a GPU without a peak) and the step's peak memory on `where`.
std::string step_postfix(double tokens_per_s, double mfu, const std::string& where, int64_t peak_bytes);
// tqdm's time format: mm:ss, or h:mm:ss from an hour on.
std::string tqdm_time(double seconds);

// Updates one bar in place on a terminal (carriage return), or prints plain lines otherwise.
class ProgressBar {
 public:
  ProgressBar(int64_t total, bool terminal);
  void update(int64_t done, double elapsed_s, int64_t done_here = -1, const std::string& postfix = {});
  // Prints a line above the bar (the step dict) without breaking it.
  void message(const std::string& line);
  void finish();

 private:
  int64_t total_;
  bool terminal_;
  std::string last_;
};

}  // namespace lcx
