// The step trace ([run] profile = true): every op of one chosen step timed on the device, by kind
// and by phase. Core's op dispatch, communicators, copies and optimizer open a ProfileScope around
// their work; a plugin doing device work outside lcx::ops (its own kernels, copies on its own
// stream) opens one too. Phases (forward, loss, backward, optimizer) and layers are marked with
// ProfilePhase where the step loop knows them.
//
// When no step is being profiled a scope costs one branch on a thread-local pointer. While one is,
// a scope records a pair of timing events on its stream (CUDA) or reads a steady clock (CPU); a
// scope opened inside another on the same thread is not recorded, so the outer one owns the time
// and kinds never count twice.
#pragma once
#include <cstdint>
#include <string>

namespace lcx {

class Stream;

enum class OpKind : uint8_t {
  gemm,
  attention_fwd,
  attention_bwd,
  norm,
  rotary,
  swiglu,
  loss,
  copy,  // device<->device, host<->device copies (a memory strategy's too)
  optimizer,
  communication,
  embedding,
  other,  // elementwise passes: add, scale, cast
};
inline constexpr int kOpKinds = static_cast<int>(OpKind::other) + 1;
const char* op_kind_name(OpKind k);

// "copy H2D", "copy D2H", "copy D2D" or "copy H2H": a copy's name in the trace.
const char* copy_name(bool dst_on_device, bool src_on_device);

enum class StepPhase : uint8_t { none, forward, loss, backward, communication, optimizer };
const char* step_phase_name(StepPhase p);

namespace profile_detail {
class Recorder;
extern thread_local Recorder* tl_recorder;  // the step being profiled on this thread, or null
// `stream`: a cudaStream_t, or null with `current` set for the thread's compute stream.
int begin(OpKind kind, const char* name, void* stream, bool current);
void end(int id);
void set_detail(int id, std::string detail);
int begin_phase(StepPhase phase, int layer);
void end_phase(int id);
}  // namespace profile_detail

class ProfileScope {
 public:
  // On the thread's compute stream (where lcx::ops issues its kernels).
  ProfileScope(OpKind kind, const char* name) {
    if (profile_detail::tl_recorder) [[unlikely]]
      id_ = profile_detail::begin(kind, name, nullptr, true);
  }
  // On `s`, for work a plugin issues on a stream of its own (copy_async on a copy stream).
  ProfileScope(OpKind kind, const char* name, const Stream& s);
  // On a raw cudaStream_t, for core code that holds one (communicators).
  ProfileScope(OpKind kind, const char* name, void* cuda_stream) {
    if (profile_detail::tl_recorder) [[unlikely]]
      id_ = profile_detail::begin(kind, name, cuda_stream, false);
  }
  ~ProfileScope() {
    if (id_ >= 0) profile_detail::end(id_);
  }
  ProfileScope(const ProfileScope&) = delete;
  ProfileScope& operator=(const ProfileScope&) = delete;

  // True when this scope is recorded: build a detail string (shapes) only then.
  bool recording() const { return id_ >= 0; }
  // Shown in the trace event's args, e.g. a GEMM's M, N, K.
  void detail(std::string text) {
    if (id_ >= 0) profile_detail::set_detail(id_, std::move(text));
  }

 private:
  int id_ = -1;
};

// Marks a phase of the step (layer -1) or one layer within a phase; ops recorded inside carry it.
class ProfilePhase {
 public:
  explicit ProfilePhase(StepPhase phase, int layer = -1) {
    if (profile_detail::tl_recorder) [[unlikely]]
      id_ = profile_detail::begin_phase(phase, layer);
  }
  ~ProfilePhase() {
    if (id_ >= 0) profile_detail::end_phase(id_);
  }
  ProfilePhase(const ProfilePhase&) = delete;
  ProfilePhase& operator=(const ProfilePhase&) = delete;

 private:
  int id_ = -1;
};

}  // namespace lcx
