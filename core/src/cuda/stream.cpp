#include "cuda/stream.h"

namespace lcx::cuda {
namespace {
thread_local cudaStream_t g_stream = nullptr;
}  // namespace

cudaStream_t current_stream() { return g_stream; }
void set_current_stream(cudaStream_t s) { g_stream = s; }

}  // namespace lcx::cuda
