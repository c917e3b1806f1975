// lcx_tokenizer_bench: tokenizes a text file with lcx's tokenizer and reports tokens, MB/s and
// MB/s per thread, so tokenizer_bench.py can set it beside `tokenizers` on the same machine.
//   lcx_tokenizer_bench TOKENIZER_JSON TEXT_FILE [--threads N] [--repeat R] [--ids OUT.u32]
// Prints one JSON object. The first pass warms the word cache; the reported figure is the best of
// the timed passes after it, each with a fresh Tokenizer::encode call on the whole text.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "data/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON TEXT_FILE [--threads N] [--repeat R] [--ids OUT.u32] [--cold]\n", argv[0]);
    return 2;
  }
  int threads = static_cast<int>(std::thread::hardware_concurrency()), repeat = 3;
  bool cold = false;
  std::string ids_out;
  for (int i = 3; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--repeat") && i + 1 < argc) repeat = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--ids") && i + 1 < argc) ids_out = argv[++i];
    else if (!std::strcmp(argv[i], "--cold")) cold = true;
  }
  try {
    auto t0 = std::chrono::steady_clock::now();
    lcx::Tokenizer tok = lcx::Tokenizer::load(argv[1]);
    double load_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::ifstream in(argv[2], std::ios::binary);
    std::stringstream buf;
    buf << in.rdbuf();
    std::string text = buf.str();
    size_t count = 0;
    double best = 1e30, first = 0;
    for (int r = 0; r <= repeat; ++r) {
      if (cold) tok = lcx::Tokenizer::load(argv[1]);  // a fresh word cache for every pass
      auto a = std::chrono::steady_clock::now();
      auto ids = tok.encode(text, threads);
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
      if (r == 0) {
        first = s;
        if (!ids_out.empty()) {
          std::ofstream o(ids_out, std::ios::binary);
          o.write(reinterpret_cast<const char*>(ids.data()), static_cast<std::streamsize>(ids.size() * 4));
        }
      } else {
        best = std::min(best, s);
      }
      count = ids.size();
    }
    if (repeat == 0) best = first;
    double mb = text.size() / 1e6;
    std::printf("{\"tokens\": %zu, \"bytes\": %zu, \"threads\": %d, \"load_s\": %.3f, \"first_s\": %.4f, "
                "\"best_s\": %.4f, \"mb_per_s\": %.2f, \"mb_per_s_per_thread\": %.2f}\n",
                count, text.size(), threads, load_s, first, best, mb / best, mb / best / threads);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
