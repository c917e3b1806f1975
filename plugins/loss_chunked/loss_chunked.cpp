// loss_chunked: the language-model head and cross entropy over `chunk_rows` rows at a time, so the
// [T,V] logits never exist whole (at 128k tokens and V = 151,936 they would be 80 GB in fp32).
//
// Rows separate cleanly: each row's softmax runs over its own vocabulary and the loss is a sum
// over rows. Per chunk, in slices of at most kLogitRows rows: logits = hidden_s @ head^T (fp32
// out), then one fused op (ops::cross_entropy_chunk) writes the rows' losses into a per-token
// buffer and the gradient grad_scale * (softmax - onehot) in the head's dtype (bf16 on GPU,
// straight from the kernel; in place over the logits when the head is fp32). Then, for the whole
// chunk, grad_hidden_c = dlogits @ head and grad_head += dlogits^T @ hidden_c, both GEMMs in the
// head's dtype with fp32 accumulation, the head's gradient accumulated in fp32.
//
// Why slices: the head-gradient GEMM reads and writes all of the fp32 [V,H] gradient (3.1 GB for
// Qwen3-4B) once per chunk, whatever the chunk's rows; at 256 rows that traffic outweighs the
// GEMM's arithmetic on an H200, so larger chunks run faster. Their cost is the [C,V] buffers; the
// fp32 logits (4 bytes an element) only ever need one slice, so a chunk holds its bf16 gradient
// (2 bytes) whole and its fp32 logits 256 rows at a time. The chunk's buffers are allocated once
// and reused, so exactly one chunk's worth is alive. A chunk whose targets are all ignored is
// skipped (its grad_hidden rows are zeroed). Every op dispatches on the tensors' device, so the
// same code runs the CPU reference and the CUDA kernels.
//
// The chunk: `chunk_rows` when set; under "auto" (the default) the plan's choice (the knob
// loss_chunked.chunk_rows: the largest chunk that fits, since each chunk costs the head gradient's
// traffic once more, see plan()), else 1024 (a run not planned for the GPU).
//
// The host waits on the device twice per call, never per chunk: once for the targets (which
// chunks have a valid label, and the valid count) and once at the end for the per-token losses,
// summed in row order in double so the loss is deterministic.
#include <lcx/ops.h>
#include <lcx/plan.h>
#include <lcx/plugin.h>
#include <lcx/slots/loss.h>
#include <lcx/slots/model.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace lcx {
namespace {

constexpr int64_t kIgnoreIndex = -100;
// Rows of fp32 logits computed at once: 256 fills an H100/H200 with the fused kernel's blocks
// (one a row) and keeps the logits GEMM efficient, at 155 MB for V = 151,936.
constexpr int64_t kLogitRows = 256;

// The chunk without a key or a plan. 1024 by measurement (docs/PERF.md, the chunk_rows sweep on an
// H200): 1.5x faster than TRL's 256 for 0.47 GB instead of 0.23 GB with the Qwen3 vocabulary.
constexpr int64_t kDefaultChunkRows = 1024;
constexpr const char* kChunkRows = "chunk_rows";

class ChunkedLoss final : public Loss {
 public:
  // chunk_rows: 0 for "auto"; name: the provider's, by which the recipe names its knob.
  ChunkedLoss(int64_t chunk_rows, std::string name) : chunk_rows_(chunk_rows), name_(std::move(name)) {}

  // Under "auto", the chunk: a few sizes, from about where an H200's GEMMs stay busy to where the
  // time gained flattens (the chunk_rows sweep, docs/PERF.md), cut to the rank's rows. Its work
  // adds to the rest of the step's: ranked once.
  std::vector<Knob> knobs(const PlanInputs& in) const override {
    if (chunk_rows_ > 0) return {};
    Knob k;
    k.name = kChunkRows;
    k.values = values_up_to({256, 1024, 4096}, std::max<int64_t>(in.tokens_per_rank, 1));
    k.default_value = kDefaultChunkRows;
    k.search = KnobSearch::ranked;
    k.means = "chunked loss: rows of the logits computed at once";
    return {std::move(k)};
  }
  void use_recipe(const Recipe& recipe) override { recipe_rows_ = recipe.get(name_, kChunkRows, 0); }

  LossResult forward_backward(const Tensor& hidden, const Tensor& head, const Tensor& targets,
                              double grad_scale, Tensor& grad_hidden, Tensor& grad_head) override {
    return run(hidden, head, targets, grad_scale, &grad_hidden, &grad_head);
  }
  LossResult forward(const Tensor& hidden, const Tensor& head, const Tensor& targets) override {
    return run(hidden, head, targets, 0, nullptr, nullptr);
  }

  // What run() allocates with gradients: the fp32 logits of one slice [S,V], the chunk's gradient
  // [C,V] in the head's dtype (none for an fp32 head: written over the logits, S = C), and the
  // per-token losses [T] fp32; C = min(chunk_rows, T).
  std::string plan_offer() const override { return "the logits never whole"; }
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const int64_t T = std::max<int64_t>(in.tokens_per_rank, 1);
    const int64_t C = std::min(rows(in.recipe.get(name_, kChunkRows, 0)), T);
    const bool in_place = in.weight_dtype == DType::f32;
    const int64_t S = slice_rows(C, in_place);
    const int64_t V = in.model.vocab_size;
    plan.work.gemm_flops += (in.head_frozen ? 4.0 : 6.0) * static_cast<double>(T) * static_cast<double>(V) *
                            static_cast<double>(in.model.hidden_size);
    plan.work.memory_bytes += 3.0 * static_cast<double>(T) * static_cast<double>(V) * 4;  // one fused pass over each slice
    // Each chunk's head-gradient GEMM reads and writes the whole fp32 [V,H] gradient, whatever its
    // rows: the cost that makes small chunks slow (the chunk_rows sweep, docs/PERF.md).
    if (!in.head_frozen)
      plan.work.memory_bytes += static_cast<double>((T + C - 1) / C) * 8.0 * static_cast<double>(V) *
                                static_cast<double>(in.model.hidden_size);
    plan.add("logits_slice", str("logits of one slice [", S, ",V] fp32 + per-token loss"), PlanCategory::transient,
             S * V * 4 + T * 4, plan_phase::loss);
    if (!in_place)
      plan.add("chunk_dlogits", str("one chunk's dlogits [", C, ",V] ", dtype_name(in.weight_dtype)),
               PlanCategory::transient, C * V * static_cast<int64_t>(dtype_size(in.weight_dtype)), plan_phase::loss);
  }

 private:
  LossResult run(const Tensor& hidden, const Tensor& head, const Tensor& targets, double grad_scale,
                 Tensor* grad_hidden, Tensor* grad_head) const {
    check_shapes(hidden, head, targets, grad_hidden, grad_head);
    const int64_t T = hidden.size(0), H = hidden.size(1), V = head.size(0);
    const Device dev = hidden.device();
    const int64_t C = std::min(rows(recipe_rows_), std::max<int64_t>(T, 1));
    LossResult result;
    const std::vector<bool> has_valid = chunks_with_valid_targets(targets, C, &result.valid);
    const bool backward = grad_hidden != nullptr;

    // Work buffers for one chunk, reused by every chunk; the last chunk uses their first rows.
    // The gradient is stored in the head's dtype, so both GEMMs against the head run in it (bf16
    // on GPU, as core's plain loss does for grad_hidden); an fp32 head takes it in place.
    const bool in_place = backward && head.dtype() == DType::f32;
    const int64_t S = slice_rows(C, in_place);
    Tensor logits = Tensor::empty({S, V}, DType::f32, dev);
    // Skipped chunks' rows stay 0 and add nothing to the sum.
    Tensor row_loss = Tensor::zeros({T}, DType::f32, dev);
    Tensor dlogits, hidden_cast;
    if (backward) {
      dlogits = in_place ? logits : Tensor::empty({C, V}, head.dtype(), dev);
      if (hidden.dtype() != head.dtype()) hidden_cast = Tensor::empty({C, H}, head.dtype(), dev);
    }

    for (int64_t begin = 0, c = 0; begin < T; begin += C, ++c) {
      const int64_t end = std::min(T, begin + C), n = end - begin;
      if (!has_valid[static_cast<size_t>(c)]) {
        if (backward) {
          Tensor rows = grad_hidden->rows(begin, end);
          rows.zero();
        }
        continue;
      }
      for (int64_t s0 = 0; s0 < n; s0 += S) {
        const int64_t s1 = std::min(n, s0 + S);
        Tensor lg = logits.rows(0, s1 - s0);
        ops::matmul(hidden.rows(begin + s0, begin + s1), false, head, true, lg);  // [s,H] @ [V,H]^T -> [s,V] fp32
        Tensor losses = row_loss.rows(begin + s0, begin + s1);
        Tensor dl = backward ? dlogits.rows(s0, s1) : Tensor();
        ops::cross_entropy_chunk(lg, targets.rows(begin + s0, begin + s1), static_cast<float>(grad_scale), losses,
                                 backward ? &dl : nullptr);
      }
      if (!backward) continue;

      const Tensor h = hidden.rows(begin, end), dl = dlogits.rows(0, n);
      Tensor gh = grad_hidden->rows(begin, end);
      ops::matmul(dl, false, head, false, gh);  // [n,V] @ [V,H] -> [n,H]
      if (!grad_head->defined()) continue;  // a frozen head
      Tensor hc = h;
      if (hidden_cast.defined()) {
        hc = hidden_cast.rows(0, n);
        ops::cast(h, hc);
      }
      ops::matmul(dl, true, hc, false, *grad_head, 1.f, 1.f);  // [n,V]^T @ [n,H], accumulated in fp32
    }
    result.loss_sum = sum_rows(row_loss);
    return result;
  }

  // The chunk: the key's, else the plan's (recipe_rows), else kDefaultChunkRows.
  int64_t rows(int64_t recipe_rows) const {
    return chunk_rows_ > 0 ? chunk_rows_ : recipe_rows > 0 ? recipe_rows : kDefaultChunkRows;
  }

  // Rows of fp32 logits computed at once in a chunk of C rows: the whole chunk when its gradient
  // is written over them (fp32 head), else at most kLogitRows.
  static int64_t slice_rows(int64_t C, bool in_place) { return in_place ? C : std::min(C, kLogitRows); }

  // One flag per chunk and the valid count, from a host copy of the targets (8 bytes a token).
  static std::vector<bool> chunks_with_valid_targets(const Tensor& targets, int64_t C, int64_t* valid) {
    const Tensor host = targets.device().is_cuda() ? targets.to(Device::cpu()) : targets;
    const int64_t T = host.size(0);
    const int64_t* t = host.data_as<int64_t>();
    std::vector<bool> flags(static_cast<size_t>((T + C - 1) / C), false);
    *valid = 0;
    for (int64_t i = 0; i < T; ++i)
      if (t[i] != kIgnoreIndex) {
        flags[static_cast<size_t>(i / C)] = true;
        ++*valid;
      }
    return flags;
  }

  // The per-token losses summed in row order, in double: the call's one read of the loss.
  static double sum_rows(const Tensor& row_loss) {
    double sum = 0;
    for (float x : row_loss.to_floats()) sum += x;
    return sum;
  }

  static void check_shapes(const Tensor& hidden, const Tensor& head, const Tensor& targets,
                           const Tensor* grad_hidden, const Tensor* grad_head) {
    if (hidden.dim() != 2 || head.dim() != 2 || hidden.size(1) != head.size(1))
      throw Error(str("loss_chunked: hidden ", shape_str(hidden.shape()), " and head ", shape_str(head.shape()),
                      " must be [T,H] and [V,H] with the same H"));
    if (targets.dtype() != DType::i64 || targets.dim() != 1 || targets.size(0) != hidden.size(0))
      throw Error(str("loss_chunked: targets must be int64 [", hidden.size(0), "], got ", dtype_name(targets.dtype()),
                      " ", shape_str(targets.shape())));
    if (grad_hidden && grad_hidden->shape() != hidden.shape())
      throw Error(str("loss_chunked: grad_hidden ", shape_str(grad_hidden->shape()), " must match hidden ",
                      shape_str(hidden.shape())));
    if (grad_head && grad_head->defined() && (grad_head->shape() != head.shape() || grad_head->dtype() != DType::f32))
      throw Error(str("loss_chunked: grad_head must be fp32 ", shape_str(head.shape()), ", got ",
                      dtype_name(grad_head->dtype()), " ", shape_str(grad_head->shape())));
  }

  const int64_t chunk_rows_;  // 0: "auto"
  const std::string name_;
  int64_t recipe_rows_ = 0;   // the plan's chunk; 0: none
};

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  const char* fix = "\"auto\" (the plan's choice, the default) or a row count >= 1; smaller chunks trade time for "
                    "memory (256 is TRL's)";
  args.config.describe(kChunkRows, "rows of logits computed at once; smaller chunks trade time for memory", ">= 1");
  const std::optional<int64_t> rows = args.config.get_int_or_auto(kChunkRows, fix);
  if (rows && *rows < 1) args.config.fail(kChunkRows, str("must be >= 1, got ", *rows), fix);
  return std::make_unique<ChunkedLoss>(rows.value_or(0), args.name);
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_LOSS, "loss_chunked", "0.3.0", "chunked linear + cross entropy, logits never whole", "ready",
           lcx::create)
