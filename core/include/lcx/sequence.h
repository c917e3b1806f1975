// One training sequence as the data pipeline yields it, and one rank's share of it as the
// Parallelism slot cuts it. Data and parallelism both speak these; neither owns them.
#pragma once
#include <cstdint>

#include "lcx/tensor.h"

namespace lcx {

// One training sequence on the host, before sharding.
struct Sequence {
  Tensor tokens;   // int32 [L]
  Tensor targets;  // int64 [L], shifted: targets[t] = tokens[t+1], -100 where ignored
  int documents = 1;  // how many documents were packed into it
};

struct Shard {
  Tensor tokens;     // int32 [T] this rank's tokens
  Tensor targets;    // int64 [T]
  Tensor positions;  // int64 [T] GLOBAL positions
  int64_t global_length = 0;
};

}  // namespace lcx
