// The memory planner: every provider's terms, core's own, and their sums (see plan/plan.h).
#include "plan/plan.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <sstream>

#include "lcx/defaults.h"
#include "lcx/error.h"
#include "lcx/size_math.h"
#include "util/text.h"

namespace lcx {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
// Outside the allocator: the CUDA context with its kernels and the cuBLAS/cuBLASLt handles. An
// estimate (a context on an H100/H200 with CUDA 12-13 takes about half a GiB); part 3 of issue 10
// checks it against the measured figure.
constexpr int64_t kContextBytes = 512 * kMiB;
constexpr int64_t kCublasLtWorkspace = 32 * kMiB;  // one per device, matmul_cublaslt.cu
// Allocation rounding and fragmentation, as a share of the allocated peak.
constexpr double kAllocatorSlack = 0.02;

size_t count_since(const MemoryPlan& p, size_t before) { return p.terms.size() - before; }

bool added_category(const MemoryPlan& p, size_t before, PlanCategory c) {
  for (size_t i = before; i < p.terms.size(); ++i)
    if (p.terms[i].category == c) return true;
  return false;
}

// The buffers train_step (core/src/train/step.cpp) holds itself, beside what the slots hold.
void plan_step(const PlanInputs& in, MemoryPlan& p) {
  const int64_t T = in.tokens_per_rank, TH = T * in.model.hidden_size * static_cast<int64_t>(dtype_size(in.weight_dtype));
  p.add("token ids int32 + targets int64 [T]", PlanCategory::transient, T * 12, plan_phase::step);
  p.add("layer output y [T,H]", PlanCategory::transient, TH, plan_phase::forward);
  p.add("last layer output, final hidden, its grad [T,H] x3", PlanCategory::transient, 3 * TH, plan_phase::loss);
  p.add("last layer output, final hidden, its grad, dx [T,H] x4", PlanCategory::transient, 4 * TH,
        plan_phase::final_norm);
  for (const char* phase : {plan_phase::mlp_backward, plan_phase::backward})
    p.add("layer dy, dx [T,H] x2", PlanCategory::transient, 2 * TH, phase);
}

// Until cp_ring and sp_ulysses plan themselves: what a ring or an all-to-all must hold at least.
void plan_parallel_estimate(const PlanInputs& in, MemoryPlan& p) {
  const int64_t T = in.tokens_per_rank, d = in.model.head_dim;
  const int64_t qd = in.model.num_heads * d, kvd = in.model.num_kv_heads * d;
  const int64_t ab = static_cast<int64_t>(dtype_size(in.weight_dtype));
  if (in.cp > 1) {
    p.add("ring: K/V blocks received and in flight, double-buffered (core estimate)", PlanCategory::communication,
          2 * 2 * T * kvd * ab, plan_phase::forward);
    p.add("ring: fp32 partial output and LSE to merge (core estimate)", PlanCategory::communication,
          T * qd * 4 + in.model.num_heads * T * 4, plan_phase::forward);
    p.add("ring: K, V and fp32 dK, dV blocks in flight, double-buffered (core estimate)", PlanCategory::communication,
          2 * (2 * ab + 2 * 4) * T * kvd, plan_phase::backward);
    p.add("ring: fp32 dq accumulator (core estimate)", PlanCategory::communication, T * qd * 4, plan_phase::backward);
  }
  if (in.sp > 1) {
    p.add("all-to-all: q, k, v, out in head layout (core estimate)", PlanCategory::communication,
          T * (2 * qd + 2 * kvd) * ab, plan_phase::forward);
    p.add("all-to-all: q, k, v, out and their grads in head layout (core estimate)", PlanCategory::communication,
          2 * T * (2 * qd + 2 * kvd) * ab, plan_phase::backward);
  }
}

std::string with_commas(int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out += ',';
    out += s[i];
  }
  return v < 0 ? "-" + out : out;
}

int64_t peak_of(const PlanInputs& in, const PlanSlots& slots) { return build_plan(in, slots).peak().bytes; }

PlanInputs with_seq(PlanInputs in, int64_t seq_len) {
  const int64_t ranks = std::max<int64_t>(1, in.cp * in.sp);
  in.seq_len = seq_len;
  in.tokens_per_rank = (seq_len + ranks - 1) / ranks;
  return in;
}

}  // namespace

PlanSlots PlanSlots::of(const SlotSet& s) {
  auto name = [&](uint32_t slot, const char* def) {
    auto it = s.providers.find(slot);
    return it == s.providers.end() ? std::string(def) : it->second.name;
  };
  PlanSlots p;
  p.loss = s.loss.get();
  p.loss_name = name(LCX_SLOT_LOSS, "nll");
  p.rope = s.rope.get();
  p.rope_name = name(LCX_SLOT_POSITIONAL_ENCODING, "rope");
  p.memory = s.memory.get();
  p.memory_name = name(LCX_SLOT_MEMORY_STRATEGY, "on_device");
  p.parallel = s.parallel.get();
  p.parallel_name = name(LCX_SLOT_PARALLELISM, "single");
  p.model = s.model.get();
  p.model_name = name(LCX_SLOT_MODEL, "model");
  p.mlp = s.mlp.get();
  p.mlp_name = name(LCX_SLOT_MLP, "whole");
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
  in.world_size = in.dp * in.cp * in.sp;
  in.weight_dtype = dtype_from_name(cfg.model.dtype);
  in.master_dtype = cfg.train.master_dtype == "bf16" ? DType::bf16 : DType::f32;
  in.grad_accum = cfg.train.grad_accum;
  in.grad_dtype = grad_dtype_for(cfg.train, in.weight_dtype, in.world_size);
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

MemoryPlan build_plan(const PlanInputs& in, const PlanSlots& s) {
  // Core's defaults stand in for a slot the caller left empty.
  std::unique_ptr<Loss> loss_default;
  std::unique_ptr<PositionalEncoding> rope_default;
  std::unique_ptr<MemoryStrategy> memory_default;
  std::unique_ptr<Parallelism> parallel_default;
  std::unique_ptr<MlpStrategy> mlp_default;
  const Loss* loss = s.loss ? s.loss : (loss_default = make_full_logits_loss()).get();
  const PositionalEncoding* rope = s.rope ? s.rope : (rope_default = make_default_rope()).get();
  const MemoryStrategy* memory = s.memory ? s.memory : (memory_default = make_on_device_memory()).get();
  const Parallelism* parallel = s.parallel ? s.parallel : (parallel_default = make_single_rank()).get();
  const MlpStrategy* mlp = s.mlp ? s.mlp : (mlp_default = make_whole_mlp()).get();

  MemoryPlan p;
  size_t before = p.terms.size();
  p.contributor = s.model_name;
  if (s.model) s.model->plan(in, p);
  if (count_since(p, before) == 0) {
    p.contributor = s.model_name + " (core)";
    plan_dense_decoder(in, p);
  }
  p.contributor = s.mlp_name;
  mlp->plan(in, p);
  p.contributor = s.loss_name;
  loss->plan(in, p);
  p.contributor = s.rope_name;
  rope->plan(in, p);

  before = p.terms.size();
  p.contributor = s.memory_name;
  memory->plan(in, p);
  if (count_since(p, before) == 0) {
    const int L = static_cast<int>(in.model.num_layers);
    const int64_t each = in.tokens_per_rank * in.model.hidden_size * static_cast<int64_t>(dtype_size(in.weight_dtype));
    p.add(str("saved layer inputs (", s.memory_name, " device_bytes)"), PlanCategory::activations_gpu,
          memory->device_bytes(L, each), plan_phase::step);
    p.add(str("saved layer inputs (", s.memory_name, " host_bytes)"), PlanCategory::activations_host,
          memory->host_bytes(L, each), plan_phase::step, true);
  }

  before = p.terms.size();
  p.contributor = s.parallel_name;
  parallel->plan(in, p);
  if ((in.cp > 1 || in.sp > 1) && !added_category(p, before, PlanCategory::communication)) {
    p.contributor = "core estimate";
    plan_parallel_estimate(in, p);
  }

  p.contributor = "step";
  plan_step(in, p);
  p.contributor = "core";
  p.add("CUDA context, kernels, cuBLAS handles (estimate)", PlanCategory::reserve, kContextBytes, plan_phase::always);
  p.add("cuBLASLt workspace", PlanCategory::reserve, kCublasLtWorkspace, plan_phase::always);
  const int64_t allocated = p.peak(false).bytes;
  p.add("allocator rounding and fragmentation (2% estimate)", PlanCategory::reserve,
        static_cast<int64_t>(static_cast<double>(allocated) * kAllocatorSlack), plan_phase::always);
  return p;
}

int64_t longest_fitting_seq(const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, int64_t unit) {
  unit = std::max<int64_t>(1, unit);
  auto fits = [&](int64_t k) { return peak_of(with_seq(in, k * unit), slots) <= gpu_bytes; };
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

std::string format_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30) || bytes == 0)
    std::snprintf(buf, sizeof buf, "%.2f GiB", b / static_cast<double>(int64_t{1} << 30));
  else if (bytes >= (int64_t{1} << 20))
    std::snprintf(buf, sizeof buf, "%.1f MiB", b / static_cast<double>(int64_t{1} << 20));
  else
    std::snprintf(buf, sizeof buf, "%.1f KiB", b / 1024.0);
  return buf;
}

std::string format_plan(const MemoryPlan& plan, const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes,
                        int64_t unit) {
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
  o << "  dtypes: weights and activations " << dtype_name(in.weight_dtype) << ", master "
    << (in.master_dtype == DType::f32 ? "fp32" : "none (moments in the weights' dtype)") << "; grad_accum "
    << in.grad_accum << "\n";
  o << "  providers: loss " << slots.loss_name << ", positional_encoding " << slots.rope_name << ", memory_strategy "
    << slots.memory_name << ", parallelism " << slots.parallel_name << ", model " << slots.model_name << "\n\n";

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
  row("pinned host memory", plan.host_peak());
  if (gpu_bytes > 0) {
    row("GPU memory", gpu_bytes,
        peak.bytes <= gpu_bytes ? str("fits, ", format_bytes(gpu_bytes - peak.bytes), " to spare")
                                : str("does NOT fit: short by ", format_bytes(peak.bytes - gpu_bytes)));
    const int64_t longest = longest_fitting_seq(in, slots, gpu_bytes, unit);
    o << "  longest sequence that fits: " << (longest ? with_commas(longest) + " tokens" : std::string("none"))
      << " (same mesh and providers, steps of " << unit << ")\n";
  }

  // One line for scripts (scripts/bench/plan_validate.sh): the figures above in bytes.
  o << "  plan: peak_bytes=" << peak.bytes << " allocated_bytes=" << allocated.bytes << " phase=\"" << peak.phase
    << "\" host_bytes=" << plan.host_peak() << " tokens_per_rank=" << in.tokens_per_rank << "\n";
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

std::vector<PlanKnob> plan_knobs(const PlanInputs& in, const PlanSlots& slots, const PluginLoader* loader,
                                 int64_t gpu_bytes, int64_t unit) {
  std::vector<PlanKnob> knobs;
  auto add = [&](std::string action, const PlanInputs& i, const PlanSlots& s) {
    const int64_t peak = peak_of(i, s);
    knobs.push_back({std::move(action), peak, peak <= gpu_bytes});
  };
  // A plugin that is not loaded yet plans itself once created with its defaults.
  auto create = [&](const std::string& name) -> std::shared_ptr<Plugin> {
    if (!loader) return nullptr;
    try {
      return loader->create(name, PluginArgs{name, ConfigView(), Device::cpu()});
    } catch (const std::exception&) {
      return nullptr;  // not installed: the knob is not offered
    }
  };
  PlanSlots combined = slots;
  std::vector<std::string> loads;
  std::shared_ptr<Plugin> chunked, offload, tiled;
  if (slots.loss_name == "nll" && (chunked = create("loss_chunked"))) {
    PlanSlots s = slots;
    s.loss = dynamic_cast<const Loss*>(chunked.get());
    s.loss_name = "loss_chunked";
    if (s.loss) {
      add("load loss_chunked (the logits never whole)", in, s);
      combined.loss = s.loss;
      combined.loss_name = s.loss_name;
      loads.push_back("loss_chunked");
    }
  }
  if (slots.memory_name == "on_device" && (offload = create("offload"))) {
    PlanSlots s = slots;
    s.memory = dynamic_cast<const MemoryStrategy*>(offload.get());
    s.memory_name = "offload";
    if (s.memory) {
      add("load offload (saved layer inputs in pinned host memory)", in, s);
      combined.memory = s.memory;
      combined.memory_name = s.memory_name;
      loads.push_back("offload");
    }
  }
  if (slots.mlp_name == "whole" && (tiled = create("tiled_mlp"))) {
    PlanSlots s = slots;
    s.mlp = dynamic_cast<const MlpStrategy*>(tiled.get());
    s.mlp_name = "tiled_mlp";
    if (s.mlp) {
      add("load tiled_mlp (the MLP's [T,I] intermediates one tile at a time)", in, s);
      combined.mlp = s.mlp;
      combined.mlp_name = s.mlp_name;
      loads.push_back("tiled_mlp");
    }
  }
  if (loads.size() > 1) add("load " + join(loads, " and "), in, combined);
  // More ranks per sequence: the first cp (doubling, up to 64) that fits with the plugins above.
  for (int64_t cp = std::max<int64_t>(2, in.cp * 2); cp <= 64; cp *= 2) {
    PlanInputs i = in;
    i.cp = cp;
    i.world_size = i.dp * i.cp * i.sp;
    const int64_t u = plan_seq_unit(i, 1);
    i = with_seq(i, (in.seq_len + u - 1) / u * u);
    const int64_t peak = peak_of(i, combined);
    if (peak <= gpu_bytes || cp == 64) {
      std::string action = str("raise distributed.cp to ", cp, " (", i.world_size, " GPUs");
      if (slots.parallel_name != "cp_ring") action += ", load cp_ring";
      if (!loads.empty()) action += ", with " + join(loads, " and ");
      knobs.push_back({action + ")", peak, peak <= gpu_bytes});
      break;
    }
  }
  const int64_t longest = longest_fitting_seq(in, slots, gpu_bytes, unit);
  if (longest > 0 && longest < in.seq_len)
    add(str("lower data.seq_len to ", longest), with_seq(in, longest), slots);
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
  o << "out of GPU memory: " << failure << "\n\n" << format_plan(plan, in, ps, gpu_bytes, unit);
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
