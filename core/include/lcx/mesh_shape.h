// The shape of the rank mesh and a rank's place in it, without the communicators (lcx/comm.h):
// what a plugin is created for (PluginArgs::mesh) and what a plan computes with.
#pragma once
#include <cstdint>

namespace lcx {

// Which sequence axis takes consecutive world ranks ([distributed] order). Consecutive ranks
// share a node (nproc_per_node of them), so the inner axis talks over NVLink and the outer one
// crosses nodes when the mesh spans several.
//   sp_inner: world rank = (dp_index * cp + cp_index) * sp + sp_index: sp groups (all-to-all
//             every layer) are neighbours, then cp rings, then data-parallel copies. The usual.
//   cp_inner: world rank = (dp_index * sp + sp_index) * cp + cp_index: cp rings are neighbours and
//             each sp group strides over them, cp ranks apart.
enum class MeshOrder : int32_t { sp_inner = 0, cp_inner = 1 };

inline const char* mesh_order_name(MeshOrder o) { return o == MeshOrder::cp_inner ? "cp_inner" : "sp_inner"; }

// The ranks of a job as a named grid dp x cp x sp, dp varying slowest, placed by `order`.
struct MeshShape {
  int dp = 1, cp = 1, sp = 1;
  MeshOrder order = MeshOrder::sp_inner;
  // Expert parallelism ([distributed] ep): every ep consecutive world ranks split each sparse
  // layer's experts, rank i of the group holding experts [i*E/ep, (i+1)*E/ep). Not a factor of
  // dp x cp x sp: the groups lie over the mesh, so under the default order a sequence's cp and sp
  // ranks sit inside one group (as Megatron-Core places expert parallelism inside DP x CP) and
  // the tokens it exchanges stay on the ranks that hold them.
  int ep = 1;
};

// A world rank's place in its expert-parallel group: which E/ep experts it holds.
inline int expert_index(const MeshShape& s, int world_rank) { return s.ep > 1 ? world_rank % s.ep : 0; }

struct MeshCoord {
  int dp = 0, cp = 0, sp = 0;
};

// A rank's place among the cp x sp ranks of one sequence, the same under either order: the index
// of the shard it holds (Parallelism::shard's rank; stacked, the outer provider cuts the inner's
// shard cp_index in sp contiguous parts) and its rank in Mesh::seq.
inline int seq_index(const MeshShape& s, const MeshCoord& c) { return c.cp * s.sp + c.sp; }

}  // namespace lcx
