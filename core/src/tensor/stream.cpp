// lcx/stream.h: CUDA streams and events behind plain handles, and their CPU stand-ins (no queue,
// events always complete). A build without CUDA has only the CPU side; a CUDA build picks by the
// device each stream or event was made for.
#include "lcx/stream.h"

#include <cstring>

#include "lcx/error.h"
#include "lcx/profile.h"

#ifdef LCX_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/check.h"
#include "cuda/stream.h"
#endif

namespace lcx {
namespace {

void need_cuda_build([[maybe_unused]] Device d) {
#ifndef LCX_HAVE_CUDA
  if (d.is_cuda())
    throw Error(str("a stream or event on ", device_name(d), " needs the CUDA backend, which this build lacks"));
#endif
}

}  // namespace

Stream Stream::compute(Device d) {
  need_cuda_build(d);
  Stream s;
  s.device_ = d;
#ifdef LCX_HAVE_CUDA
  if (d.is_cuda()) s.handle_ = cuda::current_stream();
#endif
  return s;
}

Stream Stream::create_copy(Device d) {
  need_cuda_build(d);
  Stream s;
  s.device_ = d;
#ifdef LCX_HAVE_CUDA
  if (d.is_cuda()) {
    // Non-blocking: the legacy default stream (lcx's compute unless set otherwise) would otherwise
    // serialize with it and no copy could overlap a kernel.
    cudaStream_t h = nullptr;
    LCX_CUDA_CHECK(cudaStreamCreateWithFlags(&h, cudaStreamNonBlocking));
    s.owned_ = std::shared_ptr<void>(h, [](void* p) { cudaStreamDestroy(static_cast<cudaStream_t>(p)); });
    s.handle_ = h;
  }
#endif
  return s;
}

void Stream::wait([[maybe_unused]] const Event& e) const {
#ifdef LCX_HAVE_CUDA
  if (device_.is_cuda() && e.event_)
    LCX_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(handle_), static_cast<cudaEvent_t>(e.event_.get()), 0));
#endif
}

Event Event::create(Device d, [[maybe_unused]] bool timing) {
  need_cuda_build(d);
  Event e;
  e.device_ = d;
#ifdef LCX_HAVE_CUDA
  if (d.is_cuda()) {
    cudaEvent_t h = nullptr;
    LCX_CUDA_CHECK(cudaEventCreateWithFlags(&h, timing ? cudaEventDefault : cudaEventDisableTiming));
    e.event_ = std::shared_ptr<void>(h, [](void* p) { cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
  }
#endif
  return e;
}

void Event::record([[maybe_unused]] const Stream& s) {
#ifdef LCX_HAVE_CUDA
  if (!event_) return;
  LCX_CHECK(s.device_ == device_, "an event made for ", device_name(device_), " cannot be recorded on a stream of ",
            device_name(s.device_));
  LCX_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event_.get()), static_cast<cudaStream_t>(s.handle_)));
#endif
}

bool Event::done() const {
#ifdef LCX_HAVE_CUDA
  if (!event_) return true;
  const cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(event_.get()));
  if (r == cudaErrorNotReady) return false;
  LCX_CUDA_CHECK(r);
#endif
  return true;
}

void Event::synchronize() const {
#ifdef LCX_HAVE_CUDA
  if (event_) LCX_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_.get())));
#endif
}

double Event::seconds_since([[maybe_unused]] const Event& start) const {
#ifdef LCX_HAVE_CUDA
  if (event_ && start.event_) {
    float ms = 0;
    LCX_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_.get()),
                                        static_cast<cudaEvent_t>(event_.get())));
    return ms * 1e-3;
  }
#endif
  return 0;
}

void copy_async(Tensor& dst, const Tensor& src, const Stream& s) {
  LCX_CHECK(dst.dtype() == src.dtype() && dst.numel() == src.numel(), "copy_async: ", dtype_name(dst.dtype()),
            shape_str(dst.shape()), " <- ", dtype_name(src.dtype()), shape_str(src.shape()),
            " (dtype and element count must match)");
  const size_t bytes = src.nbytes();
  if (bytes == 0) return;
  // Timed on `s`, so a memory strategy's copy shows on its copy stream beside the compute it overlaps.
  ProfileScope scope(OpKind::copy, copy_name(dst.device().is_cuda(), src.device().is_cuda()), s);
  if (!dst.device().is_cuda() && !src.device().is_cuda()) {
    std::memcpy(dst.data(), src.data(), bytes);
    return;
  }
  LCX_CHECK(s.device_.is_cuda(), "copy_async: a copy to or from ", device_name(dst.device().is_cuda() ? dst.device() : src.device()),
            " needs a stream of that device, not the CPU's");
#ifdef LCX_HAVE_CUDA
  LCX_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDefault, static_cast<cudaStream_t>(s.handle_)));
#endif
}

}  // namespace lcx
