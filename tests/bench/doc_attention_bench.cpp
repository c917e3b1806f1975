// Document-masked attention against full causal attention over the same tokens: for
// each length mix, the sequence of --tokens tokens is cut into documents, and one forward and one
// backward of Qwen3-8B's attention shape are timed both ways (the device synchronized around each
// call, the median of --reps). Useful FLOPs count only the score entries a query may see: a causal
// [n x n] block holds n(n+1)/2 of them, so a document of n tokens is worth 4 n(n+1)/2 Hq d
// forward FLOPs (QK^T and PV) and 2.5x that backward. The rate per useful FLOP says what masking
// costs per score; the wall times say what it saves.
// Mixes: "one" (a single document: the mask's overhead alone), "pg19" (lengths drawn from a
// log-normal fit of PG-19's book lengths, median ~90k tokens, so a few documents and a cut one),
// "short" (log-normal around 1k tokens: thousands of documents, as chat/code corpora), "uniform4k".
// On the GPU the masked attention runs on cuDNN's padded batches of documents (kernels/cuda/
// attention_documents.cpp), read and written in place through cuDNN's ragged offsets;
// --masked-kernels auto,padded,own also times them through padded copies of the documents (kind
// "masked_padded", the path where cuDNN refuses ragged plans, and before them) and on the own
// kernels once per document (kind "masked_own"), with the full causal one on cuDNN still.
// One JSON line per (mix, kind) on stdout, then a summary line per mix and masked kind.
// --bounds prints instead one JSON line per mix with its document bounds, and times nothing: the
// PyTorch peer (scripts/bench/doc_attention_torch.py) reads them, so both time the same documents.
//
//   doc_attention_bench --device cuda --tokens 131072 [--masked-kernels auto,padded,own]
//   doc_attention_bench --device cpu --tokens 512 --heads 4 --kv-heads 2 --head-dim 16   (a smoke run)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.h"
#include "lcx/error.h"
#include "lcx/ops.h"
#include "lcx/tensor.h"
#ifdef LCX_HAVE_CUDA
#include "kernels/attention/cudnn/attention_cudnn.h"
#include "kernels/attention/dispatch.h"
#endif

namespace lcx {
namespace {

struct Options {
  Device device = Device::cuda();
  int64_t tokens = 131072, heads = 32, kv_heads = 8, head_dim = 128;  // Qwen3-8B's attention
  std::vector<std::string> mixes = {"one", "pg19", "short", "uniform4k"};
  std::vector<std::string> masked_kernels = {"auto"};  // auto: cuDNN's batches where they load; padded; own
  int reps = 3;
  uint64_t seed = 1;
  bool bounds_only = false;
};

Options parse(int argc, char** argv) {
  Options o;
  bench::Args args("doc_attention_bench", argc, argv);
  while (args.next()) {
    const std::string& a = args.name();
    if (a == "--device") o.device = args.device();
    else if (a == "--tokens") o.tokens = args.number();
    else if (a == "--heads") o.heads = args.number();
    else if (a == "--kv-heads") o.kv_heads = args.number();
    else if (a == "--head-dim") o.head_dim = args.number();
    else if (a == "--mixes") o.mixes = bench::parse_names(args.value());
    else if (a == "--masked-kernels") o.masked_kernels = bench::parse_names(args.value());
    else if (a == "--reps") o.reps = static_cast<int>(args.number());
    else if (a == "--seed") o.seed = static_cast<uint64_t>(args.number());
    else if (a == "--bounds") o.bounds_only = true;
    else args.unknown("--device --tokens --heads --kv-heads --head-dim --mixes --masked-kernels --reps --seed --bounds");
  }
  for (const std::string& k : o.masked_kernels)
    if (k != "auto" && k != "padded" && k != "own")
      throw Error(str("--masked-kernels ", k), "--masked-kernels",
                  "name auto (cuDNN where it loads), padded (cuDNN on padded copies) and/or own");
  return o;
}

double seconds_of(Device d, const std::function<void()>& f) {
  bench::sync(d);
  const auto t0 = std::chrono::steady_clock::now();
  f();
  bench::sync(d);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The GPU's attention kernels for the masked calls: "own" pins the own kernels, "padded" keeps
// cuDNN's batches on padded copies (no ragged plans); "auto" and the CPU leave the choice alone.
// Restores the previous choice when it goes.
class MaskedKernels {
 public:
  explicit MaskedKernels(const std::string& name) {
#ifdef LCX_HAVE_CUDA
    before_ = ops::attention::choice();
    if (name == "own") ops::attention::set_choice(ops::attention::Choice::own);
    if (name == "padded") cuda::set_cudnn_ragged_documents(false);
#else
    (void)name;
#endif
  }
  ~MaskedKernels() {
#ifdef LCX_HAVE_CUDA
    ops::attention::set_choice(before_);
    cuda::set_cudnn_ragged_documents(true);
#endif
  }
  MaskedKernels(const MaskedKernels&) = delete;
  MaskedKernels& operator=(const MaskedKernels&) = delete;

 private:
#ifdef LCX_HAVE_CUDA
  ops::attention::Choice before_ = ops::attention::Choice::automatic;
#endif
};

}  // namespace
}  // namespace lcx

int main(int argc, char** argv) {
  using namespace lcx;
  try {
    const Options o = parse(argc, argv);
    if (o.bounds_only) {
      for (const std::string& mix : o.mixes) {
        const std::vector<int64_t> b = bench::document_bounds(mix, o.tokens, o.seed);
        std::printf("{\"mix\":\"%s\",\"tokens\":%lld,\"seed\":%llu,\"bounds\":[", mix.c_str(),
                    static_cast<long long>(o.tokens), static_cast<unsigned long long>(o.seed));
        for (size_t i = 0; i < b.size(); ++i) std::printf("%s%lld", i ? "," : "", static_cast<long long>(b[i]));
        std::printf("]}\n");
      }
      return 0;
    }
    const int64_t T = o.tokens, Hq = o.heads, Hkv = o.kv_heads, d = o.head_dim;
    const DType dt = o.device.is_cuda() ? DType::bf16 : DType::f32;
    const Tensor q = bench::random_uniform({T, Hq, d}, dt, o.device, 1.f, 1);
    const Tensor k = bench::random_uniform({T, Hkv, d}, dt, o.device, 1.f, 2);
    const Tensor v = bench::random_uniform({T, Hkv, d}, dt, o.device, 1.f, 3);
    const Tensor dout = bench::random_uniform({T, Hq, d}, dt, o.device, 1.f, 4);
    Tensor out = Tensor::empty({T, Hq, d}, dt, o.device), lse = Tensor::empty({Hq, T}, DType::f32, o.device);
    Tensor dq = Tensor::empty(q.shape(), dt, o.device), dk = Tensor::empty(k.shape(), dt, o.device),
           dv = Tensor::empty(v.shape(), dt, o.device);
    auto useful = [&](const std::vector<int64_t>& b) {
      double pairs = 0;
      for (size_t i = 0; i + 1 < b.size(); ++i) {
        const double n = static_cast<double>(b[i + 1] - b[i]);
        pairs += n * (n + 1) / 2;
      }
      return 4.0 * pairs * static_cast<double>(Hq * d);
    };
    for (const std::string& mix : o.mixes) {
      const std::vector<int64_t> b = bench::document_bounds(mix, T, o.seed);
      // Median forward and backward seconds over --reps, after a warm-up call (cuDNN builds its
      // plans: that call's seconds are printed too, as what a new mix of lengths costs at most),
      // printed as one JSON line.
      auto time = [&](const char* kind, const std::vector<int64_t>& documents, double t[2]) {
        ops::AttentionParams p;
        p.documents = documents;
        std::vector<double> fwd, bwd;
        double first[2] = {0, 0};
        for (int r = 0; r < o.reps + 1; ++r) {
          const double f = seconds_of(o.device, [&] { ops::attention_forward(q, k, v, out, lse, p); });
          const double g =
              seconds_of(o.device, [&] { ops::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p); });
          if (r > 0) fwd.push_back(f), bwd.push_back(g);
          else first[0] = f, first[1] = g;
        }
        t[0] = median(fwd);
        t[1] = median(bwd);
        const double flops = useful(documents.empty() ? std::vector<int64_t>{0, T} : documents);
        std::printf("{\"mix\":\"%s\",\"kind\":\"%s\",\"tokens\":%lld,\"documents\":%zu,\"forward_s\":%.6f,"
                    "\"backward_s\":%.6f,\"useful_tflops_fwd\":%.2f,\"useful_tflops_bwd\":%.2f,\"first_call_s\":%.6f}\n",
                    mix.c_str(), kind, static_cast<long long>(T), b.size() - 1, t[0], t[1], flops / t[0] / 1e12,
                    2.5 * flops / t[1] / 1e12, first[0] + first[1]);
      };
      double t_full[2] = {0, 0};
      time("causal", {}, t_full);
      for (const std::string& kernels : o.masked_kernels) {
        double t_masked[2] = {0, 0};
        {
          MaskedKernels pin(kernels);
          time(kernels == "auto" ? "masked" : kernels == "own" ? "masked_own" : "masked_padded", b, t_masked);
        }
        const double rate_fwd = (useful(b) / t_masked[0]) / (useful({0, T}) / t_full[0]);
        const double rate_bwd = (useful(b) / t_masked[1]) / (useful({0, T}) / t_full[1]);
        std::printf("summary %s (masked on %s kernels): %zu documents, masked/causal rate per useful FLOP fwd %.2fx "
                    "bwd %.2fx, wall fwd+bwd masked %.4f s vs causal %.4f s (%.2fx faster)\n",
                    mix.c_str(), kernels.c_str(), b.size() - 1, rate_fwd, rate_bwd, t_masked[0] + t_masked[1],
                    t_full[0] + t_full[1], (t_full[0] + t_full[1]) / (t_masked[0] + t_masked[1]));
      }
    }
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
