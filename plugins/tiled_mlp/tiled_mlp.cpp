// tiled_mlp: the MLP slot over tiles of rows. Each row's MLP output depends only on that row, so
// the forward, its recompute and the backward run core's whole MLP (lcx/defaults.h) on tile_rows
// rows at a time: the [T,I] intermediates (gate, up, act; dact, dgate, dup in the backward) exist
// for one tile only, and their memory no longer grows with the sequence. Outputs and the input's
// gradient are the whole MLP's row for row; the weight gradients are the same sums taken tile by
// tile (fp32 accumulation, so equal up to the order of the additions).
//
// Written against the SDK headers only: a strategy that core does not know, loaded by name.
#include <lcx/defaults.h>
#include <lcx/log.h>
#include <lcx/plan.h>
#include <lcx/plugin.h>
#include <lcx/slots/mlp_strategy.h>

#include <algorithm>

namespace lcx {
namespace {

// The automatic tile: about this many bytes per [rows, I] buffer, in whole multiples of 256 rows.
constexpr int64_t kAutoTileBytes = int64_t{256} << 20;

class TiledMlp final : public MlpStrategy {
 public:
  explicit TiledMlp(int64_t tile_rows) : tile_rows_(tile_rows), whole_(make_whole_mlp()) {}

  void forward(const Tensor& x, const MlpWeights& w, Tensor& out) override {
    const int64_t T = x.size(0), I = w.gate.size(0), R = rows(I, x.dtype());
    if (!logged_) {  // once: the run log says the tiles are in use, and how large
      log::info(str("tiled_mlp: ", T, " rows in ", (T + R - 1) / R, " tiles of ", std::min(T, R), " rows; [rows,I] buffers of ",
                    std::min(T, R) * I * static_cast<int64_t>(dtype_size(x.dtype())) / (1 << 20), " MiB"));
      logged_ = true;
    }
    for (int64_t r0 = 0; r0 < T; r0 += R) {
      const int64_t r1 = std::min(T, r0 + R);
      Tensor out_tile = out.rows(r0, r1);
      whole_->forward(x.rows(r0, r1), w, out_tile);
    }
  }

  void backward(const Tensor& x, const MlpWeights& w, const Tensor& dout, Tensor& dx, MlpWeights& grad) override {
    const int64_t T = x.size(0), R = rows(w.gate.size(0), x.dtype());
    for (int64_t r0 = 0; r0 < T; r0 += R) {
      const int64_t r1 = std::min(T, r0 + R);
      Tensor dx_tile = dx.rows(r0, r1);
      whole_->backward(x.rows(r0, r1), w, dout.rows(r0, r1), dx_tile, grad);
    }
  }

  std::string plan_offer() const override { return "the MLP's [T,I] intermediates one tile at a time"; }
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const int64_t R = std::min(in.tokens_per_rank, rows(in.model.intermediate_size, in.weight_dtype));
    const int64_t tile = R * in.model.intermediate_size * static_cast<int64_t>(dtype_size(in.weight_dtype));
    const std::string shape = str("[", R, ",I]");
    plan.add(str("layer forward: MLP gate, up, act ", shape, " (one tile)"), PlanCategory::transient, 3 * tile,
             plan_phase::forward);
    plan.add(str("recompute: MLP gate, up, act ", shape, " (one tile)"), PlanCategory::transient, 3 * tile,
             plan_phase::mlp_backward);
    plan.add(str("backward: MLP dact, dgate, dup ", shape, " (one tile)"), PlanCategory::transient, 3 * tile,
             plan_phase::mlp_backward);
  }

 private:
  int64_t rows(int64_t intermediate, DType dt) const {
    if (tile_rows_ > 0) return tile_rows_;
    const int64_t per_row = std::max<int64_t>(1, intermediate * static_cast<int64_t>(dtype_size(dt)));
    return std::max<int64_t>(256, kAutoTileBytes / per_row / 256 * 256);
  }

  const int64_t tile_rows_;  // 0: automatic
  bool logged_ = false;
  std::unique_ptr<MlpStrategy> whole_;
};

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  const int64_t rows = args.config.get_int("tile_rows", 0);
  if (rows < 0)
    args.config.fail("tile_rows", str(rows, " is negative"), "a row count, or 0 for tiles of about 256 MiB per [rows, I] buffer");
  return std::make_unique<TiledMlp>(rows);
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_MLP, "tiled_mlp", "0.1.0", "MLP over sequence tiles: [T,I] intermediates never whole", "ready",
           lcx::create)
