#include "distributed/sharded_params.h"

#include <cmath>

#include "lcx/ops.h"
#include "lcx/profile.h"
#include "kernels/adamw_kernel.h"

namespace lcx {

ShardedParams::ShardedParams(std::vector<Parameter*> params, Communicator& comm) : comm_(comm) {
  const int64_t world = comm.size(), rank = comm.rank();
  entries_.reserve(params.size());
  for (Parameter* p : params) {
    LCX_CHECK(p->value.defined(), "parameter ", p->name, " has no value to shard");
    LCX_CHECK(!by_name_.count(p->name), "parameter ", p->name, " listed twice");
    Entry e;
    e.param = p;
    e.shape = p->value.shape();
    e.numel = p->value.numel();
    const int64_t shard = (e.numel + world - 1) / world;
    const int64_t begin = std::min(e.numel, rank * shard), end = std::min(e.numel, (rank + 1) * shard);
    const Device d = p->value.device();
    e.shard.name = p->name;
    e.shard.decay = p->decay;
    e.shard.frozen = p->frozen;
    e.shard.value = Tensor::zeros({shard}, p->value.dtype(), d, MemoryCategory::weights);
    if (end > begin) e.shard.value.rows(0, end - begin).copy_from(p->value.view({e.numel}).rows(begin, end));
    if (!p->frozen) e.shard.grad = Tensor::zeros({shard}, DType::f32, d, MemoryCategory::gradients);
    p->value = Tensor();
    p->grad = Tensor();
    by_name_[p->name] = entries_.size();
    entries_.push_back(std::move(e));
  }
}

std::vector<Parameter*> ShardedParams::shards() {
  std::vector<Parameter*> out;
  for (auto& e : entries_)
    if (!e.shard.frozen) out.push_back(&e.shard);
  return out;
}

ShardedParams::Entry& ShardedParams::entry(const std::string& name) {
  auto it = by_name_.find(name);
  LCX_CHECK(it != by_name_.end(), "no sharded parameter named ", name);
  return entries_[it->second];
}

int64_t ShardedParams::shard_numel(const std::string& name) const {
  auto it = by_name_.find(name);
  LCX_CHECK(it != by_name_.end(), "no sharded parameter named ", name);
  return entries_[it->second].shard.value.numel();
}

std::vector<std::string> ShardedParams::names_with_prefix(const std::string& prefix) const {
  std::vector<std::string> out;
  for (const auto& e : entries_)
    if (e.shard.name.starts_with(prefix)) out.push_back(e.shard.name);
  return out;
}

void ShardedParams::prefetch(const std::vector<std::string>& names) {
  for (const auto& n : names) {
    Entry& e = entry(n);
    if (e.param->value.defined() || e.gathering) continue;
    e.gathered = Tensor::empty({e.shard.value.numel() * comm_.size()}, e.shard.value.dtype(), e.shard.value.device(),
                               MemoryCategory::weights);
    e.gathering = comm_.all_gather_async(e.shard.value, e.gathered);
  }
}

void ShardedParams::finish_gather(Entry& e) {
  e.gathering->wait();
  e.gathering.reset();
  e.param->value = e.gathered.rows(0, e.numel).view(e.shape);
  e.gathered = Tensor();
}

void ShardedParams::gather(const std::vector<std::string>& names, bool with_grads) {
  prefetch(names);
  for (const auto& n : names) {
    Entry& e = entry(n);
    if (e.gathering) finish_gather(e);
    if (with_grads && !e.param->frozen && !e.full_grad.defined()) {
      // The padding stays zero: backward only writes the view.
      e.full_grad = Tensor::zeros({e.shard.value.numel() * comm_.size()}, DType::f32, e.shard.value.device(),
                                  MemoryCategory::gradients);
      e.param->grad = e.full_grad.rows(0, e.numel).view(e.shape);
    }
  }
}

void ShardedParams::release(const std::vector<std::string>& names) {
  for (const auto& n : names) {
    Entry& e = entry(n);
    if (e.gathering) finish_gather(e);  // every rank issued it: it must complete
    e.param->value = Tensor();
    e.param->grad = Tensor();
    e.full_grad = Tensor();
  }
}

void ShardedParams::reduce_grads_async(const std::vector<std::string>& names) {
  for (const auto& n : names) {
    Entry& e = entry(n);
    if (e.param->frozen) continue;  // no gradient: every rank skips it alike
    LCX_CHECK(e.full_grad.defined(), "reduce_grads(", n, ") without gather(..., with_grads=true) first");
    Reduction r{&e, nullptr, std::move(e.full_grad),
                Tensor::empty(e.shard.grad.shape(), DType::f32, e.shard.grad.device(), MemoryCategory::communication)};
    r.work = comm_.reduce_scatter_async(r.full_grad, r.block);
    e.param->grad = Tensor();
    e.full_grad = Tensor();
    reductions_.push_back(std::move(r));
  }
}

void ShardedParams::finish_grads() {
  for (auto& r : reductions_) {
    r.work->wait();
    ops::add_inplace(r.entry->shard.grad, r.block);
  }
  reductions_.clear();
}

void ShardedParams::reduce_grads(const std::vector<std::string>& names) {
  reduce_grads_async(names);
  finish_grads();
}

void ShardedParams::zero_grads() {
  LCX_CHECK(reductions_.empty(), "zero_grads with reductions in flight: finish_grads() first");
  for (auto& e : entries_)
    if (e.shard.grad.defined()) e.shard.grad.zero();
}

double ShardedParams::grad_norm() {
  finish_grads();
  double sq = 0;
  {
    ProfileScope scope(OpKind::optimizer, "grad_norm");
    for (const auto& e : entries_)
      if (e.shard.grad.defined()) sq += adamw::sum_squares(e.shard.grad);
  }
  comm_.all_reduce(std::span<double>(&sq, 1));
  return std::sqrt(sq);
}

}  // namespace lcx
