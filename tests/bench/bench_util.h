// What the benchmark binaries share: comma-separated lists on the command line, a device barrier
// around the host clock, and cheap random inputs (their distribution does not change a GEMM's, a
// softmax's or an attention kernel's speed, and benchmarks fill billions of values).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "lcx/error.h"
#include "lcx/tensor.h"

namespace lcx::bench {

inline std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) v.push_back(std::stoll(item));
  return v;
}

// Comma-separated names ("one,pg19").
inline std::vector<std::string> parse_names(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) v.push_back(item);
  return v;
}

// A benchmark's command line, one option at a time: `while (args.next())`, then name() and
// value(); errors name the tool and the option.
class Args {
 public:
  Args(const char* tool, int argc, char** argv) : tool_(tool), argc_(argc), argv_(argv) {}
  bool next() { return ++i_ < argc_ && (name_ = argv_[i_], true); }
  const std::string& name() const { return name_; }
  std::string value() {
    if (i_ + 1 >= argc_) throw Error(str(tool_, ": ", name_, " needs a value"));
    return argv_[++i_];
  }
  int64_t number() { return std::stoll(value()); }
  Device device() {
    const std::string d = value();
    if (d != "cuda" && d != "cpu") throw Error(str(tool_, ": ", name_, " is cuda or cpu, got ", d));
    return d == "cuda" ? Device::cuda() : Device::cpu();
  }
  [[noreturn]] void unknown(const std::string& fix) const {
    throw Error(str(tool_, ": unknown option ", name_), {}, fix);
  }

 private:
  const char* tool_;
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string name_;
};

// The host waits for every queued kernel, so the clock around a call measures the device's work.
inline void sync(Device d) {
  if (d.is_cuda()) backend_for(d)->synchronize();
}

// Uniform values in [-half_width, half_width) from a xorshift stream picked by `seed`.
inline Tensor random_uniform(Shape shape, DType t, Device d, float half_width, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  const float k = half_width / static_cast<float>(1u << 23);
  for (auto& x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    x = static_cast<float>(static_cast<int64_t>(s >> 40) - (1 << 23)) * k;
  }
  return Tensor::from_floats(v, std::move(shape), t, d);
}

// Packed documents' cumulative bounds {0, ..., tokens}: lengths drawn from the mix until the
// sequence is full, the last one cut at its end (as the dataset cuts a document at a sequence
// boundary). "one": a single document; "pg19": log-normal around PG-19's median book (~90k
// tokens); "short": log-normal around 1k tokens (chat, code); "uniform4k": 4,096 each.
inline std::vector<int64_t> document_bounds(const std::string& mix, int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> pg19(std::log(90000.0), 0.8), short_docs(std::log(1000.0), 1.0);
  std::vector<int64_t> b{0};
  while (b.back() < tokens) {
    double n = 0;
    if (mix == "one") n = static_cast<double>(tokens);
    else if (mix == "pg19") n = pg19(rng);
    else if (mix == "short") n = short_docs(rng);
    else if (mix == "uniform4k") n = 4096;
    else throw Error(str("unknown document mix ", mix), "", "one, pg19, short or uniform4k");
    b.push_back(std::min(tokens, b.back() + std::max<int64_t>(1, static_cast<int64_t>(n))));
  }
  return b;
}

}  // namespace lcx::bench
