// Which GPUs lcx runs on: compute capability 8.0 (Ampere) or newer, since its kernels compute in
// bf16, which earlier GPUs lack. A build carries machine code for the targets LCX_CUDA_ARCHS chose
// (cmake/lcx_cuda_archs.cmake); a GPU it has neither code nor PTX for is refused by name too
// (cuda/gpu_check.h).
#pragma once
#include <string>
#include <string_view>

namespace lcx {

inline constexpr int kMinComputeMajor = 8;

// "sm_90" for (9, 0).
std::string sm_name(int major, int minor);
// Why lcx cannot run on this GPU, or "" where it can.
std::string gpu_refusal(std::string_view name, int major, int minor);
// Why this build cannot run on this GPU although lcx can, or "" where it can: `targets` lists what
// it carries, CMake's CUDA_ARCHITECTURES entries joined by commas ("80-real,90a-real,100-virtual";
// a bare "90" is machine code and PTX). Machine code for sm_XY runs on sm_XZ for Z >= Y, but an
// arch-specific target (90a) on its own capability alone; PTX for compute_XY is compiled by the
// driver for any capability from X.Y.
std::string gpu_build_refusal(std::string_view name, int major, int minor, std::string_view targets);

}  // namespace lcx
