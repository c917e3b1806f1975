// The stream every lcx kernel and library call is issued on. One per thread, the legacy default
// stream until a caller sets another, so host-side Tensor copies (which synchronize) stay ordered
// with kernels without extra events. Overlap code (copies of saved activations to the host, ring attention) sets its own stream
// for the scope of its work with StreamGuard and orders the rest with events.
#pragma once
#include <cuda_runtime.h>

namespace lcx::cuda {

cudaStream_t current_stream();
void set_current_stream(cudaStream_t s);

class StreamGuard {
 public:
  explicit StreamGuard(cudaStream_t s) : prev_(current_stream()) { set_current_stream(s); }
  ~StreamGuard() { set_current_stream(prev_); }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  cudaStream_t prev_;
};

}  // namespace lcx::cuda
