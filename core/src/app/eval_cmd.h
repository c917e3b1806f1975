// `lcx-train eval` and `lcx-train eval-plot`: loss by position of a model over long sequences.
#pragma once

namespace lcx {

// argv[0] is "eval": evaluates one model, writes <label>.csv, <label>.tokens.csv, <label>.json
// into --out and redraws --out/loss_by_position.svg from every run's CSV there.
int eval_main(int argc, char** argv);
// argv[0] is "eval-plot": one SVG from the CSVs (or folders of them) given.
int eval_plot_main(int argc, char** argv);

}  // namespace lcx
