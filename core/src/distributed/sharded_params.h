// ZeRO-3 style parameter sharding over a communicator (the whole mesh, in the trainer).
//
// Each parameter is flattened and padded with zeros to a multiple of the world size; rank r owns
// elements [r * shard, (r + 1) * shard). A rank keeps only its shard of the value (the model's
// dtype) and of the fp32 gradient; AdamW built over shards() keeps the fp32 master and moments of
// that shard only. Around each layer the trainer calls:
//
//   forward:   gather(names)                 full values into Parameter::value ... release(names)
//   backward:  gather(names, /*grads=*/true) full values, zeroed full grads for backward to
//              accumulate into ... reduce_grads(names) (sum over ranks into the shard grads,
//              frees the full grads) ... release(names)
//   step:      grad_norm() (global), AdamW over shards() updates master and value shards,
//              zero_grads() before the next step
//
// Overlap: prefetch(next layer) starts its all-gather before this layer computes, and the
// gather(next layer) that follows only waits for it; reduce_grads_async(names) starts the
// reduce-scatter and returns, and finish_grads() (called by grad_norm) completes them all.
//
// Between gather and release the model sees ordinary full parameters; outside that window their
// value and grad are undefined tensors, so the model's zero_grad() must not be called (use
// zero_grads()). gather, reduce_grads and grad_norm are collectives: every rank calls them with
// the same names in the same order.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lcx/comm.h"
#include "lcx/slots/model.h"

namespace lcx {

class ShardedParams {
 public:
  // Collective. Every rank passes the same parameters with the same values (one seed or one
  // checkpoint); each keeps its shard and frees the full value and grad.
  ShardedParams(std::vector<Parameter*> params, Communicator& comm);
  ShardedParams(const ShardedParams&) = delete;
  ShardedParams& operator=(const ShardedParams&) = delete;

  // One Parameter per trained parameter, same name and decay flag: value [shard] in the model's
  // dtype and device, grad fp32 [shard]. Hand these to AdamW and to checkpoints. A frozen
  // parameter (Parameter::frozen) is sharded and gathered as the others, but has no gradient:
  // gather(with_grads) gives it none, reduce_grads skips it, and shards() leaves it out.
  std::vector<Parameter*> shards();
  int64_t shard_numel(const std::string& name) const;
  // Names that start with `prefix` ("model.layers.3."), in the model's order.
  std::vector<std::string> names_with_prefix(const std::string& prefix) const;

  // All-gathers each named value into its Parameter (skipping ones already gathered); with
  // grads, also gives each a zeroed fp32 grad.
  void gather(const std::vector<std::string>& names, bool with_grads = false);
  // Starts the all-gathers of the named values; gather() of those names then only waits.
  void prefetch(const std::vector<std::string>& names);
  // Frees the full values (and any full grads) of the named parameters.
  void release(const std::vector<std::string>& names);
  // Reduce-scatters each named full grad (summed over ranks in rank order), adds this rank's block
  // to its shard grad, and frees the full grad.
  void reduce_grads(const std::vector<std::string>& names);
  // The same, started now: the full grads leave the Parameters at once (the model must not
  // touch them again) and land in the shard grads by finish_grads().
  void reduce_grads_async(const std::vector<std::string>& names);
  void finish_grads();
  void zero_grads();
  // L2 norm of the whole gradient across ranks (fp64 sums of fp32 squares), before clipping.
  // Finishes pending reductions first.
  double grad_norm();

 private:
  struct Entry {
    Parameter* param;
    Shape shape;
    int64_t numel = 0;
    Parameter shard;
    Tensor full_grad;  // padded [size * shard] buffer behind param->grad while gathered
    // A prefetch in flight: the padded buffer it fills.
    std::unique_ptr<CommWork> gathering;
    Tensor gathered;
  };
  // A reduce-scatter in flight: the full grad it reads, the block it writes.
  struct Reduction {
    Entry* entry;
    std::unique_ptr<CommWork> work;
    Tensor full_grad, block;
  };
  void finish_gather(Entry& e);
  Entry& entry(const std::string& name);

  Communicator& comm_;
  std::vector<Entry> entries_;
  std::map<std::string, size_t> by_name_;
  std::vector<Reduction> reductions_;
};

}  // namespace lcx
