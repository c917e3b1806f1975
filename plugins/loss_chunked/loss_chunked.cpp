// loss_chunked: the language-model head and cross entropy over `chunk_rows` rows at a time, so the
// [T,V] logits never exist whole (at 128k tokens and V = 151,936 they would be 80 GB in fp32).
//
// Rows separate cleanly: each row's softmax runs over its own vocabulary and the loss is a sum
// over rows. Per chunk: logits = hidden_c @ head^T (fp32 out), fused softmax cross entropy and its
// gradient (fp32), grad_hidden_c = dlogits @ head, grad_head += dlogits^T @ hidden_c (fp32). The
// chunk's logits and dlogits buffers are allocated once and reused, so exactly one chunk's worth
// is alive. A chunk whose targets are all ignored contributes nothing and is skipped (its
// grad_hidden rows are zeroed). Every op dispatches on the tensors' device, so the same code runs
// the CPU reference and the CUDA kernels.
#include <lcx/loss.h>
#include <lcx/ops.h>
#include <lcx/plan.h>
#include <lcx/plugin.h>

#include <algorithm>
#include <vector>

namespace lcx {
namespace {

constexpr int64_t kIgnoreIndex = -100;

class ChunkedLoss final : public Loss {
 public:
  explicit ChunkedLoss(int64_t chunk_rows) : chunk_rows_(chunk_rows) {}

  LossResult forward_backward(const Tensor& hidden, const Tensor& head, const Tensor& targets,
                              double grad_scale, Tensor& grad_hidden, Tensor& grad_head) override {
    return run(hidden, head, targets, grad_scale, &grad_hidden, &grad_head);
  }
  LossResult forward(const Tensor& hidden, const Tensor& head, const Tensor& targets) override {
    return run(hidden, head, targets, 0, nullptr, nullptr);
  }

  // One chunk's buffers as run() allocates them with gradients: logits and dlogits [C,V] fp32,
  // dlogits cast to the head's dtype, an fp32 copy of the chunk's hidden rows, and the CUDA
  // cross entropy's per-row loss; C = min(chunk_rows, T).
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const int64_t C = std::min(chunk_rows_, std::max<int64_t>(in.tokens_per_rank, 1));
    const int64_t V = in.model.vocab_size, H = in.model.hidden_size;
    plan.add(str("one chunk's logits + dlogits [", C, ",V] fp32"), PlanCategory::transient, 2 * C * V * 4 + C * 4,
             plan_phase::loss);
    if (in.weight_dtype != DType::f32) {
      plan.add(str("one chunk's dlogits cast [", C, ",V]"), PlanCategory::transient,
               C * V * static_cast<int64_t>(dtype_size(in.weight_dtype)), plan_phase::loss);
      plan.add(str("one chunk's hidden fp32 [", C, ",H]"), PlanCategory::transient, C * H * 4, plan_phase::loss);
    }
  }

 private:
  LossResult run(const Tensor& hidden, const Tensor& head, const Tensor& targets, double grad_scale,
                 Tensor* grad_hidden, Tensor* grad_head) const {
    check_shapes(hidden, head, targets, grad_hidden, grad_head);
    const int64_t T = hidden.size(0), H = hidden.size(1), V = head.size(0);
    const Device dev = hidden.device();
    const int64_t C = std::min(chunk_rows_, std::max<int64_t>(T, 1));
    const std::vector<bool> has_valid = chunks_with_valid_targets(targets, C);
    const bool backward = grad_hidden != nullptr;

    // Work buffers for one chunk, reused by every chunk; the last chunk uses their first rows.
    Tensor logits = Tensor::empty({C, V}, DType::f32, dev);
    Tensor dlogits, dlogits_cast, hidden_f32;
    const bool cast_dlogits = backward && head.dtype() != DType::f32;
    const bool cast_hidden = backward && hidden.dtype() != DType::f32;
    if (backward) {
      dlogits = Tensor::empty({C, V}, DType::f32, dev);
      // The GEMM against the head runs in the head's dtype (bf16 on GPU), as core's plain loss does.
      if (cast_dlogits) dlogits_cast = Tensor::empty({C, V}, head.dtype(), dev);
      // The head gradient accumulates in fp32 from an fp32 copy of the chunk's hidden rows.
      if (cast_hidden) hidden_f32 = Tensor::empty({C, H}, DType::f32, dev);
    }

    LossResult result;
    for (int64_t begin = 0, c = 0; begin < T; begin += C, ++c) {
      const int64_t end = std::min(T, begin + C), n = end - begin;
      if (!has_valid[static_cast<size_t>(c)]) {
        if (backward) {
          Tensor rows = grad_hidden->rows(begin, end);
          rows.zero();
        }
        continue;
      }
      const Tensor h = hidden.rows(begin, end);
      const Tensor tgt = targets.rows(begin, end);
      Tensor lg = logits.rows(0, n);
      ops::matmul(h, false, head, true, lg);  // [n,H] @ [V,H]^T -> [n,V]
      int64_t valid = 0;
      Tensor dl = backward ? dlogits.rows(0, n) : Tensor();
      result.loss_sum += ops::cross_entropy_forward_backward(lg, tgt, grad_scale, backward ? &dl : nullptr, &valid);
      result.valid += valid;
      if (!backward) continue;

      Tensor dl_head = dl;
      if (cast_dlogits) {
        dl_head = dlogits_cast.rows(0, n);
        ops::cast(dl, dl_head);
      }
      Tensor gh = grad_hidden->rows(begin, end);
      ops::matmul(dl_head, false, head, false, gh);  // [n,V] @ [V,H] -> [n,H]
      Tensor h32 = h;
      if (cast_hidden) {
        h32 = hidden_f32.rows(0, n);
        ops::cast(h, h32);
      }
      ops::matmul(dl, true, h32, false, *grad_head, 1.f, 1.f);  // [n,V]^T @ [n,H], accumulated
    }
    return result;
  }

  // One flag per chunk, from a host copy of the targets (they are small: 8 bytes a token).
  static std::vector<bool> chunks_with_valid_targets(const Tensor& targets, int64_t C) {
    const Tensor host = targets.device().is_cuda() ? targets.to(Device::cpu()) : targets;
    const int64_t T = host.size(0);
    const int64_t* t = host.data_as<int64_t>();
    std::vector<bool> flags(static_cast<size_t>((T + C - 1) / C), false);
    for (int64_t i = 0; i < T; ++i)
      if (t[i] != kIgnoreIndex) flags[static_cast<size_t>(i / C)] = true;
    return flags;
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
    if (grad_head && (grad_head->shape() != head.shape() || grad_head->dtype() != DType::f32))
      throw Error(str("loss_chunked: grad_head must be fp32 ", shape_str(head.shape()), ", got ",
                      dtype_name(grad_head->dtype()), " ", shape_str(grad_head->shape())));
  }

  int64_t chunk_rows_;
};

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  const int64_t rows = args.config.get_int("chunk_rows", 256);
  if (rows < 1)
    args.config.fail("chunk_rows", str("must be >= 1, got ", rows),
                     "256 is TRL's default; larger chunks trade memory for fewer, larger GEMMs");
  return std::make_unique<ChunkedLoss>(rows);
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_LOSS, "loss_chunked", "0.2.0", "chunked linear + cross entropy, logits never whole", "ready",
           lcx::create)
