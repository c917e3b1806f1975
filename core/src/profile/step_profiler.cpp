// The step trace: one Recorder per profiled step, owned by a StepProfiler and reachable from the
// SDK's ProfileScope through a thread-local pointer (null, and so one branch, on every other step
// and thread).
//
// On a GPU each scope takes two timing events from a pool made at the step's start (grown by
// doubling, capped with a warning) and records them on its stream around the work; nothing waits
// during the step. finish() synchronizes once and reads every event against the step's first one
// (cudaEventElapsedTime), so times are the device's: a host gap is the time a stream sat idle
// between two ops. On the CPU, where work runs as it is issued, a steady clock is read instead.
#include "profile/step_profiler.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lcx/clock.h"
#include "lcx/error.h"
#include "lcx/log.h"
#include "lcx/stream.h"
#ifdef LCX_HAVE_CUDA
#include <cuda_runtime.h>

#include "cuda/check.h"
#include "cuda/stream.h"
#endif

namespace lcx {

const char* op_kind_name(OpKind k) {
  static constexpr const char* kNames[kOpKinds] = {"gemm", "attention_fwd", "attention_bwd", "norm",
                                                   "rotary", "swiglu", "loss", "copy",
                                                   "optimizer", "communication", "embedding", "other"};
  return kNames[static_cast<int>(k)];
}

const char* copy_name(bool dst_on_device, bool src_on_device) {
  if (dst_on_device) return src_on_device ? "copy D2D" : "copy H2D";
  return src_on_device ? "copy D2H" : "copy H2H";
}

const char* step_phase_name(StepPhase p) {
  static constexpr const char* kNames[] = {"none", "forward", "loss", "backward", "communication", "optimizer"};
  return kNames[static_cast<int>(p)];
}

ProfileScope::ProfileScope(OpKind kind, const char* name, const Stream& s) {
  if (profile_detail::tl_recorder) [[unlikely]]
    id_ = profile_detail::begin(kind, name, s.device().is_cuda() ? s.native_handle() : nullptr, !s.device().is_cuda());
}

namespace profile_detail {

thread_local Recorder* tl_recorder = nullptr;

namespace {

// Far more ops than one step of the largest model issues; past it scopes go unrecorded rather
// than take ever more events.
constexpr size_t kMaxScopes = size_t{1} << 20;
constexpr size_t kFirstEvents = 8192;

}  // namespace

struct Span {
  bool is_phase = false;
  OpKind kind = OpKind::other;
  StepPhase phase = StepPhase::none;
  int layer = -1;
  int track = 0;  // 0: phases and layers; 1: the compute stream; 2 on: other streams
  std::string name, detail;
  void* stream = nullptr;
  int event = -1;  // the first of its two events on a GPU
  double begin_s = 0, end_s = 0;  // from the step's start once resolved
  bool closed = false;
};

class Recorder {
 public:
  Recorder(Device d, int64_t step) : device_(d), step_(step) {
#ifdef LCX_HAVE_CUDA
    if (d.is_cuda()) {
      compute_ = cuda::current_stream();
      grow(kFirstEvents);
      next_ = 2;  // events 0 and 1 are the step's start and end
      LCX_CUDA_CHECK(cudaEventRecord(events_[0], static_cast<cudaStream_t>(compute_)));
    }
#endif
    streams_.push_back(compute_);
    start_s_ = now_s();
  }

  ~Recorder() {
#ifdef LCX_HAVE_CUDA
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
#endif
  }

  int begin(OpKind kind, const char* name, void* stream, bool current) {
    if (open_op_ >= 0) return -1;  // inside another op: the outer scope owns the time
    Span s;
    s.kind = kind;
    s.name = name;
    s.stream = current ? current_stream() : stream;
    s.track = track_of(s.stream);
    for (auto it = phases_.rbegin(); it != phases_.rend(); ++it) {
      const Span& p = spans_[static_cast<size_t>(*it)];
      if (s.phase == StepPhase::none) s.phase = p.phase;
      if (s.layer < 0) s.layer = p.layer;
    }
    if (!open(s)) return -1;
    open_op_ = static_cast<int>(spans_.size());
    spans_.push_back(std::move(s));
    return open_op_;
  }

  void end(int id) {
    close(spans_[static_cast<size_t>(id)]);
    if (id == open_op_) open_op_ = -1;
  }

  void set_detail(int id, std::string d) { spans_[static_cast<size_t>(id)].detail = std::move(d); }

  int begin_phase(StepPhase phase, int layer) {
    Span s;
    s.is_phase = true;
    s.phase = phase;
    s.layer = layer;
    s.name = layer < 0 ? step_phase_name(phase) : str(step_phase_name(phase), " layer ", layer);
    s.stream = current_stream();
    s.track = 0;
    if (!open(s)) return -1;
    const int id = static_cast<int>(spans_.size());
    spans_.push_back(std::move(s));
    phases_.push_back(id);
    return id;
  }

  void end_phase(int id) {
    close(spans_[static_cast<size_t>(id)]);
    auto it = std::find(phases_.begin(), phases_.end(), id);
    if (it != phases_.end()) phases_.erase(it);
  }

  ProfileReport finish(const std::string& dir);

 private:
  bool on_gpu() const { return device_.is_cuda(); }

  void* current_stream() const {
#ifdef LCX_HAVE_CUDA
    if (on_gpu()) return cuda::current_stream();
#endif
    return nullptr;
  }

  int track_of(void* stream) {
    auto it = std::find(streams_.begin(), streams_.end(), stream);
    if (it == streams_.end()) it = streams_.insert(streams_.end(), stream);
    return 1 + static_cast<int>(it - streams_.begin());
  }

  // Starts a span's clock; false when the event pool is at its cap.
  bool open(Span& s) {
#ifdef LCX_HAVE_CUDA
    if (on_gpu()) {
      if (next_ + 2 > events_.size()) {
        if (events_.size() >= 2 * kMaxScopes) {
          ++dropped_;
          return false;
        }
        grow(std::min(events_.size(), 2 * kMaxScopes - events_.size()));
      }
      s.event = static_cast<int>(next_);
      next_ += 2;
      LCX_CUDA_CHECK(cudaEventRecord(events_[static_cast<size_t>(s.event)], static_cast<cudaStream_t>(s.stream)));
      return true;
    }
#endif
    s.begin_s = now_s() - start_s_;
    return true;
  }

  void close(Span& s) {
#ifdef LCX_HAVE_CUDA
    if (on_gpu()) LCX_CUDA_CHECK(cudaEventRecord(events_[static_cast<size_t>(s.event) + 1], static_cast<cudaStream_t>(s.stream)));
#endif
    if (!on_gpu()) s.end_s = now_s() - start_s_;
    s.closed = true;
  }

#ifdef LCX_HAVE_CUDA
  void grow(size_t n) {
    for (size_t i = 0; i < n; ++i) {
      cudaEvent_t e = nullptr;
      LCX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDefault));
      events_.push_back(e);
    }
  }

  // Seconds from the step's start event to event `i`.
  double since_start(size_t i) const {
    float ms = 0;
    LCX_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[0], events_[i]));
    return ms * 1e-3;
  }

  std::vector<cudaEvent_t> events_;
#endif

  Device device_;
  int64_t step_;
  void* compute_ = nullptr;
  std::vector<void*> streams_;
  std::vector<Span> spans_;
  std::vector<int> phases_;  // open phase spans, outermost first
  int open_op_ = -1;
  size_t next_ = 0;
  size_t dropped_ = 0;
  double start_s_ = 0;
};

namespace {

std::string header(const char* label, const char* last) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "  %-15s %12s %10s %10s", label, "total ms", "% of step", last);
  return buf;
}

std::string row(const std::string& label, double ms, double step_ms, const std::string& last) {
  char buf[160];
  std::snprintf(buf, sizeof buf, "  %-15s %12.3f %9.1f%% %10s", label.c_str(), ms, step_ms > 0 ? 100 * ms / step_ms : 0.0,
                last.c_str());
  return buf;
}

double us(double s) { return std::round(s * 1e9) / 1e3; }  // microseconds, to the nanosecond

}  // namespace

ProfileReport Recorder::finish(const std::string& dir) {
  double step_s = 0;
#ifdef LCX_HAVE_CUDA
  if (on_gpu()) {
    LCX_CUDA_CHECK(cudaEventRecord(events_[1], static_cast<cudaStream_t>(compute_)));
    // Copy and communication streams too: every recorded event must have completed.
    LCX_CUDA_CHECK(cudaDeviceSynchronize());
    for (Span& s : spans_)
      if (s.closed) {
        s.begin_s = since_start(static_cast<size_t>(s.event));
        s.end_s = since_start(static_cast<size_t>(s.event) + 1);
      }
    step_s = since_start(1);
  }
#endif
  if (!on_gpu()) step_s = now_s() - start_s_;
  const double step_ms = step_s * 1e3;

  struct Total {
    double ms = 0;
    int64_t count = 0;
  };
  Total kinds[kOpKinds];
  Total phase_span[6], phase_ops[6];
  std::vector<const Span*> compute_ops;
  for (const Span& s : spans_) {
    if (!s.closed) continue;
    const double ms = (s.end_s - s.begin_s) * 1e3;
    const int p = static_cast<int>(s.phase);
    if (s.is_phase) {
      if (s.layer >= 0) continue;
      phase_span[p].ms += ms;
      ++phase_span[p].count;
      continue;
    }
    kinds[static_cast<int>(s.kind)].ms += ms;
    ++kinds[static_cast<int>(s.kind)].count;
    phase_ops[p].ms += ms;
    ++phase_ops[p].count;
    if (s.track == 1) compute_ops.push_back(&s);
  }
  // Host gaps: the compute stream idle between one op's end and the next one's start.
  std::sort(compute_ops.begin(), compute_ops.end(), [](const Span* a, const Span* b) { return a->begin_s < b->begin_s; });
  Total gaps;
  for (size_t i = 1; i < compute_ops.size(); ++i) {
    const double g = compute_ops[i]->begin_s - compute_ops[i - 1]->end_s;
    if (g > 0) {
      gaps.ms += g * 1e3;
      ++gaps.count;
    }
  }

  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", 0},
                    {"args", {{"name", str("lcx step ", step_, " on ", device_name(device_))}}}});
  events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", 0}, {"args", {{"name", "phases and layers"}}}});
  for (size_t i = 0; i < streams_.size(); ++i)
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", 0}, {"tid", i + 1},
                      {"args", {{"name", i == 0 ? (on_gpu() ? "compute stream" : "host") : str("stream ", i)}}}});
  events.push_back({{"name", str("step ", step_)}, {"cat", "step"}, {"ph", "X"}, {"ts", 0}, {"dur", us(step_s)},
                    {"pid", 0}, {"tid", 0}, {"args", nlohmann::json::object()}});
  for (const Span& s : spans_) {
    if (!s.closed) continue;
    nlohmann::json args = {{"phase", step_phase_name(s.phase)}};
    if (s.layer >= 0) args["layer"] = s.layer;
    if (!s.is_phase) args["kind"] = op_kind_name(s.kind);
    if (!s.detail.empty()) args["detail"] = s.detail;
    events.push_back({{"name", s.name},
                      {"cat", s.is_phase ? (s.layer < 0 ? "phase" : "layer") : op_kind_name(s.kind)},
                      {"ph", "X"},
                      {"ts", us(s.begin_s)},
                      {"dur", us(s.end_s - s.begin_s)},
                      {"pid", 0},
                      {"tid", s.track},
                      {"args", std::move(args)}});
  }
  nlohmann::json summary = {{"step", step_}, {"device", device_name(device_)}, {"step_ms", step_ms},
                            {"host_gaps_ms", gaps.ms}, {"host_gaps", gaps.count}, {"unrecorded_ops", dropped_}};
  for (int k = 0; k < kOpKinds; ++k)
    if (kinds[k].count > 0)
      summary["kinds"][op_kind_name(static_cast<OpKind>(k))] = {{"ms", kinds[k].ms}, {"count", kinds[k].count}};
  for (int p = 0; p < 6; ++p)
    if (phase_span[p].count > 0 || phase_ops[p].count > 0)
      summary["phases"][step_phase_name(static_cast<StepPhase>(p))] = {{"ms", phase_span[p].ms}, {"ops_ms", phase_ops[p].ms}};

  ProfileReport r;
  r.step_ms = step_ms;
  std::filesystem::create_directories(dir);
  r.trace_path = (std::filesystem::path(dir) / str("trace-step", step_, ".json")).string();
  {
    std::ofstream out(r.trace_path);
    if (!out) throw Error(str("cannot write the step trace ", r.trace_path), "run.output_dir", "check the folder is writable");
    out << nlohmann::json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}, {"otherData", summary}}.dump() << "\n";
  }

  r.table.push_back(str("profile of step ", step_, " on ", device_name(device_), ": ", step_ms, " ms; trace ", r.trace_path));
  r.table.push_back(header("kind", "count"));
  std::vector<int> order;
  for (int k = 0; k < kOpKinds; ++k)
    if (kinds[k].count > 0) order.push_back(k);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return kinds[a].ms > kinds[b].ms; });
  for (int k : order) r.table.push_back(row(op_kind_name(static_cast<OpKind>(k)), kinds[k].ms, step_ms, str(kinds[k].count)));
  r.table.push_back(row("host gaps", gaps.ms, step_ms, str(gaps.count)));
  r.table.push_back(header("phase", "ops ms"));
  for (int p = 1; p < 6; ++p)
    if (phase_span[p].count > 0) {
      char ops[32];
      std::snprintf(ops, sizeof ops, "%.3f", phase_ops[p].ms);
      r.table.push_back(row(step_phase_name(static_cast<StepPhase>(p)), phase_span[p].ms, step_ms, ops));
    }
  if (dropped_ > 0)
    log::warn(str("profile: ", dropped_, " ops past the first ", kMaxScopes, " were not recorded; the totals miss them"));
  return r;
}

int begin(OpKind kind, const char* name, void* stream, bool current) { return tl_recorder->begin(kind, name, stream, current); }
void end(int id) {
  if (tl_recorder) tl_recorder->end(id);
}
void set_detail(int id, std::string detail) {
  if (tl_recorder) tl_recorder->set_detail(id, std::move(detail));
}
int begin_phase(StepPhase phase, int layer) { return tl_recorder->begin_phase(phase, layer); }
void end_phase(int id) {
  if (tl_recorder) tl_recorder->end_phase(id);
}

}  // namespace profile_detail

StepProfiler::StepProfiler(Device device, int64_t step)
    : rec_(std::make_unique<profile_detail::Recorder>(device, step)) {
  profile_detail::tl_recorder = rec_.get();
}

StepProfiler::~StepProfiler() {
  if (profile_detail::tl_recorder == rec_.get()) profile_detail::tl_recorder = nullptr;
}

ProfileReport StepProfiler::finish(const std::string& dir) {
  profile_detail::tl_recorder = nullptr;
  return rec_->finish(dir);
}

}  // namespace lcx
