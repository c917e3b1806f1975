// Rank 0's bytes to every rank before any communicator exists: how NCCL ranks agree on the
// ncclUniqueId. Over TCP, rank 0 listens on MASTER_PORT and answers each of the other ranks
// once; with DistEnv::bootstrap_file (one node), rank 0 writes the file atomically and the others
// wait for it. Both give up after timeout_s with an error naming the address or file.
#pragma once
#include <string>

#include "distributed/launcher.h"

namespace lcx {

// Rank 0 passes the payload (every rank passes its size in `bytes`); every rank gets it back.
std::string bootstrap_broadcast(const DistEnv& env, const std::string& payload, size_t bytes, double timeout_s);

}  // namespace lcx
