// `lcx-train tokenize`: prints the ids lcx's tokenizer gives a text (or only their number), so a
// user can check what the model will see. Ids are those of Hugging Face `tokenizers`. With --chat,
// a conversation .jsonl as training reads it: one line of ids per conversation, rendered by the
// chat template, with --mask a line of 0/1 after each, 1 where the token trains, and with --spans
// the text of the stretches that train.
#include <boost/program_options.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "app/cli.h"
#include "data/chat_data.h"
#include "data/tokenizer.h"
#include "data/utf8.h"
#include "lcx/error.h"
#include "util/file.h"

namespace po = boost::program_options;

namespace lcx {

namespace {

std::string joined(const auto& v) {
  std::string line;
  line.reserve(v.size() * 7);
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) line.push_back(' ');
    line += std::to_string(static_cast<int64_t>(v[i]));
  }
  line.push_back('\n');
  return line;
}

// The text of each run of trained tokens, special tokens kept, as one JSON array: what a user
// checks to see which words the loss is taken on.
std::string trained_spans(const Tokenizer& tok, const std::vector<int32_t>& ids, const std::vector<uint8_t>& mask) {
  nlohmann::json spans = nlohmann::json::array();
  for (size_t i = 0; i < ids.size();) {
    if (!mask[i]) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < ids.size() && mask[j]) ++j;
    spans.push_back(tok.decode(std::vector<int32_t>(ids.begin() + static_cast<std::ptrdiff_t>(i),
                                                    ids.begin() + static_cast<std::ptrdiff_t>(j))));
    i = j;
  }
  return spans.dump() + "\n";
}

// --chat: every conversation of `file`, in order; a line that is not one is named on stderr and
// makes the exit status 1.
int tokenize_chat(const Tokenizer& tok, const std::string& file, const std::string& tokenizer_config,
                  const std::string& kwargs, bool mask, bool spans, int threads) {
  const std::string all = read_file(file, "--chat", "give a .jsonl of conversations");
  ChatRenderer chat = ChatRenderer::load(tok.path(), tokenizer_config, kwargs.empty() ? "{}" : kwargs);
  std::vector<std::string_view> lines;
  std::vector<size_t> numbers;
  std::deque<std::string> repaired;  // lines whose invalid UTF-8 was replaced; views point into them
  std::string format = "chat";
  for (size_t at = 0, no = 1; at < all.size(); ++no) {
    size_t nl = all.find('\n', at);
    if (nl == std::string::npos) nl = all.size();
    std::string_view line(all.data() + at, nl - at);
    at = nl + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    if (utf8::first_invalid(line) != std::string_view::npos) {
      repaired.push_back(utf8::repair(line, nullptr));
      line = repaired.back();
    }
    if (lines.empty()) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && !j.contains("messages") && j.contains("prompt") && j.contains("completion"))
        format = "prompt_completion";
    }
    lines.push_back(line);
    numbers.push_back(no);
  }
  const LossOn loss_on = format == "chat" ? LossOn::assistant : LossOn::completion;
  auto enc = encode_conversations(chat, tok, lines, format, loss_on, threads);
  int status = 0;
  std::string out;
  for (size_t i = 0; i < enc.size(); ++i) {
    if (!enc[i].error.empty()) {
      std::fprintf(stderr, "%s:%zu: not a conversation: %s\n", file.c_str(), numbers[i], enc[i].error.c_str());
      status = 1;
      continue;
    }
    // A plain prompt and completion train the end-of-text the data writes after them, as TRL
    // appends it: shown here as training reads it.
    if (enc[i].eos_trains) {
      enc[i].ids.push_back(tok.eos_id());
      enc[i].mask.push_back(1);
    }
    out += joined(enc[i].ids);
    if (mask) out += joined(enc[i].mask);
    if (spans) out += trained_spans(tok, enc[i].ids, enc[i].mask);
  }
  std::fwrite(out.data(), 1, out.size(), stdout);
  return status;
}

// --file: read and encoded a block at a time, each block's ids printed as they come, so a file
// larger than memory is tokenized in memory near one block's.
int tokenize_file(const Tokenizer& tok, const std::string& file, bool count, int threads) {
  std::ifstream in = open_file(file, "--file", "give a readable text file");
  const uint64_t size = std::filesystem::file_size(file);
  constexpr uint64_t kLarge = uint64_t{64} << 20;
  const auto start = std::chrono::steady_clock::now();
  if (size >= kLarge) std::fprintf(stderr, "tokenizing %s: %llu MiB...\n", file.c_str(), static_cast<unsigned long long>(size >> 20));
  uint64_t tokens = 0;
  bool first = true;
  EncodeStats stats;
  tok.encode_stream(
      [&](char* buf, size_t n) {
        in.read(buf, static_cast<std::streamsize>(n));
        if (in.bad()) throw Error(str("--file: reading '", file, "' failed"), "--file", "give a readable text file");
        return static_cast<size_t>(in.gcount());
      },
      [&](std::vector<int32_t>&& ids) {
        tokens += ids.size();
        if (count || ids.empty()) return;
        std::string line = joined(ids);
        line.pop_back();  // one line for the whole file: the blocks joined by spaces
        if (!first) std::fputc(' ', stdout);
        std::fwrite(line.data(), 1, line.size(), stdout);
        first = false;
      },
      threads, &stats);
  if (size >= kLarge) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "tokenized %s: %llu tokens in %.1f s (%.1f MiB/s)\n", file.c_str(),
                 static_cast<unsigned long long>(tokens), s, static_cast<double>(size >> 20) / std::max(s, 1e-9));
  }
  if (stats.invalid_utf8 > 0)
    std::fprintf(stderr, "warning: %lld invalid UTF-8 sequences replaced by U+FFFD (as Python's errors='replace')\n",
                 static_cast<long long>(stats.invalid_utf8));
  if (count) std::printf("%llu\n", static_cast<unsigned long long>(tokens));
  else std::fputc('\n', stdout);
  return 0;
}

}  // namespace

int tokenize_main(int argc, char** argv) {
  std::string tokenizer, text, file, chat, tokenizer_config, kwargs;
  bool count = false, help = false, mask = false, spans = false;
  int threads = 0;
  po::options_description desc(
      "lcx-train tokenize: the token ids of a text\n\n"
      "Usage: lcx-train tokenize --tokenizer FILE (--text STRING | --file PATH) [--count]\n"
      "       lcx-train tokenize --tokenizer FILE --chat JSONL [--tokenizer-config FILE] [--kwargs JSON] [--mask] [--spans]\n\n"
      "Options");
  desc.add_options()
      ("tokenizer", po::value(&tokenizer)->value_name("FILE"), "a Hugging Face tokenizer.json")
      ("text", po::value(&text)->value_name("STRING"), "the text to tokenize")
      ("file", po::value(&file)->value_name("PATH"), "a file whose whole content is tokenized")
      ("count", po::bool_switch(&count), "print only the number of tokens")
      ("chat", po::value(&chat)->value_name("JSONL"),
       "conversations (`messages`, or `prompt` and `completion`), one per line: a line of ids for each")
      ("tokenizer-config", po::value(&tokenizer_config)->value_name("FILE"),
       "the chat template: a tokenizer_config.json or a Jinja file (default: the tokenizer_config.json beside "
       "--tokenizer)")
      ("kwargs", po::value(&kwargs)->value_name("JSON"),
       "the template's variables as a JSON object, e.g. '{\"enable_thinking\": false}'")
      ("mask", po::bool_switch(&mask), "after each line of ids, a line of 0/1: 1 where the token trains "
       "(the assistant's turns, or the completion and the end-of-text after it)")
      ("spans", po::bool_switch(&spans), "after each conversation, a JSON list of the texts of the stretches that train "
       "(special tokens shown)")
      ("threads", po::value(&threads)->value_name("N"), "encoding threads (default: all cores)")
      ("help,h", po::bool_switch(&help), "print this help");
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw Error(e.what(), {}, "see lcx-train tokenize --help");
  }
  if (help) {
    std::cout << desc;
    return 0;
  }
  if (tokenizer.empty()) throw Error("tokenize needs --tokenizer", "--tokenizer", "give the path of a tokenizer.json");
  if (vm.count("chat")) {
    if (vm.count("text") || vm.count("file") || count)
      throw Error("--chat reads conversations; --text, --file and --count are for plain text", "--chat",
                  "pass --chat JSONL alone, or --text/--file without it");
    return tokenize_chat(Tokenizer::load(tokenizer), chat, tokenizer_config, kwargs, mask, spans, threads);
  }
  if (mask || spans || vm.count("kwargs") || vm.count("tokenizer-config"))
    throw Error("--mask, --spans, --kwargs and --tokenizer-config go with --chat", "--chat", "add --chat JSONL");
  if (vm.count("text") == vm.count("file"))
    throw Error("tokenize needs exactly one of --text and --file", "--text", "pass --text STRING or --file PATH");
  Tokenizer tok = Tokenizer::load(tokenizer);
  if (!file.empty()) return tokenize_file(tok, file, count, threads);
  // A large file takes a while: say what is being done, and at what rate it went.
  constexpr size_t kLarge = size_t{64} << 20;
  const auto start = std::chrono::steady_clock::now();
  const std::string what = "--text";
  if (text.size() >= kLarge) std::fprintf(stderr, "tokenizing %s: %zu MiB...\n", what.c_str(), text.size() >> 20);
  EncodeStats stats;
  auto ids = tok.encode(text, threads, &stats);
  if (text.size() >= kLarge) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::fprintf(stderr, "tokenized %s: %zu tokens in %.1f s (%.1f MiB/s)\n", what.c_str(), ids.size(), s,
                 static_cast<double>(text.size() >> 20) / std::max(s, 1e-9));
  }
  if (stats.invalid_utf8 > 0)
    std::fprintf(stderr, "warning: %lld invalid UTF-8 sequences replaced by U+FFFD (as Python's errors='replace')\n",
                 static_cast<long long>(stats.invalid_utf8));
  if (count) {
    std::printf("%zu\n", ids.size());
    return 0;
  }
  std::string line;
  line.reserve(ids.size() * 7);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line.push_back(' ');
    line += std::to_string(ids[i]);
  }
  line.push_back('\n');
  std::fwrite(line.data(), 1, line.size(), stdout);
  return 0;
}

}  // namespace lcx
