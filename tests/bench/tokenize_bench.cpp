// Tokenizer throughput on one text: the tokenizer loaded once, the text encoded --reps times with
// --threads threads; the first encode is cold (empty word caches), the others warm. One JSON line
// on stdout with the load time and the tokens per second of the first and of the median encode.
//
//   tokenize_bench --tokenizer data/qwen3/tokenizer.json --file data/kjv/kjv.txt --threads 16
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "data/tokenizer.h"
#include "util/file.h"

namespace lcx {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int run(int argc, char** argv) {
  std::string tokenizer, file;
  int threads = 0, reps = 5;
  bench::Args args("tokenize_bench", argc, argv);
  while (args.next()) {
    const std::string& a = args.name();
    if (a == "--tokenizer") tokenizer = args.value();
    else if (a == "--file") file = args.value();
    else if (a == "--threads") threads = static_cast<int>(args.number());
    else if (a == "--reps") reps = static_cast<int>(args.number());
    else args.unknown("options: --tokenizer FILE --file PATH [--threads N] [--reps N]");
  }
  if (tokenizer.empty() || file.empty() || reps < 1)
    throw Error("tokenize_bench needs --tokenizer and --file", {}, "see the file's opening comment");
  const std::string text = read_file(file, "--file", "give a text file");
  auto t0 = std::chrono::steady_clock::now();
  const Tokenizer tok = Tokenizer::load(tokenizer);
  const double load = seconds_since(t0);
  std::vector<double> times;
  size_t tokens = 0;
  for (int r = 0; r < reps; ++r) {
    t0 = std::chrono::steady_clock::now();
    tokens = tok.encode(text, threads).size();
    times.push_back(seconds_since(t0));
  }
  const double first = times[0];
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  nlohmann::json out = {{"tokenizer", tokenizer}, {"file", file}, {"bytes", text.size()}, {"tokens", tokens},
                        {"threads", threads}, {"load_s", load}, {"first_s", first}, {"median_s", median},
                        {"first_tokens_per_s", tokens / first}, {"median_tokens_per_s", tokens / median}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace
}  // namespace lcx

int main(int argc, char** argv) {
  try {
    return lcx::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
