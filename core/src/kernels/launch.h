// How a GPU attention call's work runs once the call has allocated its scratch (cuDNN's workspace
// and accumulators, padded copies, document tables): the CUDA attention entry points hand every
// kernel, copy and fill they would queue to `launch`, which the attention table the run installed
// chose (kernels/attention_table.h). The kernels' allocations therefore never depend on it.
#pragma once
#include <functional>

namespace lcx::ops {

using Launch = void (*)(const std::function<void()>& work);

// Runs the work: what a training run's attention does with it.
void run_work(const std::function<void()>& work);

}  // namespace lcx::ops
