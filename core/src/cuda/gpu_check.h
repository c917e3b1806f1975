// The start's check of the GPU a run computes on (util/gpu_support.h says which GPUs lcx takes).
#pragma once

namespace lcx::cuda {

// Refuses, by the GPU's name, a device below sm_80 or one this build holds no code for: the kernels
// would otherwise fail at their first launch with the driver's "no kernel image" and no hint.
void check_gpu_supported(int device);

}  // namespace lcx::cuda
