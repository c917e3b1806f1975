// The workspace cuDNN asks of lcx's fused attention, by shape: one JSON line per (direction,
// heads, tokens). The memory plan needs it because the backward's workspace grows with the
// sequence on some cuDNN versions and is not one of the step's own tensors; this prints what the
// loaded cuDNN asks, so the plan's term can be checked against it on the GPU machine.
//   cudnn_workspace [--tokens 32768,65536,...] [--heads 4:1,32:8] [--head-dim 128]
#include <cstdio>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention/cudnn/attention_cudnn.h"
#include "lcx/error.h"
#include "lcx/tensor.h"

int main(int argc, char** argv) {
  using namespace lcx;
  std::vector<int64_t> tokens = {32768, 65536, 131072, 196608, 262144, 393216, 524288, 1048576};
  std::vector<std::pair<int64_t, int64_t>> heads = {{4, 1}, {2, 1}, {16, 8}, {32, 8}};
  int64_t d = 128;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    std::stringstream ss(v);
    std::string item;
    if (a == "--tokens") {
      tokens.clear();
      while (std::getline(ss, item, ',')) tokens.push_back(std::stoll(item));
    } else if (a == "--heads") {
      heads.clear();
      while (std::getline(ss, item, ','))
        heads.emplace_back(std::stoll(item.substr(0, item.find(':'))), std::stoll(item.substr(item.find(':') + 1)));
    } else if (a == "--head-dim") {
      d = std::stoll(v);
    } else {
      std::fprintf(stderr, "cudnn_workspace: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  if (!cuda_available()) {
    std::printf("{\"skipped\": \"no GPU\"}\n");
    return 0;
  }
  std::printf("{\"cudnn\": \"%s\"}\n", cuda::cudnn_version().c_str());
  for (bool backward : {false, true})
    for (auto [hq, hkv] : heads)
      for (int64_t t : tokens) {
        int64_t ws = -1;
        try {
          ws = cuda::cudnn_attention_workspace(backward, t, t, hq, hkv, d, DType::bf16, true);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "%s\n", e.what());
        }
        std::printf("{\"backward\": %s, \"Hq\": %lld, \"Hkv\": %lld, \"d\": %lld, \"T\": %lld, \"workspace\": %lld, "
                    "\"dq_accum\": %lld}\n",
                    backward ? "true" : "false", static_cast<long long>(hq), static_cast<long long>(hkv),
                    static_cast<long long>(d), static_cast<long long>(t), static_cast<long long>(ws),
                    static_cast<long long>(hq * t * d * 4));
        std::fflush(stdout);
      }
  return 0;
}
