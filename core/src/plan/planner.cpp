// The memory planner: every provider's terms, core's own, and their sums (see plan/plan.h).
#include "plan/plan.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <sstream>

#include "lcx/error.h"
#include "lcx/size_math.h"
#include "util/text.h"

namespace lcx {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
// Outside the allocator: the CUDA context with its kernels and the cuBLAS/cuBLASLt handles. An
// estimate: a context on an H100/H200 with CUDA 12-13 takes about half a GiB (docs/PERF.md, "Memory
// plan against measured peaks", holds it to the measured figure).
constexpr int64_t kContextBytes = 512 * kMiB;
constexpr int64_t kCublasLtWorkspace = 32 * kMiB;  // one per device, matmul_cublaslt.cu
// Allocation rounding and fragmentation, as a share of the allocated peak.
constexpr double kAllocatorSlack = 0.02;

// The buffers train_step (core/src/train/step.cpp) holds itself, beside what the slots hold.
// [eval]'s forward-only pass (train/evaluate.h) adds no term: at the same sequence length it holds
// the forward's buffers without anything saved for a backward and the Loss slot's forward without
// its gradients, so it peaks within the step (tests/train/eval_test.cpp measures it).
void plan_step(const PlanInputs& in, MemoryPlan& p) {
  const int64_t T = in.tokens_per_rank, TH = T * in.model.hidden_size * static_cast<int64_t>(dtype_size(in.weight_dtype));
  p.add("token_ids", "token ids int32 + targets int64 [T]", PlanCategory::transient, T * 12, plan_phase::step);
  p.add("layer_output", "layer output y [T,H]", PlanCategory::transient, TH, plan_phase::forward);
  p.add("loss_hidden", "last layer output, final hidden, its grad [T,H] x3", PlanCategory::transient, 3 * TH,
        plan_phase::loss);
  p.add("final_norm_hidden", "last layer output, final hidden, its grad, dx [T,H] x4", PlanCategory::transient, 4 * TH,
        plan_phase::final_norm);
  for (const char* phase : {plan_phase::mlp_backward, plan_phase::backward})
    p.add("layer_grads", "layer dy, dx [T,H] x2", PlanCategory::transient, 2 * TH, phase);
  // checkpoint_every = k: a segment's rebuilt inputs live through its backward; while the last is
  // being rebuilt, the k-2 before it and dy sit beside the forward's buffers (its output is the
  // layer output above), which also covers the forward's own unsaved input. Exact beside a memory
  // strategy whose device bytes stay level (a window of inputs moved in and out); beside one that
  // releases each saved input (on_device) and a k not dividing L, the full segments come after a
  // release and the peak is one [T,H] below this. With train.rebuild_each, a layer's backward
  // holds its own rebuilt input alone, and a rebuild the input it runs from and dy.
  const int64_t rebuilt = std::min(in.recipe.checkpoint_every(), in.model.num_layers) - 1;
  const bool each = in.recipe.rebuild_each();
  const int64_t held = each ? std::min<int64_t>(rebuilt, 1) : rebuilt, rebuilding = each ? std::min<int64_t>(rebuilt, 2) : rebuilt;
  if (rebuilt > 0) {
    const std::string what = str("rebuilt layer inputs ", held, " x [T,H] (train.checkpoint_every ", in.recipe.checkpoint_every(),
                                 each ? ", rebuild_each" : "", ")");
    p.add("rebuilt_inputs", what, PlanCategory::transient, held * TH, plan_phase::mlp_backward);
    p.add("rebuilt_inputs", what, PlanCategory::transient, held * TH, plan_phase::backward);
    p.add("rebuild_buffers", str("rebuild in the backward: ", rebuilding - 1, " rebuilt inputs and dy [T,H]"),
          PlanCategory::transient, rebuilding * TH, plan_phase::forward);
  }
}

int64_t peak_of(const PlanInputs& in, const PlanSlots& slots) { return build_plan(in, slots).peak().bytes; }

PlanInputs with_seq(PlanInputs in, int64_t seq_len) {
  const int64_t ranks = std::max<int64_t>(1, in.cp * in.sp);
  in.seq_len = seq_len;
  in.tokens_per_rank = (seq_len + ranks - 1) / ranks;
  return in;
}

}  // namespace

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return v < 0 ? "-" + out : out;
}

PlanSlots PlanSlots::of(const SlotSet& s) {
  PlanSlots p;
  for_each_slot([&]<class T>(const SlotRow<T>& row) {
    p.get<T>() = s.get<T>().get();
    auto it = s.providers.find(row.id);
    if (it != s.providers.end()) p.name_of<T>() = it->second.name;
  });
  if (s.parallel_inner) p.parallel_inner_axis = s.parallel_inner->mesh_axis();
  return p;
}

DType grad_dtype_for(const TrainConfig& train, DType weights, int64_t world_size) {
  const bool needs_f32 = train.master_dtype != "bf16" || train.grad_accum > 1 || world_size > 1;
  if (train.grad_dtype == "fp32" || weights == DType::f32) return DType::f32;
  if (train.grad_dtype == "auto") return needs_f32 ? DType::f32 : weights;
  if (needs_f32)
    throw Error(str("train.grad_dtype = \"bf16\" with ",
                    train.master_dtype != "bf16" ? "an fp32 master copy"
                    : train.grad_accum > 1      ? str("grad_accum = ", train.grad_accum)
                                                : str(world_size, " ranks")),
                "train.grad_dtype",
                "gradients summed over sequences or ranks, or feeding an fp32 master, stay fp32: use \"auto\" or \"fp32\"");
  return weights;
}

int64_t plan_seq_unit(const PlanInputs& in, int64_t pad_to_multiple_of) {
  const int64_t shard = in.cp > 1 ? 2 * in.cp * in.sp : in.sp;
  return std::lcm(std::max<int64_t>(1, pad_to_multiple_of), std::max<int64_t>(1, shard));
}

PlanInputs plan_inputs(const CoreConfig& cfg, const ModelConfig& model, int64_t seq_len) {
  PlanInputs in;
  in.model = model;
  in.dp = cfg.distributed.dp;
  in.cp = cfg.distributed.cp;
  in.sp = cfg.distributed.sp;
  in.order = cfg.distributed.order;
  in.ep = cfg.distributed.ep;
  in.rebuild_each = cfg.train.rebuild_each;
  in.world_size = in.dp * in.cp * in.sp;
  in.local_ranks = cfg.distributed.nproc_per_node;
  in.weight_dtype = dtype_from_name(cfg.model.dtype);
  in.master_dtype = cfg.train.master_dtype == "bf16" ? DType::bf16 : DType::f32;
  in.grad_accum = cfg.train.grad_accum;
  in.grad_dtype = grad_dtype_for(cfg.train, in.weight_dtype, in.world_size);
  in.documents_masked = !cfg.data.attend_across_documents;
  const int64_t unit = plan_seq_unit(in, cfg.data.pad_to_multiple_of);
  in = with_seq(in, checked_mul(checked_add(seq_len, unit - 1, "data.seq_len") / unit, unit, "data.seq_len"));
  // A term of the plan is one rank's tokens x one model width x a few bytes and buffers; refused
  // here, such a length cannot wrap inside a provider's plan() into a size that "fits".
  const int64_t widest = std::max({model.vocab_size, model.intermediate_size, model.hidden_size,
                                   model.num_heads * model.head_dim, int64_t{1}});
  try {
    checked_mul(checked_mul(in.tokens_per_rank, widest, "tokens x width"), 16, "tokens x width x 16 bytes");
  } catch (const Error& e) {
    throw Error(str("data.seq_len = ", seq_len, ": the step's buffers pass what 64-bit sizes count (", e.what(), ")"),
                "data.seq_len", "lower data.seq_len: no machine holds such a step");
  }
  return in;
}

MemoryPlan build_plan(const PlanInputs& given, const PlanSlots& s) {
  // The Adapter slot says first what it freezes, so every provider plans the same trained set.
  PlanInputs in = given;
  if (const Adapter* adapter = s.get<Adapter>()) adapter->plan_inputs(in);
  MemoryPlan p;
  for_each_slot([&]<class T>(const SlotRow<T>& row) {
    const T* provider = s.get<T>();
    std::unique_ptr<T> standin;  // core's default for a slot the caller left empty
    if (!provider && row.make_default) provider = (standin = row.make_default()).get();
    if (!provider) return;
    p.contributor = s.name_of<T>();
    provider->plan(in, p);
  });

  p.contributor = "step";
  plan_step(in, p);
  p.contributor = "core";
  p.add("cuda_context", "CUDA context, kernels, cuBLAS handles (estimate)", PlanCategory::reserve, kContextBytes,
        plan_phase::always);
  p.add("cublaslt_workspace", "cuBLASLt workspace", PlanCategory::reserve, kCublasLtWorkspace, plan_phase::always);
  const int64_t allocated = p.peak(false).bytes;
  p.add("allocator_slack", "allocator rounding and fragmentation (2% estimate)", PlanCategory::reserve,
        static_cast<int64_t>(static_cast<double>(allocated) * kAllocatorSlack), plan_phase::always);
  return p;
}

int64_t longest_seq_where(const PlanInputs& in, int64_t unit, const std::function<bool(const PlanInputs&)>& fits_at) {
  unit = std::max<int64_t>(1, unit);
  auto fits = [&](int64_t k) { return fits_at(with_seq(in, k * unit)); };
  if (!fits(1)) return 0;
  int64_t lo = 1, hi = 2;  // fits(lo), and hi is the first power of two tried that does not
  const int64_t max_k = (int64_t{1} << 40) / unit;
  while (hi < max_k && fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  if (hi >= max_k && fits(max_k)) return max_k * unit;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo * unit;
}

int64_t longest_fitting_seq(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t unit) {
  return longest_seq_where(in, unit, [&](const PlanInputs& at) { return peak_of(at, slots) <= gpu_bytes; });
}

std::string format_plan(const MemoryPlan& plan, const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes,
                        int64_t host_bytes, bool terms) {
  std::ostringstream o;
  const ModelConfig& m = in.model;
  char line[512];
  auto row = [&](const std::string& label, int64_t bytes, const std::string& note = {}) {
    std::snprintf(line, sizeof line, "  %-28s %12s%s%s\n", label.c_str(), format_bytes(bytes).c_str(),
                  note.empty() ? "" : "  ", note.c_str());
    o << line;
  };
  o << "memory plan, per GPU\n";
  o << "  model: " << m.model_type << ", hidden " << m.hidden_size << ", intermediate " << m.intermediate_size << ", "
    << m.num_layers << " layers, " << m.num_heads << "/" << m.num_kv_heads << " heads of " << m.head_dim << ", vocab "
    << m.vocab_size << (m.tie_word_embeddings ? ", tied head" : ", untied head") << "\n";
  o << "  sequence: " << with_commas(in.seq_len) << " tokens; mesh dp " << in.dp << " x cp " << in.cp << " x sp "
    << in.sp << " (world " << in.world_size << "): " << with_commas(in.tokens_per_rank) << " tokens per rank\n";
  if (const Model* model = slots.get<Model>()) o << model->plan_summary(in);
  // Placement matters only when both sequence axes have ranks: say which one shares a node.
  if (in.cp > 1 && in.sp > 1)
    o << "  placement: order " << mesh_order_name(in.order)
      << (in.order == MeshOrder::cp_inner
              ? str(": each cp ring on ", in.cp, " neighbouring ranks, each sp group strided ", in.cp, " ranks apart\n")
              : str(": each sp group on ", in.sp, " neighbouring ranks, each cp ring strided ", in.sp, " ranks apart\n"));
  o << "  dtypes: weights and activations " << dtype_name(in.weight_dtype) << ", master "
    << (in.master_dtype == DType::f32 ? "fp32" : "none (moments in the weights' dtype)") << "; grad_accum "
    << in.grad_accum << "\n";
  // Every slot's provider, in the table's order.
  o << "  providers:";
  const char* sep = " ";
  for_each_slot([&]<class T>(const SlotRow<T>& row) {
    o << sep << row.name << " " << slots.name_of<T>();
    sep = ", ";
  });
  o << "\n\n";

  const MemoryPlan::Peak peak = plan.peak(), allocated = plan.peak(false);
  const MemoryPlan::Peak transient = plan.largest_transient();
  int64_t comm = 0;
  for (const auto& t : plan.terms)
    if (!t.on_host && t.category == PlanCategory::communication && MemoryPlan::live_in(t, peak.phase)) comm += t.bytes;
  row("weights", plan.category_bytes(PlanCategory::weights));
  row("gradients", plan.category_bytes(PlanCategory::gradients));
  row("master weights", plan.category_bytes(PlanCategory::master_weights));
  row("optimizer state", plan.category_bytes(PlanCategory::optimizer));
  row("saved activations (GPU)", plan.category_bytes(PlanCategory::activations_gpu));
  row("saved activations (host)", plan.category_bytes(PlanCategory::activations_host, true), "pinned, not on the GPU");
  row("communication buffers", comm, "in the peak's phase");
  row("largest transient", transient.bytes, "in " + transient.phase);
  row("allocator reserve", plan.category_bytes(PlanCategory::reserve), "context, workspaces, slack (not allocated)");
  o << "  " << std::string(42, '-') << "\n";
  row("peak", peak.bytes, str("in ", peak.phase, " (allocated ", format_bytes(allocated.bytes), " + reserve)"));
  row("pinned host memory", plan.host_peak(), in.local_ranks > 1 ? "per rank" : "");
  const int64_t host_node = node_host_bytes(plan, in);
  if (in.local_ranks > 1) row("pinned host, node", host_node, str(in.local_ranks, " ranks on one node"));
  if (host_bytes >= 0) {
    row("host memory", host_bytes,
        host_node <= host_bytes ? str("fits, ", format_bytes(host_bytes - host_node), " to spare")
                                : str("short by ", format_bytes(host_node - host_bytes)));
    if (host_node > host_bytes) o << "  host fix: " << kHostMemoryFix << "\n";
  }
  if (gpu_bytes > 0) {
    row("GPU memory", gpu_bytes,
        peak.bytes <= gpu_bytes ? str("fits, ", format_bytes(gpu_bytes - peak.bytes), " to spare")
                                : str("does NOT fit: short by ", format_bytes(peak.bytes - gpu_bytes)));
  }

  // One line for scripts (scripts/bench/plan_validate.sh): the figures above in bytes.
  o << "  plan: peak_bytes=" << peak.bytes << " allocated_bytes=" << allocated.bytes << " phase=\"" << peak.phase
    << "\" host_bytes=" << plan.host_peak() << " tokens_per_rank=" << in.tokens_per_rank << "\n";
  if (!terms) return o.str();
  o << "\nper phase (GPU, reserve included):";
  for (const auto& ph : MemoryPlan::phases()) o << "\n  " << std::left << ph << ": " << format_bytes(plan.gpu_bytes(ph));
  o << "\n\nterms:\n";
  for (const auto& t : plan.terms) {
    std::snprintf(line, sizeof line, "  %12s  %-24s %-26s %-16s %s\n", format_bytes(t.bytes).c_str(),
                  (t.on_host ? std::string("host: ") + plan_category_name(t.category) : plan_category_name(t.category))
                      .c_str(),
                  t.phase.c_str(), t.contributor.c_str(), t.name.c_str());
    o << line;
  }
  return o.str();
}

namespace {

// An installed plugin that offers itself to a plan that does not fit, created with its defaults.
struct Offer {
  std::string name;
  uint32_t slot = 0;
  std::string why;  // its plan_offer()
  std::shared_ptr<Plugin> object;
};

std::vector<Offer> installed_offers(const PluginLoader* loader) {
  std::vector<Offer> offers;
  if (!loader) return offers;
  std::vector<PluginInfo> found = loader->discover();
  std::sort(found.begin(), found.end(), [](const PluginInfo& a, const PluginInfo& b) { return a.name < b.name; });
  for (const PluginInfo& info : found) {
    if (info.slot == LCX_SLOT_MODEL) continue;
    std::shared_ptr<Plugin> object;
    try {
      object = loader->create(info.path, PluginArgs{info.name, ConfigView(), Device::cpu()});
    } catch (const std::exception&) {
      continue;  // needs a table to be created: it is not offered
    }
    std::string why = object->plan_offer();
    // An adapter always lowers the peak (the base frozen: no gradients, master or moments of its
    // own), so every installed one is offered.
    if (why.empty() && info.slot == LCX_SLOT_ADAPTER) why = "its adapters trained, the base frozen";
    if (!why.empty()) offers.push_back({info.name, info.slot, std::move(why), std::move(object)});
  }
  return offers;
}

// Puts `o` in its slot of `s`; false when its object does not implement the slot's interface.
bool place(PlanSlots& s, const Offer& o) {
  bool placed = false;
  for_each_slot([&]<class T>(const SlotRow<T>& row) {
    if (row.id != o.slot) return;
    if (const T* p = dynamic_cast<const T*>(o.object.get())) {
      s.get<T>() = p;
      s.name_of<T>() = o.name;
      placed = true;
    }
  });
  return placed;
}

// Whether slot `slot` of `s` runs its core default.
bool runs_default(const PlanSlots& s, uint32_t slot) {
  bool out = false;
  for_each_slot([&]<class T>(const SlotRow<T>& row) {
    if (row.id == slot) out = row.default_name && s.name_of<T>() == row.default_name;
  });
  return out;
}

}  // namespace

std::vector<PlanKnob> plan_knobs(const PlanInputs& in, const PlanSlots& slots, const PluginLoader* loader,
                                 int64_t gpu_bytes, int64_t unit) {
  std::vector<PlanKnob> knobs;
  // False, and nothing offered, where a provider refuses this run's settings (an optimizer that
  // needs an fp32 master under master_dtype bf16): it is no fix.
  auto add = [&](std::string action, std::vector<std::string> load, std::vector<std::pair<std::string, std::string>> set,
                 const PlanInputs& i, const PlanSlots& s) {
    int64_t peak = 0;
    try {
      peak = peak_of(i, s);
    } catch (const Error&) {
      return false;
    }
    knobs.push_back({std::move(action), std::move(load), std::move(set), peak, peak <= gpu_bytes});
    return true;
  };
  const std::vector<Offer> offers = installed_offers(loader);
  // Each provider that would replace a core default, alone, then all of them together.
  PlanSlots combined = slots;
  std::vector<std::string> loads;
  std::vector<const Offer*> adapters;
  for (const Offer& o : offers) {
    if (o.slot == LCX_SLOT_PARALLELISM || !runs_default(slots, o.slot)) continue;
    PlanSlots s = slots;
    if (!place(s, o)) continue;
    if (!add(str("load ", o.name, " (", o.why, ")"), {o.name}, {}, in, s)) continue;
    // An adapter changes what trains, not only where it lives: offered on its own, never folded
    // into the other providers' fixes.
    if (o.slot == LCX_SLOT_ADAPTER) {
      adapters.push_back(&o);
      continue;
    }
    place(combined, o);
    loads.push_back(o.name);
  }
  if (loads.size() > 1) add("load " + join(loads, " and "), loads, {}, in, combined);
  // More ranks per sequence: the first size of a parallelism's mesh axis (doubling, up to 64)
  // that fits with the providers above; the loaded parallelism when it offers itself, else the
  // first installed one that does. A stacked pair (two-dimensional) grows its inner's axis as loaded.
  const Offer* parallel = nullptr;
  for (const Offer& o : offers)
    if (o.slot == LCX_SLOT_PARALLELISM && (!parallel || o.name == slots.parallel_name)) parallel = &o;
  const bool stacked = !slots.parallel_inner_axis.empty();
  const Parallelism* grows = parallel ? dynamic_cast<const Parallelism*>(parallel->object.get()) : nullptr;
  const std::string axis = stacked ? slots.parallel_inner_axis : grows ? grows->mesh_axis() : std::string();
  if (axis == "cp" || axis == "sp") {
    PlanSlots with = combined;
    if (!stacked) place(with, *parallel);
    const int64_t now = axis == "cp" ? in.cp : in.sp;
    for (int64_t n = std::max<int64_t>(2, now * 2); n <= 64; n *= 2) {
      PlanInputs i = in;
      (axis == "cp" ? i.cp : i.sp) = n;
      i.world_size = i.dp * i.cp * i.sp;
      const int64_t u = plan_seq_unit(i, 1);
      i = with_seq(i, (in.seq_len + u - 1) / u * u);
      const int64_t peak = peak_of(i, with);
      if (peak <= gpu_bytes || n == 64) {
        std::string action = str("raise distributed.", axis, " to ", n, " (", i.world_size, " GPUs");
        std::vector<std::string> load = loads;
        if (!stacked && slots.parallel_name != parallel->name) {
          action += ", load " + parallel->name;
          load.push_back(parallel->name);
        }
        if (!loads.empty()) action += ", with " + join(loads, " and ");
        knobs.push_back({action + ")", std::move(load), {{"distributed." + axis, std::to_string(n)}}, peak,
                         peak <= gpu_bytes});
        break;
      }
    }
  }
  const int64_t longest = longest_fitting_seq(in, slots, gpu_bytes, unit);
  if (longest > 0 && longest < in.seq_len)
    add(str("lower data.seq_len to ", longest), {}, {{"data.seq_len", std::to_string(longest)}}, with_seq(in, longest),
        slots);
  // No length fits as loaded: the longest that fits with the providers above together, and with
  // them and each adapter, where this length does not.
  if (longest == 0) {
    auto shorter = [&](const std::vector<std::string>& names, const PlanSlots& with) {
      if (names.empty() || peak_of(in, with) <= gpu_bytes) return;
      const int64_t n = longest_fitting_seq(in, with, gpu_bytes, unit);
      if (n > 0)
        add(str("load ", join(names, " and "), ", and lower data.seq_len to ", n), names,
            {{"data.seq_len", std::to_string(n)}}, with_seq(in, n), with);
    };
    shorter(loads, combined);
    for (const Offer* a : adapters) {
      PlanSlots with = combined;
      place(with, *a);
      std::vector<std::string> names = loads;
      names.push_back(a->name);
      shorter(names, with);
    }
  }
  return knobs;
}

std::string format_out_of_memory(const CoreConfig& cfg, const SlotSet& slots, const ModelConfig& model,
                                 int64_t gpu_bytes, const std::string& failure) {
  if (gpu_bytes <= 0) gpu_bytes = local_gpu_memory().value_or(0);
  const PlanInputs in = plan_inputs(cfg, model, cfg.data.seq_len);
  const PlanSlots ps = PlanSlots::of(slots);
  const int64_t unit = plan_seq_unit(in, cfg.data.pad_to_multiple_of);
  const MemoryPlan plan = build_plan(in, ps);
  std::ostringstream o;
  o << "out of GPU memory: " << failure << "\n\n" << format_plan(plan, in, ps, gpu_bytes);
  if (gpu_bytes > 0) {
    PluginLoader loader(PluginLoader::default_search_dirs(cfg.plugins.dir));
    const auto knobs = plan_knobs(in, ps, &loader, gpu_bytes, unit);
    o << "\nwhat would make it fit in " << format_bytes(gpu_bytes) << ":\n";
    for (const auto& k : knobs)
      o << "  " << (k.fits ? "fits   " : "short  ") << k.action << ": peak " << format_bytes(k.peak) << "\n";
    if (knobs.empty()) o << "  (no knob found: a smaller model, or more GPUs per sequence)\n";
  }
  return o.str();
}

}  // namespace lcx
