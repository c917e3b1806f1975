// The shape of the rank mesh and a rank's place in it, without the communicators (lcx/comm.h):
// what a plugin is created for (PluginArgs::mesh) and what a plan computes with.
#pragma once

namespace lcx {

// The ranks of a job as a named grid dp x cp x sp, sp varying fastest:
//   world rank = (dp_index * cp + cp_index) * sp + sp_index
// so sp groups (all-to-all every layer) are neighbours, then cp rings, then data-parallel copies.
struct MeshShape {
  int dp = 1, cp = 1, sp = 1;
};

struct MeshCoord {
  int dp = 0, cp = 0, sp = 0;
};

}  // namespace lcx
