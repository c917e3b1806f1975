// Data the way users have it, each case through the real lcx-train: a TRL user's compressed
// ShareGPT and .json files train; a file that is not what its name says is refused by name before
// any step; conversations packed whole (data.packing = "bfd"); and a step whose sequences hold no
// target that trains adds nothing, neither a NaN loss nor a stop.
#include <gtest/gtest.h>
#include <zlib.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "support/test_util.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

std::string gzip(const std::string& bytes) {
  z_stream z{};
  EXPECT_EQ(deflateInit2(&z, 6, Z_DEFLATED, 16 + MAX_WBITS, 8, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&z, bytes.size()) + 32, '\0');
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  z.avail_in = static_cast<uInt>(bytes.size());
  z.next_out = reinterpret_cast<Bytef*>(out.data());
  z.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&z, Z_FINISH), Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

// A ShareGPT conversation; `answer` empty: the user's turn alone, with nothing to train.
json sharegpt(const std::string& question, const std::string& answer) {
  json turns = json::array({{{"from", "system"}, {"value", "You answer briefly."}}, {{"from", "human"}, {"value", question}}});
  if (!answer.empty()) turns.push_back({{"from", "gpt"}, {"value", answer}});
  return {{"conversations", turns}};
}

std::string words(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += " lorem";
  return s;
}

// The same in transformers' `messages` form.
json messages(const std::string& question, const std::string& answer) {
  json m = json::array({{{"role", "system"}, {"content", "You answer briefly."}}, {{"role", "user"}, {"content", question}}});
  if (!answer.empty()) m.push_back({{"role", "assistant"}, {"content", answer}});
  return {{"messages", m}};
}

struct DataRun : ::testing::Test {
  fs::path dir = test::temp_dir("e2e-data");

  void SetUp() override {
    const fs::path config = fs::path(test::qwen3_tokenizer()).parent_path() / "tokenizer_config.json";
    if (!fs::exists(config)) GTEST_SKIP() << "data/qwen3/ absent: run scripts/fetch_data.sh";
  }

  // The tiny model of test_util with Qwen3's vocabulary (conversations use all of it), on `source`.
  std::string manifest(const fs::path& source, const std::string& data_keys, const std::string& train = "max_steps = 2\n",
                       const std::string& tables = {}) {
    std::string text = test::tiny_run_manifest(dir / "out", source, 1, true, train, tables);
    const std::string vocab = "\"vocab_size\": 256";
    text.replace(text.find(vocab), vocab.size(), "\"vocab_size\": 151936");
    const std::string at = "seq_len = 32\ndrop_last = true\n";
    text.replace(text.find(at), at.size(), data_keys);
    test::write_file(dir / "run.toml", text);
    return (dir / "run.toml").string();
  }

  test::CommandResult lcx(const std::string& args) { return test::run_command(test::lcx_train() + " " + args); }

  std::vector<json> metrics() {
    std::vector<json> rows;
    std::ifstream in(dir / "out" / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      json j = json::parse(line, nullptr, false);
      if (j.is_object() && j.contains("loss")) rows.push_back(j);
    }
    return rows;
  }
};

TEST_F(DataRun, CompressedShareGptAndJsonListsTrain) {
  std::string lines;
  for (int i = 0; i < 8; ++i) lines += sharegpt("What is " + std::to_string(i) + " + 1?", std::to_string(i + 1) + ".").dump() + "\n";
  test::write_file(dir / "chat.jsonl.gz", gzip(lines));
  auto r = lcx("--config " + manifest(dir / "chat.jsonl.gz", "seq_len = 64\n"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "first record has ShareGPT's `conversations` field")) << r.output;
  EXPECT_TRUE(has(r.output, "data: 1 file, 8 conversations")) << r.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-2")) << r.output;

  // TRL's prompt-completion records as a .json list, the prompt's content as parts.
  json list = json::array();
  for (int i = 0; i < 8; ++i)
    list.push_back({{"prompt", {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Count to " + std::to_string(i)}}}}}}},
                    {"completion", {{{"role", "assistant"}, {"content", "1 2 3"}}}}});
  test::write_file(dir / "pc.json", json{{"train", list}}.dump());
  auto pc = lcx("--config " + manifest(dir / "pc.json", "seq_len = 64\n") + " --overwrite");
  ASSERT_EQ(pc.exit_code, 0) << pc.output;
  EXPECT_TRUE(has(pc.output, "data: 1 file, 8 conversations")) << pc.output;
  EXPECT_TRUE(has(pc.output, "prompt_completion")) << pc.output;
}

TEST_F(DataRun, AFileThatIsNotWhatItsNameSaysIsNeverTrainedOn) {
  // A .jsonl.gz that was never compressed, compressed bytes under a plain name, and a name lcx
  // does not read: each refused, naming the file, before the run folder holds a checkpoint.
  const std::string lines = sharegpt("Hi", "Hello").dump() + "\n";
  test::write_file(dir / "plain.jsonl.gz", lines);
  test::write_file(dir / "packed.jsonl", gzip(lines));
  test::write_file(dir / "ids.bin", std::string(64, '\x01'));
  const std::pair<std::string, std::string> cases[] = {{"plain.jsonl.gz", "does not start with gzip's header"},
                                                       {"packed.jsonl", "holds gzip data under a name without .gz"},
                                                       {"ids.bin", "is not a kind of file lcx reads"}};
  for (const auto& [name, says] : cases) {
    auto r = lcx("--config " + manifest(dir / name, "seq_len = 64\n") + " --overwrite");
    EXPECT_EQ(r.exit_code, 2) << name << "\n" << r.output;
    EXPECT_TRUE(has(r.output, (dir / name).string())) << name << "\n" << r.output;
    EXPECT_TRUE(has(r.output, says)) << name << "\n" << r.output;
    EXPECT_FALSE(fs::exists(dir / "out" / "checkpoint-2")) << name;
  }
}

TEST_F(DataRun, BestFitKeepsConversationsWhole) {
  std::string lines;
  for (int i = 0; i < 12; ++i)
    lines += sharegpt("Tell me about the number " + std::to_string(i) + std::string(static_cast<size_t>(i % 5) * 12, '!'),
                      "It is " + std::to_string(i) + ", a fine number" + std::string(static_cast<size_t>(i % 3) * 9, '.'))
                 .dump() +
             "\n";
  test::write_file(dir / "chat.jsonl", lines);
  auto stream = lcx("--config " + manifest(dir / "chat.jsonl", "seq_len = 128\n", "max_steps = 1\n"));
  ASSERT_EQ(stream.exit_code, 0) << stream.output;
  EXPECT_TRUE(has(stream.output, "continue into the next sequence")) << stream.output;
  auto bfd = lcx("--config " + manifest(dir / "chat.jsonl", "seq_len = 128\npacking = \"bfd\"\n", "max_steps = 1\n") +
                 " --overwrite");
  ASSERT_EQ(bfd.exit_code, 0) << bfd.output;
  EXPECT_TRUE(has(bfd.output, "packed best-fit (")) << bfd.output;
  EXPECT_FALSE(has(bfd.output, "continue into the next sequence")) << bfd.output;
  // A resumed run keeps the packing it was trained with.
  auto other = lcx("--config " + manifest(dir / "chat.jsonl", "seq_len = 128\n", "max_steps = 2\n") + " --resume latest");
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_TRUE(has(other.output, "data.packing is \"stream\" but the checkpoint was trained with \"bfd\"")) << other.output;
}

// Best-fit sequences are shorter than seq_len and end in padding that is a document of its own:
// cut over cp_ring's two ranks they train as on one rank, and a length cp_ring cannot cut evenly is
// refused before the first step, with pad_to_multiple_of as the fix.
TEST_F(DataRun, BestFitUnderCpRingTrainsAsOneRank) {
  std::ofstream out(dir / "docs.tokens", std::ios::binary);
  uint32_t x = 17;
  for (int i = 0; i < 32 * 24; ++i) {
    x = x * 1103515245u + 12345u;
    const uint32_t t = (x >> 16) % 9 == 0 ? 151643u : (x >> 8) % 256;  // <|endoftext|> closes a document
    out.write(reinterpret_cast<const char*>(&t), 4);
  }
  out.close();
  const std::string keys = "seq_len = 32\npacking = \"bfd\"\npad_to_multiple_of = 4\n";
  const std::string cp2 = "[plugins]\nload = [\"cp_ring\"]\n[distributed]\nnproc_per_node = 2\ncp = 2\n";
  auto one = lcx("--config " + manifest(dir / "docs.tokens", keys, "max_steps = 3\n"));
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_TRUE(has(one.output, "packed best-fit (")) << one.output;
  const auto single = metrics();
  auto two = lcx("--config " + manifest(dir / "docs.tokens", keys, "max_steps = 3\n", cp2) + " --overwrite");
  ASSERT_EQ(two.exit_code, 0) << two.output;
  const auto ring = metrics();
  ASSERT_EQ(single.size(), 3u);
  ASSERT_EQ(ring.size(), 3u);
  for (size_t i = 0; i < 3; ++i)
    EXPECT_NEAR(ring[i]["loss"].get<double>(), single[i]["loss"].get<double>(), 1e-5 * single[i]["loss"].get<double>()) << i;
  auto odd = lcx("--config " + manifest(dir / "docs.tokens", "seq_len = 32\npacking = \"bfd\"\n", "max_steps = 3\n", cp2) +
                 " --overwrite");
  EXPECT_EQ(odd.exit_code, 2) << odd.output;
  EXPECT_TRUE(has(odd.output, "data.pad_to_multiple_of")) << odd.output;
}

// Two sources by weight, a held-out share evaluated, and the mixture kept on resume.
TEST_F(DataRun, WeightedSourcesAndAHeldOutShare) {
  std::string a, b;
  for (int i = 0; i < 24; ++i) a += json{{"text", "The first source, line " + std::to_string(i) + "." + words(8)}}.dump() + "\n";
  for (int i = 0; i < 8; ++i) b += json{{"text", "Another source entirely, " + std::to_string(i) + "." + words(4)}}.dump() + "\n";
  test::write_file(dir / "a" / "a.jsonl", a);
  test::write_file(dir / "b.jsonl.gz", gzip(b));
  std::string m = manifest(dir / "unused", "seq_len = 32\npacking = \"bfd\"\n", "max_steps = 3\nsave_steps = 2\n");
  std::string text;
  {
    std::ifstream in(m);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string src = "source = \"" + (dir / "unused").string() + "\"\n";
  text.replace(text.find(src), src.size(), "");
  text += "[eval]\nsplit = 0.25\nevery = 2\n[[data.sources]]\npath = \"" + (dir / "a").string() +
          "\"\nweight = 1\n[[data.sources]]\npath = \"" + (dir / "b.jsonl.gz").string() + "\"\nweight = 1\n";
  test::write_file(m, text);
  auto r = lcx("--config " + m);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "2 sources mixed -> ")) << r.output;
  EXPECT_TRUE(has(r.output, "held out for evaluation (eval.split), not trained on")) << r.output;
  EXPECT_TRUE(has(r.output, "held out of [[data.sources]] (eval.split = 0.25)")) << r.output;
  std::ifstream in(dir / "out" / "metrics.jsonl");
  int evals = 0;
  for (std::string line; std::getline(in, line);) evals += has(line, "\"eval_loss\"");
  EXPECT_GE(evals, 1);
  // Resumed from step 2, step 3 reads what the first run's step 3 read: the same loss.
  const double loss3 = metrics().back()["loss"].get<double>();
  fs::remove_all(dir / "out" / "checkpoint-3");
  fs::remove(dir / "out" / "metrics.jsonl");
  auto resumed = lcx("--config " + m + " --resume latest");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_DOUBLE_EQ(metrics().back()["loss"].get<double>(), loss3);
}

// GPT-OSS's harmony conversations (gpt-oss-20b's chat_template.jinja, its tokenizer) train the tiny
// model with loss_on = "assistant": only the assistant messages' tokens are targets (the kept
// reasoning, the tool calls, the answers), as many as `lcx-train tokenize --mask` marks. The model
// is the tiny Qwen3 with GPT-OSS's vocabulary: what is under test is the data, not the family.
TEST_F(DataRun, GptOssHarmonyConversationsTrainTheAssistantsMessages) {
  const fs::path tok = fs::path(LCX_SOURCE_DIR) / "data" / "gptoss" / "tokenizer.json";
  if (!fs::exists(tok)) GTEST_SKIP() << "data/gptoss/ absent: run scripts/fetch_data.sh";
  const fs::path tmpl = fs::path(LCX_SOURCE_DIR) / "tests/data/fixtures/chat/templates/gptoss.jinja";
  const json tools = json::array({{{"type", "function"},
                                   {"function", {{"name", "add"}, {"description", "Adds two numbers."},
                                                 {"parameters", {{"type", "object"},
                                                                 {"properties", {{"a", {{"type", "number"}}}, {"b", {{"type", "number"}}}}},
                                                                 {"required", {"a", "b"}}}}}}}});
  std::string lines;
  for (int i = 0; i < 4; ++i) {
    const std::string a = std::to_string(i), b = std::to_string(i + 2), sum = std::to_string(2 * i + 2);
    json call = {{"type", "function"}, {"function", {{"name", "add"}, {"arguments", {{"a", i}, {"b", i + 2}}}}}};
    json m = json::array({{{"role", "developer"}, {"content", "Use the tool for sums."}},
                          {{"role", "user"}, {"content", "What is " + a + " + " + b + "?"}},
                          {{"role", "assistant"}, {"thinking", "Call add."}, {"tool_calls", json::array({call})}},
                          {{"role", "tool"}, {"content", sum}},
                          {{"role", "assistant"}, {"thinking", "The tool says " + sum + "."}, {"content", sum + "."}}});
    lines += json{{"messages", m}, {"tools", tools}}.dump() + "\n";
  }
  test::write_file(dir / "chat.jsonl", lines);
  std::string m = manifest(dir / "chat.jsonl", "seq_len = 512\npacking = \"bfd\"\nchat_template = \"" + tmpl.string() + "\"\n",
                           "max_steps = 2\n");
  std::string text;
  {
    std::ifstream in(m);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string vocab = "\"vocab_size\": 151936", qwen = "tokenizer = \"" + test::qwen3_tokenizer() + "\"";
  text.replace(text.find(vocab), vocab.size(), "\"vocab_size\": 201088");
  text.replace(text.find(qwen), qwen.size(), "tokenizer = \"" + tok.string() + "\"");
  test::write_file(m, text);
  auto r = lcx("--config " + m);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "data: 1 file, 4 conversations")) << r.output;
  // Best-fit packs the four conversations whole, two to a sequence of 512: the two steps see each once.
  const auto rows = metrics();
  ASSERT_EQ(rows.size(), 2u);
  int64_t targets = 0;
  for (const json& row : rows) {
    EXPECT_TRUE(std::isfinite(row["loss"].get<double>())) << row.dump();
    targets += row["valid_targets"].get<int64_t>();
  }

  auto t = lcx("tokenize --tokenizer " + tok.string() + " --chat " + (dir / "chat.jsonl").string() +
               " --tokenizer-config " + tmpl.string() + " --mask");
  ASSERT_EQ(t.exit_code, 0) << t.output;
  std::istringstream in(t.output);
  int64_t tokens = 0, trained = 0, k = 0;
  for (std::string line; std::getline(in, line); ++k) {
    std::istringstream nums(line);
    for (int64_t x; nums >> x;) (k % 2 ? trained : tokens) += k % 2 ? x : 1;
  }
  ASSERT_GT(trained, 0);
  EXPECT_LT(trained, tokens / 4);
  // The targets are the marked tokens (a label is the token itself, shifted onto the one before).
  EXPECT_EQ(targets, trained) << r.output;
}

// Sequences whose labels are all -100 (conversations of a system prompt and a user turn only, cut
// into sequences of their own) make steps with nothing to train: each adds nothing, no loss is
// NaN, the run is not stopped as diverged, and it saves its checkpoint.
TEST_F(DataRun, AStepWithNoTrainedTargetAddsNothingAndNeverStopsTheRun) {
  std::string lines = messages("Hi", "Hello there.").dump() + "\n";
  for (int i = 0; i < 6; ++i)
    lines += messages("Please read this long question number " + std::to_string(i) + " and think hard about it:" + words(40), "")
                 .dump() +
             "\n";
  test::write_file(dir / "chat.jsonl", lines);
  auto r = lcx("--config " + manifest(dir / "chat.jsonl", "seq_len = 32\nshuffle = false\n", "max_steps = 6\n"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_FALSE(has(r.output, "non-finite")) << r.output;
  EXPECT_TRUE(has(r.output, "no target of its sequences trains")) << r.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-6")) << r.output;
  const auto rows = metrics();
  ASSERT_EQ(rows.size(), 6u);
  int untrained = 0;
  for (const json& row : rows) {
    ASSERT_TRUE(row["loss"].is_number()) << row.dump();
    EXPECT_TRUE(std::isfinite(row["loss"].get<double>())) << row.dump();
    if (row["valid_targets"] == 0) {
      ++untrained;
      EXPECT_EQ(row["loss"].get<double>(), 0.0) << row.dump();
      EXPECT_TRUE(row["skipped"].get<bool>()) << row.dump();
    }
  }
  EXPECT_GE(untrained, 3);
  EXPECT_TRUE(rows[0]["valid_targets"].get<int64_t>() > 0) << rows[0].dump();
}

}  // namespace
}  // namespace lcx
