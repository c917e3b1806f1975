// Tokenizing conversations against the same text as plain documents: a chat .jsonl is read into
// a token cache as training reads it (each line parsed, rendered by the chat template, its turns
// found, tokenized with offsets, the mask written beside the ids), and so is a .jsonl of the
// rendered texts under `text` (parsed and tokenized, no mask). Both are timed end to end through
// Dataset::open into a fresh cache folder, the median of --reps; the rate is tokens per second.
// The target is chat >= 0.8x plain on 16 threads. One JSON line on stdout.
//
//   scripts/gen_agent_transcripts.py --out /tmp/agent.jsonl --conversations 64 --tokens 100000
//   chat_tokenize_bench --chat /tmp/agent.jsonl --tokenizer data/qwen3/tokenizer.json --threads 16
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_util.h"
#include "data/chat_data.h"
#include "data/dataset.h"
#include "util/file.h"

namespace fs = std::filesystem;

namespace lcx {
namespace {

struct Options {
  std::string chat, tokenizer, work = "/tmp/chat_tokenize_bench";
  int threads = 0, reps = 3;
};

Options parse(int argc, char** argv) {
  Options o;
  bench::Args args("chat_tokenize_bench", argc, argv);
  while (args.next()) {
    const std::string& a = args.name();
    if (a == "--chat") o.chat = args.value();
    else if (a == "--tokenizer") o.tokenizer = args.value();
    else if (a == "--threads") o.threads = static_cast<int>(args.number());
    else if (a == "--reps") o.reps = static_cast<int>(args.number());
    else if (a == "--work") o.work = args.value();
    else args.unknown("options: --chat FILE --tokenizer FILE [--threads N] [--reps N] [--work DIR]");
  }
  if (o.chat.empty() || o.tokenizer.empty())
    throw Error("chat_tokenize_bench needs --chat and --tokenizer", {}, "see the file's opening comment");
  return o;
}

// The rendered text of each conversation, as a .jsonl of plain documents.
void write_plain(const Options& o, const Tokenizer& tok, const std::string& path) {
  const std::string all = read_file(o.chat, "--chat", "give a chat .jsonl");
  std::vector<std::string_view> lines;
  for (size_t at = 0; at < all.size();) {
    size_t nl = all.find('\n', at);
    if (nl == std::string::npos) nl = all.size();
    if (nl > at) lines.emplace_back(all.data() + at, nl - at);
    at = nl + 1;
  }
  ChatRenderer chat = ChatRenderer::load(tok.path(), "", "{}");
  std::string out;
  for (auto line : lines) {
    Conversation c;
    if (!parse_conversation(line, "chat", c).empty()) continue;
    out += nlohmann::json{{"text", chat.render(std::move(c), LossOn::all).text}}.dump() + "\n";
  }
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(out.data(), 1, out.size(), f) != out.size() || std::fclose(f) != 0)
    throw Error(str("cannot write ", path));
}

struct Timing {
  double seconds = 0;
  int64_t tokens = 0;
};

Timing time_open(const Options& o, const Tokenizer& tok, const std::string& source, const std::string& format) {
  std::vector<double> times;
  int64_t tokens = 0;
  for (int r = 0; r < o.reps; ++r) {
    DataConfig cfg;
    cfg.tokenizer = tok.path();
    cfg.source = source;
    cfg.format = format;
    cfg.seq_len = 2;
    cfg.shuffle = false;
    cfg.cache_dir = str(o.work, "/cache-", format, "-", r);
    fs::remove_all(cfg.cache_dir);
    const auto t0 = std::chrono::steady_clock::now();
    Dataset d = Dataset::open(cfg, tok, {.threads = o.threads, .progress = false});
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    tokens = d.report().tokens;
    fs::remove_all(cfg.cache_dir);
  }
  std::sort(times.begin(), times.end());
  return {times[times.size() / 2], tokens};
}

int run(int argc, char** argv) {
  const Options o = parse(argc, argv);
  fs::create_directories(o.work);
  Tokenizer tok = Tokenizer::load(o.tokenizer);
  const std::string plain = o.work + "/plain.jsonl";
  write_plain(o, tok, plain);
  const Timing chat = time_open(o, tok, o.chat, "chat"), text = time_open(o, tok, plain, "jsonl");
  const double chat_rate = static_cast<double>(chat.tokens) / chat.seconds;
  const double plain_rate = static_cast<double>(text.tokens) / text.seconds;
  std::printf(
      "{\"bench\": \"chat_tokenize\", \"threads\": %d, \"chat_tokens\": %lld, \"plain_tokens\": %lld, "
      "\"chat_s\": %.3f, \"plain_s\": %.3f, \"chat_tokens_per_s\": %.0f, \"plain_tokens_per_s\": %.0f, "
      "\"chat_over_plain\": %.3f}\n",
      o.threads, static_cast<long long>(chat.tokens), static_cast<long long>(text.tokens), chat.seconds, text.seconds,
      chat_rate, plain_rate, chat_rate / plain_rate);
  return 0;
}

}  // namespace
}  // namespace lcx

int main(int argc, char** argv) {
  try {
    return lcx::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
