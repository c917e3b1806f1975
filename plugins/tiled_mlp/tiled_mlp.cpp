// tiled_mlp: the MLP slot over tiles of rows. Each row's MLP output depends only on that row, so
// the forward, its recompute and the backward run core's whole MLP (lcx/defaults.h) on tile_rows
// rows at a time: the [T,I] intermediates (gate, up, act; dact, dgate, dup in the backward) exist
// for one tile only, and their memory no longer grows with the sequence. Outputs and the input's
// gradient are the whole MLP's row for row; the weight gradients are the same sums taken tile by
// tile (fp32 accumulation, so equal up to the order of the additions).
//
// The tile: `tile_rows` when set; under "auto" (the default) the plan's choice (the knob
// tiled_mlp.tile_rows, the fastest tile that fits: each tile costs its weight gradients'
// accumulation once more, see plan()), else about 256 MiB per [rows, I] buffer (a run not planned
// for the GPU).
//
// Written against the SDK headers only: a strategy that core does not know, loaded by name.
#include <lcx/defaults.h>
#include <lcx/log.h>
#include <lcx/plan.h>
#include <lcx/plugin.h>
#include <lcx/slots/mlp_strategy.h>
#include <lcx/slots/model.h>

#include <algorithm>
#include <limits>
#include <optional>

namespace lcx {
namespace {

// The tile without a key or a plan: about this many bytes per [rows, I] buffer, in whole multiples
// of 256 rows.
constexpr int64_t kAutoTileBytes = int64_t{256} << 20;
constexpr const char* kTileRows = "tile_rows";


class TiledMlp final : public MlpStrategy {
 public:
  // tile_rows: 0 for "auto"; name: the provider's, by which the recipe names its knob.
  TiledMlp(int64_t tile_rows, std::string name)
      : tile_rows_(tile_rows), name_(std::move(name)), whole_(make_whole_mlp()) {}

  // Under "auto", the tile: a few sizes, from about where an H200's GEMMs stay busy to where the
  // time gained flattens (the chunk_rows sweep, docs/PERF.md), cut to the rank's rows (which are
  // one tile more). Its work adds to the rest of the step's: ranked once.
  std::vector<Knob> knobs(const PlanInputs& in) const override {
    if (tile_rows_ > 0) return {};
    Knob k;
    k.name = kTileRows;
    k.values = values_up_to({4096, 8192, 16384, 32768, std::numeric_limits<int64_t>::max()},
                            std::max<int64_t>(in.tokens_per_rank, 1));
    k.search = KnobSearch::ranked;
    k.means = "tiled MLP: rows of the MLP's [T,I] intermediates computed at once";
    return {std::move(k)};
  }
  void use_recipe(const Recipe& recipe) override { recipe_rows_ = recipe.get(name_, kTileRows, 0); }

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
      MlpWeights tile = w;
      if (w.rows.defined()) tile.rows = w.rows.rows(r0, r1);
      whole_->forward(x.rows(r0, r1), tile, out_tile);
    }
  }

  void backward(const Tensor& x, const MlpWeights& w, const Tensor& dout, Tensor& dx, MlpWeights& grad) override {
    const int64_t T = x.size(0), R = rows(w.gate.size(0), x.dtype(), recipe_rows_);
    for (int64_t r0 = 0; r0 < T; r0 += R) {
      const int64_t r1 = std::min(T, r0 + R);
      Tensor dx_tile = dx.rows(r0, r1);
      MlpWeights tile = w;
      if (w.rows.defined()) tile.rows = w.rows.rows(r0, r1);
      whole_->backward(x.rows(r0, r1), tile, dout.rows(r0, r1), dx_tile, grad);
    }
  }

  std::string plan_offer() const override { return "the MLP's [T,I] intermediates one tile at a time"; }
  // Each tile is one call of core's whole MLP over its rows, so a tile's work beyond the arithmetic
  // (the model counts that) is whole's plan of one call: the tiles repeat it, and larger tiles save it.
  void plan(const PlanInputs& in, MemoryPlan& plan) const override {
    // A model whose every layer runs an MLP of its own plans it itself.
    if (in.model.mlp_slot_layers == 0) return;
    const int64_t T = std::max<int64_t>(in.tokens_per_rank, 1);
    const int64_t R = std::min(T, rows(in.model.intermediate_size, in.weight_dtype, in.recipe.get(name_, kTileRows, 0)));
    const int64_t tile = R * in.model.intermediate_size * static_cast<int64_t>(dtype_size(in.weight_dtype));
    const std::string shape = str("[", R, ",I]");
    plan.add("mlp_forward", str("layer forward: MLP gate, up, act ", shape, " (one tile)"), PlanCategory::transient,
             3 * tile, plan_phase::forward);
    plan.add("mlp_recompute", str("recompute: MLP gate, up, act ", shape, " (one tile)"), PlanCategory::transient,
             3 * tile, plan_phase::mlp_backward);
    plan.add("mlp_backward", str("backward: MLP dact, dgate, dup ", shape, " (one tile)"), PlanCategory::transient,
             3 * tile, plan_phase::mlp_backward);
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
  const std::string name_;
  int64_t recipe_rows_ = 0;  // the plan's tile; 0: none
  bool logged_ = false;
  std::unique_ptr<MlpStrategy> whole_;
};

std::unique_ptr<Plugin> create(const PluginArgs& args) {
  const char* fix = "\"auto\" (the plan's choice, the default) or a row count >= 1, e.g. 8192";
  args.config.describe(kTileRows, "tokens of the MLP's [T, I] intermediates computed at once", ">= 1");
  const std::optional<int64_t> rows = args.config.get_int_or_auto(kTileRows, fix);
  if (rows && *rows < 1) args.config.fail(kTileRows, str(*rows, " is not a row count"), fix);
  return std::make_unique<TiledMlp>(rows.value_or(0), args.name);
}

}  // namespace
}  // namespace lcx

LCX_PLUGIN(LCX_SLOT_MLP, "tiled_mlp", "0.1.0", "MLP over sequence tiles: [T,I] intermediates never whole", "ready",
           lcx::create)
