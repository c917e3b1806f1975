// The NCCL communicator (CUDA builds): one process per GPU. Every call is enqueued on the
// communicator's own stream after the work already issued on the caller's stream, and the host
// then waits for it with the timeout: NCCL runs non-blocking (ncclConfig blocking = 0), so a
// hang can be seen, the communicator aborted and an lcx::Error thrown. NCCL cannot say which
// ranks never arrived; the launcher names the rank that exited. send_recv_async leaves the group
// running until wait(), which is where ring attention overlaps its compute.
#pragma once
#include <memory>

#include "distributed/launcher.h"
#include "lcx/comm.h"

namespace lcx {

#ifdef LCX_HAVE_CUDA
// A collective over every rank of the job: rank 0 makes the ncclUniqueId, bootstrap_broadcast
// (TCP on MASTER_ADDR:MASTER_PORT, or LCX_BOOTSTRAP_FILE) hands it out, then each rank joins on
// CUDA device `device` (its LOCAL_RANK on a node). Sets NCCL_NVLS_ENABLE=0 first.
std::unique_ptr<Communicator> make_nccl_world(const DistEnv& env, int device, CommOptions opts = {});
#endif

}  // namespace lcx
