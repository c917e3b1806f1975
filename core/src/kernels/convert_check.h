// Stored checkpoint values into a float tensor's storage, checked for finiteness in the same pass:
// the weight loader's one pass over every byte (core/src/io/safetensors.cpp). The CPU reference and
// the CUDA kernel convert identically (through fp32, rounding to nearest even, NaN payloads as
// lcx/dtype.h keeps them) and find the same non-finite elements; tests/gpu/convert_check_gpu_test.cpp
// holds them equal.
#pragma once
#include <cstdint>

#include "lcx/dtype.h"

namespace lcx::ops {

// The float encodings a safetensors file stores.
enum class StoredFloat : uint8_t { f64, f32, f16, bf16 };

namespace cpu {
// n values at `src` into `dst` as `to`. src may equal dst when `from` is `to`'s encoding: then
// nothing is written and only the check runs. With `check`, returns the index of the first element
// that is not finite once converted; -1 when all are (and always -1 without `check`).
int64_t convert_check(const void* src, StoredFloat from, void* dst, DType to, int64_t n, bool check);
}  // namespace cpu

#ifdef LCX_HAVE_CUDA
namespace cuda {
// The same on the device, issued on the current stream with no host sync. With `first_bad` (device
// memory), *first_bad is lowered atomically to base + i for every non-finite element i, so one
// counter serves a tensor converted in several calls.
void convert_check(const void* src, StoredFloat from, void* dst, DType to, int64_t n, uint64_t base,
                   unsigned long long* first_bad);
}  // namespace cuda
#endif

}  // namespace lcx::ops
