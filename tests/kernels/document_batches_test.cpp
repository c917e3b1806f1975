// The grouping of document-masked attention on cuDNN (kernels/document_batches.h): every document
// in exactly one batch, batch sizes powers of two, padded sizes of their length class (octaves, or
// quarter steps and 32nd steps for long documents) that hold their documents, and padded rows
// within the real rows rounded up to a power of two.
#include "kernels/document_batches.h"

#include <gtest/gtest.h>

#include "kernels/cudnn_sizes.h"
#include "lcx/attention_cost.h"

#include <bit>
#include <random>

namespace lcx::ops {
namespace {

// Checks the invariants the CUDA side and the memory plan rely on (for either kind of length
// class); returns the batches.
std::vector<DocumentBatch> checked(const std::vector<int64_t>& lengths,
                                   LengthClasses classes = LengthClasses::fine) {
  const std::vector<DocumentBatch> batches = document_batches(lengths, classes);
  std::vector<int> seen(lengths.size(), 0);
  int64_t total = 0;
  for (int64_t n : lengths) total += std::max<int64_t>(0, n);
  for (const DocumentBatch& b : batches) {
    EXPECT_EQ(b.rows % kMinPaddedRows, 0) << b.rows;
    EXPECT_GE(b.rows, kMinPaddedRows);
    EXPECT_TRUE(std::has_single_bit(b.docs.size())) << b.docs.size();
    EXPECT_LE(static_cast<int64_t>(b.docs.size()) * b.rows,
              std::max(static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(total))), kMinPaddedRows));
    for (size_t i : b.docs) {
      if (i >= lengths.size()) {
        ADD_FAILURE() << "document index " << i << " past " << lengths.size();
        continue;
      }
      ++seen[i];
      EXPECT_LE(lengths[i], b.rows);
      EXPECT_EQ(padded_rows(lengths[i], classes), b.rows);
    }
  }
  for (size_t i = 0; i < lengths.size(); ++i) EXPECT_EQ(seen[i], lengths[i] > 0 ? 1 : 0) << "document " << i;
  return batches;
}

TEST(DocumentBatches, PaddedRowsAreQuarterStepsOfTheOctaveThenFiner) {
  EXPECT_EQ(padded_rows(1), kMinPaddedRows);
  EXPECT_EQ(padded_rows(kMinPaddedRows), kMinPaddedRows);
  EXPECT_EQ(padded_rows(kMinPaddedRows + 1), 2 * kMinPaddedRows);  // below 1,024 rows: steps of 128
  EXPECT_EQ(padded_rows(300), 384);
  EXPECT_EQ(padded_rows(4096), 4096);
  EXPECT_EQ(padded_rows(3500), 3584);    // 1.75 x 2,048
  EXPECT_EQ(padded_rows(4097), 4224);    // past kFineFromRows: steps of 8,192 / 64
  EXPECT_EQ(padded_rows(90001), 90112);  // 44 x 2,048
  EXPECT_EQ(padded_rows(66045), 67584);  // a book of the pg19 mix: 2.3% padded, not 24% (81,920)
  // Less than one step (a quarter of the octave's lower half, a 32nd past kFineFromRows, at least
  // kMinPaddedRows) above the document, and never below it.
  for (int64_t n = 1; n < 300000; n = n * 5 / 4 + 1) {
    const int64_t S = padded_rows(n);
    const int64_t p = static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(n)));
    const int64_t step = std::max(kMinPaddedRows, n > kFineFromRows ? p / 64 : p / 8);
    EXPECT_GE(S, n);
    EXPECT_LT(S - std::max(n, kMinPaddedRows), step) << n;
    EXPECT_EQ(S % step, 0) << n;
  }
}

TEST(DocumentBatches, ThirteenDocumentsOfOneSizeRunAsEightFourOne) {
  const std::vector<DocumentBatch> b = checked(std::vector<int64_t>(13, 1000));
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0].docs.size(), 8u);
  EXPECT_EQ(b[1].docs.size(), 4u);
  EXPECT_EQ(b[2].docs.size(), 1u);
  for (const DocumentBatch& x : b) EXPECT_EQ(x.rows, 1024);  // 1,000 rows: 1,024 is the step above
}

TEST(DocumentBatches, SizesAscendAndZeroLengthsAreLeftOut) {
  const std::vector<DocumentBatch> b = checked({300, 0, 5000, 70, 260, 129});
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(b[0].rows, 128);
  EXPECT_EQ(b[0].docs, std::vector<size_t>{3});
  EXPECT_EQ(b[1].rows, 256);
  EXPECT_EQ(b[1].docs, std::vector<size_t>{5});
  EXPECT_EQ(b[2].rows, 384);  // 300 and 260 rows share the step
  EXPECT_EQ(b[2].docs, (std::vector<size_t>{0, 4}));
  EXPECT_EQ(b[3].rows, 5120);
}

TEST(DocumentBatches, TinyDocumentsAreCappedAtTheRealRowsRoundedUp) {
  // 1,000 documents of 3 rows: 3,000 real rows, 4,096 rounded up; a batch of 128-row documents
  // holds at most 32 of them.
  const std::vector<DocumentBatch> b = checked(std::vector<int64_t>(1000, 3));
  for (const DocumentBatch& x : b) EXPECT_LE(x.docs.size(), 32u);
  EXPECT_EQ(b.front().docs.size(), 32u);
  // One tiny document alone pads to the least size.
  EXPECT_EQ(checked({5}).front().rows, kMinPaddedRows);
}

TEST(DocumentBatches, RandomMixesKeepTheInvariants) {
  std::mt19937_64 rng(7);
  std::lognormal_distribution<double> len(std::log(1000.0), 1.5);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> lengths(1 + rng() % 300);
    for (int64_t& n : lengths) n = static_cast<int64_t>(len(rng)) % 200000;
    checked(lengths);
    checked(lengths, LengthClasses::octave);
  }
}

// The pair grouping's invariants: documents with queries and keys each in exactly one batch, both
// padded sizes holding their lengths, power-of-two counts, and each side's padded rows within its
// real rows rounded up to a power of two (the memory plan's bound).
std::vector<DocumentPairBatch> checked_pairs(const std::vector<int64_t>& q, const std::vector<int64_t>& k,
                                             LengthClasses classes = LengthClasses::fine) {
  const std::vector<DocumentPairBatch> batches = document_pair_batches(q, k, classes);
  std::vector<int> seen(q.size(), 0);
  int64_t q_total = 0, k_total = 0;
  for (size_t i = 0; i < q.size(); ++i)
    if (q[i] > 0 && k[i] > 0) {
      q_total += q[i];
      k_total += k[i];
    }
  auto bound = [](int64_t total) {
    return std::max(static_cast<int64_t>(std::bit_ceil(static_cast<uint64_t>(std::max<int64_t>(1, total)))),
                    kMinPaddedRows);
  };
  for (const DocumentPairBatch& b : batches) {
    EXPECT_TRUE(std::has_single_bit(b.docs.size())) << b.docs.size();
    const int64_t B = static_cast<int64_t>(b.docs.size());
    EXPECT_LE(B * b.q_rows, std::max(bound(q_total), b.q_rows));
    EXPECT_LE(B * b.k_rows, std::max(bound(k_total), b.k_rows));
    for (size_t i : b.docs) {
      if (i >= q.size()) {
        ADD_FAILURE() << "document index " << i << " past " << q.size();
        continue;
      }
      ++seen[i];
      EXPECT_EQ(padded_rows(q[i], classes), b.q_rows);
      EXPECT_EQ(padded_rows(k[i], classes), b.k_rows);
      EXPECT_LE(q[i], b.q_rows);
      EXPECT_LE(k[i], b.k_rows);
    }
  }
  for (size_t i = 0; i < q.size(); ++i) EXPECT_EQ(seen[i], q[i] > 0 && k[i] > 0 ? 1 : 0) << "document " << i;
  return batches;
}

TEST(DocumentBatches, PairsGroupByBothPaddedSizes) {
  // Documents 1 and 4 lack keys or queries in this piece: left out (ops.cpp handles them).
  const std::vector<DocumentPairBatch> b =
      checked_pairs({100, 50, 300, 120, 0, 200, 90}, {1000, 0, 1000, 900, 40, 100, 1000});
  ASSERT_EQ(b.size(), 4u);
  EXPECT_EQ(b[0].q_rows, 128);
  EXPECT_EQ(b[0].k_rows, 1024);
  EXPECT_EQ(b[0].docs, (std::vector<size_t>{0, 3}));
  EXPECT_EQ(b[1].docs, std::vector<size_t>{6});
  EXPECT_EQ(b[2].q_rows, 256);
  EXPECT_EQ(b[2].k_rows, 128);
  EXPECT_EQ(b[3].q_rows, 384);
  EXPECT_EQ(b[3].k_rows, 1024);
}

TEST(DocumentBatches, PairsAreCappedOnTheTighterSide) {
  // 64 documents of 2 queries and 100 keys: 128 query rows in all (padded 128 each: one a batch),
  // 6,400 key rows.
  const std::vector<DocumentPairBatch> b = checked_pairs(std::vector<int64_t>(64, 2), std::vector<int64_t>(64, 100));
  ASSERT_EQ(b.size(), 64u);
  // 40 documents of 100 queries and 100 keys: 4,000 rows each side, 4,096 rounded, 32 a batch.
  const std::vector<DocumentPairBatch> c =
      checked_pairs(std::vector<int64_t>(40, 100), std::vector<int64_t>(40, 100));
  ASSERT_EQ(c.size(), 2u);
  EXPECT_EQ(c[0].docs.size(), 32u);
  EXPECT_EQ(c[1].docs.size(), 8u);
}

TEST(DocumentBatches, RandomPairsKeepTheInvariants) {
  std::mt19937_64 rng(11);
  std::lognormal_distribution<double> len(std::log(500.0), 1.5);
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<int64_t> q(1 + rng() % 200), k(q.size());
    for (size_t i = 0; i < q.size(); ++i) {
      q[i] = rng() % 5 == 0 ? 0 : static_cast<int64_t>(len(rng)) % 50000;
      k[i] = rng() % 5 == 0 ? 0 : static_cast<int64_t>(len(rng)) % 50000;
    }
    checked_pairs(q, k);
    checked_pairs(q, k, LengthClasses::octave);
  }
}

// Read in place, documents group by octave: powers of two, at least kMinPaddedRows, so fewer calls.
TEST(DocumentBatches, OctaveClassesArePowersOfTwo) {
  EXPECT_EQ(padded_rows(1, LengthClasses::octave), kMinPaddedRows);
  EXPECT_EQ(padded_rows(129, LengthClasses::octave), 256);
  EXPECT_EQ(padded_rows(300, LengthClasses::octave), 512);
  EXPECT_EQ(padded_rows(4096, LengthClasses::octave), 4096);
  EXPECT_EQ(padded_rows(66045, LengthClasses::octave), 131072);
  // 300, 260, 500 and 450 rows share one class (and one batch) there; fine classes split them
  // into 384 and 512.
  const std::vector<DocumentBatch> b = checked({300, 260, 500, 450, 70}, LengthClasses::octave);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_EQ(b[0].rows, 128);
  EXPECT_EQ(b[1].rows, 512);
  EXPECT_EQ(b[1].docs, (std::vector<size_t>{0, 1, 2, 3}));
  EXPECT_EQ(checked({300, 260, 500, 450, 70}).size(), 3u);
}

// The work the padded batches compute, which cp_ring balances: causal blocks at their padded rows,
// pairs apart as full rectangles, one call a batch.
TEST(DocumentBatches, PaddedWorkCountsPaddedPairsAndCalls) {
  // Same rows: 100 and 120 rows pad to 128 (one batch of two), 5,000 to 5,120 (a 32nd of 8,192
  // past 4,096 rows: 256-row steps): 2 * 128 * 129 / 2 + 5120 * 5121 / 2 pairs in two calls.
  const PaddedWork same = padded_work({100, 5000, 120}, {}, true);
  EXPECT_EQ(same.pairs, 2 * 128 * 129 / 2 + int64_t{5120} * 5121 / 2);
  EXPECT_EQ(same.calls, 2);
  // Apart: (100 queries, 300 keys) pads to (128, 384); (600, 40) to (640, 128); distinct pairs of
  // sizes, so a call each.
  const PaddedWork apart = padded_work({100, 600}, {300, 40}, false);
  EXPECT_EQ(apart.pairs, 128 * 384 + 640 * 128);
  EXPECT_EQ(apart.calls, 2);
  EXPECT_EQ(padded_work({}, {}, true).calls, 0);
  // Octave classes: each document computed at its rows rounded up to whole 128-row tiles (cuDNN
  // skips the tiles past its real rows), the calls fewer: 100 and 120 rows in one batch (128),
  // 5,000 in another (8,192), 5,000 rows computed as 5,120.
  const PaddedWork octave = padded_work({100, 5000, 120}, {}, true, LengthClasses::octave);
  EXPECT_EQ(octave.pairs, 2 * 128 * 129 / 2 + int64_t{5120} * 5121 / 2);
  EXPECT_EQ(octave.calls, 2);
  // 300 and 500 rows: one class (512), each computed at 384 and 512 rows; fine classes: two calls.
  EXPECT_EQ(padded_work({300, 500}, {}, true, LengthClasses::octave).calls, 1);
  EXPECT_EQ(padded_work({300, 500}, {}, true, LengthClasses::octave).pairs, 384 * 385 / 2 + 512 * 513 / 2);
  EXPECT_EQ(padded_work({300, 500}, {}, true).calls, 2);
  const PaddedWork octave_apart = padded_work({100, 600}, {300, 40}, false, LengthClasses::octave);
  EXPECT_EQ(octave_apart.pairs, 128 * 384 + 640 * 128);
  EXPECT_EQ(octave_apart.calls, 2);  // (128, 512) and (1024, 128)
  // Each call's key octaves above 512 rows: the 128-row call none, the 8,192-row call 4; apart,
  // keys of 512 and 128 rows none. 5,120 rows in fine classes count as ceil(log2) = 13: 4.
  EXPECT_EQ(octave.call_octaves, 4);
  EXPECT_EQ(octave_apart.call_octaves, 0);
  EXPECT_EQ(same.call_octaves, 4);
  EXPECT_EQ(call_octaves(513), 1);
  EXPECT_EQ(call_octaves(1024), 1);
  EXPECT_EQ(call_octaves(32768), 6);
  EXPECT_EQ(call_octaves(1), 0);
  // Query tiles: each document's computed query rows in 128-row tiles, whatever the batching. Same
  // rows, octave: 128 + 5,120 + 128 rows are 1 + 40 + 1; fine: the same. Apart, octave: 100 queries
  // computed as 128 (1), 600 as 640 (5); fine, 600 pads to 640 too.
  EXPECT_EQ(octave.query_tiles, 42);
  EXPECT_EQ(same.query_tiles, 42);
  EXPECT_EQ(octave_apart.query_tiles, 6);
  EXPECT_EQ(apart.query_tiles, 6);
  EXPECT_EQ(padded_work({300, 500}, {}, true, LengthClasses::octave).query_tiles, 3 + 4);
}

// What the SDK tells a plugin (lcx/attention_cost.h) is the work of the batches the GPU runs:
// documents read in place, in octave classes.
TEST(DocumentBatches, AttentionWorkIsTheInPlaceBatchesWork) {
  const std::vector<int64_t> q{100, 5000, 120, 300, 0, 70000}, k{300, 40, 120, 1000, 7, 65536};
  for (bool same : {true, false}) {
    SCOPED_TRACE(same ? "same rows" : "apart");
    const PaddedWork w = padded_work(q, k, same, LengthClasses::octave);
    const AttentionWork a = attention_work(q, k, same);
    EXPECT_EQ(a.pairs, w.pairs);
    EXPECT_EQ(a.calls, w.calls);
    EXPECT_EQ(a.call_octaves, w.call_octaves);
    EXPECT_EQ(a.query_tiles, w.query_tiles);
    EXPECT_NE(a.pairs, padded_work(q, k, same).pairs) << "fine classes compute the padding";
  }
  EXPECT_EQ(kAttentionTileRows, kMinPaddedRows);
}

// The bytes the SDK tells a plugin one attention call allocates are cuDNN's (kernels/cudnn_sizes.h):
// unmasked, its workspaces and dQ accumulator; masked, the batches' and the document tables.
TEST(DocumentBatches, AttentionCallBytesAreCudnnBuffers) {
  const int64_t hq = 4, T = 5000, d = 128;
  const AttentionBytes call = attention_call_bytes(hq, T, d);
  EXPECT_EQ(call.forward, 256);
  EXPECT_EQ(call.backward, 2 * hq * T * d * 4 + 256);
  EXPECT_EQ(call.step, 0);
  const AttentionBytes masked = attention_call_bytes(hq, T, d, true);
  EXPECT_EQ(masked.forward, cudnn_document_batch_bytes(false, hq, T, d));
  EXPECT_EQ(masked.forward, 8192 * hq * 4 + 256);
  EXPECT_EQ(masked.backward, cudnn_document_batch_bytes(true, hq, T, d));
  EXPECT_EQ(masked.step, document_table_bytes(T));
}

}  // namespace
}  // namespace lcx::ops
