// The dp x cp x sp mesh: validation before any GPU work, then one split per axis. Splits are
// collectives of the world communicator, so every rank builds its mesh in the same order.
#include "lcx/comm.h"

namespace lcx {

void Mesh::validate(const MeshShape& s, int world_size) {
  const std::pair<const char*, int> axes[] = {{"dp", s.dp}, {"cp", s.cp}, {"sp", s.sp}};
  for (const auto& [key, v] : axes)
    if (v < 1)
      throw Error(str("[distributed] ", key, " = ", v, ": every mesh axis needs at least one rank"),
                  str("distributed.", key), "set it to 1 or more");
  const int64_t product = static_cast<int64_t>(s.dp) * s.cp * s.sp;
  if (product != world_size)
    throw Error(str("[distributed] dp x cp x sp = ", s.dp, " x ", s.cp, " x ", s.sp, " = ", product,
                    " ranks, but the world size is ", world_size),
                "distributed.dp", str("choose dp, cp and sp whose product is ", world_size,
                                      " (nproc_per_node x nodes, or WORLD_SIZE)"));
  if (s.ep < 1 || world_size % s.ep != 0)
    throw Error(str("[distributed] ep = ", s.ep, " does not divide the world's ", world_size, " ranks"),
                "distributed.ep", str("set ep to a divisor of ", world_size, " (1: every rank holds every expert)"));
}

MeshCoord Mesh::coord_of(const MeshShape& s, int r) {
  if (s.order == MeshOrder::cp_inner) return {r / (s.cp * s.sp), r % s.cp, (r / s.cp) % s.sp};
  return {r / (s.cp * s.sp), (r / s.sp) % s.cp, r % s.sp};
}

Mesh::Mesh(Communicator& world, const MeshShape& shape)
    : world_(world), shape_(shape), coord_((validate(shape, world.size()), coord_of(shape, world.rank()))) {
  const auto [d, c, s] = coord_;
  // Color = the coordinates that stay fixed along the axis; key = the position along it, so an
  // axis's ranks are its coordinates under either order.
  dp_ = world.split(c * shape.sp + s, d, "dp");
  cp_ = world.split(d * shape.sp + s, c, "cp");
  sp_ = world.split(d * shape.cp + c, s, "sp");
  seq_ = world.split(d, seq_index(shape, coord_), "seq");
  if (shape.ep > 1) {
    const int r = world.rank();
    partition_ = world.split(r / shape.ep, expert_index(shape, r), "ep");
    partition_replicas_ = world.split(expert_index(shape, r), r / shape.ep, "edp");
  }
}

Mesh::~Mesh() = default;

}  // namespace lcx
