// The loss on its own: loss_chunked (loaded through the real plugin loader)
// against core's plain full-logits loss, forward + backward on random data of one head's shape
// (default Qwen3-4B's: H 2560, V 151,936, bf16 on the GPU), at each length asked, and a sweep of
// chunk_rows. For every run: the median time of the timed calls after a warm-up (the device is
// synchronized around the host clock; the chunked loss reads its sum back itself), and the memory
// the loss adds: the allocator's peak during the call minus what was live before it (hidden,
// grad_hidden, head, head gradient and targets). A run that runs out of memory is reported as not
// fitting and the next one goes on. One JSON line per run on stdout, for scripts/bench/loss_bench.sh.
//
//   loss_bench --device cuda --tokens 32768,131072 --sweep 64,128,256,512,1024,2048,4096
//   loss_bench --device cpu --dtype bf16 --tokens 1024 --hidden 64 --vocab 1001 --sweep 64,1024   (a smoke run)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "config/manifest.h"
#include "lcx/defaults.h"
#include "lcx/slots/loss.h"
#include "lcx/tensor.h"
#include "loader/plugin_loader.h"

namespace lcx {
namespace {

struct Options {
  Device device = Device::cuda();
  std::vector<int64_t> tokens = {32768, 131072};
  std::vector<int64_t> sweep = {64, 128, 256, 512, 1024, 2048, 4096};
  int64_t hidden = 2560, vocab = 151936, chunk_rows = 256;
  int reps = 3;
  bool plain = true;
  std::string plugin_dir;
  std::string dtype;  // of hidden and head: bf16 on a GPU, fp32 on the CPU unless asked
};

Options parse(int argc, char** argv) {
  Options o;
  bench::Args args("loss_bench", argc, argv);
  while (args.next()) {
    const std::string& a = args.name();
    if (a == "--device") {
      o.device = args.device();
    } else if (a == "--tokens") {
      o.tokens = bench::parse_list(args.value());
    } else if (a == "--sweep") {
      o.sweep = bench::parse_list(args.value());
    } else if (a == "--hidden") {
      o.hidden = args.number();
    } else if (a == "--vocab") {
      o.vocab = args.number();
    } else if (a == "--chunk-rows") {
      o.chunk_rows = args.number();
    } else if (a == "--reps") {
      o.reps = std::max<int>(1, static_cast<int>(args.number()));
    } else if (a == "--dtype") {
      o.dtype = args.value();
      if (o.dtype != "bf16" && o.dtype != "fp32") throw Error(str("loss_bench: --dtype is bf16 or fp32, got ", o.dtype));
    } else if (a == "--no-plain") {
      o.plain = false;
    } else if (a == "--plugin-dir") {
      o.plugin_dir = args.value();
    } else {
      args.unknown("see the usage at the top of tests/bench/loss_bench.cpp");
    }
  }
  return o;
}

// Standard deviation `std`: uniform values of half-width sqrt(3) std.
Tensor random_normalish(Shape shape, DType t, Device d, float std, uint64_t seed) {
  return bench::random_uniform(std::move(shape), t, d, std::sqrt(3.f) * std, seed);
}

struct Inputs {
  Tensor hidden, head, targets, grad_hidden, grad_head;
};

Inputs make_inputs(const Options& o, int64_t T) {
  const DType dt = o.dtype.empty() ? (o.device.is_cuda() ? DType::bf16 : DType::f32)
                                    : o.dtype == "bf16" ? DType::bf16 : DType::f32;
  Inputs in;
  in.hidden = random_normalish({T, o.hidden}, dt, o.device, 1.f, 1);
  in.head = random_normalish({o.vocab, o.hidden}, dt, o.device, 0.02f, 2);
  Tensor t = Tensor::empty({T}, DType::i64);
  uint64_t s = 12345;
  int64_t* p = t.data_as<int64_t>();
  for (int64_t i = 0; i < T; ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = static_cast<int64_t>((s >> 33) % static_cast<uint64_t>(o.vocab));
  }
  p[T - 1] = -100;  // the shifted labels' last position predicts nothing
  in.targets = t.to(o.device);
  in.grad_hidden = Tensor::empty({T, o.hidden}, dt, o.device);
  in.grad_head = Tensor::zeros({o.vocab, o.hidden}, DType::f32, o.device);
  return in;
}

std::string json_escape(const std::string& s) {
  std::string r;
  for (char c : s) {
    if (c == '"' || c == '\\') r += '\\';
    if (c == '\n') {
      r += "\\n";
      continue;
    }
    r += c;
  }
  return r;
}

// One line: {"loss":..., "tokens":..., "chunk_rows":..., ...}; a failure carries "error".
void run_one(const Options& o, Loss& loss, const std::string& name, int64_t chunk_rows, Inputs& in) {
  const int64_t T = in.hidden.size(0);
  Allocator& a = allocator_for(o.device);
  std::printf("{\"loss\": \"%s\", \"device\": \"%s\", \"dtype\": \"%s\", \"tokens\": %lld, \"hidden\": %lld, "
              "\"vocab\": %lld, \"chunk_rows\": %lld, ",
              name.c_str(), device_name(o.device).c_str(), dtype_name(in.hidden.dtype()), static_cast<long long>(T),
              static_cast<long long>(o.hidden), static_cast<long long>(o.vocab), static_cast<long long>(chunk_rows));
  try {
    LossResult r;
    int64_t added = 0;
    std::vector<double> ms;
    for (int i = 0; i <= o.reps; ++i) {
      bench::sync(o.device);
      const int64_t live = a.stats().live_bytes;
      a.reset_peak();
      const auto t0 = std::chrono::steady_clock::now();
      r = loss.forward_backward(in.hidden, in.head, in.targets, 1.0 / static_cast<double>(T), in.grad_hidden,
                                in.grad_head);
      bench::sync(o.device);
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      added = std::max(added, a.stats().peak_bytes - live);
      if (i > 0) ms.push_back(t);  // the first call picks GEMM algorithms and grows the allocator's cache
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    const double flop = 3.0 * 2.0 * static_cast<double>(T) * static_cast<double>(o.vocab) * static_cast<double>(o.hidden);
    std::printf("\"ms\": %.3f, \"tflops\": %.1f, \"added_bytes\": %lld, \"loss_mean\": %.6f, \"valid\": %lld}\n", med,
                flop / med / 1e9, static_cast<long long>(added), r.loss_sum / static_cast<double>(std::max<int64_t>(r.valid, 1)),
                static_cast<long long>(r.valid));
  } catch (const Error& e) {
    const std::string what = e.what();
    const bool oom = what.find("out of memory") != std::string::npos;
    std::printf("\"error\": \"%s\", \"detail\": \"%s\"}\n", oom ? "does not fit" : "failed",
                json_escape(what.substr(0, 300)).c_str());
  }
  std::fflush(stdout);
}

std::shared_ptr<Loss> load_chunked(const Options& o, int64_t chunk_rows) {
  std::vector<std::string> dirs = PluginLoader::default_search_dirs(o.plugin_dir);
  const Manifest m = Manifest::parse(str("[loss_chunked]\nchunk_rows = ", chunk_rows, "\n"), "loss_bench");
  PluginLoader loader(dirs);
  auto loss = std::dynamic_pointer_cast<Loss>(
      loader.create("loss_chunked", PluginArgs{"loss_chunked", m.section("loss_chunked"), o.device}));
  if (!loss) throw Error("loss_bench: loss_chunked is not a Loss");
  return loss;
}

int main_impl(int argc, char** argv) {
  const Options o = parse(argc, argv);
  if (o.device.is_cuda() && !cuda_available())
    throw Error("loss_bench: no CUDA device visible", {}, "run with --device cpu for a smoke run");
  for (int64_t T : o.tokens) {
    Inputs in = make_inputs(o, T);
    std::vector<int64_t> rows = o.sweep;
    if (std::find(rows.begin(), rows.end(), o.chunk_rows) == rows.end()) rows.push_back(o.chunk_rows);
    for (int64_t c : rows) {
      auto loss = load_chunked(o, c);
      run_one(o, *loss, "chunked", c, in);
    }
    if (o.plain) {
      auto plain = make_full_logits_loss();
      run_one(o, *plain, "plain", T, in);
    }
  }
  return 0;
}

}  // namespace
}  // namespace lcx

int main(int argc, char** argv) {
  try {
    return lcx::main_impl(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
