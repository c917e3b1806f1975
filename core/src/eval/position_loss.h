// Loss by position: where along a long sequence a model loses the thread. Per-position losses of
// several sequences are summed, averaged into equal-width position bins, written as CSV, and
// drawn as an SVG (one line per run, the text's unigram entropy dashed: a model that no longer
// uses its context does about as well as guessing from word frequencies).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "train/step.h"

namespace lcx {

// Per-position sums over the sequences evaluated so far.
struct PositionLoss {
  std::vector<double> sum;     // [N] loss summed over sequences
  std::vector<int64_t> count;  // [N] valid targets summed over sequences
  void add(const std::vector<float>& loss, const Tensor& targets);  // targets int64 [N], -100 ignored
  // The mean loss over positions [begin, end) (all sequences together); NaN when nothing counted.
  double mean(int64_t begin, int64_t end) const;
};

struct BinRow {
  int64_t start = 0, end = 0;  // positions [start, end)
  double mean_loss = 0;        // NaN when no valid target fell in the bin
  int64_t count = 0;
};

// `bins` equal-width bins over the positions (the last ones may be one position wider).
std::vector<BinRow> bin_positions(const PositionLoss& pl, int bins);

// One run on a plot: its label and bins.
struct RunCurve {
  std::string label;
  std::vector<BinRow> bins;
};

// CSV: header `label,bin_start,bin_end,mean_loss,count`, one row a bin.
std::string bins_csv(const RunCurve& run);
// Reads one or more runs back from a CSV written by bins_csv (grouped by label, in file order).
std::vector<RunCurve> parse_bins_csv(const std::string& text);

// Entropy in nats of the empirical distribution given by token counts (zeros skipped).
double unigram_entropy(const std::vector<int64_t>& counts);

// The SVG text: position on x, mean loss on y, one polyline per run, a legend, and the entropy
// as a dashed line (skipped when NaN). A mark_position > 0 draws a dotted vertical line there
// (e.g. the length the model was trained at) named mark_label.
std::string loss_plot_svg(const std::vector<RunCurve>& runs, double entropy_nats, const std::string& title,
                          int64_t mark_position = 0, const std::string& mark_label = {});

// Each position's loss of one shard: the final hidden states through the model's head in row
// chunks (a [chunk, V] block of logits at a time), log-softmax in fp64 on the host.
std::vector<float> per_position_loss(StepSlots& s, const Shard& shard, Device device, int64_t chunk_rows = 256);

}  // namespace lcx
