// tiled_mlp: the MLP slot over tiles of rows. Each row's MLP output depends only on that row, so
// the forward, its recompute and the backward run core's whole MLP (lcx/defaults.h) on tile_rows
// rows at a time: the [T,I] intermediates (gate, up, act; dact, dgate, dup in the backward) exist
// for one tile only, and their memory no longer grows with the sequence. Outputs and the input's
// gradient are the whole MLP's row for row; the weight gradients are the same sums taken tile by
// tile (fp32 accumulation, so equal up to the order of the additions).
//
// The tile: `tile_rows` when set; under "auto" (the default) the plan's choice (Recipe::mlp_tile_rows,
// the fastest tile that fits: each tile costs its weight gradients' accumulation once more, see
// plan()), else about 256 MiB per [rows, I] buffer (a run not planned for the GPU).
//
// Written against the SDK headers only: a strategy that core does not know, loaded by name.
#include <lcx/defaults.h>
#include <lcx/log.h>
#include <lcx/plan.h>
#include <lcx/plugin.h>
#include <lcx/slots/mlp_strategy.h>
#include <lcx/slots/model.h>

#include <algorithm>
#include <optional>

namespace lcx {
namespace {

// The tile without a key or a plan: about this many bytes per [rows, I] buffer, in whole multiples
// of 256 rows.
constexpr int64_t kAutoTileBytes = int64_t{256} << 20;

class TiledMlp final : public MlpStrategy {
 public:
  // tile_rows: 0 for "auto".
  explicit TiledMlp(int64_t tile_rows) : tile_rows_(tile_rows), whole_(make_whole_mlp()) {}

  void use_recipe(const Recipe& recipe) override { recipe_rows_ = recipe.mlp_tile_rows; }

  void forward(const Tensor& x, const MlpWeights& w, Tensor& out) override {
    const int64_t T = x.size(0), I = w.gate.size(0), R = rows(I, x.dtype(), recipe_rows_);
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
    const int64_t T = x.size(0), R = rows(w.gate.size(0), x.dtype(), recipe_rows_);
    for (int64_t r0 = 0; r0 < T; r0 += R) {
      const int64_t r1 = std::min(T, r0 + R);
      Tensor dx_tile = dx.rows(r0, r1);
      whole_->backward(x.rows(r0, r1), w, dout.rows(r0, r1), dx_tile, grad);
    }
  }

  std::string plan_offer() const override { return "the MLP's [T,I] intermediates one tile at a time"; }
  // Each tile is one call of core's whole MLP over its rows, so a tile's work beyond the arithmetic
  // (the model counts that) is whole's plan of one call: the tiles repeat it, and larger tiles save it.
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    const int64_t T = std::max<int64_t>(in.tokens_per_rank, 1);
    const int64_t R = std::min(T, rows(in.model.intermediate_size, in.weight_dtype, in.recipe.mlp_tile_rows));
    const int64_t tile = R * in.model.intermediate_size * static_cast<int64_t>(dtype_size(in.weight_dtype));
    const std::string shape = str("[", R, ",I]");
    plan.add(str("layer forward: MLP gate, up, act ", shape, " (one tile)"), PlanCategory::transient, 3 * tile,
             plan_phase::forward);
    plan.add(str("recompute: MLP gate, up, act ", shape, " (one tile)"), PlanCategory::transient, 3 * tile,
             plan_phase::mlp_backward);
    plan.add(str("backward: MLP dact, dgate, dup ", shape, " (one tile)"), PlanCategory::transient, 3 * tile,
             plan_phase::mlp_backward);
    MemoryPlan one;
    whole_->plan(in, one);
    plan.work.memory_bytes += static_cast<double>((T + R - 1) / R) * one.work.memory_bytes;
  }

 private:
  // The tile: the key's, else the plan's (recipe_rows), else about kAutoTileBytes per [rows, I] buffer.
  int64_t rows(int64_t intermediate, DType dt, int64_t recipe_rows) const {
    if (tile_rows_ > 0) return tile_rows_;
    if (recipe_rows > 0) return recipe_rows;
    const int64_t per_row = std::max<int64_t>(1, intermediate * static_cast<int64_t>(dtype_size(dt)));
    return std::max<int64_t>(256, kAutoTileBytes / per_row / 256 * 256);
  }

  const int64_t tile_rows_;  // 0: "auto"
  int64_t recipe_rows_ = 0;  // the plan's tile (Recipe::mlp_tile_rows); 0: none
  bool logged_ = false;
  std::unique_ptr<MlpStrategy> whole_;
};

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  const char* fix = "\"auto\" (the plan's choice, the default) or a row count >= 1, e.g. 8192";
  args.config.describe("tile_rows", "tokens of the MLP's [T, I] intermediates computed at once", ">= 1");
  const std::optional<int64_t> rows = args.config.get_int_or_auto("tile_rows", fix);
  if (rows && *rows < 1) args.config.fail("tile_rows", str(*rows, " is not a row count"), fix);
  return std::make_unique<TiledMlp>(rows.value_or(0));
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_MLP, "tiled_mlp", "0.1.0", "MLP over sequence tiles: [T,I] intermediates never whole", "ready",
           lcx::create)
