// Loss by position: binning, CSV, SVG, entropy, and `lcx-train eval` / `eval-plot` on a tiny model.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "eval/position_loss.h"
#include "lcx/error.h"
#include "support/test_util.h"

namespace lcx {
namespace {

Tensor targets_of(const std::vector<int64_t>& t) {
  Tensor x = Tensor::empty({static_cast<int64_t>(t.size())}, DType::i64);
  std::copy(t.begin(), t.end(), x.data_as<int64_t>());
  return x;
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

TEST(PositionLoss, AveragesOverSequencesAndSkipsIgnoredTargets) {
  PositionLoss pl;
  pl.add({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, targets_of({1, 1, 1, 1, 1, 1, 1, 1, 1, -100}));
  pl.add({3, 2, 1, 0, 5, 6, 7, 8, 9, 10}, targets_of({1, 1, 1, 1, 1, 1, 1, 1, 1, -100}));
  auto bins = bin_positions(pl, 3);
  ASSERT_EQ(bins.size(), 3u);
  EXPECT_EQ(bins[0].start, 0);
  EXPECT_EQ(bins[0].end, 3);
  EXPECT_EQ(bins[1].start, 3);
  EXPECT_EQ(bins[1].end, 6);
  EXPECT_EQ(bins[2].start, 6);
  EXPECT_EQ(bins[2].end, 10);
  EXPECT_DOUBLE_EQ(bins[0].mean_loss, 2.0);               // (1+2+3+3+2+1)/6
  EXPECT_DOUBLE_EQ(bins[1].mean_loss, 26.0 / 6);          // (4+5+6+0+5+6)/6
  EXPECT_DOUBLE_EQ(bins[2].mean_loss, (7 + 8 + 9) / 3.0);  // position 9 is ignored
  EXPECT_EQ(bins[2].count, 6);
  EXPECT_TRUE(std::isnan(pl.mean(9, 10)));
  EXPECT_DOUBLE_EQ(pl.mean(0, 10), (45.0 + 41.0) / 18);
  EXPECT_THROW(pl.add({1, 2}, targets_of({1, 1})), Error);
  EXPECT_THROW(bin_positions(pl, 0), Error);
  // More bins than positions: one a position.
  EXPECT_EQ(bin_positions(pl, 50).size(), 10u);
}

TEST(PositionLoss, CsvRoundTrips) {
  RunCurve a{"base@2048", {{0, 4, 1.5, 8}, {4, 8, 2.25, 8}}};
  RunCurve b{"yarn", {{0, 4, std::nan(""), 0}}};
  const std::string ca = bins_csv(a);
  EXPECT_EQ(ca.substr(0, ca.find('\n')), "label,bin_start,bin_end,mean_loss,count");
  EXPECT_NE(ca.find("base@2048,4,8,2.250000,8"), std::string::npos) << ca;
  auto runs = parse_bins_csv(ca + bins_csv(b).substr(ca.find('\n') + 1));
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].label, "base@2048");
  ASSERT_EQ(runs[0].bins.size(), 2u);
  EXPECT_EQ(runs[0].bins[1].start, 4);
  EXPECT_DOUBLE_EQ(runs[0].bins[1].mean_loss, 2.25);
  EXPECT_EQ(runs[0].bins[1].count, 8);
  EXPECT_TRUE(std::isnan(runs[1].bins[0].mean_loss));
  EXPECT_THROW(bins_csv(RunCurve{"a,b", {}}), Error);
  EXPECT_THROW(parse_bins_csv("x,y\n1,2\n"), Error);
}

TEST(PositionLoss, EntropyOfKnownDistributions) {
  EXPECT_NEAR(unigram_entropy({5, 5, 5, 5}), std::log(4.0), 1e-12);
  EXPECT_NEAR(unigram_entropy({1, 0, 1, 2, 0}), -(0.5 * std::log(0.25) + 0.5 * std::log(0.5)), 1e-12);
  EXPECT_NEAR(unigram_entropy({7}), 0.0, 1e-12);
  EXPECT_TRUE(std::isnan(unigram_entropy({0, 0})));
}

TEST(PositionLoss, SvgHasOnePolylinePerRunAndTheEntropyLine) {
  std::vector<RunCurve> runs{{"no scaling", {{0, 10, 3.0, 4}, {10, 20, 9.5, 4}}},
                             {"yarn <8>", {{0, 10, 3.1, 4}, {10, 20, 3.2, 4}, {20, 30, std::nan(""), 0}}}};
  const std::string svg = loss_plot_svg(runs, 6.25, "t & t");
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
  EXPECT_EQ(count_of(svg, "<polyline"), 2u);
  EXPECT_EQ(count_of(svg, "<text"), count_of(svg, "</text>"));
  EXPECT_NE(svg.find("yarn &lt;8&gt;"), std::string::npos);
  EXPECT_NE(svg.find("t &amp; t"), std::string::npos);
  EXPECT_EQ(svg.find("yarn <8>"), std::string::npos);
  EXPECT_NE(svg.find("unigram entropy 6.25"), std::string::npos);
  EXPECT_EQ(count_of(svg, "stroke-dasharray"), 2u);  // the line and its legend sample
  // The NaN bin is left out: the second run has two points.
  const size_t p2 = svg.find("<polyline", svg.find("<polyline") + 1);
  const std::string pts = svg.substr(svg.find("points=\"", p2) + 8);
  EXPECT_EQ(count_of(pts.substr(0, pts.find('"')), ","), 2u);
  EXPECT_EQ(count_of(loss_plot_svg(runs, std::nan(""), "t"), "stroke-dasharray"), 0u);
  const std::string marked = loss_plot_svg(runs, std::nan(""), "t", 10, "trained <10>");
  EXPECT_EQ(count_of(marked, "stroke-dasharray=\"2,3\""), 1u);
  EXPECT_NE(marked.find("trained &lt;10&gt;"), std::string::npos);
  EXPECT_EQ(count_of(marked, "<text"), count_of(marked, "</text>"));
}

// `lcx-train eval` on a tiny model trained for a few steps: files, counts, the tokens used, the
// entropy of the data's targets, and two runs in one plot.
TEST(EvalCommand, WritesBinsTokensAndAPlotOfEveryRun) {
  if (!std::filesystem::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent";
  auto dir = test::temp_dir("eval");
  std::vector<uint32_t> tokens(32 * 12);
  std::mt19937 rng(5);
  for (auto& t : tokens) t = rng() % 256;
  {
    std::ofstream out(dir / "data.tokens", std::ios::binary);
    out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 4));
  }
  test::write_file(dir / "run.toml", test::tiny_run_manifest(dir / "out", dir / "data.tokens", 1, true, "max_steps = 3\n"));
  auto r = test::run_command(test::lcx_train() + " --config " + (dir / "run.toml").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;

  const std::string base = test::lcx_train() + " eval --config " + (dir / "run.toml").string() +
                           " --checkpoint latest --seq-len 64 --bins 8 --out " + (dir / "ev").string();
  r = test::run_command(base + " --label first --max-sequences 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream csv(dir / "ev" / "first.csv");
  std::stringstream cs;
  cs << csv.rdbuf();
  auto runs = parse_bins_csv(cs.str());
  ASSERT_EQ(runs.size(), 1u);
  ASSERT_EQ(runs[0].bins.size(), 8u);
  int64_t counted = 0;
  for (const auto& b : runs[0].bins) {
    counted += b.count;
    EXPECT_GT(b.mean_loss, 0.0);
    EXPECT_LT(b.mean_loss, 20.0);
  }
  EXPECT_EQ(counted, 2 * 63);  // the last position of each sequence has no target
  EXPECT_EQ(runs[0].bins.back().end, 64);

  // The token ids: the first two sequences of 64 of the file.
  std::ifstream tk(dir / "ev" / "first.tokens.csv");
  std::string line;
  std::getline(tk, line);
  EXPECT_EQ(line, "sequence,token_ids");
  for (int s = 0; s < 2; ++s) {
    ASSERT_TRUE(std::getline(tk, line));
    std::string want = std::to_string(s) + ",";
    for (int k = 0; k < 64; ++k) want += (k ? " " : "") + std::to_string(tokens[static_cast<size_t>(s * 64 + k)]);
    EXPECT_EQ(line, want);
  }

  // The entropy of the dataset's targets: every sequence of 64 without its first token.
  std::map<uint32_t, int64_t> freq;
  for (size_t s = 0; s + 64 <= tokens.size(); s += 64)
    for (size_t k = 1; k < 64; ++k) freq[tokens[s + k]]++;
  std::vector<int64_t> counts;
  for (const auto& [id, c] : freq) counts.push_back(c);
  std::ifstream mj(dir / "ev" / "first.json");
  auto meta = nlohmann::json::parse(mj);
  EXPECT_NEAR(meta.at("unigram_entropy_nats").get<double>(), unigram_entropy(counts), 1e-9);
  EXPECT_EQ(meta.at("sequences").get<int>(), 2);
  EXPECT_TRUE(std::isfinite(meta.at("mean_loss_last_10pct").get<double>()));
  // eval's own head + log-softmax against the Loss slot on the first sequence.
  const double slot_sum = meta.at("first_sequence_loss_slot_sum").get<double>();
  EXPECT_GT(slot_sum, 0.0);
  EXPECT_NEAR(meta.at("first_sequence_loss_sum").get<double>(), slot_sum, 1e-4 * slot_sum);

  r = test::run_command(base + " --label second --max-sequences 1");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream svg_in(dir / "ev" / "loss_by_position.svg");
  std::stringstream svg;
  svg << svg_in.rdbuf();
  EXPECT_EQ(svg.str().rfind("<svg", 0), 0u);
  EXPECT_EQ(count_of(svg.str(), "<polyline"), 2u);

  r = test::run_command(test::lcx_train() + " eval-plot --out " + (dir / "merged.svg").string() + " " +
                        (dir / "ev" / "first.csv").string() + " " + (dir / "ev" / "second.csv").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  std::ifstream merged_in(dir / "merged.svg");
  std::stringstream merged;
  merged << merged_in.rdbuf();
  EXPECT_EQ(count_of(merged.str(), "<polyline"), 2u);
  EXPECT_NE(merged.str().find("unigram entropy"), std::string::npos);  // from first.json

  r = test::run_command(base + " --model " + (dir / "out").string());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("exactly one of --checkpoint and --model"), std::string::npos) << r.output;
  std::filesystem::remove_all(dir);
}

// The plot marks the length the model was trained on (its config.json's max_position_embeddings,
// recorded in <label>.json), in eval's own SVG and in eval-plot's; eval-plot counts its runs in
// words ("1 run").
TEST(EvalCommand, PlotsMarkTheTrainedLengthAndCountRuns) {
  if (!std::filesystem::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent";
  auto dir = test::temp_dir("eval-mark");
  std::vector<uint32_t> tokens(32 * 12);
  std::mt19937 rng(7);
  for (auto& t : tokens) t = rng() % 256;
  {
    std::ofstream out(dir / "data.tokens", std::ios::binary);
    out.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(tokens.size() * 4));
  }
  std::string manifest = test::tiny_run_manifest(dir / "out", dir / "data.tokens", 1, true, "max_steps = 1\n");
  const std::string tied = "\"tie_word_embeddings\": true";
  manifest.replace(manifest.find(tied), tied.size(), tied + ", \"max_position_embeddings\": 48");
  test::write_file(dir / "run.toml", manifest);
  auto r = test::run_command(test::lcx_train() + " --config " + (dir / "run.toml").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  r = test::run_command(test::lcx_train() + " eval --config " + (dir / "run.toml").string() +
                        " --checkpoint latest --seq-len 64 --bins 8 --max-sequences 1 --label one --out " + (dir / "ev").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("one: 1 sequence of 64 tokens"), std::string::npos) << r.output;
  std::ifstream mj(dir / "ev" / "one.json");
  EXPECT_EQ(nlohmann::json::parse(mj).at("trained_positions").get<int64_t>(), 48);
  auto read = [](const std::filesystem::path& p) {
    std::ifstream in(p);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  for (const auto& svg : {dir / "ev" / "loss_by_position.svg", dir / "merged.svg"}) {
    if (svg.filename() == "merged.svg") {
      r = test::run_command(test::lcx_train() + " eval-plot --out " + svg.string() + " " + (dir / "ev" / "one.csv").string());
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_NE(r.output.find(": 1 run\n"), std::string::npos) << r.output;
    }
    const std::string text = read(svg);
    EXPECT_NE(text.find(">trained length</text>"), std::string::npos) << svg;
    EXPECT_NE(text.find("stroke-dasharray=\"2,3\""), std::string::npos) << svg;  // the dotted line at 48
  }
  r = test::run_command(test::lcx_train() + " eval-plot --out " + (dir / "two.svg").string() + " " +
                        (dir / "ev" / "one.csv").string() + " " + (dir / "ev" / "one.csv").string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(": 2 runs\n"), std::string::npos) << r.output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace lcx
