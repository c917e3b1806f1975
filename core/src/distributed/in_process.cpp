// The in-process communicator: ranks are threads sharing one rendezvous.
//
// Each collective has a meeting keyed by its sequence number. A rank posts a copy of its input (so
// in-place calls need no care), waits until every rank of the group posted, computes its own output
// from the immutable posts without the lock, and departs; the last to depart frees the meeting.
// Sums run in fp32 (integers in int64) in rank order, so results are the serial sum bit for bit
// whatever the thread timing. Point-to-point sends are buffered copies in a FIFO per (sender,
// receiver); a receive waits for its message. One mutex and condition variable per world (all split
// groups share them) let an abort wake every waiting rank at once.
//
// Copies of CUDA tensors stay on their device (virtual ranks share one GPU: through the host, a
// ZeRO-3 step of an 8B model moved gigabytes per layer through one thread and summed them there).
// Every rank issues its work on the legacy default stream, which orders a post's copy before any
// rank's read of it; a rank that wrote its output synchronizes the device before departing, so a
// post's memory is not reused by a copy stream while a read of it is still queued.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "lcx/comm.h"
#include "lcx/ops.h"
#include "lcx/profile.h"

namespace lcx {
namespace {

using Clock = std::chrono::steady_clock;

struct World {
  std::mutex mu;
  std::condition_variable cv;
  bool aborted = false;
  int failed_rank = -1;
  std::string failure, key, fix;
};

struct Group;

struct Contribution {
  bool posted = false;
  Tensor data;  // flat copy of the input: on the input's CUDA device, else on the host
  std::vector<double> f64;
  int color = 0, key = 0;
};

struct Meeting {
  std::string op;
  int arrived = 0, departed = 0;
  std::vector<Contribution> in;
  // split: each rank's new group and its rank there, built by the last rank to arrive.
  std::vector<std::shared_ptr<Group>> split_group;
  std::vector<int> split_rank;
  std::string mismatch;  // set by the last to arrive when ranks passed different sizes
};

struct Group {
  std::shared_ptr<World> world;
  std::vector<int> world_ranks;  // group rank -> world rank
  std::string name;
  std::map<int64_t, Meeting> meetings;
  std::map<std::pair<int, int>, std::deque<Tensor>> mail;  // (sender, receiver) -> messages
};

Tensor post_copy(const Tensor& t) {
  if (!t.device().is_cuda()) return t.clone().view({t.numel()});
  Tensor d = Tensor::empty({t.numel()}, t.dtype(), t.device(), MemoryCategory::communication);
  d.copy_from(t.view({t.numel()}));
  return d;
}

// A post as `device` holds it: as it is when it already lives there.
Tensor on_device(const Tensor& post, Device device) { return post.device() == device ? post : post.to(device); }

// After a rank wrote a CUDA output from the posts (see the header comment).
void settle(const Tensor& out) {
  if (out.device().is_cuda()) backend_for(out.device())->synchronize();
}

bool float_dtype(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

// Sum of elements [offset, offset + count) of every rank's post, in rank order, as `dtype`.
Tensor sum_in_rank_order(const Meeting& s, int64_t offset, int64_t count, DType dtype) {
  Tensor out = Tensor::empty({count}, dtype, Device::cpu());
  auto host_rows = [&](const Contribution& c) {
    const Tensor rows = c.data.rows(offset, offset + count);
    return rows.device().is_cuda() ? rows.to(Device::cpu()) : rows;
  };
  if (dtype == DType::i32 || dtype == DType::i64) {
    std::vector<int64_t> acc(static_cast<size_t>(count), 0);
    for (const auto& c : s.in) {
      const Tensor rows = host_rows(c);
      for (int64_t i = 0; i < count; ++i)
        acc[static_cast<size_t>(i)] += dtype == DType::i32 ? rows.data_as<int32_t>()[i] : rows.data_as<int64_t>()[i];
    }
    for (int64_t i = 0; i < count; ++i) {
      if (dtype == DType::i32)
        out.data_as<int32_t>()[i] = static_cast<int32_t>(acc[static_cast<size_t>(i)]);
      else
        out.data_as<int64_t>()[i] = acc[static_cast<size_t>(i)];
    }
    return out;
  }
  std::vector<float> acc(static_cast<size_t>(count), 0.0f);
  for (size_t r = 0; r < s.in.size(); ++r) {
    std::vector<float> v = host_rows(s.in[r]).to_floats();
    if (r == 0)
      acc = std::move(v);
    else
      for (size_t i = 0; i < acc.size(); ++i) acc[i] += v[i];
  }
  return Tensor::from_floats(acc, {count}, dtype);
}

// out <- the rank-order sum of elements [offset, offset + out.numel()) of the posts. A float
// output on a GPU is summed there (fp32 accumulator, the same additions as the host loop);
// anything else on the host.
void reduce_into(const Meeting& s, int64_t offset, Tensor& out) {
  const int64_t n = out.numel();
  Tensor flat = out.view({n});
  if (!out.device().is_cuda() || !float_dtype(out.dtype())) {
    flat.copy_from(sum_in_rank_order(s, offset, n, out.dtype()));
    return;
  }
  Tensor acc = Tensor::empty({n}, DType::f32, out.device(), MemoryCategory::communication);
  for (size_t r = 0; r < s.in.size(); ++r) {
    const Tensor x = on_device(s.in[r].data, out.device()).rows(offset, offset + n);
    if (r == 0)
      ops::cast(x, acc);
    else
      ops::add_inplace(acc, x);
  }
  ops::cast(acc, flat);
  settle(out);
}

class InProcessComm;

class InProcessWork final : public CommWork {
 public:
  InProcessWork(InProcessComm* comm, int64_t seq, std::vector<P2POp> recvs)
      : comm_(comm), seq_(seq), recvs_(std::move(recvs)) {}
  void wait() override;

 private:
  InProcessComm* comm_;
  int64_t seq_;
  std::vector<P2POp> recvs_;
};

// An async collective: posted at issue, completed (waiting for the other ranks, writing the
// output) in wait().
class CollectiveWork final : public CommWork {
 public:
  CollectiveWork(InProcessComm* comm, std::string op, int64_t seq, std::function<void(const Meeting&)> compute)
      : comm_(comm), op_(std::move(op)), seq_(seq), compute_(std::move(compute)) {}
  void wait() override;

 private:
  InProcessComm* comm_;
  std::string op_;
  int64_t seq_;
  std::function<void(const Meeting&)> compute_;
};

class InProcessComm final : public Communicator {
  friend class CollectiveWork;

 public:
  InProcessComm(std::shared_ptr<Group> g, int rank, double timeout)
      : g_(std::move(g)), rank_(rank), timeout_(timeout) {}

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(g_->world_ranks.size()); }
  const std::string& name() const override { return g_->name; }
  double timeout() const override { return timeout_; }
  void set_timeout(double seconds) override { timeout_ = seconds; }

  void all_reduce(Tensor& t) override {
    Contribution c;
    c.data = post_copy(t);
    collective("all_reduce", std::move(c), [&](const Meeting& s) {
      reduce_into(s, 0, t);
    });
  }

  void all_reduce(std::span<double> values) override {
    Contribution c;
    c.f64.assign(values.begin(), values.end());
    collective("all_reduce(host fp64)", std::move(c), [&](const Meeting& s) {
                 for (size_t i = 0; i < values.size(); ++i) {
                   double acc = 0;
                   for (const auto& in : s.in) acc += in.f64[i];
                   values[i] = acc;
                 }
               });
  }

  std::unique_ptr<CommWork> reduce_scatter_async(const Tensor& in, Tensor& out) override {
    require(in.dtype() == out.dtype() && in.numel() == size() * out.numel(), "reduce_scatter", in, out,
            "in.numel() == size() * out.numel()");
    Contribution c;
    c.data = post_copy(in);
    const int64_t seq = post("reduce_scatter", std::move(c));
    const int64_t n = out.numel(), offset = rank_ * n;
    return std::make_unique<CollectiveWork>(this, "reduce_scatter", seq,
                                            [out, offset](const Meeting& s) mutable { reduce_into(s, offset, out); });
  }

  std::unique_ptr<CommWork> all_gather_async(const Tensor& in, Tensor& out) override {
    require(in.dtype() == out.dtype() && out.numel() == size() * in.numel(), "all_gather", in, out,
            "out.numel() == size() * in.numel()");
    Contribution c;
    c.data = post_copy(in);
    const int64_t seq = post("all_gather", std::move(c));
    const int64_t n = in.numel();
    return std::make_unique<CollectiveWork>(this, "all_gather", seq, [out, n](const Meeting& s) mutable {
      Tensor flat = out.view({out.numel()});
      for (size_t r = 0; r < s.in.size(); ++r) {
        Tensor dst = flat.rows(static_cast<int64_t>(r) * n, static_cast<int64_t>(r + 1) * n);
        dst.copy_from(s.in[r].data);
      }
      settle(out);
    });
  }

  void all_to_all(const Tensor& in, Tensor& out) override {
    require(in.dtype() == out.dtype() && in.numel() == out.numel() && in.numel() % size() == 0, "all_to_all",
            in, out, "in.numel() == out.numel(), a multiple of size()");
    LCX_CHECK(in.numel() == 0 || in.data() != out.data(), "all_to_all needs distinct in and out");
    Contribution c;
    c.data = post_copy(in);
    collective("all_to_all", std::move(c), [&](const Meeting& s) {
      Tensor flat = out.view({out.numel()});
      const int64_t b = in.numel() / size();
      for (size_t r = 0; r < s.in.size(); ++r) {
        Tensor dst = flat.rows(static_cast<int64_t>(r) * b, static_cast<int64_t>(r + 1) * b);
        dst.copy_from(s.in[r].data.rows(rank_ * b, (rank_ + 1) * b));
      }
      settle(out);
    });
  }

  std::unique_ptr<CommWork> send_recv_async(std::vector<P2POp> ops) override {
    const int64_t seq = ++p2p_seq_;
    std::vector<P2POp> recvs;
    for (auto& op : ops) {
      LCX_CHECK(op.peer >= 0 && op.peer < size(), "send_recv peer ", op.peer, " outside communicator '",
                name(), "' of size ", size());
      if (op.kind == P2POp::Kind::recv) {
        recvs.push_back(std::move(op));
        continue;
      }
      Tensor h = post_copy(op.tensor);
      std::lock_guard lock(g_->world->mu);
      g_->mail[{rank_, op.peer}].push_back(std::move(h));
    }
    g_->world->cv.notify_all();
    return std::make_unique<InProcessWork>(this, seq, std::move(recvs));
  }

  void barrier() override { collective("barrier", Contribution{}, [](const Meeting&) {}); }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    Contribution c;
    c.color = color;
    c.key = key;
    std::unique_ptr<Communicator> result;
    auto build = [&](Meeting& s) {
      std::map<int, std::vector<int>> members;  // color -> parent ranks, ordered by (key, rank)
      for (int r = 0; r < size(); ++r) members[s.in[static_cast<size_t>(r)].color].push_back(r);
      s.split_group.resize(s.in.size());
      s.split_rank.resize(s.in.size());
      for (auto& [col, ranks] : members) {
        std::stable_sort(ranks.begin(), ranks.end(),
                         [&](int a, int b) { return s.in[static_cast<size_t>(a)].key < s.in[static_cast<size_t>(b)].key; });
        auto g = std::make_shared<Group>();
        g->world = g_->world;
        g->name = name;
        for (size_t i = 0; i < ranks.size(); ++i) {
          g->world_ranks.push_back(g_->world_ranks[static_cast<size_t>(ranks[i])]);
          s.split_group[static_cast<size_t>(ranks[i])] = g;
          s.split_rank[static_cast<size_t>(ranks[i])] = static_cast<int>(i);
        }
      }
    };
    collective(
        "split", std::move(c),
        [&](const Meeting& s) {
          result = std::make_unique<InProcessComm>(s.split_group[static_cast<size_t>(rank_)],
                                                   s.split_rank[static_cast<size_t>(rank_)], timeout_);
        },
        build);
    return result;
  }

  void abort(const std::string& message) override { abort_with(message, {}, {}); }

  void abort_with(const std::string& message, const std::string& key, const std::string& fix) {
    World& w = *g_->world;
    {
      std::lock_guard lock(w.mu);
      if (!w.aborted) {
        w.aborted = true;
        w.failed_rank = world_rank(rank_);
        w.failure = message;
        w.key = key;
        w.fix = fix;
      }
    }
    w.cv.notify_all();
  }

  // Called with the world lock held: the error every waiting rank throws once a rank failed.
  void rethrow_failure() const {
    const World& w = *g_->world;
    if (w.aborted) throw_aborted();
  }

  [[noreturn]] void throw_aborted() const {
    const World& w = *g_->world;
    throw Error(str("rank ", w.failed_rank, " failed: ", w.failure), w.key, w.fix);
  }

  std::string describe_missing(const std::vector<int>& missing) const {
    std::string s;
    for (int r : missing) {
      if (!s.empty()) s += ", ";
      s += std::to_string(r);
      if (world_rank(r) != r) s += str(" (world rank ", world_rank(r), ")");
    }
    return s;
  }

  std::string where(const std::string& op, int64_t seq) const {
    return str(op, " #", seq, " on communicator '", name(), "' (rank ", rank_, " of ", size(), ")");
  }

  void receive(int64_t seq, std::vector<P2POp>& recvs) {
    World& w = *g_->world;
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_);
    for (auto& op : recvs) {
      Tensor msg;
      {
        std::unique_lock lock(w.mu);
        auto& box = g_->mail[{op.peer, rank_}];
        while (!w.aborted && box.empty()) {
          if (w.cv.wait_until(lock, deadline) == std::cv_status::timeout && box.empty() && !w.aborted) {
            std::vector<int> missing;
            for (const auto& o : recvs)
              if (g_->mail[{o.peer, rank_}].empty() &&
                  std::find(missing.begin(), missing.end(), o.peer) == missing.end())
                missing.push_back(o.peer);
            throw Error(str(where("send_recv", seq), " timed out after ", timeout_,
                            " s waiting for messages; ranks missing: ", describe_missing(missing)),
                        {}, "the missing ranks never sent: check their logs for an earlier failure or a skipped call");
          }
        }
        if (w.aborted) throw_aborted();
        msg = std::move(box.front());
        box.pop_front();
      }
      if (msg.dtype() != op.tensor.dtype() || msg.numel() != op.tensor.numel())
        throw Error(str(where("send_recv", seq), ": rank ", op.peer, " sent ", msg.numel(), " ",
                        dtype_name(msg.dtype()), " elements, the receive expects ", op.tensor.numel(), " ",
                        dtype_name(op.tensor.dtype())));
      op.tensor.copy_from(msg.view(op.tensor.shape()));
      settle(op.tensor);
    }
  }

 private:
  int world_rank(int r) const { return g_->world_ranks[static_cast<size_t>(r)]; }

  void require(bool ok, const char* op, const Tensor& in, const Tensor& out, const char* rule) const {
    if (!ok)
      throw Error(str(op, " on communicator '", name(), "' (size ", size(), "): in ", dtype_name(in.dtype()),
                      shape_str(in.shape()), ", out ", dtype_name(out.dtype()), shape_str(out.shape()),
                      "; needs one dtype and ", rule));
  }

  // Posts `c` as this rank's part of the next collective and returns its sequence number; the
  // last rank to post runs `on_complete` under the lock. Never waits.
  template <typename Complete = void (*)(Meeting&)>
  int64_t post(const std::string& op, Contribution c, Complete on_complete = [](Meeting&) {}) {
    World& w = *g_->world;
    const int64_t seq = ++seq_;
    std::lock_guard lock(w.mu);
    if (w.aborted) throw_aborted();
    Meeting& meeting = g_->meetings[seq];
    if (meeting.op.empty()) {
      meeting.op = op;
      meeting.in.resize(static_cast<size_t>(size()));
    } else if (meeting.op != op) {
      throw Error(str(where(op, seq), ": another rank called ", meeting.op, " as call #", seq),
                  {}, "every rank must call the collectives of a communicator in the same order");
    }
    c.posted = true;
    meeting.in[static_cast<size_t>(rank_)] = std::move(c);
    if (++meeting.arrived == size()) {
      check_consistent(meeting, op, seq);
      on_complete(meeting);
      w.cv.notify_all();
    }
    return seq;
  }

  // Waits until every rank posted collective `seq`, runs `compute` on the full meeting without
  // the lock (posts are immutable until all depart), then departs.
  template <typename Compute>
  void complete(const std::string& op, int64_t seq, Compute&& compute) {
    World& w = *g_->world;
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_);
    Meeting* meeting = nullptr;
    {
      std::unique_lock lock(w.mu);
      meeting = &g_->meetings.at(seq);
      while (meeting->arrived < size() && !w.aborted) {
        if (w.cv.wait_until(lock, deadline) == std::cv_status::timeout && meeting->arrived < size() && !w.aborted) {
          std::vector<int> missing;
          for (int r = 0; r < size(); ++r)
            if (!meeting->in[static_cast<size_t>(r)].posted) missing.push_back(r);
          throw Error(str(where(op, seq), " timed out after ", timeout_, " s; ranks missing: ",
                          describe_missing(missing)),
                      {}, "the missing ranks never made this call: check their logs for an earlier failure or a skipped call");
        }
      }
      if (meeting->arrived < size()) throw_aborted();
      if (!meeting->mismatch.empty()) {
        std::string m = meeting->mismatch;
        depart(seq);
        throw Error(m, {}, "every rank must pass the same dtype and element count");
      }
    }
    compute(*meeting);
    std::lock_guard lock(w.mu);
    depart(seq);
  }

  template <typename Compute, typename Complete = void (*)(Meeting&)>
  void collective(const std::string& op, Contribution c, Compute&& compute, Complete on_complete = [](Meeting&) {}) {
    ProfileScope scope(OpKind::communication, op.c_str());
    const int64_t seq = post(op, std::move(c), on_complete);
    complete(op, seq, std::forward<Compute>(compute));
  }

  // Called with the lock held.
  void depart(int64_t seq) {
    auto it = g_->meetings.find(seq);
    if (++it->second.departed == size()) g_->meetings.erase(it);
  }

  void check_consistent(Meeting& s, const std::string& op, int64_t seq) const {
    for (size_t r = 1; r < s.in.size(); ++r) {
      const auto& a = s.in[0];
      const auto& b = s.in[r];
      const bool same = a.data.defined() == b.data.defined() && a.f64.size() == b.f64.size() &&
                        (!a.data.defined() || (a.data.dtype() == b.data.dtype() && a.data.numel() == b.data.numel()));
      if (!same) {
        s.mismatch = str(op, " #", seq, " on communicator '", name(), "': rank 0 passed ",
                         a.data.defined() ? a.data.numel() : static_cast<int64_t>(a.f64.size()), " ",
                         a.data.defined() ? dtype_name(a.data.dtype()) : "fp64", " elements, rank ", r, " ",
                         b.data.defined() ? b.data.numel() : static_cast<int64_t>(b.f64.size()), " ",
                         b.data.defined() ? dtype_name(b.data.dtype()) : "fp64");
        return;
      }
    }
  }

  std::shared_ptr<Group> g_;
  int rank_;
  double timeout_;
  int64_t seq_ = 0;
  int64_t p2p_seq_ = 0;
};

void CollectiveWork::wait() {
  if (!compute_) return;
  auto compute = std::move(compute_);
  compute_ = nullptr;
  ProfileScope scope(OpKind::communication, op_.c_str());
  comm_->complete(op_, seq_, compute);
}

void InProcessWork::wait() {
  if (recvs_.empty()) return;
  std::vector<P2POp> recvs = std::move(recvs_);
  recvs_.clear();
  ProfileScope scope(OpKind::communication, "send_recv");
  comm_->receive(seq_, recvs);
}

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_in_process_world(int size, CommOptions opts) {
  LCX_CHECK(size >= 1, "world size ", size);
  auto g = std::make_shared<Group>();
  g->world = std::make_shared<World>();
  g->name = "world";
  for (int r = 0; r < size; ++r) g->world_ranks.push_back(r);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < size; ++r) out.push_back(std::make_unique<InProcessComm>(g, r, opts.timeout_s));
  return out;
}

void run_in_process(int size, const std::function<void(Communicator&)>& fn, CommOptions opts) {
  auto comms = make_in_process_world(size, opts);
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    auto* c = static_cast<InProcessComm*>(comms[static_cast<size_t>(r)].get());
    threads.emplace_back([c, &fn] {
      try {
        fn(*c);
      } catch (const Error& e) {
        c->abort_with(e.what(), e.key(), e.fix());
      } catch (const std::exception& e) {
        c->abort_with(e.what(), {}, {});
      }
    });
  }
  for (auto& t : threads) t.join();
  // Every thread has returned, so the world state is no longer shared.
  auto* c0 = static_cast<InProcessComm*>(comms[0].get());
  c0->rethrow_failure();
}

}  // namespace lcx
