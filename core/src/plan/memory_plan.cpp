// The SDK half of the memory plan (lcx/plan.h): terms and their sums per phase.
#include <algorithm>

#include "lcx/attention_cost.h"
#include "lcx/plan.h"
#include "lcx/size_math.h"

namespace lcx {

const char* plan_category_name(PlanCategory c) {
  switch (c) {
    case PlanCategory::weights: return "weights";
    case PlanCategory::gradients: return "gradients";
    case PlanCategory::master_weights: return "master weights";
    case PlanCategory::optimizer: return "optimizer state";
    case PlanCategory::activations_gpu: return "saved activations (GPU)";
    case PlanCategory::activations_host: return "saved activations (host)";
    case PlanCategory::transient: return "transient";
    case PlanCategory::reserve: return "reserve";
    case PlanCategory::communication: return "communication";
  }
  return "?";
}

void MemoryPlan::add(std::string id, std::string name, PlanCategory category, int64_t bytes, std::string phase,
                     bool on_host) {
  // A negative size is a product that wrapped: refuse it rather than drop it as empty.
  if (bytes < 0) throw Error(str("memory plan: the term '", name, "' of ", contributor, " has ", bytes,
                                 " bytes, a size that passed 64 bits"),
                             "data.seq_len", "lower data.seq_len");
  if (bytes == 0) return;  // a term of nothing only clutters the breakdown
  terms.push_back({std::move(id), std::move(name), category, bytes, std::move(phase), on_host, contributor});
}

const PlanTerm* MemoryPlan::find(std::string_view id, std::string_view of) const {
  for (const auto& t : terms)
    if (t.id == id && (of.empty() || t.contributor == of)) return &t;
  return nullptr;
}

const std::vector<std::string>& MemoryPlan::phases() {
  static const std::vector<std::string> p = {plan_phase::forward, plan_phase::loss, plan_phase::final_norm,
                                             plan_phase::mlp_backward, plan_phase::backward, plan_phase::optimizer};
  return p;
}

bool MemoryPlan::live_in(const PlanTerm& t, const std::string& phase) {
  if (t.phase == plan_phase::always || t.phase == phase) return true;
  // The step's terms live from the first layer's forward to the last layer's backward.
  return t.phase == plan_phase::step && phase != plan_phase::optimizer;
}

int64_t MemoryPlan::gpu_bytes(const std::string& phase, bool with_reserve) const {
  int64_t n = 0;
  for (const auto& t : terms)
    if (!t.on_host && live_in(t, phase) && (with_reserve || t.category != PlanCategory::reserve))
      n = checked_add(n, t.bytes, str("memory plan, phase ", phase));
  return n;
}

int64_t MemoryPlan::host_bytes(const std::string& phase) const {
  int64_t n = 0;
  for (const auto& t : terms)
    if (t.on_host && live_in(t, phase)) n = checked_add(n, t.bytes, str("memory plan, host, phase ", phase));
  return n;
}

int64_t MemoryPlan::host_peak() const {
  int64_t n = 0;
  for (const auto& p : phases()) n = std::max(n, host_bytes(p));
  return n;
}

MemoryPlan::Peak MemoryPlan::peak(bool with_reserve) const {
  Peak best{phases().front(), -1};
  for (const auto& p : phases()) {
    const int64_t b = gpu_bytes(p, with_reserve);
    if (b > best.bytes) best = {p, b};
  }
  return best;
}

int64_t MemoryPlan::category_bytes(PlanCategory c, bool on_host) const {
  int64_t n = 0;
  for (const auto& t : terms)
    if (t.category == c && t.on_host == on_host) n += t.bytes;
  return n;
}

MemoryPlan::Peak MemoryPlan::largest_transient() const {
  Peak best{phases().front(), 0};
  for (const auto& p : phases()) {
    int64_t n = 0;
    for (const auto& t : terms)
      if (!t.on_host && t.category == PlanCategory::transient && live_in(t, p)) n += t.bytes;
    if (n > best.bytes) best = {p, n};
  }
  return best;
}

void plan_document_masks(MemoryPlan& plan, int64_t hq, int64_t rows, int64_t d) {
  const AttentionBytes b = attention_call_bytes(hq, rows, d, true);
  plan.add("document_mask_forward", "document-masked attention forward: stats of the batches (cuDNN, ragged)",
           PlanCategory::transient, b.forward, plan_phase::forward);
  plan.add("document_mask_backward",
           "document-masked attention backward: stats, softmax sums, dQ accumulator, workspace (cuDNN, ragged)",
           PlanCategory::transient, b.backward, plan_phase::backward);
  plan.add("document_tables",
           "document tables: bounds [docs+1] int64, per batch lengths and first rows int32, ragged offsets int64",
           PlanCategory::transient, b.step, plan_phase::step);
}

}  // namespace lcx
