// Random initialization of a decoder model's weights: counter-based normal numbers, so element i
// of a parameter depends only on (seed, the parameter's name, i), never on the order of the work
// or how it is split across threads.
#pragma once
#include <cstdint>
#include <string>

#include "lcx/tensor.h"

namespace lcx::decoder {

// The key of one parameter's numbers.
uint64_t init_key(uint64_t seed, const std::string& name);

// Fills a CPU tensor (f32, bf16 or f16) with N(0, std^2): pair j of elements takes one SplitMix64
// output of (key, j) through Box-Muller in float (r cos to element 2j, r sin to 2j+1), with
// polynomial ln, sin and cos. threads <= 0: one per hardware thread. The values are the same for
// every thread count, run and machine.
void fill_normal(Tensor& t, uint64_t key, double std, int threads = 0);

}  // namespace lcx::decoder
