// Work per rank under cp_ring. Virtual ranks sharing one GPU run at once, so
// their kernels overlap and a rank's own time cannot be read off a joint run; instead each rank's
// ring schedule runs alone on the device: at every ring step the attention pieces cp_ring computes
// for it (schedule.h, the plugin's own schedule), forward and backward, on tensors of the
// model's attention shape. The device is synchronized around each rank's schedule and the host
// clock read; after a warm-up pass of every rank, the median of --reps repetitions (default 9, taken
// round the ranks: with 5, ranks of equal work still came out up to 6% apart) is reported. The
// same is done for contiguous sharding (rank r holds the r-th L/cp tokens), the layout zigzag
// replaces, so the table shows the imbalance zigzag removes. Also printed: the bytes one rank
// sends per layer (K/V blocks in the forward; K/V again and the fp32 dK/dV accumulators in the
// backward), the figure the plugin logs.
// With --mix, the layout cp_ring balances for the documents (balance.h balanced_layout) is
// timed too, each ring step as the plugin runs it (step_rounds: one ops::attention_*_blocks call a
// round): its summary line gives k (each rank holds 2k chunks), the spread of the cost it
// balances (computed pairs and a fixed cost a cuDNN call) that it predicts and the host seconds
// balanced_layout took (layout_host_s, what cp_ring's shard() spends on it); beside it the plain
// zigzag under the same document masks, the layout it replaces (--documents-only: these two
// alone, for sweeping seeds).
// One JSON line per (layout, cp, rank) and one summary line per (layout, cp) on stdout.
//
//   cp_balance_bench --device cuda --tokens 131072 --cp 2,4,8 [--mix pg19|short]   (--mix adds the
//   balanced schedule masked by packed documents of that length mix, bench_util.h)
//   cp_balance_bench --device cpu --tokens 512 --cp 2,4 --heads 4 --kv-heads 2 --head-dim 16   (a smoke run)
//   cp_balance_bench --device cuda --tokens 131072 --cp 4 --mix pg19 --documents-only --chunks 0,3,4,7,2,5,1,6
//   --bounds 0,16256,...,131072   (that layout timed in place of the balanced one, for ablations)
//   cp_balance_bench --device cpu --mix short --documents-only --layouts-only   (each rank's masked pairs,
//   computed pairs, rounds and cuDNN calls without running them; a GPU run prints them beside its
//   times, which fit cost.h RingCosts)
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "bench_util.h"
#include "lcx/attention_cost.h"
#include "lcx/error.h"
#include "lcx/ops.h"
#include "lcx/tensor.h"
#include "balance.h"

namespace lcx {
namespace {

struct Options {
  Device device = Device::cuda();
  int64_t tokens = 131072, heads = 32, kv_heads = 8, head_dim = 128;  // Qwen3-8B's attention
  std::vector<int64_t> cps = {2, 4, 8};
  int reps = 9;
  // Packed documents (bench_util.h's mixes): cp_ring's balanced schedule masked by their bounds,
  // beside the unmasked layouts. Empty: one text.
  std::string mix;
  uint64_t seed = 1;
  bool documents_only = false;
  bool layouts_only = false;  // each rank's pieces, pairs and calls, nothing run (for fitting the call cost)
  // A layout to time in place of the balanced one (one --cp): its chunks rank by rank (2k each, in
  // position order) and, optionally, the chunks' bounds (2 cp k + 1 of them, 0 to --tokens).
  std::vector<int64_t> given_chunks, given_bounds;
};

Options parse(int argc, char** argv) {
  Options o;
  bench::Args args("cp_balance_bench", argc, argv);
  while (args.next()) {
    const std::string& a = args.name();
    if (a == "--device") o.device = args.device();
    else if (a == "--tokens") o.tokens = args.number();
    else if (a == "--cp") o.cps = bench::parse_list(args.value());
    else if (a == "--heads") o.heads = args.number();
    else if (a == "--kv-heads") o.kv_heads = args.number();
    else if (a == "--head-dim") o.head_dim = args.number();
    else if (a == "--mix") o.mix = args.value();
    else if (a == "--seed") o.seed = static_cast<uint64_t>(args.number());
    else if (a == "--documents-only") o.documents_only = true;
    else if (a == "--layouts-only") o.layouts_only = true;
    else if (a == "--chunks") o.given_chunks = bench::parse_list(args.value());
    else if (a == "--bounds") o.given_bounds = bench::parse_list(args.value());
    else if (a == "--reps") o.reps = std::max<int>(1, static_cast<int>(args.number()));
    else args.unknown("see the usage at the top of tests/bench/cp_balance_bench.cpp");
  }
  return o;
}

// Values in [-1, 1): bf16 on a GPU (cuDNN's input), fp32 on the CPU.
Tensor random_tensor(Shape shape, Device d, uint64_t seed) {
  return bench::random_uniform(std::move(shape), d.is_cuda() ? DType::bf16 : DType::f32, d, 1.f, seed);
}

enum class Layout { zigzag, contiguous, zigzag_masked, balanced_documents };
bool masked(Layout l) { return l == Layout::zigzag_masked || l == Layout::balanced_documents; }

// Rank r's pieces against rank j's block without documents; c is the zigzag's chunk. Contiguous: r
// holds tokens [2rc, 2(r+1)c), so its own block is causal, earlier blocks are full and later ones
// are not seen at all.
std::vector<cp_ring::PlacedPiece> schedule(Layout layout, int r, int j, int64_t c) {
  std::vector<cp_ring::PlacedPiece> out;
  if (layout == Layout::zigzag)
    for (const cp_ring::Piece& p : cp_ring::pieces_for(r, j, c, true)) out.push_back({p, 0, 0});
  else if (j == r)
    out.push_back({{0, 2 * c, 0, 2 * c, true}, 0, 0});
  else if (j < r)
    out.push_back({{0, 2 * c, 0, 2 * c, false}, 0, 0});
  return out;
}

struct RankTime {
  double forward_s = 0, backward_s = 0;
  double units = 0;  // score-matrix entries computed, in units of c x c (a causal c x c counts one half)
  int64_t pieces = 0;  // attention calls of the forward (the backward makes as many): pieces, or rounds
  int64_t masked_pairs = 0;  // (query, key) pairs the document masks leave (masked layouts only)
  int64_t padded_pairs = 0;  // the pairs the GPU's batches compute (each document at its computed rows)
  int64_t batches = 0;       // the batches' cuDNN calls (forward; the backward makes as many)
  int64_t call_octaves = 0;  // the calls' key octaves (AttentionWork::call_octaves)
  int64_t query_tiles = 0;   // the blocks' query tiles (AttentionWork::query_tiles)
};

auto clock_now() { return std::chrono::steady_clock::now(); }
double seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// One rank's whole ring under document masks as cp_ring runs it: each step's rounds
// (schedule.h step_rounds), one ops::attention_*_blocks call each, on the rank's full rows.
// The ring's merges and gradient sums are not timed (as the pieces' are not below).
RankTime time_rank_rounds(const Options& o, int r, int n, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& dout, const cp_ring::ChunkLayout& chunks,
                          const std::vector<int64_t>& documents) {
  const Device dev = o.device;
  const float scale = 1.f / std::sqrt(static_cast<float>(o.head_dim));
  RankTime t;
  std::vector<std::vector<cp_ring::Round>> steps;
  for (int s = 0; s < n; ++s) steps.push_back(cp_ring::step_rounds(r, (r - s + n) % n, chunks, true, documents));
  const int64_t c = chunks.c;
  for (const auto& rounds : steps)
    for (const cp_ring::Round& round : rounds) {
      const AttentionWork w = cp_ring::round_work(round);
      t.padded_pairs += w.pairs;
      t.batches += w.calls;
      t.call_octaves += w.call_octaves;
      t.query_tiles += w.query_tiles;
      ++t.pieces;
      for (const ops::AttentionBlock& b : round.blocks)
        t.units += static_cast<double>(b.q_rows * b.k_rows) / static_cast<double>(c * c) * (round.causal ? 0.5 : 1.0);
    }
  for (int64_t ch : chunks.of(r))
    t.masked_pairs += cp_ring::range_work(documents, chunks.begin(ch), chunks.begin(ch) + chunks.rows(ch));
  if (o.layouts_only) return t;
  // The rounds' outputs land in one buffer (their values do not change the backward's speed).
  Tensor out = Tensor::zeros(q.shape(), q.dtype(), dev), lse = Tensor::zeros({q.size(1), q.size(0)}, DType::f32, dev);
  Tensor dq = Tensor::empty(q.shape(), q.dtype(), dev);
  Tensor dk = Tensor::empty(k.shape(), q.dtype(), dev), dv = Tensor::empty(v.shape(), q.dtype(), dev);
  bench::sync(dev);
  auto t0 = clock_now();
  for (const auto& rounds : steps)
    for (const cp_ring::Round& round : rounds)
      ops::attention_forward_blocks(q, k, v, out, lse, scale, round.causal, round.blocks);
  bench::sync(dev);
  auto t1 = clock_now();
  for (const auto& rounds : steps)
    for (const cp_ring::Round& round : rounds)
      ops::attention_backward_blocks(q, k, v, out, lse, dout, dq, dk, dv, scale, round.causal, round.blocks);
  bench::sync(dev);
  auto t2 = clock_now();
  t.forward_s = seconds(t0, t1);
  t.backward_s = seconds(t1, t2);
  return t;
}

// One rank's whole ring, forward then backward, alone on the device.
RankTime time_rank(const Options& o, Layout layout, int r, int n, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& dout, const cp_ring::ChunkLayout& chunks, const std::vector<int64_t>& documents) {
  if (masked(layout)) return time_rank_rounds(o, r, n, q, k, v, dout, chunks, documents);
  const int64_t c = q.size(0) / 2;
  const Device dev = o.device;
  const DType dt = q.dtype();
  ops::AttentionParams p;
  p.scale = 1.f / std::sqrt(static_cast<float>(o.head_dim));
  RankTime t;
  auto place = [&](const cp_ring::PlacedPiece& pp) { p.causal = pp.piece.causal; };
  auto clock = clock_now;
  // The LSE of a piece comes from its own forward (its values do not change the backward's speed).
  std::vector<std::pair<Tensor, Tensor>> outs;
  bench::sync(dev);
  auto t0 = clock();
  for (int s = 0; s < n; ++s) {
    const int j = (r - s + n) % n;
    for (const cp_ring::PlacedPiece& pp : schedule(layout, r, j, c)) {
      const cp_ring::Piece& pc = pp.piece;
      const int64_t nq = pc.q_end - pc.q_begin, nk = pc.k_end - pc.k_begin;
      Tensor out = Tensor::empty({nq, q.size(1), q.size(2)}, dt, dev);
      Tensor lse = Tensor::empty({q.size(1), nq}, DType::f32, dev);
      place(pp);
      if (!o.layouts_only)
        ops::attention_forward(q.rows(pc.q_begin, pc.q_end), k.rows(pc.k_begin, pc.k_end), v.rows(pc.k_begin, pc.k_end),
                             out, lse, p);
      outs.emplace_back(std::move(out), std::move(lse));
      t.units += static_cast<double>(nq * nk) / static_cast<double>(c * c) * (pc.causal ? 0.5 : 1.0);
      ++t.pieces;
    }
  }
  bench::sync(dev);
  auto t1 = clock();
  size_t i = 0;
  for (int s = 0; s < n; ++s) {
    const int j = (r - s + n) % n;
    for (const cp_ring::PlacedPiece& pp : schedule(layout, r, j, c)) {
      const cp_ring::Piece& pc = pp.piece;
      const int64_t nq = pc.q_end - pc.q_begin, nk = pc.k_end - pc.k_begin;
      Tensor dq = Tensor::empty({nq, q.size(1), q.size(2)}, dt, dev);
      Tensor dk = Tensor::empty({nk, k.size(1), k.size(2)}, dt, dev), dv = Tensor::empty({nk, v.size(1), v.size(2)}, dt, dev);
      place(pp);
      const auto& [out, lse] = outs[i++];
      if (!o.layouts_only)
        ops::attention_backward(q.rows(pc.q_begin, pc.q_end), k.rows(pc.k_begin, pc.k_end), v.rows(pc.k_begin, pc.k_end),
                              out, lse, dout.rows(pc.q_begin, pc.q_end), dq, dk, dv, p);
    }
  }
  bench::sync(dev);
  auto t2 = clock();
  t.forward_s = seconds(t0, t1);
  t.backward_s = seconds(t1, t2);
  return t;
}

// The middle value; of an even count the mean of the middle two (with 2 repetitions, not the
// larger: one slow repetition alone would be reported).
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : (v[h - 1] + v[h]) / 2;
}

// --chunks (and --bounds): the layout to time, checked as cp_ring would need it, its predicted
// spread costed as balanced_layout costs its own.
cp_ring::ChunkLayout given_layout(const Options& o, int n, const std::vector<int64_t>& documents) {
  const int64_t m = static_cast<int64_t>(o.given_chunks.size()), L = o.tokens;
  if (o.cps.size() != 1 || m % (2 * n) != 0 || L % m != 0)
    throw Error(str("cp_balance_bench: --chunks holds ", m, " chunks; it takes one --cp and 2k chunks a rank that cut ",
                    "--tokens evenly"), "--chunks");
  cp_ring::ChunkLayout l{n, m / (2 * n), L / m, o.given_chunks, 0, o.given_bounds};
  // The bounds first: the rows below are read off them.
  if (!l.bounds.empty() &&
      (static_cast<int64_t>(l.bounds.size()) != m + 1 || l.bounds.front() != 0 || l.bounds.back() != L ||
       std::adjacent_find(l.bounds.begin(), l.bounds.end(), std::greater_equal<int64_t>()) != l.bounds.end()))
    throw Error(str("cp_balance_bench: --bounds takes ", m + 1, " rising values from 0 to ", L), "--bounds");
  std::vector<int64_t> rows(static_cast<size_t>(n), 0), seen(static_cast<size_t>(m), 0);
  for (int r = 0; r < n; ++r)
    for (int64_t ch : l.of(r)) {
      if (ch < 0 || ch >= m || seen[static_cast<size_t>(ch)]++)
        throw Error(str("cp_balance_bench: --chunks must name each of chunks 0 to ", m - 1, " once"), "--chunks");
      rows[static_cast<size_t>(r)] += l.rows(ch);
    }
  for (int64_t x : rows)
    if (x != L / n) throw Error(str("cp_balance_bench: a rank's chunks hold ", x, " rows, not ", L / n), "--bounds");
  cp_ring::rank_costs(l, documents, {}, cp_ring::ring_costs());  // sets the predicted spread
  return l;
}

int run(const Options& o) {
  constexpr double kMiB = 1024.0 * 1024.0;
  const double elem = o.device.is_cuda() ? 2.0 : 4.0;
  for (const int64_t cp : o.cps) {
    if (o.tokens % (2 * cp) != 0)
      throw Error(str("cp_balance_bench: ", o.tokens, " tokens do not cut into 2 x cp = ", 2 * cp, " chunks"), {},
                  "pick --tokens a multiple of 2 x cp");
    const int64_t c = o.tokens / (2 * cp);
    const Tensor q = random_tensor({2 * c, o.heads, o.head_dim}, o.device, 1);
    const Tensor k = random_tensor({2 * c, o.kv_heads, o.head_dim}, o.device, 2);
    const Tensor v = random_tensor({2 * c, o.kv_heads, o.head_dim}, o.device, 3);
    const Tensor dout = random_tensor({2 * c, o.heads, o.head_dim}, o.device, 4);
    const double kv_block = 2.0 * static_cast<double>(k.numel()) * elem, grads = 2.0 * static_cast<double>(k.numel()) * 4;
    const double fwd_bytes = static_cast<double>(cp - 1) * kv_block;
    const double bwd_bytes = static_cast<double>(cp - 1) * kv_block + static_cast<double>(cp) * grads;
    const std::vector<int64_t> documents = o.mix.empty() ? std::vector<int64_t>{} : bench::document_bounds(o.mix, o.tokens, o.seed);
    const auto layout_start = clock_now();  // the host time cp_ring's shard() spends on it
    const cp_ring::ChunkLayout balanced = o.given_chunks.empty()
                                              ? cp_ring::balanced_layout(documents, o.tokens, static_cast<int>(cp))
                                              : given_layout(o, static_cast<int>(cp), documents);
    const double layout_host_s = seconds(layout_start, clock_now());
    const cp_ring::ChunkLayout zigzag = cp_ring::zigzag_layout(o.tokens, static_cast<int>(cp));
    std::vector<Layout> layouts;
    if (documents.empty() || !o.documents_only) layouts = {Layout::zigzag, Layout::contiguous};
    if (!documents.empty()) layouts.insert(layouts.end(), {Layout::zigzag_masked, Layout::balanced_documents});
    for (Layout layout : layouts) {
      const cp_ring::ChunkLayout& chunks = layout == Layout::balanced_documents ? balanced : zigzag;
      const std::string docs = str(o.mix, " (", documents.size() - 1, " documents, seed ", o.seed, ")");
      const std::string name = layout == Layout::zigzag          ? "zigzag"
                               : layout == Layout::contiguous    ? "contiguous"
                               : layout == Layout::zigzag_masked ? "zigzag+" + docs
                               : o.given_chunks.empty()          ? "balanced+" + docs
                                                                 : "given+" + docs;
      // A warm-up of every rank: each rank's rounds have batch shapes of their own, and cuDNN builds
      // a plan for each new one on its first call (hundreds of ms a shape, charged to the first
      // repetition; with the warm-up of one rank only, ranks of equal work at a million tokens on 4
      // ranks came out up to 12% apart, and short documents up to 14x).
      for (int r = 0; r < static_cast<int>(cp); ++r)
        time_rank(o, layout, r, static_cast<int>(cp), q, k, v, dout, chunks, documents);
      // Repetitions go round the ranks (rep outer, rank inner), not rank after rank: the GPU's clock
      // drifts under its power cap over seconds, and timing one rank's repetitions back to back
      // charged a slow stretch to that rank alone (ranks of equal work differed by up to 12%).
      const size_t n = static_cast<size_t>(cp);
      std::vector<std::vector<double>> f(n), b(n);
      std::vector<RankTime> last(n);
      for (int rep = 0; rep < o.reps; ++rep)
        for (size_t r = 0; r < n; ++r) {
          last[r] = time_rank(o, layout, static_cast<int>(r), static_cast<int>(cp), q, k, v, dout, chunks, documents);
          f[r].push_back(last[r].forward_s);
          b[r].push_back(last[r].backward_s);
        }
      std::vector<double> totals;
      for (size_t r = 0; r < n; ++r) {
        const double fm = median(f[r]), bm = median(b[r]);
        totals.push_back(fm + bm);
        const RankTime& t = last[r];
        std::printf(
            "{\"layout\": \"%s\", \"cp\": %lld, \"rank\": %zu, \"tokens\": %lld, \"work_units\": %.1f, \"pieces\": %lld, "
            "\"masked_pairs\": %lld, \"padded_pairs\": %lld, \"batches\": %lld, \"call_octaves\": %lld, \"query_tiles\": %lld, \"forward_ms\": %.3f, \"backward_ms\": %.3f, \"total_ms\": %.3f}\n",
            name.c_str(), static_cast<long long>(cp), r, static_cast<long long>(o.tokens), t.units,
            static_cast<long long>(t.pieces), static_cast<long long>(t.masked_pairs), static_cast<long long>(t.padded_pairs),
            static_cast<long long>(t.batches), static_cast<long long>(t.call_octaves),
            static_cast<long long>(t.query_tiles), fm * 1e3, bm * 1e3, (fm + bm) * 1e3);
        std::fflush(stdout);
      }
      const double mx = *std::max_element(totals.begin(), totals.end());
      const double mn = *std::min_element(totals.begin(), totals.end());
      double mean = 0;
      for (double x : totals) mean += x / static_cast<double>(totals.size());
      // The balanced layout's k and the spread of the masked work it predicts.
      const std::string predicted = layout == Layout::balanced_documents
                                        ? str(", \"k\": ", chunks.k, ", \"chunk_rows\": ", chunks.c,
                                              ", \"bounds_moved\": ", chunks.bounds.empty() ? "false" : "true",
                                              ", \"predicted_spread_pct\": ", 100.0 * chunks.spread,
                                              ", \"layout_host_s\": ", layout_host_s)
                                        : std::string();
      // Under --layouts-only nothing ran: the times are 0 and their ratios null, so the line stays JSON.
      auto ratio = [](double num, double den, const char* format) {
        if (!(den > 0)) return std::string("null");
        char buf[32];
        std::snprintf(buf, sizeof buf, format, num / den);
        return std::string(buf);
      };
      std::printf(
          "{\"summary\": true, \"layout\": \"%s\", \"cp\": %lld, \"tokens\": %lld, \"min_ms\": %.3f, \"max_ms\": %.3f, "
          "\"mean_ms\": %.3f, \"spread_pct\": %s, \"max_over_min\": %s, \"sent_per_layer_forward_mib\": %.1f, "
          "\"sent_per_layer_backward_mib\": %.1f%s}\n",
          name.c_str(), static_cast<long long>(cp), static_cast<long long>(o.tokens), mn * 1e3, mx * 1e3, mean * 1e3,
          ratio(100.0 * (mx - mn), mean, "%.2f").c_str(), ratio(mx, mn, "%.4f").c_str(), fwd_bytes / kMiB, bwd_bytes / kMiB,
          predicted.c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace
}  // namespace lcx

int main(int argc, char** argv) {
  try {
    return lcx::run(lcx::parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
