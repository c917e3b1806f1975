// Evaluation during training ([eval], train/evaluate.h): its keys and refusals, its memory within
// the step's, and lcx-train runs read as a user would: the eval loss equals a hand computation of
// the mean over the targets the data's masks leave, on one rank and on thread-ranks cp 2, sp 2,
// cp 2 x sp 2 and dp 2 (x cp 2 x sp 2); its rows in metrics.jsonl and TensorBoard; every,
// max_sequences and at_start; a resume that adds no second row. And checkpoints that carry the
// chat model's files (tokenizer_config.json with the run's chat template, generation_config.json,
// special_tokens_map.json).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "config/core_config.h"
#include "data/dataset.h"
#include "lcx/memory.h"
#include "models/model_util.h"
#include "support/tfevents_reader.h"
#include "train/run.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;

// A tiny Qwen3 over the Qwen3 tokenizer's whole vocabulary, so held-out text tokenizes into ids it has.
constexpr const char* kInit =
    R"({"vocab_size": 151936, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "tie_word_embeddings": true})";
constexpr int kSeed = 3;

bool have_tokenizer() { return fs::exists(test::qwen3_tokenizer()); }

// The corpus of every run here: training tokens (a .tokens file) and held-out text of another
// format (.jsonl, six documents: packed and masked per document, each EOS's target ignored).
struct Corpus {
  fs::path dir, tokens, eval;
};
const Corpus& corpus() {
  static const Corpus c = [] {
    Corpus k;
    k.dir = test::temp_dir("eval-corpus");
    k.tokens = k.dir / "train.tokens";
    // One 40-token pattern repeated 12 times: 15 training sequences of 32.
    std::vector<uint32_t> pattern(40);
    for (size_t i = 0; i < pattern.size(); ++i) pattern[i] = static_cast<uint32_t>((i * 7919 + 13) % 5000);
    std::ofstream tokens(k.tokens, std::ios::binary);
    for (int r = 0; r < 12; ++r) tokens.write(reinterpret_cast<const char*>(pattern.data()), pattern.size() * 4);
    k.eval = k.dir / "heldout.jsonl";
    std::ofstream out(k.eval);
    const char* lines[] = {"In the beginning God created the heaven and the earth.",
                           "And the earth was without form, and void; and darkness was upon the face of the deep.",
                           "And God said, Let there be light: and there was light.",
                           "And God saw the light, that it was good: and God divided the light from the darkness.",
                           "And God called the light Day, and the darkness he called Night.",
                           "And the evening and the morning were the first day."};
    for (int r = 0; r < 2; ++r)
      for (const char* l : lines) out << nlohmann::json{{"text", l}}.dump() << "\n";
    return k;
  }();
  return c;
}

// The manifest of a run into `out`: `eval` is the [eval] table's body, `extra` whole tables after
// it, `data_extra` lines of [data]; `model` the [model] line of its weights, `tokenizer` its file.
struct Setting {
  std::string eval;
  int64_t max_steps = 1;
  std::string extra, data_extra;
  std::string model = str("init = '", kInit, "'");
  std::string tokenizer = test::qwen3_tokenizer();
  std::string eval_source = corpus().eval.string();
};
std::string manifest(const fs::path& out, const Setting& s) {
  return str("[run]\noutput_dir = \"", out.string(), "\"\nseed = ", kSeed, "\ndevice = \"cpu\"\n[model]\nmodule = \"qwen3\"\n",
             s.model, "\ndtype = \"fp32\"\n[data]\ntokenizer = \"", s.tokenizer, "\"\nsource = \"", corpus().tokens.string(),
             "\"\nseq_len = 32\ndrop_last = true\n", s.data_extra, "[eval]\nsource = \"", s.eval_source, "\"\n", s.eval,
             "[train]\nlr = 0.01\nmax_steps = ", s.max_steps, "\n", s.extra);
}

struct Rows {
  std::vector<nlohmann::json> steps, evals;  // in file order
  std::vector<std::string> kinds;            // "step" / "eval", in file order
  std::string output;                        // what lcx-train printed
};

Rows run(const fs::path& dir, const std::string& toml, const std::string& args = {}) {
  test::write_file(dir / "run.toml", toml);
  const test::CommandResult r = test::run_command(str(test::lcx_train(), " --config ", (dir / "run.toml").string(), " ", args));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  Rows rows;
  rows.output = r.output;
  std::ifstream in(dir / "out" / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    const bool eval = j.contains("eval_loss");
    (eval ? rows.evals : rows.steps).push_back(j);
    rows.kinds.push_back(eval ? "eval" : "step");
  }
  return rows;
}

std::vector<int64_t> steps_of(const std::vector<nlohmann::json>& rows) {
  std::vector<int64_t> s;
  for (const auto& r : rows) s.push_back(r.at("step").get<int64_t>());
  return s;
}

CoreConfig config_of(const std::string& toml) {
  const Manifest m = Manifest::parse(toml, "test manifest");
  return read_core_config(m, {"cp_ring", "sp_ulysses"});
}

// The mean loss over the first `n` eval sequences, by hand: the model's final hidden states (its
// forward through core's slots on one rank), the tied head's logits and their log-sum-exp in double,
// at every target the data did not mask.
struct Hand {
  double loss = 0;
  int64_t valid = 0;
};
Hand hand_loss(Model& model, const Dataset& data, int64_t n) {
  test::DefaultSlots s(model);
  const std::vector<float> head = model.head_weight().to_floats();
  const int64_t V = model.config().vocab_size, H = model.config().hidden_size;
  double sum = 0;
  Hand h;
  for (int64_t i = 0; i < n; ++i) {
    const Shard shard = s.parallel->shard(data.get(i), 0);
    const std::vector<float> hidden = forward_hidden(s.slots, shard, Device::cpu()).to_floats();
    const int64_t* target = shard.targets.data_as<int64_t>();
    for (int64_t t = 0; t < shard.targets.numel(); ++t) {
      if (target[t] == -100) continue;
      std::vector<double> logits(static_cast<size_t>(V));
      double top = -INFINITY;
      for (int64_t v = 0; v < V; ++v) {
        double z = 0;
        for (int64_t k = 0; k < H; ++k)
          z += static_cast<double>(hidden[static_cast<size_t>(t * H + k)]) * head[static_cast<size_t>(v * H + k)];
        logits[static_cast<size_t>(v)] = z;
        top = std::max(top, z);
      }
      double e = 0;
      for (double z : logits) e += std::exp(z - top);
      sum += top + std::log(e) - logits[static_cast<size_t>(target[t])];
      ++h.valid;
    }
  }
  h.loss = sum / static_cast<double>(h.valid);
  return h;
}

Dataset eval_dataset(const CoreConfig& cfg) {
  return Dataset::open(eval_data_config(cfg), Tokenizer::load(cfg.data.tokenizer), {.seed = kSeed, .progress = false});
}

TEST(EvalConfig, RefusesNegativeEveryAndMaxSequencesByKeyAndFix) {
  test::Thrown e = test::thrown_by([] { config_of("[eval]\nsource = \"x.jsonl\"\nevery = -1\n"); });
  EXPECT_EQ(e.key, "eval.every");
  EXPECT_EQ(e.fix, "0 turns evaluation during training off; 100 evaluates every 100 steps");
  e = test::thrown_by([] { config_of("[eval]\nsource = \"x.jsonl\"\nmax_sequences = -2\n"); });
  EXPECT_EQ(e.key, "eval.max_sequences");
  EXPECT_EQ(e.fix, "0 evaluates every sequence of eval.source");
  e = test::thrown_by([] { config_of("[eval]\nsource = \"x.jsonl\"\nmax_sequence = 2\n"); });
  EXPECT_EQ(e.key, "eval.max_sequence");  // a misspelt key is refused by name, as in every section
}

TEST(EvalConfig, RefusesAnEvaluationWithoutASource) {
  const char* fix = "set [eval] source to held-out data (any source [data] reads) or split to a share of [data] (0.01), "
                    "or leave every = 0 and at_start = false";
  test::Thrown e = test::thrown_by([] { config_of("[eval]\nevery = 10\n"); });
  EXPECT_EQ(e.key, "eval.every");
  EXPECT_EQ(e.fix, fix);
  e = test::thrown_by([] { config_of("[eval]\nat_start = true\n"); });
  EXPECT_EQ(e.key, "eval.at_start");
  EXPECT_EQ(e.fix, fix);
  EXPECT_FALSE(config_of("[eval]\nsource = \"x.jsonl\"\n").eval.enabled());  // a source alone evaluates nothing
  EXPECT_FALSE(config_of("").eval.enabled());
}

// eval.split holds out a share of [data] instead of naming held-out data; its combinations that
// cannot mean what they say are refused by name.
TEST(EvalConfig, SplitHoldsOutAShareOfTheTrainingData) {
  const CoreConfig c = config_of("[data]\nsource = \"train.jsonl\"\n[eval]\nsplit = 0.01\nevery = 50\n");
  EXPECT_TRUE(c.eval.enabled());
  EXPECT_EQ(eval_data_config(c).source, "train.jsonl");
  const std::pair<const char*, const char*> refused[] = {
      {"[eval]\nsplit = 0.01\nsource = \"x.jsonl\"\nevery = 5\n", "eval.split"},
      {"[eval]\nsplit = 0.01\n", "eval.split"},
      {"[eval]\nsplit = 1.0\nevery = 5\n", "eval.split"},
      {"[eval]\nsplit = -0.5\nevery = 5\n", "eval.split"}};
  for (const auto& [toml, key] : refused) EXPECT_EQ(test::thrown_by([&] { config_of(toml); }).key, key) << toml;
}

// [[data.sources]]: each table's path and weight (or fraction); what cannot be mixed is refused.
TEST(EvalConfig, DataSourcesAreReadAsTablesOfPathAndWeight) {
  const CoreConfig c = config_of("[[data.sources]]\npath = \"a.jsonl\"\nweight = 3\n[[data.sources]]\npath = \"b\"\nweight = 1\n");
  ASSERT_EQ(c.data.sources.size(), 2u);
  EXPECT_EQ(c.data.sources[0].path, "a.jsonl");
  EXPECT_EQ(c.data.sources[0].weight, 3);
  EXPECT_EQ(data_sources_text(c.data), "a.jsonl weight=3; b weight=1");
  const char* refused[] = {
      "[[data.sources]]\npath = \"a\"\n",                                      // neither weight nor fraction
      "[[data.sources]]\npath = \"a\"\nweight = 1\nfraction = 1\n",            // both
      "[[data.sources]]\npath = \"a\"\nweight = 0\n",                          // not > 0
      "[[data.sources]]\npath = \"a\"\nweight = 1\nwieght = 2\n",              // an unknown key
      "[[data.sources]]\npath = \"a\"\nweight = 1\n[[data.sources]]\npath = \"b\"\nfraction = 1\n",
      "[data]\nsource = \"c\"\n[[data.sources]]\npath = \"a\"\nweight = 1\n"};
  for (const char* toml : refused) EXPECT_EQ(test::thrown_by([&] { config_of(toml); }).key, "data.sources") << toml;
}

TEST(EvalConfig, ReadsEvalsSourceAsTheTrainingDataIsRead) {
  const CoreConfig c = config_of(
      "[data]\ntokenizer = \"/t/tokenizer.json\"\nsource = \"/d/train.jsonl\"\nformat = \"jsonl\"\ntext_field = \"body\"\n"
      "seq_len = 64\npad_to_multiple_of = 8\nshuffle = true\nattend_across_documents = true\n"
      "[eval]\nsource = \"/d/heldout.jsonl\"\nevery = 5\nmax_sequences = 7\nat_start = true\n");
  EXPECT_EQ(c.eval.every, 5);
  EXPECT_EQ(c.eval.max_sequences, 7);
  EXPECT_TRUE(c.eval.at_start);
  const DataConfig d = eval_data_config(c);
  EXPECT_EQ(d.source, "/d/heldout.jsonl");
  EXPECT_EQ(d.tokenizer, c.data.tokenizer);
  EXPECT_EQ(d.format, "jsonl");
  EXPECT_EQ(d.text_field, "body");
  EXPECT_EQ(d.seq_len, 64);
  EXPECT_EQ(d.pad_to_multiple_of, 8);
  EXPECT_TRUE(d.attend_across_documents);
  EXPECT_FALSE(d.shuffle) << "max_sequences takes the same sequences at every evaluation";
}

TEST(EvalConfig, RefusesASourceThatDoesNotExist) {
  if (!have_tokenizer()) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
  CoreConfig c;
  c.eval.source = "/nonexistent/heldout.jsonl";
  const test::Thrown e = test::thrown_by([&] { check_eval_source(c); });
  EXPECT_EQ(e.key, "eval.source");
  EXPECT_EQ(e.fix, "check the path, or remove [eval] source to train without evaluation");
  // lcx-train refuses it before the run folder gets its first byte.
  const auto dir = test::temp_dir("eval-missing");
  test::write_file(dir / "run.toml", manifest(dir / "out", {.eval = "every = 1\n", .eval_source = "/nonexistent/heldout.jsonl"}));
  const test::CommandResult r = test::run_command(str(test::lcx_train(), " --config ", (dir / "run.toml").string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("eval.source /nonexistent/heldout.jsonl does not exist"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "out" / "metrics.jsonl"));
}

// Evaluation adds no plan term: its forward keeps nothing for a backward, so at the step's
// sequence length it peaks below the step (here measured on the CPU allocator, the full-logits
// loss and loss_chunked both).
TEST(EvalMemory, ForwardOnlyPeaksBelowTheTrainingStep) {
  for (const std::string loss : {"nll", "loss_chunked"}) {
    auto model = test::make_qwen3();
    model->init_random(R"({"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": false})",
                       1, Device::cpu(), DType::f32);
    std::shared_ptr<Loss> chunked = loss == "nll" ? nullptr : test::make_plugin<Loss>("loss_chunked", "chunk_rows = 16");
    test::DefaultSlots s(*model);
    if (chunked) s.slots.loss = chunked.get();
    std::vector<int64_t> ids(256), labels(256);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = labels[i] = static_cast<int64_t>((i * 37) % 512);
    const Shard shard = test::shard_from_labels(ids, labels);
    Allocator& cpu = allocator_for(Device::cpu());
    auto peak_above_live = [&](const std::function<void()>& f) {
      cpu.reset_peak();
      const int64_t live = cpu.stats().live_bytes;
      f();
      return cpu.stats().peak_bytes - live;
    };
    model->zero_grad();
    const int64_t step = peak_above_live([&] { train_step(s.slots, shard, 1.0 / 255, Device::cpu()); });
    const int64_t eval = peak_above_live([&] { eval_step(s.slots, shard, Device::cpu()); });
    EXPECT_GT(eval, 0) << loss;
    EXPECT_LE(eval, step) << loss << ": the evaluation's forward needs memory beyond the step's peak";
  }
}

// One rank's run: at_start, every 2 steps, the first 3 of the held-out sequences, 4 steps, the
// final checkpoint; shared by the tests that compare with it.
struct OneRank {
  fs::path dir;
  Rows rows;
};
const OneRank& one_rank() {
  static const OneRank o = [] {
    OneRank r;
    r.dir = test::temp_dir("eval-one");
    r.rows = run(r.dir, manifest(r.dir / "out", {.eval = "every = 2\nmax_sequences = 3\nat_start = true\n", .max_steps = 4}));
    return r;
  }();
  return o;
}

TEST(EvalRun, LossIsTheHandComputedMeanOverTheTargetsTheMasksLeave) {
  if (!have_tokenizer()) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
  const OneRank& o = one_rank();
  ASSERT_EQ(steps_of(o.rows.evals), (std::vector<int64_t>{0, 2, 4}));
  ASSERT_EQ(steps_of(o.rows.steps), (std::vector<int64_t>{1, 2, 3, 4}));
  // Each evaluation's row follows its step's.
  EXPECT_EQ(o.rows.kinds, (std::vector<std::string>{"eval", "step", "step", "eval", "step", "step", "eval"}));
  const CoreConfig cfg = config_of(manifest(o.dir / "out", {}));
  const Dataset data = eval_dataset(cfg);
  ASSERT_GT(data.num_sequences(), 3);
  int64_t masked = 0, valid = 0;
  for (int64_t i = 0; i < 3; ++i) {
    valid += data.valid_labels(i);
    masked += data.length(i) - data.valid_labels(i);
  }
  ASSERT_GT(masked, 3) << "the held-out documents' EOS targets are masked, and more than the sequences' last";

  // Before the first step: the random init's loss; after step 4: the weights checkpoint-4 holds.
  auto init = test::make_qwen3();
  init->init_random(kInit, kSeed, Device::cpu(), DType::f32);
  auto trained = test::make_qwen3();
  trained->load_hf((o.dir / "out" / "checkpoint-4").string(), Device::cpu(), DType::f32);
  const std::pair<const nlohmann::json*, Model*> cases[] = {{&o.rows.evals[0], init.get()}, {&o.rows.evals[2], trained.get()}};
  for (const auto& [row, model] : cases) {
    const Hand want = hand_loss(*model, data, 3);
    EXPECT_EQ(want.valid, valid);
    EXPECT_EQ(row->at("eval_tokens").get<int64_t>(), valid);
    EXPECT_EQ(row->at("eval_sequences").get<int64_t>(), 3);
    EXPECT_GE(row->at("eval_s").get<double>(), 0);
    const double got = row->at("eval_loss").get<double>();
    EXPECT_LE(std::fabs(got - want.loss) / want.loss, 1e-6) << "step " << row->at("step") << ": lcx " << got << ", by hand " << want.loss;
  }
  EXPECT_NE(o.rows.evals[0].at("eval_loss"), o.rows.evals[2].at("eval_loss")) << "evaluated the starting weights again";

  // The step's log line carries it, and TensorBoard has it as eval/loss at the same steps.
  EXPECT_NE(o.rows.output.find("'eval_loss': "), std::string::npos) << o.rows.output;
  std::vector<fs::path> events;
  for (const auto& e : fs::directory_iterator(o.dir / "out"))
    if (e.path().filename().string().starts_with("events.out.tfevents.")) events.push_back(e.path());
  ASSERT_EQ(events.size(), 1u);
  std::vector<std::pair<int64_t, float>> tb;
  for (const auto& rec : test::read_records(events[0])) {
    auto e = test::decode(rec);
    if (!e.count(5)) continue;
    const int64_t step = e.count(2) ? static_cast<int64_t>(e.find(2)->second.varint) : 0;
    auto summary = test::decode(e.find(5)->second.bytes);
    for (auto [it, end] = summary.equal_range(1); it != end; ++it) {
      auto v = test::decode(it->second.bytes);
      EXPECT_NE(v.find(1)->second.bytes, "train/eval_loss");
      if (v.find(1)->second.bytes == "eval/loss") tb.emplace_back(step, test::as<float>(v.find(2)->second.bytes));
    }
  }
  ASSERT_EQ(tb.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(tb[i].first, o.rows.evals[i].at("step").get<int64_t>());
    EXPECT_EQ(tb[i].second, static_cast<float>(o.rows.evals[i].at("eval_loss").get<double>()));
  }
}

// The same runs over thread-ranks: under cp and sp each target is counted by the one rank whose
// shard holds it, so the eval loss and its count are one rank's (not cp times it, not a row per
// rank); dp ranks split the sequences (3 over 2: one rank repeats a pass that counts nothing, so
// ZeRO-3's gathers pair up), and dp 2 x cp 2 x sp 2 is dp 2's.
TEST(EvalRun, EqualOnOneRankAndUnderCpSpAndDp) {
  if (!have_tokenizer()) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
  const Rows& one = one_rank().rows;
  auto mesh = [](int dp, int cp, int sp) {
    const auto dir = test::temp_dir(str("eval-mesh", dp, cp, sp));
    std::string load = cp > 1 && sp > 1 ? "\"sp_ulysses\", \"cp_ring\"" : cp > 1 ? "\"cp_ring\"" : sp > 1 ? "\"sp_ulysses\"" : "";
    return run(dir, manifest(dir / "out", {.eval = "every = 2\nmax_sequences = 3\nat_start = true\n", .max_steps = 4,
                                           .extra = str("[plugins]\nload = [", load, "]\n[distributed]\nnproc_per_node = ",
                                                        dp * cp * sp, "\ncp = ", cp, "\nsp = ", sp, "\n")}));
  };
  auto same = [](const Rows& got, const Rows& want, size_t rows, const std::string& what) {
    ASSERT_EQ(steps_of(got.evals), steps_of(want.evals)) << what << ": one row per evaluation";
    for (size_t i = 0; i < rows; ++i) {
      const double g = got.evals[i].at("eval_loss").get<double>(), w = want.evals[i].at("eval_loss").get<double>();
      EXPECT_LE(std::fabs(g - w) / w, 1e-6) << what << ", step " << want.evals[i].at("step") << ": " << g << " vs " << w;
      EXPECT_EQ(got.evals[i].at("eval_tokens"), want.evals[i].at("eval_tokens")) << what;
      EXPECT_EQ(got.evals[i].at("eval_sequences"), want.evals[i].at("eval_sequences")) << what;
    }
  };
  same(mesh(1, 2, 1), one, 3, "cp 2");
  same(mesh(1, 1, 2), one, 3, "sp 2");
  same(mesh(1, 2, 2), one, 3, "cp 2 x sp 2");
  const Rows dp2 = mesh(2, 1, 1);
  same(dp2, one, 1, "dp 2 (before its first step, which trains on other sequences)");
  same(mesh(2, 2, 2), dp2, 3, "dp 2 x cp 2 x sp 2");
}

TEST(EvalRun, EveryMaxSequencesAndAtStart) {
  if (!have_tokenizer()) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
  const auto dir = test::temp_dir("eval-every");
  const Rows r = run(dir, manifest(dir / "out", {.eval = "every = 3\n", .max_steps = 7}));
  EXPECT_EQ(steps_of(r.evals), (std::vector<int64_t>{3, 6})) << "no row before the first step without at_start";
  EXPECT_EQ(steps_of(r.steps).size(), 7u);
  const Dataset data = eval_dataset(config_of(manifest(dir / "out", {})));
  int64_t valid = 0;
  for (int64_t i = 0; i < data.num_sequences(); ++i) valid += data.valid_labels(i);
  for (const auto& e : r.evals) {
    EXPECT_EQ(e.at("eval_sequences").get<int64_t>(), data.num_sequences()) << "max_sequences = 0 evaluates them all";
    EXPECT_EQ(e.at("eval_tokens").get<int64_t>(), valid);
  }
  // at_start alone: one evaluation, before the first step.
  const auto dir2 = test::temp_dir("eval-start");
  const Rows s = run(dir2, manifest(dir2 / "out", {.eval = "at_start = true\nmax_sequences = 100\n", .max_steps = 2}));
  EXPECT_EQ(steps_of(s.evals), (std::vector<int64_t>{0}));
  EXPECT_EQ(s.evals[0].at("eval_sequences").get<int64_t>(), data.num_sequences()) << "more asked than there are";
}

// A run resumed at a step whose evaluation is in metrics.jsonl evaluates there no second time,
// though it asks for at_start.
TEST(EvalRun, AResumeAddsNoSecondRowForTheStepItResumesAt) {
  if (!have_tokenizer()) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
  const auto dir = test::temp_dir("eval-resume");
  const std::string eval = "every = 2\nat_start = true\nmax_sequences = 2\n";
  run(dir, manifest(dir / "out", {.eval = eval, .max_steps = 2}));
  const Rows r = run(dir, manifest(dir / "out", {.eval = eval, .max_steps = 4}), "--resume latest");
  EXPECT_EQ(steps_of(r.evals), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(steps_of(r.steps), (std::vector<int64_t>{1, 2, 3, 4}));
}

// `lcx-train eval` on a manifest with [eval] source evaluates those sequences (held-out .jsonl
// here, the training data a .tokens file), read as the trainer reads them.
TEST(EvalCommand, ReadsEvalsSource) {
  if (!have_tokenizer()) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
  const OneRank& o = one_rank();
  test::write_file(o.dir / "eval.toml", manifest(o.dir / "out", {}));
  const test::CommandResult r = test::run_command(str(test::lcx_train(), " eval --config ", (o.dir / "eval.toml").string(),
                                                      " --checkpoint latest --seq-len 32 --max-sequences 2 --out ",
                                                      (o.dir / "curve").string(), " --label heldout"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const Dataset data = eval_dataset(config_of(manifest(o.dir / "out", {})));
  std::ifstream in(o.dir / "curve" / "heldout.tokens.csv");
  std::string header, first;
  std::getline(in, header);
  std::getline(in, first);
  std::string want = "0,";
  const Sequence s = data.get(0);
  for (int64_t k = 0; k < s.tokens.numel(); ++k) want += str(k ? " " : "", s.tokens.data_as<int32_t>()[k]);
  EXPECT_EQ(first, want);
}

// Checkpoints as transformers, vLLM and TRL read a chat model: the tokenizer's folder's files for a
// random init, the model folder's first where it has them, and the run's own chat template.
TEST(EvalCheckpoint, CarriesTheChatModelFilesAndTheRunsTemplate) {
  if (!have_tokenizer()) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
  auto read = [](const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  };
  const auto dir = test::temp_dir("eval-chat-files");
  const fs::path tok = dir / "tok";
  fs::create_directories(tok);
  fs::copy_file(test::qwen3_tokenizer(), tok / "tokenizer.json");
  const nlohmann::ordered_json tok_config = {{"add_bos_token", false},
                                             {"chat_template", "{{ messages[0]['content'] }}"},
                                             {"eos_token", "<|im_end|>"},
                                             {"model_max_length", 131072}};
  test::write_file(tok / "tokenizer_config.json", tok_config.dump(2));
  test::write_file(tok / "generation_config.json", R"({"eos_token_id": [151645, 151643], "from": "tokenizer folder"})");
  test::write_file(tok / "special_tokens_map.json", R"({"eos_token": "<|im_end|>"})");
  const std::string custom = "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}\n";
  test::write_file(dir / "custom.jinja", custom);
  const std::string own_template = str("chat_template = \"", (dir / "custom.jinja").string(), "\"\n");
  const std::string tokenizer = (tok / "tokenizer.json").string();

  // Random init, the run's own template.
  run(dir / "a", manifest(dir / "a" / "out", {.data_extra = own_template, .tokenizer = tokenizer}));
  const fs::path a = dir / "a" / "out" / "checkpoint-1";
  ASSERT_TRUE(fs::exists(a / "tokenizer_config.json"));
  const auto a_config = nlohmann::ordered_json::parse(read(a / "tokenizer_config.json"));
  EXPECT_EQ(a_config.at("chat_template").get<std::string>(), custom);
  nlohmann::ordered_json rest = a_config, want_rest = tok_config;
  rest.erase("chat_template");
  want_rest.erase("chat_template");
  EXPECT_EQ(rest, want_rest) << "the tokenizer's other settings, in their order";
  EXPECT_EQ(read(a / "generation_config.json"), read(tok / "generation_config.json"));
  EXPECT_EQ(read(a / "special_tokens_map.json"), read(tok / "special_tokens_map.json"));
  EXPECT_FALSE(fs::exists(a / "chat_template.jinja"));

  // From a model folder (that checkpoint, with files of its own) and another tokenizer: the
  // tokenizer's settings and template from the tokenizer's folder (they go with the tokenizer.json
  // copied, and are what the run rendered with), the model's own where the tokenizer has none, the
  // generation defaults the model's; byte for byte without a template of the run's.
  const fs::path model = dir / "model";
  fs::copy(a, model, fs::copy_options::recursive);
  fs::remove(model / "special_tokens_map.json");
  test::write_file(model / "tokenizer_config.json", R"({"chat_template": "the model folder's"})");
  test::write_file(model / "generation_config.json", R"({"eos_token_id": 151645, "from": "model folder"})");
  test::write_file(model / "chat_template.jinja", "{{ 'the model folder template' }}");
  const std::string from_model = str("path = \"", model.string(), "\"");
  run(dir / "b", manifest(dir / "b" / "out", {.model = from_model, .tokenizer = tokenizer}));
  const fs::path b = dir / "b" / "out" / "checkpoint-1";
  EXPECT_EQ(read(b / "generation_config.json"), read(model / "generation_config.json"));
  EXPECT_EQ(read(b / "tokenizer_config.json"), read(tok / "tokenizer_config.json"));
  EXPECT_EQ(read(b / "special_tokens_map.json"), read(tok / "special_tokens_map.json"));
  EXPECT_EQ(read(b / "chat_template.jinja"), "{{ 'the model folder template' }}");

  // With the run's template, chat_template.jinja (which transformers reads before the key) is it too.
  run(dir / "c", manifest(dir / "c" / "out", {.data_extra = own_template, .model = from_model, .tokenizer = tokenizer}));
  const fs::path c = dir / "c" / "out" / "checkpoint-1";
  EXPECT_EQ(read(c / "chat_template.jinja"), custom);
  EXPECT_EQ(nlohmann::json::parse(read(c / "tokenizer_config.json")).at("chat_template").get<std::string>(), custom);

  // A tokenizer_config.json as the run's template: its chat_template, the "default" of named ones.
  const std::string named = "{{ 'default template' }}";
  test::write_file(dir / "named" / "tokenizer_config.json",
                   nlohmann::json{{"chat_template", {{{"name", "tool_use"}, {"template", "{{ 'tools' }}"}},
                                                     {{"name", "default"}, {"template", named}}}}}
                       .dump());
  run(dir / "e", manifest(dir / "e" / "out", {.data_extra = str("chat_template = \"", (dir / "named" / "tokenizer_config.json").string(), "\"\n"),
                                              .tokenizer = tokenizer}));
  const auto e_config = nlohmann::ordered_json::parse(read(dir / "e" / "out" / "checkpoint-1" / "tokenizer_config.json"));
  EXPECT_EQ(e_config.at("chat_template").get<std::string>(), named);
  EXPECT_EQ(e_config.at("model_max_length").get<int64_t>(), 131072) << "the tokenizer's own settings kept";

  // A missing template file is refused before the run starts, by its key.
  test::write_file(dir / "d" / "run.toml",
                   manifest(dir / "d" / "out", {.data_extra = "chat_template = \"/nonexistent.jinja\"\n", .tokenizer = tokenizer}));
  const test::CommandResult r = test::run_command(str(test::lcx_train(), " --config ", (dir / "d" / "run.toml").string()));
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("data.chat_template /nonexistent.jinja is not a file"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace lcx
