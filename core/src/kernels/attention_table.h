// The attention ops' entry points, one table the run installs once: the computing one (ops.cpp),
// or a rehearsal's (lcx-train --rehearse, kernels/rehearsal.cpp) whose attention allocates exactly
// what the computing one does, launches nothing and writes zeros to its outputs, so a step at full
// length keeps its exact allocation sequence in minutes. Every attention op, core's and the
// plugins' (all reach it through lcx::ops), goes through the installed table.
#pragma once
#include "kernels/launch.h"
#include "lcx/ops.h"

namespace lcx::ops {

struct AttentionTable {
  // Arguments checked and the scale resolved (ops.cpp); cuda: the tensors are on the GPU.
  void (*forward)(bool cuda, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                  const AttentionParams& p);
  void (*backward)(bool cuda, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                   const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                   const AttentionParams& p);
  // The GPU work of attention_forward_blocks' and attention_backward_blocks' cuDNN batches.
  Launch launch;
};

const AttentionTable& computing_attention();
const AttentionTable& rehearsal_attention();

// Installed once a run (thread-ranks share it); the computing table until then.
void install_attention(const AttentionTable& table);
const AttentionTable& attention_table();

}  // namespace lcx::ops
