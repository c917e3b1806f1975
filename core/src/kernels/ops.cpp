// Interim: the op dispatch before the CPU reference and CUDA kernels exist (issues 3 and 6).
#include "lcx/ops.h"

namespace lcx::ops {

[[noreturn]] static void missing(const char* op) { throw Error(str("op ", op, " is not built yet")); }

void matmul(const Tensor&, bool, const Tensor&, bool, Tensor&, float, float) { missing("matmul"); }
void embedding_forward(const Tensor&, const Tensor&, Tensor&) { missing("embedding_forward"); }
void embedding_backward(const Tensor&, const Tensor&, Tensor&) { missing("embedding_backward"); }
void rmsnorm_forward(const Tensor&, const Tensor&, float, Tensor&, Tensor&) { missing("rmsnorm_forward"); }
void rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) {
  missing("rmsnorm_backward");
}
void rotary_forward(Tensor&, const Tensor&, const Tensor&) { missing("rotary_forward"); }
void rotary_backward(Tensor&, const Tensor&, const Tensor&) { missing("rotary_backward"); }
void swiglu_forward(const Tensor&, const Tensor&, Tensor&) { missing("swiglu_forward"); }
void swiglu_backward(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) { missing("swiglu_backward"); }
void add(const Tensor&, const Tensor&, Tensor&) { missing("add"); }
void add_inplace(Tensor&, const Tensor&) { missing("add_inplace"); }
void scale_inplace(Tensor&, float) { missing("scale_inplace"); }
void cast(const Tensor&, Tensor&) { missing("cast"); }
void attention_forward(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, const AttentionParams&) {
  missing("attention_forward");
}
void attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        Tensor&, Tensor&, Tensor&, const AttentionParams&) {
  missing("attention_backward");
}
double cross_entropy_forward_backward(const Tensor&, const Tensor&, double, Tensor*, int64_t*) {
  missing("cross_entropy_forward_backward");
}

}  // namespace lcx::ops
