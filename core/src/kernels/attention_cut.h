// The switch a rehearsal (lcx-train --rehearse) turns on: every attention op, core's and the
// plugins' (all reach it through lcx::ops), still allocates what it allocates (cuDNN's workspace,
// the backward's accumulators) but launches no attention kernel and writes zeros to its outputs,
// so a step at full length keeps its exact allocation sequence in minutes.
#pragma once

namespace lcx::ops {

void set_attention_cut(bool on);
bool attention_cut();

}  // namespace lcx::ops
