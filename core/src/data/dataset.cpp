#include "data/dataset.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <deque>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/chat_data.h"
#include "data/token_cache.h"
#include "data/utf8.h"
#include "lcx/error.h"
#include "lcx/log.h"
#include "util/sha256.h"

namespace fs = std::filesystem;

namespace lcx {

struct Dataset::State {
  DataConfig cfg;
  int64_t seed = 0;
  int32_t eos = 0;
  std::shared_ptr<MappedFile> file;  // keeps `tokens` and `doc_starts` mapped
  const uint32_t* tokens = nullptr;
  int64_t num_tokens = 0;
  const uint64_t* doc_starts = nullptr;
  int64_t num_docs = 0;
  const uint8_t* mask = nullptr;  // 1 where a token trains; null: all do
  std::vector<uint64_t> own_doc_starts;  // for a pre-tokenized source, found by scanning for EOS
  int64_t num_sequences = 0;
  int64_t last_real = 0;    // tokens in the final sequence before padding
  int64_t last_length = 0;  // its padded length
  DataReport report;

  mutable std::mutex perm_mu;
  mutable int64_t perm_epoch = -1;
  mutable std::vector<int64_t> perm;

  int64_t real_length(int64_t i) const { return i + 1 == num_sequences ? last_real : cfg.seq_len; }
  // Documents starting inside sequence i after its first token: [first, last) of doc_starts.
  std::pair<const uint64_t*, const uint64_t*> starts_inside(int64_t i) const {
    const uint64_t a = static_cast<uint64_t>(i * cfg.seq_len);
    const uint64_t* e = doc_starts + num_docs;
    return {std::upper_bound(doc_starts, e, a), std::lower_bound(doc_starts, e, a + static_cast<uint64_t>(real_length(i)))};
  }
};

namespace {

using json = nlohmann::json;

struct SourceFile {
  fs::path path;
  std::string rel;
  uint64_t size = 0;
  int64_t mtime = 0;
  // An edit that keeps size and mtime (a restored timestamp) still changes these.
  int64_t ctime_ns = 0;
  uint64_t inode = 0;
};

void read_identity(SourceFile& f) {
  struct stat st {};
  if (::stat(f.path.c_str(), &st) != 0) return;
  f.ctime_ns = static_cast<int64_t>(st.st_ctim.tv_sec) * 1000000000 + st.st_ctim.tv_nsec;
  f.inode = static_cast<uint64_t>(st.st_ino);
}

std::string ext_of(const fs::path& p) {
  std::string e = p.extension().string();
  std::transform(e.begin(), e.end(), e.begin(), [](unsigned char c) { return std::tolower(c); });
  return e;
}

void note(int64_t& count, std::string& first, const std::string& where) {
  if (count++ == 0) first = where;
}

// Every file with one of `exts` under `dir`, sorted by relative path; names starting with '.'
// (the cache folder among them) are skipped. Folders that cannot be listed count as unreadable.
void walk(const fs::path& dir, const fs::path& root, const std::vector<std::string>& exts,
          std::vector<SourceFile>& out, DataReport& r) {
  std::error_code ec;
  fs::directory_iterator it(dir, ec), end;
  if (ec) {
    note(r.unreadable, r.first_unreadable, dir.string());
    return;
  }
  for (; it != end; it.increment(ec)) {
    if (ec) {
      note(r.unreadable, r.first_unreadable, dir.string());
      return;
    }
    const fs::path& p = it->path();
    if (p.filename().string().rfind('.', 0) == 0) continue;
    std::error_code e2;
    if (it->is_directory(e2)) {
      walk(p, root, exts, out, r);
    } else if (std::find(exts.begin(), exts.end(), ext_of(p)) != exts.end()) {
      SourceFile f;
      f.path = p;
      f.rel = fs::relative(p, root, e2).generic_string();
      f.size = it->file_size(e2);
      if (e2) {
        note(r.unreadable, r.first_unreadable, p.string());
        continue;
      }
      f.mtime = static_cast<int64_t>(fs::last_write_time(p, e2).time_since_epoch().count());
      read_identity(f);
      out.push_back(std::move(f));
    }
  }
}

bool is_chat_format(const std::string& format) { return format == "chat" || format == "prompt_completion"; }

// A .jsonl read with format auto: conversations when its first line has `messages` (or `prompt`
// and `completion`), as TRL tells its dataset types apart; said in the log.
std::string jsonl_kind(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  std::string line;
  while (std::getline(in, line))
    if (line.find_first_not_of(" \t\r") != std::string::npos) break;
  json j = json::parse(line, nullptr, false);
  std::string kind = "jsonl";
  if (j.is_object() && j.contains("messages")) kind = "chat";
  else if (j.is_object() && j.contains("prompt") && j.contains("completion")) kind = "prompt_completion";
  if (kind != "jsonl")
    log::info(str("data: ", file.string(), "'s first line has ", kind == "chat" ? "a `messages` field" : "`prompt` and `completion`",
                  ": reading conversations (data.format = \"", kind, "\")"));
  return kind;
}

std::string resolve_format(const DataConfig& cfg) {
  fs::path src(cfg.source);
  if (cfg.format != "auto") return cfg.format;
  if (fs::is_directory(src)) {
    std::vector<SourceFile> txt, jsonl;
    DataReport scratch;
    walk(src, src, {".txt"}, txt, scratch);
    if (!txt.empty()) return "txt";
    walk(src, src, {".jsonl"}, jsonl, scratch);
    if (!jsonl.empty()) {
      std::sort(jsonl.begin(), jsonl.end(), [](const SourceFile& a, const SourceFile& b) { return a.rel < b.rel; });
      return jsonl_kind(jsonl.front().path);
    }
    throw Error(str("data.source ", cfg.source, " holds no .txt or .jsonl file"), "data.source",
                "point it at a folder of .txt files, a .jsonl file or a .tokens file, or set data.format");
  }
  std::string e = ext_of(src);
  if (e == ".jsonl") return jsonl_kind(src);
  if (e == ".tokens" || e == ".bin") return "tokens";
  return "txt";
}

// data.loss_on for `format`: auto resolved, combinations that train nothing meant refused.
LossOn resolve_loss_on(const DataConfig& cfg, const std::string& format) {
  const std::string& l = cfg.loss_on;
  if (format == "chat") {
    if (l == "completion")
      throw Error(str("data.loss_on = \"completion\" needs a prompt and a completion; data.source ", cfg.source,
                      " is read as chat"),
                  "data.loss_on", "use loss_on = \"assistant\" (or \"all\"), or give prompt_completion lines");
    return l == "all" ? LossOn::all : LossOn::assistant;
  }
  if (format == "prompt_completion")
    return l == "all" ? LossOn::all : l == "assistant" ? LossOn::assistant : LossOn::completion;
  if (l == "assistant" || l == "completion")
    throw Error(str("data.loss_on = \"", l, "\" needs conversations, and data.source ", cfg.source, " is read as ", format),
                "data.loss_on",
                "give .jsonl lines with `messages` (data.format = \"chat\") or `prompt` and `completion`, or set "
                "loss_on = \"all\"");
  return LossOn::all;
}

// Reads documents and hands them to the tokenizer in batches of about 16 MB, all threads at
// once; a progress line with the rate and ETA goes to stderr.
// Conversations go in as their lines (views that stay valid until the next flush) and come out as
// ids with their masks.
struct ChatInput {
  const ChatRenderer* chat = nullptr;
  std::string format;
  LossOn loss_on = LossOn::all;
};

class Builder {
 public:
  Builder(const Tokenizer& tok, TokenCacheWriter& w, DataReport& r, int threads, bool progress, uint64_t total,
          ChatInput chat = {})
      : tok_(tok), w_(w), r_(r), threads_(threads), total_(total), start_(clock::now()), last_(start_),
        chat_(std::move(chat)) {
    tty_ = progress && isatty(STDERR_FILENO);
  }
  // One line of a conversation file; `line` must stay valid until flush().
  void add_line(std::string_view line, std::string where) {
    pending_bytes_ += line.size();
    lines_.push_back(line);
    where_.push_back(std::move(where));
    if (pending_bytes_ >= (16u << 20) || lines_.size() >= 16384) flush();
  }
  int64_t conversations() const { return r_.documents; }
  void add(std::string text, std::string where) {
    if (text.empty()) {
      note(r_.empty, r_.first_empty, where);
      return;
    }
    pending_bytes_ += text.size();
    texts_.push_back(std::move(text));
    where_.push_back(std::move(where));
    if (pending_bytes_ >= (16u << 20) || texts_.size() >= 16384) flush();
  }
  // `bytes` of the source have been read; they count as done once their documents are encoded.
  void consumed(uint64_t bytes) {
    read_ += bytes;
    if (texts_.empty()) done_ = read_, show(false);
  }
  void flush() {
    if (chat_.chat) {
      flush_conversations();
      return;
    }
    if (texts_.empty()) return;
    std::vector<std::string_view> views(texts_.begin(), texts_.end());
    std::vector<EncodeStats> stats;
    auto ids = tok_.encode_batch(views, threads_, &stats);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (stats[i].invalid_utf8 > 0) {
        note(r_.invalid_utf8_documents, r_.first_invalid_utf8, where_[i]);
        r_.invalid_utf8_sequences += stats[i].invalid_utf8;
      }
      w_.add_document(ids[i]);
      ++r_.documents;
    }
    texts_.clear();
    batch_done();
  }
  void finish() {
    flush();
    show(true);
  }

 private:
  void flush_conversations() {
    if (lines_.empty()) return;
    auto enc = encode_conversations(*chat_.chat, tok_, lines_, chat_.format, chat_.loss_on, threads_);
    for (size_t i = 0; i < enc.size(); ++i) {
      EncodedConversation& c = enc[i];
      if (!c.error.empty() || c.ids.empty()) {
        if (r_.bad_conversations++ < 5) r_.bad_examples.push_back(str(where_[i], ": ", c.error.empty() ? "renders to nothing" : c.error));
        continue;
      }
      int64_t trained = 0;
      for (uint8_t m : c.mask) trained += m;
      if (trained == 0) note(r_.untrained, r_.first_untrained, where_[i]);
      r_.trained_tokens += trained + (r_.documents > 0 && last_eos_trains_ ? 1 : 0);
      w_.add_document(c.ids, &c.mask, last_eos_trains_ ? 1 : 0);
      last_eos_trains_ = c.eos_trains;
      ++r_.documents;
    }
    lines_.clear();
    batch_done();
  }
  // A batch's inputs are in the cache: the next one starts empty, the progress line moves.
  void batch_done() {
    where_.clear();
    pending_bytes_ = 0;
    done_ = read_;
    show(false);
  }

  using clock = std::chrono::steady_clock;
  void show(bool final) {
    auto now = clock::now();
    double since = std::chrono::duration<double>(now - last_).count();
    if (!final && since < (tty_ ? 0.25 : 30.0)) return;
    last_ = now;
    double el = std::chrono::duration<double>(now - start_).count();
    double rate = el > 0 ? done_ / el : 0;
    double eta = rate > 0 && total_ > done_ ? (total_ - done_) / rate : 0;
    char line[160];
    std::snprintf(line, sizeof line, "tokenizing %3d%% %.1f/%.1f MB, %.1f MB/s, %llu tokens, ETA %llds",
                  total_ ? static_cast<int>(100 * done_ / total_) : 100, done_ / 1e6, total_ / 1e6, rate / 1e6,
                  static_cast<unsigned long long>(w_.num_tokens()), static_cast<long long>(eta));
    if (tty_) std::fprintf(stderr, "\r%s\033[K%s", line, final ? "\n" : "");
    else if (!final || el > 30) log::info(line);
  }

  const Tokenizer& tok_;
  TokenCacheWriter& w_;
  DataReport& r_;
  int threads_;
  uint64_t total_, read_ = 0, done_ = 0;
  clock::time_point start_, last_;
  bool tty_ = false;
  std::vector<std::string> texts_, where_;
  uint64_t pending_bytes_ = 0;
  ChatInput chat_;
  std::vector<std::string_view> lines_;
  bool last_eos_trains_ = false;
};

bool read_whole(const fs::path& p, std::string& out) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return false;
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) return false;
  out = std::move(s).str();
  return true;
}

// Calls fn(line, where) for each line of `all` that is not blank, its invalid UTF-8 replaced and
// counted in `r`; a replaced line lives in `repaired` as long as the caller keeps it. Returns the
// number of lines passed.
template <typename Fn>
int64_t for_each_line(const std::string& all, const SourceFile& f, DataReport& r, std::deque<std::string>& repaired, Fn fn) {
  int64_t lines = 0;
  size_t line_no = 0, at = 0;
  while (at < all.size()) {
    size_t nl = all.find('\n', at);
    if (nl == std::string::npos) nl = all.size();
    std::string_view line(all.data() + at, nl - at);
    at = nl + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;  // blank: no document
    ++lines;
    std::string where = str(f.path.string(), ":", line_no);
    if (utf8::first_invalid(line) != std::string_view::npos) {
      int64_t n = 0;
      repaired.push_back(utf8::repair(line, &n));
      line = repaired.back();
      note(r.invalid_utf8_documents, r.first_invalid_utf8, where);
      r.invalid_utf8_sequences += n;
    }
    fn(line, std::move(where));
  }
  return lines;
}

void read_jsonl(const SourceFile& f, const std::string& field, Builder& b, DataReport& r) {
  std::string all;
  if (!read_whole(f.path, all)) {
    note(r.unreadable, r.first_unreadable, f.path.string());
    return;
  }
  std::deque<std::string> repaired;
  const int64_t lines = for_each_line(all, f, r, repaired, [&](std::string_view line, std::string where) {
    json j = json::parse(line.begin(), line.end(), nullptr, false);
    if (j.is_discarded()) {
      note(r.not_json, r.first_not_json, where);
      return;
    }
    if (!j.is_object() || !j.contains(field) || !j[field].is_string()) {
      note(r.missing_field, r.first_missing_field, where);
      return;
    }
    b.add(j[field].get<std::string>(), where);
  });
  // A file with no line but blank ones is one empty input.
  if (lines == 0) note(r.empty, r.first_empty, f.path.string());
  b.consumed(f.size);
}

// A conversation file: every line not blank is one conversation or a reported bad line; a file
// with lines and no conversation is refused, as its format is plainly not what it was read as.
void read_chat_jsonl(const SourceFile& f, const std::string& format, Builder& b, DataReport& r) {
  std::string all;
  if (!read_whole(f.path, all)) {
    note(r.unreadable, r.first_unreadable, f.path.string());
    return;
  }
  std::deque<std::string> repaired;  // lines whose invalid UTF-8 was replaced, alive until the flush
  const int64_t docs_before = r.documents, bad_before = r.bad_conversations;
  const size_t examples_before = r.bad_examples.size();
  const int64_t lines =
      for_each_line(all, f, r, repaired, [&](std::string_view line, std::string where) { b.add_line(line, std::move(where)); });
  b.flush();
  b.consumed(f.size);
  if (lines == 0) {
    note(r.empty, r.first_empty, f.path.string());
  } else if (r.documents == docs_before) {
    const std::string first = r.bad_examples.size() > examples_before ? r.bad_examples[examples_before] : std::string();
    throw Error(str("data.source: no line of ", f.path.string(), " is a conversation (", r.bad_conversations - bad_before,
                    " lines; the first: ", first, ")"),
                "data.source",
                format == "chat"
                    ? "give one conversation per line: {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}, "
                      "{\"role\": \"assistant\", \"content\": \"...\"}]}, or set data.format to how the file is written"
                    : "give one example per line: {\"prompt\": \"...\", \"completion\": \"...\"} (strings or message "
                      "lists), or set data.format to how the file is written");
  }
}

json report_meta(const DataReport& r) {
  return {{"files", r.files}, {"documents", r.documents}, {"empty", r.empty}, {"unreadable", r.unreadable},
          {"not_json", r.not_json}, {"missing_field", r.missing_field},
          {"invalid_utf8_documents", r.invalid_utf8_documents}, {"invalid_utf8_sequences", r.invalid_utf8_sequences},
          {"first_empty", r.first_empty}, {"first_unreadable", r.first_unreadable}, {"first_not_json", r.first_not_json},
          {"first_missing_field", r.first_missing_field}, {"first_invalid_utf8", r.first_invalid_utf8},
          {"bad_conversations", r.bad_conversations}, {"bad_examples", r.bad_examples}, {"untrained", r.untrained},
          {"first_untrained", r.first_untrained}, {"trained_tokens", r.trained_tokens}};
}

void load_meta(const std::string& meta, DataReport& r) {
  json j = json::parse(meta, nullptr, false);
  if (j.is_discarded()) return;
  r.files = j.value("files", 0);
  r.documents = j.value("documents", 0);
  r.empty = j.value("empty", 0);
  r.unreadable = j.value("unreadable", 0);
  r.not_json = j.value("not_json", 0);
  r.missing_field = j.value("missing_field", 0);
  r.invalid_utf8_documents = j.value("invalid_utf8_documents", 0);
  r.invalid_utf8_sequences = j.value("invalid_utf8_sequences", 0);
  r.first_empty = j.value("first_empty", "");
  r.first_unreadable = j.value("first_unreadable", "");
  r.first_not_json = j.value("first_not_json", "");
  r.first_missing_field = j.value("first_missing_field", "");
  r.first_invalid_utf8 = j.value("first_invalid_utf8", "");
  r.bad_conversations = j.value("bad_conversations", 0);
  r.bad_examples = j.value("bad_examples", std::vector<std::string>{});
  r.untrained = j.value("untrained", 0);
  r.first_untrained = j.value("first_untrained", "");
  r.trained_tokens = j.value("trained_tokens", 0);
}

// Tokenizes a text source into the cache (or reuses an intact one) and maps it.
void open_text_source(Dataset::State& s, const DataConfig& cfg, const std::string& format, const Tokenizer& tok,
                      const Dataset::Options& opt) {
  fs::path src(cfg.source);
  DataReport& r = s.report;
  const bool chat = is_chat_format(format);
  const LossOn loss_on = resolve_loss_on(cfg, format);
  std::optional<ChatRenderer> renderer;
  if (chat) {
    renderer = ChatRenderer::load(tok.path(), cfg.chat_template, cfg.chat_template_kwargs);
    r.chat_template = renderer->source();
    r.loss_on = loss_on_name(loss_on);
    // A template whose turns cannot be found is refused before any line is read.
    if (loss_on == LossOn::assistant && !renderer->chat_template().has_generation_blocks()) renderer->markers();
  }
  std::vector<SourceFile> files;
  if (fs::is_directory(src)) {
    walk(src, src, {format == "txt" ? ".txt" : ".jsonl"}, files, r);
  } else {
    std::error_code ec;
    SourceFile f;
    f.path = src;
    f.rel = src.filename().string();
    f.size = fs::file_size(src, ec);
    if (ec) throw Error(str("data.source ", cfg.source, " cannot be read: ", ec.message()), "data.source", "give an existing file or folder");
    f.mtime = static_cast<int64_t>(fs::last_write_time(src, ec).time_since_epoch().count());
    read_identity(f);
    files.push_back(f);
  }
  std::sort(files.begin(), files.end(), [](const SourceFile& a, const SourceFile& b) { return a.rel < b.rel; });
  r.files = static_cast<int64_t>(files.size());
  const int64_t walk_unreadable = r.unreadable;
  const std::string walk_first = r.first_unreadable;

  // The key: everything that changes the token stream.
  Sha256 key;
  auto add = [&](const std::string& x) { key.update(x.data(), x.size()), key.update("\n", 1); };
  add("lcx-token-cache 2");
  add(tok.hash());
  add(format);
  if (format == "jsonl") add(cfg.text_field);
  // The template, its variables and special tokens, and which tokens train change the masks.
  const std::string chat_key = chat ? str(renderer->key(), "\t", loss_on_name(loss_on)) : std::string();
  if (chat) add(chat_key);
  for (const auto& f : files) add(str(f.rel, "\t", f.size, "\t", f.mtime, "\t", f.ctime_ns, "\t", f.inode));
  const std::string key_hex = key.hex();

  fs::path dir = cfg.cache_dir.empty() ? (fs::is_directory(src) ? src : src.parent_path()) / ".lcx-cache" : fs::path(cfg.cache_dir);
  std::string name = sha256_string(str(fs::absolute(src).lexically_normal().string(), "\n", format, "\n",
                                       format == "jsonl" ? cfg.text_field : "", "\n", tok.hash(), chat_key))
                         .substr(0, 16);
  fs::path path = dir / ("tokens-" + name + ".lcxtok");
  r.cache_path = path.string();

  if (fs::is_directory(dir)) remove_abandoned_cache_files(dir.string());
  std::string why;
  TokenCacheView v = open_token_cache(path.string(), key_hex, &why);
  if (!v.file) {
    if (why != "missing") log::warn(str("data: token cache ", path.string(), " is ", why, "; rebuilding it"));
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec)
      throw Error(str("cannot create the token cache folder ", dir.string(), ": ", ec.message()), "data.cache_dir",
                  "set data.cache_dir to a writable folder");
    uint64_t total = 0;
    for (const auto& f : files) total += f.size;
    {
      TokenCacheWriter w(path.string(), key_hex, tok.eos_id(), chat);
      Builder b(tok, w, r, opt.threads, opt.progress, total,
                chat ? ChatInput{&*renderer, format, loss_on} : ChatInput{});
      for (const auto& f : files) {
        if (chat) {
          read_chat_jsonl(f, format, b, r);
          continue;
        }
        if (format == "jsonl") {
          read_jsonl(f, cfg.text_field, b, r);
          continue;
        }
        std::string text;
        b.consumed(f.size);
        if (!read_whole(f.path, text)) note(r.unreadable, r.first_unreadable, f.path.string());
        else b.add(std::move(text), f.path.string());
      }
      b.finish();
      w.finish(report_meta(r).dump());
    }
    v = open_token_cache(path.string(), key_hex, &why);
    if (!v.file) throw Error(str("the token cache just written, ", path.string(), ", is ", why));
  } else {
    load_meta(v.meta, r);
    // Folders that cannot be listed never reach the cache's key; count them on every run.
    if (walk_unreadable > r.unreadable) r.unreadable = walk_unreadable, r.first_unreadable = walk_first;
    r.from_cache = true;
  }
  s.file = v.file;
  s.tokens = v.tokens;
  s.num_tokens = static_cast<int64_t>(v.num_tokens);
  s.doc_starts = v.doc_starts;
  s.num_docs = static_cast<int64_t>(v.num_docs);
  s.mask = v.mask;
  if (chat && !v.mask) throw Error(str("token cache ", path.string(), " has no mask"));
  if (v.eos != tok.eos_id()) throw Error(str("token cache ", path.string(), " was written with eos ", v.eos));
}

// A pre-tokenized file: uint32 ids, little endian, used in place.
void open_token_source(Dataset::State& s, const DataConfig& cfg, const Tokenizer& tok) {
  std::string err;
  auto f = MappedFile::open(cfg.source, &err);
  if (!f) throw Error(str("data.source ", cfg.source, " cannot be read: ", err), "data.source", "give a readable .tokens file");
  if (f->size() % 4 != 0)
    throw Error(str("data.source ", cfg.source, " has ", f->size(), " bytes, not a whole number of uint32 ids"), "data.source",
                "write the ids as uint32 little endian");
  s.report.files = 1;
  s.tokens = reinterpret_cast<const uint32_t*>(f->data());
  s.num_tokens = static_cast<int64_t>(f->size() / 4);
  const uint32_t vocab = static_cast<uint32_t>(tok.vocab_size());
  for (int64_t i = 0; i < s.num_tokens; ++i) {
    if (s.tokens[i] >= vocab)
      throw Error(str("data.source ", cfg.source, ": id ", s.tokens[i], " at position ", i, " is outside the tokenizer's ", vocab,
                      " ids"), "data.source", "pre-tokenize with the tokenizer named in data.tokenizer");
    if (i == 0 || s.tokens[i - 1] == static_cast<uint32_t>(s.eos)) s.own_doc_starts.push_back(static_cast<uint64_t>(i));
  }
  if (s.num_tokens == 0) note(s.report.empty, s.report.first_empty, cfg.source);
  s.file = std::move(f);
  s.doc_starts = s.own_doc_starts.data();
  s.num_docs = static_cast<int64_t>(s.own_doc_starts.size());
  s.report.documents = s.num_docs;
}

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

std::string DataReport::summary() const {
  const bool chat = !loss_on.empty();
  const char* doc = chat ? " conversation" : " document";
  std::string s = str("data: ", files, files == 1 ? " file, " : " files, ", documents, doc, documents == 1 ? ", " : "s, ",
                      tokens, " tokens -> ", sequences, sequences == 1 ? " sequence" : " sequences");
  if (chat)
    s += str(" (", format, ", template ", chat_template, ", loss on ", loss_on, ": ", trained_tokens, " tokens train)");
  if (padding) s += str(" (", padding, " padding tokens in the last)");
  if (dropped_tokens) s += str(", ", dropped_tokens, " tokens dropped (", dropped_why, ")");
  std::vector<std::string> bad;
  auto add = [&](int64_t n, const char* what, const std::string& first) {
    if (n) bad.push_back(str(n, " ", what, " (first: ", first, ")"));
  };
  add(empty, "empty", first_empty);
  add(unreadable, "unreadable", first_unreadable);
  add(not_json, "not JSON", first_not_json);
  add(missing_field, "without the text field", first_missing_field);
  if (!bad.empty()) {
    s += "; skipped ";
    for (size_t i = 0; i < bad.size(); ++i) s += (i ? ", " : "") + bad[i];
  }
  if (bad_conversations) {
    s += str("; skipped ", bad_conversations, bad_conversations == 1 ? " line that is" : " lines that are",
             " not a conversation (");
    for (size_t i = 0; i < bad_examples.size(); ++i) s += (i ? "; " : "") + bad_examples[i];
    if (bad_conversations > static_cast<int64_t>(bad_examples.size()))
      s += str("; and ", bad_conversations - static_cast<int64_t>(bad_examples.size()), " more");
    s += ")";
  }
  if (untrained)
    s += str("; ", untrained, untrained == 1 ? " conversation has" : " conversations have", " no token that trains (first: ",
             first_untrained, ")");
  if (cut_documents)
    s += str("; ", cut_documents, doc, cut_documents == 1 ? " continues" : "s continue", " into the next sequence",
             longer_than_sequence ? str(" (", longer_than_sequence, " longer than data.seq_len)") : std::string());
  if (invalid_utf8_documents)
    s += str("; ", invalid_utf8_documents, " with invalid UTF-8, ", invalid_utf8_sequences,
             " sequences replaced by U+FFFD (first: ", first_invalid_utf8, ")");
  s += from_cache ? str("; token cache ", cache_path) : (cache_path.empty() ? "" : str("; wrote token cache ", cache_path));
  return s;
}

Dataset Dataset::open(const DataConfig& cfg, const Tokenizer& tok, const Options& opt) {
  if (cfg.source.empty()) throw Error("data.source is not set", "data.source", "name a folder of .txt files, a .jsonl file or a .tokens file");
  if (!fs::exists(cfg.source)) throw Error(str("data.source ", cfg.source, " does not exist"), "data.source", "check the path");
  if (cfg.seq_len < 2) throw Error(str("data.seq_len = ", cfg.seq_len, " is too short"), "data.seq_len", "use at least 2");
  if (cfg.pad_to_multiple_of < 1 || cfg.seq_len % cfg.pad_to_multiple_of != 0)
    throw Error(str("data.seq_len = ", cfg.seq_len, " is not a multiple of data.pad_to_multiple_of = ", cfg.pad_to_multiple_of),
                "data.seq_len", str("use a multiple of ", cfg.pad_to_multiple_of));
  auto s = std::make_shared<State>();
  s->cfg = cfg;
  s->seed = opt.seed;
  s->eos = tok.eos_id();
  const std::string format = resolve_format(cfg);
  s->report.format = format;
  if (format == "tokens") {
    resolve_loss_on(cfg, format);
    open_token_source(*s, cfg, tok);
  } else {
    open_text_source(*s, cfg, format, tok, opt);
  }

  // Sequences: full ones, then the remainder (kept and padded, unless drop_last).
  DataReport& r = s->report;
  r.tokens = s->num_tokens;
  const int64_t L = cfg.seq_len, rem = s->num_tokens % L;
  if (s->num_tokens == 0)
    throw Error(str("data.source ", cfg.source, " holds no token (", r.summary(), ")"), "data.source",
                "give documents with text in them");
  // One sequence longer than the whole stream would be mostly padding, or none: say so.
  if (s->num_tokens < L)
    throw Error(str("data.seq_len = ", L, " is longer than the ", s->num_tokens, " tokens data.source ", cfg.source,
                    " holds"),
                "data.seq_len", str("use data.seq_len <= ", s->num_tokens, ", or add documents"));
  s->num_sequences = s->num_tokens / L;
  s->last_real = s->last_length = L;
  if (rem > 0) {
    if (cfg.drop_last || rem < 2) {
      r.dropped_tokens = rem;
      r.dropped_why = cfg.drop_last ? "the final partial sequence, as data.drop_last = true"
                                    : "a final sequence of one token has no label to learn";
    } else {
      const int64_t m = cfg.pad_to_multiple_of;
      s->last_real = rem;
      s->last_length = (rem + m - 1) / m * m;
      r.padding = s->last_length - rem;
      ++s->num_sequences;
    }
  }
  r.sequences = s->num_sequences;
  // Documents cut by a sequence's end: continued in the next one, their masks with their tokens.
  for (int64_t d = 0; d < s->num_docs; ++d) {
    const int64_t b = static_cast<int64_t>(s->doc_starts[d]);
    const int64_t e = d + 1 < s->num_docs ? static_cast<int64_t>(s->doc_starts[d + 1]) - 1 : s->num_tokens;  // eos excluded
    if (e - b > L) ++r.longer_than_sequence;
    if (e > b && b / L != (e - 1) / L) ++r.cut_documents;
  }
  log::info(r.summary());
  Dataset d;
  d.s_ = std::move(s);
  // Every step would have no loss to take (a NaN, skipped): say why at the start.
  int64_t valid = 0;
  for (int64_t i = 0; i < d.s_->num_sequences && valid == 0; ++i) valid += d.valid_labels(i);
  if (valid == 0 && d.s_->mask)
    throw Error(str("data.source ", cfg.source, " has no trainable target: no token of its conversations is selected by ",
                    "data.loss_on = \"", r.loss_on, "\" (", r.summary(), ")"),
                "data.loss_on", "give conversations with assistant turns, or set data.loss_on = \"all\"");
  if (valid == 0)
    throw Error(str("data.source ", cfg.source, " has no trainable target: every token is the end of a document, which "
                    "predicts nothing"),
                "data.source", "give documents with text in them (a token file of only end-of-text ids has none)");
  if (r.dropped_tokens) log::warn(str("data: dropped ", r.dropped_tokens, " tokens at the end of the stream: ", r.dropped_why));
  return d;
}

int64_t Dataset::num_sequences() const { return s_->num_sequences; }
int64_t Dataset::seq_len() const { return s_->cfg.seq_len; }
int64_t Dataset::num_documents() const { return s_->num_docs; }
const DataReport& Dataset::report() const { return s_->report; }

int64_t Dataset::length(int64_t index) const {
  return index + 1 == s_->num_sequences ? s_->last_length : s_->cfg.seq_len;
}

// With masked documents each one's EOS predicts nothing: the next document is out of its sight.
int64_t Dataset::valid_labels(int64_t index) const {
  const State& s = *s_;
  const int64_t n = s.real_length(index) - 1;
  const auto [first, last] = s.starts_inside(index);
  if (!s.mask) return s.cfg.attend_across_documents ? n : n - (last - first);
  // Target t is token t + 1, kept where its mask is 1, except a document's eos predicting the next.
  const int64_t a = index * s.cfg.seq_len;
  int64_t v = 0;
  for (int64_t t = 1; t <= n; ++t) v += s.mask[a + t];
  if (!s.cfg.attend_across_documents)
    for (const uint64_t* d = first; d != last; ++d) v -= s.mask[*d];
  return v;
}

Sequence Dataset::get(int64_t index) const {
  const State& s = *s_;
  if (index < 0 || index >= s.num_sequences)
    throw Error(str("sequence ", index, " is outside the dataset's ", s.num_sequences));
  const int64_t L = length(index), real = s.real_length(index), a = index * s.cfg.seq_len;
  Sequence q;
  q.tokens = Tensor::empty({L}, DType::i32);
  q.targets = Tensor::empty({L}, DType::i64);
  int32_t* tk = q.tokens.data_as<int32_t>();
  int64_t* tg = q.targets.data_as<int64_t>();
  const uint32_t* src = s.tokens + a;
  for (int64_t t = 0; t < L; ++t) {
    tk[t] = t < real ? static_cast<int32_t>(src[t]) : s.eos;
    tg[t] = t + 1 < real ? static_cast<int64_t>(src[t + 1]) : -100;
  }
  if (s.mask)
    for (int64_t t = 0; t + 1 < real; ++t)
      if (!s.mask[a + t + 1]) tg[t] = -100;
  // Documents touching [a, a + real): the one holding a, then each one starting inside.
  const auto [first, last] = s.starts_inside(index);
  q.document_count = static_cast<int>(last - first) + 1;
  if (!s.cfg.attend_across_documents) {
    // A document's EOS closes it: its target (the next document's first token) is ignored. The
    // padding stays with the last document, whose targets there are -100 already.
    q.document_bounds.push_back(0);
    for (const uint64_t* d = first; d != last; ++d) {
      const int64_t at = static_cast<int64_t>(*d) - a;
      tg[at - 1] = -100;
      q.document_bounds.push_back(at);
    }
    q.document_bounds.push_back(L);
  }
  return q;
}

int64_t Dataset::index_at(int64_t epoch, int64_t position) const {
  const State& s = *s_;
  if (position < 0 || position >= s.num_sequences) throw Error(str("position ", position, " is outside the epoch"));
  if (!s.cfg.shuffle) return position;
  std::lock_guard<std::mutex> lock(s.perm_mu);
  if (s.perm_epoch != epoch) {
    // Fisher-Yates driven by splitmix64, with Lemire's unbiased bounded draw: the same order on
    // every platform and standard library.
    uint64_t state = static_cast<uint64_t>(s.seed) * 0xD1342543DE82EF95ull + static_cast<uint64_t>(epoch);
    s.perm.resize(s.num_sequences);
    for (int64_t i = 0; i < s.num_sequences; ++i) s.perm[i] = i;
    for (uint64_t i = s.num_sequences; i > 1; --i) {
      uint64_t j;
      for (;;) {
        __uint128_t m = static_cast<__uint128_t>(splitmix64(state)) * i;
        uint64_t low = static_cast<uint64_t>(m);
        if (low >= (0 - i) % i) {
          j = static_cast<uint64_t>(m >> 64);
          break;
        }
      }
      std::swap(s.perm[i - 1], s.perm[j]);
    }
    s.perm_epoch = epoch;
  }
  return s.perm[position];
}

int64_t Dataset::steps_per_epoch(int64_t batch_size) const {
  if (batch_size < 1) throw Error(str("batch size ", batch_size, " must be at least 1"));
  return (s_->num_sequences + batch_size - 1) / batch_size;
}

Batch Dataset::batch(int64_t step, int64_t batch_size) const {
  const int64_t spe = steps_per_epoch(batch_size);
  Batch b;
  b.epoch = step / spe;
  const int64_t begin = (step % spe) * batch_size, end = std::min(begin + batch_size, s_->num_sequences);
  for (int64_t p = begin; p < end; ++p) {
    int64_t i = index_at(b.epoch, p);
    b.sequences.push_back(get(i));
    b.tokens += s_->real_length(i);
    b.valid_labels += valid_labels(i);
  }
  return b;
}

}  // namespace lcx
