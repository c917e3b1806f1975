// Communicators and the rank mesh: how ranks that share one training step exchange tensors.
//
// Code above this header never knows which implementation it talks to:
//   - in-process: ranks are threads of one process (CPU tests; "virtual ranks" sharing one GPU).
//     Data moves through host copies and sums run in fp32 in rank order, so a result does not
//     depend on timing and equals the serial sum bit for bit.
//   - NCCL (core, CUDA builds): one process per GPU, bootstrapped from the launch variables.
//
// Rules every implementation keeps:
//   - Collectives are called by every rank of the communicator in the same order. Each call has
//     a per-communicator sequence number (#1, #2, ...) that errors quote.
//   - Every call has a timeout (CommOptions::timeout_s, set_timeout). A call that waits longer
//     throws lcx::Error naming the collective, its sequence number, the communicator and, where
//     the implementation can tell, the ranks that never arrived.
//   - When one rank fails (abort(), or an exception inside run_in_process), ranks waiting in any
//     collective throw "rank N failed: <its message>" promptly instead of waiting out the timeout.
//   - Tensors are contiguous; shapes only matter through their element counts: "along dim 0"
//     means in the flat row-major order, as Tensor::rows cuts them. All tensors of one call have
//     one dtype and live on the communicator's device (in-process: any device, per call).
//
// Typical use:
//   lcx::run_in_process(4, [&](lcx::Communicator& c) {          // tests: 4 thread-ranks
//     lcx::Mesh mesh(c, {.dp = 1, .cp = 2, .sp = 2});
//     auto ring = mesh.cp().send_recv_async({lcx::P2POp::send(kv, next), lcx::P2POp::recv(kv_in, prev)});
//     ... attention on the block in hand ...
//     ring->wait();
//   });
// Overlap: send_recv_async, all_gather_async and reduce_scatter_async return a CommWork; the
// call is issued (its sequence number taken) at once and completes in wait(). The NCCL
// implementation waits on the host in wait() (that is where its timeout lives), so data is
// ready on every stream afterwards.
// A Parallelism plugin gets its rank's mesh in configure() (lcx/slots/parallelism.h).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "lcx/mesh_shape.h"
#include "lcx/tensor.h"

namespace lcx {

struct CommOptions {
  double timeout_s = 300;  // per call; tests use a second or two
};

// A grouped send/recv in flight. wait() returns when every op of the group completed (receive
// buffers hold their data) and throws what the blocking call would have thrown.
class CommWork {
 public:
  virtual ~CommWork() = default;
  virtual void wait() = 0;
};

// One point-to-point op of a group. A send is matched by the peer's recv in the same order per
// (sender, receiver) pair; both sides use the same dtype and element count.
struct P2POp {
  enum class Kind : uint8_t { send, recv };
  Kind kind = Kind::send;
  int peer = 0;  // rank in the communicator
  Tensor tensor;  // send: read; recv: written
  static P2POp send(const Tensor& t, int peer) { return {Kind::send, peer, t}; }
  static P2POp recv(const Tensor& t, int peer) { return {Kind::recv, peer, t}; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "world", "dp", "cp", "sp", "seq": appears in every error of this communicator.
  virtual const std::string& name() const = 0;
  virtual double timeout() const = 0;
  virtual void set_timeout(double seconds) = 0;

  // Sum over ranks, in place. Floating types accumulate in fp32 (bf16/fp16 rounded once at the
  // end in-process), integers exactly.
  virtual void all_reduce(Tensor& t) = 0;
  // Sum of host scalars in fp64 (loss sums, squared norms, token counts), in place.
  virtual void all_reduce(std::span<double> values) = 0;
  // in holds size() equal blocks along dim 0; rank r gets the sum of every rank's block r.
  // in.numel() == size() * out.numel().
  void reduce_scatter(const Tensor& in, Tensor& out) { reduce_scatter_async(in, out)->wait(); }
  // out = every rank's `in` concatenated along dim 0 in rank order. out.numel() == size() * in.numel().
  void all_gather(const Tensor& in, Tensor& out) { all_gather_async(in, out)->wait(); }
  // The same, started now and finished by wait() (ZeRO-3 gathers the next layer while this one
  // computes). Issue order is the call order the ranks must agree on; leave in and out untouched
  // until wait(), and wait() on every work before the communicator goes.
  virtual std::unique_ptr<CommWork> reduce_scatter_async(const Tensor& in, Tensor& out) = 0;
  virtual std::unique_ptr<CommWork> all_gather_async(const Tensor& in, Tensor& out) = 0;
  // in holds size() equal blocks along dim 0; block j goes to rank j, and out's block i is what
  // rank i sent here. in.numel() == out.numel(), a multiple of size(). in and out must differ.
  virtual void all_to_all(const Tensor& in, Tensor& out) = 0;
  // A batch of sends and receives that progress together (a ring step sends to the next rank
  // while receiving from the previous: issued one by one, both sides would wait on each other).
  // Sends are posted at once; overlap compute with the returned work and wait() before reading.
  virtual std::unique_ptr<CommWork> send_recv_async(std::vector<P2POp> ops) = 0;
  void send_recv(std::vector<P2POp> ops) { send_recv_async(std::move(ops))->wait(); }
  virtual void barrier() = 0;

  // A collective over this communicator: ranks with the same color form a new communicator,
  // ordered by key (then by rank here). Like MPI_Comm_split and ncclCommSplit.
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;
  // This rank failed with `message`: the other ranks' pending and future calls throw
  // "rank N failed: message" (N is this rank in the world).
  virtual void abort(const std::string& message) = 0;
};

// In-process world of `size` thread-ranks; element r is rank r. Hand each to its own thread.
std::vector<std::unique_ptr<Communicator>> make_in_process_world(int size, CommOptions opts = {});

// Runs fn on `size` threads, each with its rank's communicator, and joins them. When a rank
// throws, the others are aborted, and this throws lcx::Error "rank N failed: <message>" for the
// first rank that failed (its key and fix kept), after every thread returned.
void run_in_process(int size, const std::function<void(Communicator&)>& fn, CommOptions opts = {});

class Mesh {
 public:
  // Throws lcx::Error naming the [distributed] keys when an axis is < 1, dp * cp * sp differs
  // from world_size, or ep does not divide it. Call before any GPU work.
  static void validate(const MeshShape& shape, int world_size);
  // Where a world rank sits, as shape.order places the axes (lcx/mesh_shape.h).
  static MeshCoord coord_of(const MeshShape& shape, int world_rank);

  // A collective over `world` (every rank calls it): validates, then splits one communicator per
  // axis. `world` must outlive the mesh.
  Mesh(Communicator& world, const MeshShape& shape);
  ~Mesh();
  Mesh(const Mesh&) = delete;
  Mesh& operator=(const Mesh&) = delete;

  const MeshShape& shape() const { return shape_; }
  const MeshCoord& coord() const { return coord_; }
  Communicator& world() const { return world_; }
  Communicator& dp() const { return *dp_; }
  Communicator& cp() const { return *cp_; }
  Communicator& sp() const { return *sp_; }
  // cp x sp: the ranks that share one sequence (loss and valid-token counts of one sequence),
  // ranked by seq_index (the order of their shards) whatever the placement order.
  Communicator& seq() const { return *seq_; }
  // MeshShape::ep > 1 (null otherwise): the ep consecutive world ranks that each hold one part of
  // the model's partitioned parameters (GradGroup::partition_replicas), ranked by their place in
  // it (world rank mod ep, lcx/mesh_shape.h), and the ranks holding the same part (one per
  // partition), over which its gradients are summed.
  Communicator* partition() const { return partition_.get(); }
  Communicator* partition_replicas() const { return partition_replicas_.get(); }

 private:
  Communicator& world_;
  MeshShape shape_;
  MeshCoord coord_;
  std::unique_ptr<Communicator> dp_, cp_, sp_, seq_, partition_, partition_replicas_;
};

}  // namespace lcx
