#include "distributed/nccl_comm.h"

#ifdef LCX_HAVE_CUDA
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "cuda/check.h"
#include "cuda/stream.h"
#include "distributed/bootstrap.h"
#include "lcx/profile.h"

#define LCX_NCCL_CHECK(call)                                                                       \
  do {                                                                                             \
    ncclResult_t lcx_nr_ = (call);                                                                 \
    if (lcx_nr_ != ncclSuccess && lcx_nr_ != ncclInProgress)                                       \
      throw ::lcx::Error(::lcx::str(#call " failed: ", ncclGetErrorString(lcx_nr_), " at ", __FILE__, \
                                    ":", __LINE__));                                               \
  } while (0)

namespace lcx {
namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::f32: return ncclFloat32;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
  }
  throw Error("unsupported dtype for NCCL");
}

ncclConfig_t nonblocking_config() {
  ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
  c.blocking = 0;
  return c;
}

Clock::time_point deadline_after(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

class NcclComm;

class NcclWork final : public CommWork {
 public:
  NcclWork(NcclComm* c, const char* op, int64_t seq, cudaEvent_t done) : comm_(c), op_(op), seq_(seq), done_(done) {}
  ~NcclWork() override {
    if (done_) cudaEventDestroy(done_);
  }
  void wait() override;

 private:
  NcclComm* comm_;
  const char* op_;
  int64_t seq_;
  cudaEvent_t done_;
};

class NcclComm final : public Communicator {
 public:
  NcclComm(ncclComm_t comm, int device, std::string name, double timeout)
      : comm_(comm), device_(device), name_(std::move(name)), timeout_(timeout) {
    LCX_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    LCX_NCCL_CHECK(ncclCommCount(comm_, &size_));
    LCX_CUDA_CHECK(cudaSetDevice(device_));
    LCX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    LCX_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    LCX_CUDA_CHECK(cudaMalloc(&scratch_, kScratchDoubles * sizeof(double)));
  }

  ~NcclComm() override {
    cudaSetDevice(device_);
    if (comm_) {
      // Finalize flushes pending work; a peer that is gone would make it wait forever, so it
      // gets the timeout and then the communicator is aborted instead.
      const ncclResult_t fin = ncclCommFinalize(comm_);
      const bool clean = fin == ncclSuccess || fin == ncclInProgress;
      const auto deadline = deadline_after(timeout_);
      ncclResult_t st = ncclInProgress;
      while (clean && Clock::now() < deadline && ncclCommGetAsyncError(comm_, &st) == ncclSuccess && st == ncclInProgress)
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      if (clean && st == ncclSuccess)
        ncclCommDestroy(comm_);
      else
        ncclCommAbort(comm_);
    }
    cudaFree(scratch_);
    cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }
  double timeout() const override { return timeout_; }
  void set_timeout(double seconds) override { timeout_ = seconds; }

  void all_reduce(Tensor& t) override {
    check_tensor("all_reduce", t);
    run("all_reduce", [&] {
      return ncclAllReduce(t.data(), t.data(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), ncclSum, comm_, stream_);
    });
  }

  void all_reduce(std::span<double> values) override {
    for (size_t off = 0; off < values.size(); off += kScratchDoubles) {
      const size_t n = std::min(kScratchDoubles, values.size() - off);
      LCX_CUDA_CHECK(cudaMemcpy(scratch_, values.data() + off, n * sizeof(double), cudaMemcpyHostToDevice));
      run("all_reduce(host fp64)", [&] { return ncclAllReduce(scratch_, scratch_, n, ncclFloat64, ncclSum, comm_, stream_); });
      LCX_CUDA_CHECK(cudaMemcpy(values.data() + off, scratch_, n * sizeof(double), cudaMemcpyDeviceToHost));
    }
  }

  std::unique_ptr<CommWork> reduce_scatter_async(const Tensor& in, Tensor& out) override {
    check_tensor("reduce_scatter", in);
    check_tensor("reduce_scatter", out);
    require(in.dtype() == out.dtype() && in.numel() == size_ * out.numel(), "reduce_scatter", "in.numel() == size() * out.numel()");
    return start("reduce_scatter", ++seq_, [&] {
      return ncclReduceScatter(in.data(), out.data(), static_cast<size_t>(out.numel()), nccl_type(in.dtype()), ncclSum,
                               comm_, stream_);
    });
  }

  std::unique_ptr<CommWork> all_gather_async(const Tensor& in, Tensor& out) override {
    check_tensor("all_gather", in);
    check_tensor("all_gather", out);
    require(in.dtype() == out.dtype() && out.numel() == size_ * in.numel(), "all_gather", "out.numel() == size() * in.numel()");
    return start("all_gather", ++seq_, [&] {
      return ncclAllGather(in.data(), out.data(), static_cast<size_t>(in.numel()), nccl_type(in.dtype()), comm_, stream_);
    });
  }

  void all_to_all(const Tensor& in, Tensor& out) override {
    check_tensor("all_to_all", in);
    check_tensor("all_to_all", out);
    require(in.dtype() == out.dtype() && in.numel() == out.numel() && in.numel() % size_ == 0, "all_to_all",
            "in.numel() == out.numel(), a multiple of size()");
    const size_t block = static_cast<size_t>(in.numel() / size_), bytes = block * dtype_size(in.dtype());
    run("all_to_all", [&] {
      ncclResult_t r = ncclGroupStart();
      for (int p = 0; p < size_ && (r == ncclSuccess || r == ncclInProgress); ++p) {
        r = ncclSend(static_cast<const char*>(in.data()) + p * bytes, block, nccl_type(in.dtype()), p, comm_, stream_);
        if (r == ncclSuccess || r == ncclInProgress)
          r = ncclRecv(static_cast<char*>(out.data()) + p * bytes, block, nccl_type(in.dtype()), p, comm_, stream_);
      }
      ncclResult_t e = ncclGroupEnd();
      return r == ncclSuccess || r == ncclInProgress ? e : r;
    });
  }

  std::unique_ptr<CommWork> send_recv_async(std::vector<P2POp> ops) override {
    const int64_t seq = ++p2p_seq_;
    for (const auto& op : ops) {
      check_tensor("send_recv", op.tensor);
      LCX_CHECK(op.peer >= 0 && op.peer < size_, "send_recv peer ", op.peer, " outside communicator '", name_, "'");
    }
    return start("send_recv", seq, [&] {
      ncclResult_t r = ncclGroupStart();
      for (const auto& op : ops) {
        if (r != ncclSuccess && r != ncclInProgress) break;
        const size_t n = static_cast<size_t>(op.tensor.numel());
        r = op.kind == P2POp::Kind::send ? ncclSend(op.tensor.data(), n, nccl_type(op.tensor.dtype()), op.peer, comm_, stream_)
                                         : ncclRecv(op.tensor.data(), n, nccl_type(op.tensor.dtype()), op.peer, comm_, stream_);
      }
      ncclResult_t e = ncclGroupEnd();
      return r == ncclSuccess || r == ncclInProgress ? e : r;
    });
  }

  void barrier() override {
    LCX_CUDA_CHECK(cudaMemsetAsync(scratch_, 0, sizeof(double), stream_));
    run("barrier", [&] { return ncclAllReduce(scratch_, scratch_, 1, ncclFloat64, ncclSum, comm_, stream_); });
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    const int64_t seq = ++seq_;
    ncclConfig_t cfg = nonblocking_config();
    ncclComm_t sub = nullptr;
    LCX_CUDA_CHECK(cudaSetDevice(device_));
    LCX_NCCL_CHECK(ncclCommSplit(comm_, color, key, &sub, &cfg));
    settle("split", seq, deadline_after(timeout_));
    settle_comm(sub, "split", seq, deadline_after(timeout_));
    return std::make_unique<NcclComm>(sub, device_, name, timeout_);
  }

  void abort(const std::string&) override {
    // The other processes learn of it from their timeouts, or sooner from the launcher, which
    // stops every rank when one exits non-zero.
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

  // Waits until `done` completed; aborts the communicator and throws at the deadline.
  void wait_event(cudaEvent_t done, const char* op, int64_t seq) {
    const auto deadline = deadline_after(timeout_);
    for (;;) {
      cudaError_t q = cudaEventQuery(done);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) LCX_CUDA_CHECK(q);
      check_async(op, seq);
      if (Clock::now() > deadline) fail_timeout(op, seq);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  static constexpr size_t kScratchDoubles = 1024;

  std::string where(const char* op, int64_t seq) const {
    return str(op, " #", seq, " on NCCL communicator '", name_, "' (rank ", rank_, " of ", size_, ")");
  }

  [[noreturn]] void fail_timeout(const char* op, int64_t seq) {
    abort("timeout");
    throw Error(str(where(op, seq), " timed out after ", timeout_,
                    " s; ranks missing: not known to NCCL (the launcher names the rank that failed); the communicator was aborted"),
                {}, "a rank is stuck, skipped this call or died: see the other ranks' logs");
  }

  void check_async(const char* op, int64_t seq) {
    LCX_CHECK(comm_ != nullptr, where(op, seq), " after this communicator was aborted");
    ncclResult_t st = ncclSuccess;
    LCX_NCCL_CHECK(ncclCommGetAsyncError(comm_, &st));
    if (st != ncclSuccess && st != ncclInProgress)
      throw Error(str(where(op, seq), " failed: ", ncclGetErrorString(st), " (", ncclGetLastError(comm_), ")"));
  }

  // A non-blocking NCCL call returns ncclInProgress until it is enqueued; wait for that.
  void settle(const char* op, int64_t seq, Clock::time_point deadline) { settle_comm(comm_, op, seq, deadline); }
  void settle_comm(ncclComm_t c, const char* op, int64_t seq, Clock::time_point deadline) {
    for (;;) {
      ncclResult_t st = ncclSuccess;
      LCX_NCCL_CHECK(ncclCommGetAsyncError(c, &st));
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) throw Error(str(where(op, seq), " failed: ", ncclGetErrorString(st)));
      if (Clock::now() > deadline) fail_timeout(op, seq);
      std::this_thread::yield();
    }
  }

  template <typename F>
  void enqueue(const char* op, int64_t seq, F&& call) {
    LCX_CHECK(comm_ != nullptr, where(op, seq), " after this communicator was aborted");
    LCX_CUDA_CHECK(cudaSetDevice(device_));
    // Inputs were written on the caller's stream: the communicator's stream waits for them.
    LCX_CUDA_CHECK(cudaEventRecord(ready_, cuda::current_stream()));
    LCX_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    // Timed on the communicator's stream after that wait: the collective's own time.
    ProfileScope scope(OpKind::communication, op, stream_);
    ncclResult_t r = call();
    if (r != ncclSuccess && r != ncclInProgress)
      throw Error(str(where(op, seq), " failed: ", ncclGetErrorString(r), " (", ncclGetLastError(comm_), ")"));
    settle(op, seq, deadline_after(timeout_));
  }

  // Enqueues and returns a work whose wait() is the host-side wait with the timeout.
  template <typename F>
  std::unique_ptr<CommWork> start(const char* op, int64_t seq, F&& call) {
    cudaEvent_t done = nullptr;
    LCX_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    auto work = std::make_unique<NcclWork>(this, op, seq, done);
    enqueue(op, seq, std::forward<F>(call));
    LCX_CUDA_CHECK(cudaEventRecord(done, stream_));
    return work;
  }

  template <typename F>
  void run(const char* op, F&& call) {
    const int64_t seq = ++seq_;
    enqueue(op, seq, std::forward<F>(call));
    LCX_CUDA_CHECK(cudaEventRecord(ready_, stream_));
    wait_event(ready_, op, seq);
  }

  void check_tensor(const char* op, const Tensor& t) const {
    if (!t.device().is_cuda() || t.device().index != device_)
      throw Error(str(op, " on NCCL communicator '", name_, "': tensor on ", device_name(t.device()), ", the communicator uses ",
                      device_name(Device::cuda(device_))));
  }

  void require(bool ok, const char* op, const char* rule) const {
    if (!ok) throw Error(str(op, " on NCCL communicator '", name_, "': needs one dtype and ", rule));
  }

  ncclComm_t comm_;
  int device_;
  std::string name_;
  double timeout_;
  int rank_ = 0, size_ = 1;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
  double* scratch_ = nullptr;
  int64_t seq_ = 0, p2p_seq_ = 0;
};

void NcclWork::wait() {
  if (!done_) return;
  comm_->wait_event(done_, op_, seq_);
  cudaEventDestroy(done_);
  done_ = nullptr;
}

}  // namespace

std::unique_ptr<Communicator> make_nccl_world(const DistEnv& env, int device, CommOptions opts) {
  ::setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast stays off on these machines
  LCX_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (env.rank == 0) LCX_NCCL_CHECK(ncclGetUniqueId(&id));
  std::string bytes = bootstrap_broadcast(
      env, env.rank == 0 ? std::string(id.internal, sizeof(id.internal)) : std::string(), sizeof(id.internal), opts.timeout_s);
  std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
  ncclConfig_t cfg = nonblocking_config();
  ncclComm_t comm = nullptr;
  LCX_NCCL_CHECK(ncclCommInitRankConfig(&comm, env.world_size, id, env.rank, &cfg));
  const auto deadline = deadline_after(opts.timeout_s);
  for (;;) {
    ncclResult_t st = ncclSuccess;
    LCX_NCCL_CHECK(ncclCommGetAsyncError(comm, &st));
    if (st == ncclSuccess) break;
    if (st != ncclInProgress) {
      ncclCommAbort(comm);
      throw Error(str("NCCL init of rank ", env.rank, " of ", env.world_size, " failed: ", ncclGetErrorString(st)));
    }
    if (Clock::now() > deadline) {
      ncclCommAbort(comm);
      throw Error(str("NCCL init of rank ", env.rank, " of ", env.world_size, " timed out after ", opts.timeout_s, " s"),
                  "MASTER_ADDR", "check that every rank started and can reach the others");
    }
    std::this_thread::yield();
  }
  return std::make_unique<NcclComm>(comm, device, "world", opts.timeout_s);
}

}  // namespace lcx
#endif
