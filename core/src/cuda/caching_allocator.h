// The CUDA device allocators. The default is a caching allocator with expandable segments built on
// CUDA's virtual memory management: one large virtual address range is reserved per device, and
// physical memory is mapped under it in chunks only where live blocks need it. Blocks are carved
// from the range best-fit and coalesce on free; freed blocks keep their physical pages (the cache)
// until memory runs short, when every chunk lying wholly in free space is unmapped and its memory
// reused elsewhere in the range. A large contiguous tensor therefore needs enough free physical
// memory, never one free hole of its size: what PyTorch's expandable_segments:True gives.
//
// Frees are stream-ordered on the stream the work was issued on: a block freed while kernels
// queued earlier still read it may be handed out again at once, which is safe for work on the
// same stream (all of lcx's compute); a caller that frees memory another stream still uses must
// synchronize that stream first.
//
// Where the device has no virtual memory management (some virtualized GPUs), a plain
// cudaMalloc/cudaFree allocator stands in, with the same statistics.
#pragma once
#include <cstddef>
#include <memory>

#include "lcx/memory.h"

namespace lcx::cuda {

std::shared_ptr<Allocator> make_device_allocator(int device);

// Unmaps the cached physical memory of device `device` (pages under free blocks only) and returns
// the bytes given back. Synchronizes the device first.
size_t release_cached(int device);

}  // namespace lcx::cuda
