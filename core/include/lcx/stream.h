// Streams and events for plugins that overlap copies with compute (a memory strategy's host copies). A Stream is a queue
// of device work; an Event marks a point in one. Ordering between streams is by events on the
// device (Stream::wait), so the host never blocks unless it asks to (Event::synchronize).
//
// On the CPU there is no queue: work runs when it is issued, every event has completed, waits
// return at once. Code written against these types therefore runs unchanged on CPU tensors,
// which is how CI exercises the GPU logic.
#pragma once
#include <memory>

#include "lcx/memory.h"
#include "lcx/tensor.h"

namespace lcx {

class Event;

class Stream {
 public:
  Stream() = default;  // the CPU's (no queue)
  // The stream this thread's kernels are issued on (lcx's compute).
  static Stream compute(Device d);
  // A new stream for copies: it does not wait on the compute stream unless told to by an event.
  static Stream create_copy(Device d);
  Device device() const { return device_; }
  // The cudaStream_t (null: the legacy default stream, or the CPU's), for timing it (lcx/profile.h).
  void* native_handle() const { return handle_; }
  // Work issued on this stream after the call waits for `e`; the host does not block.
  void wait(const Event& e) const;

 private:
  friend class Event;
  friend void copy_async(Tensor& dst, const Tensor& src, const Stream& s);
  Device device_;
  std::shared_ptr<void> owned_;  // the stream when this object created it
  void* handle_ = nullptr;       // cudaStream_t; null is the legacy default stream on a GPU
};

class Event {
 public:
  Event() = default;  // the CPU's: always complete
  // `timing`: the event can measure elapsed time (a little slower to record).
  static Event create(Device d, bool timing = false);
  // Marks the point in `s` after all work issued on it so far.
  void record(const Stream& s);
  bool done() const;         // completed, without blocking
  void synchronize() const;  // the host blocks until completed
  // Seconds from `start` to this event, both recorded with timing and both completed.
  double seconds_since(const Event& start) const;

 private:
  friend class Stream;
  Device device_;
  std::shared_ptr<void> event_;  // cudaEvent_t
};

// dst <- src (same dtype and element count) issued on `s`, returning at once on a GPU. For the
// copy to overlap compute the host side must be pinned memory (lcx/pinned.h); both tensors must
// stay alive until an event recorded after it on `s` completes.
void copy_async(Tensor& dst, const Tensor& src, const Stream& s);

}  // namespace lcx
