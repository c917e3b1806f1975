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
#include <set>
#include <tuple>
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/chat_data.h"
#include "data/data_file.h"
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

  // Sequences laid out from pieces of the stream (data.packing = "bfd", or data.overlong other than
  // "continue"); empty for the plain stream, where sequence i is [i * seq_len, + seq_len).
  struct Segment {
    int64_t start = 0, length = 0;
    bool opens = true;  // a document begins here (else it goes on from the previous sequence)
  };
  std::vector<Segment> segments;
  std::vector<int64_t> seq_segments;  // sequence i: segments [seq_segments[i], seq_segments[i + 1])
  std::vector<int64_t> seq_valid;     // sequence i's targets that are not -100
  bool laid_out() const { return !seq_segments.empty(); }
  // A mixture of sources ([[data.sources]]): each one's dataset, and the mixture's sequences in
  // order as (source, its sequence).
  std::vector<std::shared_ptr<const State>> parts;
  std::vector<std::pair<int32_t, int64_t>> entries;
  bool mixed() const { return !parts.empty(); }
  // The sequences this dataset serves, when a share is held out for evaluation (eval.split):
  // their indices among all; empty, all of them.
  std::vector<int64_t> view;
  int64_t count() const { return view.empty() ? num_sequences : static_cast<int64_t>(view.size()); }
  int64_t at(int64_t i) const { return view.empty() ? i : view[static_cast<size_t>(i)]; }
  const State& part(int64_t i) const { return *parts[static_cast<size_t>(entries[i].first)]; }

  int64_t real_length(int64_t i) const {
    if (mixed()) return part(i).real_length(entries[i].second);
    if (laid_out()) {
      int64_t n = 0;
      for (int64_t k = seq_segments[i]; k < seq_segments[i + 1]; ++k) n += segments[k].length;
      return n;
    }
    return i + 1 == num_sequences ? last_real : cfg.seq_len;
  }
  int64_t padded_length(int64_t i) const {
    if (mixed()) return part(i).padded_length(entries[i].second);
    if (!laid_out()) return i + 1 == num_sequences ? last_length : cfg.seq_len;
    const int64_t m = cfg.pad_to_multiple_of;
    return (real_length(i) + m - 1) / m * m;
  }
  // Sequence i among all of them.
  Sequence get(int64_t i) const;
  int64_t valid_labels(int64_t i) const;
  // A laid-out sequence: its tokens and targets (`length` of them) and document bounds.
  void fill(int64_t i, int32_t* tk, int64_t* tg, int64_t length, std::vector<int64_t>& bounds) const;
  // Documents starting inside sequence i after its first token: [first, last) of doc_starts.
  std::pair<const uint64_t*, const uint64_t*> starts_inside(int64_t i) const {
    const uint64_t a = static_cast<uint64_t>(i * cfg.seq_len);
    const uint64_t* e = doc_starts + num_docs;
    return {std::upper_bound(doc_starts, e, a), std::lower_bound(doc_starts, e, a + static_cast<uint64_t>(real_length(i)))};
  }
};

void Dataset::State::fill(int64_t i, int32_t* tk, int64_t* tg, int64_t length, std::vector<int64_t>& bounds) const {
  const bool masked = !cfg.attend_across_documents;
  bounds.clear();
  if (masked) bounds.push_back(0);
  int64_t at = 0;
  for (int64_t k = seq_segments[i]; k < seq_segments[i + 1]; ++k) {
    const Segment& g = segments[k];
    if (masked && at > 0 && g.opens) bounds.push_back(at);
    for (int64_t t = 0; t < g.length; ++t) {
      tk[at + t] = static_cast<int32_t>(tokens[g.start + t]);
      // Whether the token trains, kept in its target slot until the targets are shifted in.
      tg[at + t] = mask ? mask[g.start + t] : 1;
    }
    at += g.length;
  }
  const int64_t real = at;
  for (int64_t t = 0; t < length; ++t) {
    if (t >= real) tk[t] = eos;
    tg[t] = t + 1 < real && tg[t + 1] ? static_cast<int64_t>(tk[t + 1]) : -100;
  }
  // A document's last token does not predict the next document, which it cannot see.
  for (size_t b = 1; b < bounds.size(); ++b) tg[bounds[b] - 1] = -100;
  if (masked) {
    // Padding is a document of its own: it attends to itself alone, and a Parallelism provider
    // that balances ranks by their documents' work sees it as the little work it is.
    if (length > real) bounds.push_back(real);
    bounds.push_back(length);
  }
}

namespace {

using json = nlohmann::json;

struct SourceFile {
  fs::path path;
  std::string rel;
  DataFileName name;
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

void note(int64_t& count, std::string& first, const std::string& where) {
  if (count++ == 0) first = where;
}

// How errors name the data: its source, or its sources.
std::string data_name(const DataConfig& cfg) {
  return cfg.sources.empty() ? str("data.source ", cfg.source) : str("data.sources (", data_sources_text(cfg), ")");
}

// Every data file under `dir` (data_file_name), sorted later by relative path; names starting with
// '.' (the cache folder among them) are skipped, and so are files that are no data (a README),
// counted. Folders that cannot be listed count as unreadable.
void walk(const fs::path& dir, const fs::path& root, std::vector<SourceFile>& out, DataReport& r) {
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
      walk(p, root, out, r);
      continue;
    }
    SourceFile f;
    f.name = data_file_name(p.string());
    if (f.name.kind.empty() || f.name.kind == "tokens") {
      note(r.other_files, r.first_other_file, p.string());
      continue;
    }
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

bool is_chat_format(const std::string& format) { return format == "chat" || format == "prompt_completion"; }

// The first 64 KiB of a file, decompressed, checked to be text (check_looks_like_text).
void check_text_file(const SourceFile& f) {
  ByteStream in(f.path.string(), f.name.compression);
  std::string head(64 << 10, '\0');
  size_t n = 0;
  for (size_t k; n < head.size() && (k = in.read(head.data() + n, head.size() - n)) > 0;) n += k;
  head.resize(n);
  check_looks_like_text(head, f.path.string());
}

// The records of a .json file: a list of objects, or an object holding one list.
nlohmann::ordered_json json_records(const SourceFile& f, DataReport& r) {
  ByteStream in(f.path.string(), f.name.compression);
  std::string all = read_all(in);
  if (utf8::first_invalid(all) != std::string::npos) {
    int64_t n = 0;
    all = utf8::repair(all, &n);
    note(r.invalid_utf8_documents, r.first_invalid_utf8, f.path.string());
    r.invalid_utf8_sequences += n;
  }
  auto j = nlohmann::ordered_json::parse(all, nullptr, false);
  const std::string fix = "give a list of records ([{\"text\": ...}, ...]) or an object holding one list, or one "
                          "record a line in a .jsonl file";
  if (j.is_discarded()) throw Error(str("data.source: ", f.path.string(), " is not JSON"), "data.source", fix);
  if (j.is_object()) {
    const nlohmann::ordered_json* list = nullptr;
    int lists = 0;
    for (const auto& [k, v] : j.items())
      if (v.is_array()) ++lists, list = &v;
    if (lists != 1)
      throw Error(str("data.source: ", f.path.string(), " is a JSON object holding ", lists, " lists, not one list of records"),
                  "data.source", fix);
    return *list;
  }
  if (!j.is_array()) throw Error(str("data.source: ", f.path.string(), " is a JSON value, not a list of records"), "data.source", fix);
  return j;
}

// How a record file is read with format auto, from its first record, as TRL tells its dataset
// types apart: `messages` (or ShareGPT's `conversations`) is chat, `prompt` and `completion` are
// prompt_completion, anything else text from data.text_field; said in the log.
std::string record_kind(const SourceFile& f, DataReport& r) {
  nlohmann::json j;
  if (f.name.kind == "json") {
    auto records = json_records(f, r);
    if (!records.empty()) j = records.front();
  } else {
    ByteStream in(f.path.string(), f.name.compression);
    std::vector<char> buf(1 << 16);
    std::string line;
    for (size_t n; (n = in.read(buf.data(), buf.size())) > 0;) {
      line.append(buf.data(), n);
      const size_t start = line.find_first_not_of(" \t\r\n");
      if (start == std::string::npos) {
        line.clear();
        continue;
      }
      if (line.find('\n', start) != std::string::npos) break;
    }
    const size_t start = line.find_first_not_of(" \t\r\n");
    if (start != std::string::npos) {
      const size_t end = line.find('\n', start);
      j = nlohmann::json::parse(line.substr(start, end == std::string::npos ? std::string::npos : end - start), nullptr, false);
    }
  }
  std::string kind = "jsonl", why;
  if (j.is_object() && j.contains("messages")) kind = "chat", why = "a `messages` field";
  else if (j.is_object() && j.contains("conversations")) kind = "chat", why = "ShareGPT's `conversations` field";
  else if (j.is_object() && j.contains("prompt") && j.contains("completion")) kind = "prompt_completion", why = "`prompt` and `completion`";
  if (kind != "jsonl")
    log::info(str("data: ", f.path.string(), "'s first record has ", why, ": reading conversations (data.format = \"", kind, "\")"));
  return kind;
}

// The data files of cfg.source: the file itself (refused when its name is no data lcx reads), or
// the data files of a folder, sorted by path.
std::vector<SourceFile> list_files(const DataConfig& cfg, DataReport& r) {
  fs::path src(cfg.source);
  std::vector<SourceFile> files;
  if (fs::is_directory(src)) {
    walk(src, src, files, r);
    std::sort(files.begin(), files.end(), [](const SourceFile& a, const SourceFile& b) { return a.rel < b.rel; });
    return files;
  }
  SourceFile f;
  f.path = src;
  f.rel = src.filename().string();
  f.name = data_file_name(cfg.source);
  // An explicit format reads a file of any name as that format says (it was asked for).
  if (f.name.kind.empty() && cfg.format != "auto")
    f.name.kind = cfg.format == "txt" ? "txt" : cfg.format == "tokens" ? "tokens" : "jsonl";
  if (f.name.kind.empty()) refuse_data_file_name(cfg.source);
  std::error_code ec;
  f.size = fs::file_size(src, ec);
  if (ec) throw Error(str("data.source ", cfg.source, " cannot be read: ", ec.message()), "data.source", "give an existing file or folder");
  f.mtime = static_cast<int64_t>(fs::last_write_time(src, ec).time_since_epoch().count());
  read_identity(f);
  files.push_back(std::move(f));
  return files;
}

// data.format, or with auto what the files are: .tokens ids, .txt text, or records whose first
// one says how they are read. A folder mixing text and record files is refused: one of the two
// would be read in a way its author did not mean.
std::string resolve_format(const DataConfig& cfg, std::vector<SourceFile>& files, DataReport& r) {
  if (files.size() == 1 && files[0].name.kind == "tokens") {
    if (cfg.format != "auto" && cfg.format != "tokens")
      throw Error(str("data.format = \"", cfg.format, "\" but data.source ", cfg.source, " is a .tokens file of ids"),
                  "data.format", "set data.format = \"auto\" (or \"tokens\")");
    return "tokens";
  }
  if (cfg.format == "tokens") throw Error(str("data.format = \"tokens\" but data.source ", cfg.source, " is not a .tokens file"),
                                          "data.format", "give a .tokens file of uint32 ids, or set data.format = \"auto\"");
  const SourceFile *text = nullptr, *record = nullptr;
  for (const auto& f : files) {
    const SourceFile*& first = f.name.kind == "txt" ? text : record;
    if (!first) first = &f;
  }
  if (files.empty())
    throw Error(str("data.source ", cfg.source, " holds no data file", r.other_files ? str(" (", r.other_files, " other files, e.g. ",
                    r.first_other_file, ")") : std::string()),
                "data.source",
                "point it at a folder of .txt, .jsonl or .json files (each may be .gz or .zst), a single such file, or a .tokens file");
  if (text && record && (cfg.format == "auto" || files.size() > 1))
    throw Error(str("data.source ", cfg.source, " mixes text files (", text->path.string(), ") and record files (",
                    record->path.string(), ")"),
                "data.source", "keep one kind in the folder, or give each kind its own folder and run");
  if (cfg.format != "auto") return cfg.format;
  if (text) return "txt";
  return record_kind(*record, r);
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
  // One record of a conversation file.
  void add_line(std::string line, std::string where) {
    pending_bytes_ += line.size();
    lines_.push_back(std::move(line));
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
      // The tokenizer's template opens each text as transformers' tokenizer(text) does (Llama's BOS).
      const auto& prefix = tok_.prefix_ids();
      if (!prefix.empty()) ids[i].insert(ids[i].begin(), prefix.begin(), prefix.end());
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
    auto enc = encode_conversations(*chat_.chat, tok_, std::vector<std::string_view>(lines_.begin(), lines_.end()),
                                    chat_.format, chat_.loss_on, threads_);
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
  std::vector<std::string> lines_;
  bool last_eos_trains_ = false;
};

// A file that cannot be opened is counted, as a folder that cannot be listed is.
bool readable(const SourceFile& f, DataReport& r) {
  std::ifstream in(f.path, std::ios::binary);
  if (in) return true;
  note(r.unreadable, r.first_unreadable, f.path.string());
  return false;
}

// Calls fn(record, where) for each record of a record file: a .jsonl's lines that are not blank,
// a .json's list; invalid UTF-8 replaced and counted in `r`. Returns the number of records.
template <typename Fn>
int64_t for_each_record(const SourceFile& f, DataReport& r, Fn fn) {
  check_text_file(f);
  int64_t records = 0;
  if (f.name.kind == "json") {
    const auto list = json_records(f, r);
    for (size_t i = 0; i < list.size(); ++i, ++records) fn(list[i].dump(), str(f.path.string(), "[", i, "]"));
    return records;
  }
  ByteStream in(f.path.string(), f.name.compression);
  for_each_line(in, [&](std::string_view line, int64_t line_no) {
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) return;  // blank: no document
    ++records;
    std::string where = str(f.path.string(), ":", line_no);
    if (utf8::first_invalid(line) == std::string_view::npos) {
      fn(std::string(line), std::move(where));
      return;
    }
    int64_t n = 0;
    std::string repaired = utf8::repair(line, &n);
    note(r.invalid_utf8_documents, r.first_invalid_utf8, where);
    r.invalid_utf8_sequences += n;
    fn(std::move(repaired), std::move(where));
  });
  return records;
}

// A record file read as text: each record's `field`. A file with records and no document is
// refused: it is not what it is read as.
void read_text_records(const SourceFile& f, const std::string& field, Builder& b, DataReport& r) {
  if (!readable(f, r)) return;
  const int64_t docs_before = r.documents + r.empty;
  std::string first_bad;
  const int64_t records = for_each_record(f, r, [&](std::string record, std::string where) {
    json j = json::parse(record, nullptr, false);
    if (j.is_discarded()) {
      if (first_bad.empty()) first_bad = where + ": not JSON";
      note(r.not_json, r.first_not_json, where);
      return;
    }
    if (!j.is_object() || !j.contains(field) || !j[field].is_string()) {
      if (first_bad.empty()) first_bad = str(where, ": no string `", field, "` field");
      note(r.missing_field, r.first_missing_field, where);
      return;
    }
    b.add(j[field].get<std::string>(), where);
  });
  b.flush();
  // A file with no record is one empty input.
  if (records == 0) note(r.empty, r.first_empty, f.path.string());
  else if (r.documents + r.empty == docs_before)
    throw Error(str("data.source: no record of ", f.path.string(), " holds text (", records, " records; the first: ", first_bad, ")"),
                "data.source",
                str("give records with a string `", field, "` field, set data.text_field to the field that holds the text, "
                    "or data.format to how the file is written"));
  b.consumed(f.size);
}

// A text file: one document.
void read_text_file(const SourceFile& f, Builder& b, DataReport& r) {
  b.consumed(f.size);
  if (!readable(f, r)) return;
  ByteStream in(f.path.string(), f.name.compression);
  std::string text = read_all(in);
  check_looks_like_text(text, f.path.string());
  b.add(std::move(text), f.path.string());
}

// A conversation file: every record is one conversation or a reported bad one; a file with records
// and no conversation is refused, as its format is plainly not what it was read as.
void read_chat_records(const SourceFile& f, const std::string& format, Builder& b, DataReport& r) {
  if (!readable(f, r)) return;
  const int64_t docs_before = r.documents, bad_before = r.bad_conversations;
  const size_t examples_before = r.bad_examples.size();
  const int64_t lines = for_each_record(f, r, [&](std::string line, std::string where) { b.add_line(std::move(line), std::move(where)); });
  b.flush();
  b.consumed(f.size);
  if (lines == 0) {
    note(r.empty, r.first_empty, f.path.string());
  } else if (r.documents == docs_before) {
    const std::string first = r.bad_examples.size() > examples_before ? r.bad_examples[examples_before] : std::string();
    throw Error(str("data.source: no record of ", f.path.string(), " is a conversation (", r.bad_conversations - bad_before,
                    " records; the first: ", first, ")"),
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
void open_text_source(Dataset::State& s, const DataConfig& cfg, const std::string& format,
                      const std::vector<SourceFile>& files, const Tokenizer& tok, const Dataset::Options& opt) {
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
  if (!chat && !tok.prefix_ids().empty()) {
    std::string prefix = "prefix";
    for (int32_t id : tok.prefix_ids()) prefix += str(" ", id);
    add(prefix);
  }
  for (const auto& f : files) add(str(f.rel, "\t", f.size, "\t", f.mtime, "\t", f.ctime_ns, "\t", f.inode));
  const std::string key_hex = key.hex();

  std::string name = sha256_string(str(fs::absolute(src).lexically_normal().string(), "\n", format, "\n",
                                       format == "jsonl" ? cfg.text_field : "", "\n", tok.hash(), chat_key))
                         .substr(0, 16);
  const std::string file_name = "tokens-" + name + ".lcxtok";
  fs::path dir = cfg.cache_dir.empty()
                     ? fs::path(default_token_cache_dir((fs::is_directory(src) ? src : src.parent_path()).string(), file_name))
                     : fs::path(cfg.cache_dir);
  fs::path path = dir / file_name;
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
        if (chat) read_chat_records(f, format, b, r);
        else if (format == "jsonl") read_text_records(f, cfg.text_field, b, r);
        else read_text_file(f, b, r);
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

// 0 .. n-1 shuffled by Fisher-Yates driven by splitmix64 from `state`, with Lemire's unbiased
// bounded draw: the same order on every platform and standard library.
std::vector<int64_t> permutation(int64_t n, uint64_t state) {
  std::vector<int64_t> perm(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) perm[i] = i;
  for (uint64_t i = static_cast<uint64_t>(n); i > 1; --i) {
    uint64_t j;
    for (;;) {
      __uint128_t m = static_cast<__uint128_t>(splitmix64(state)) * i;
      uint64_t low = static_cast<uint64_t>(m);
      if (low >= (0 - i) % i) {
        j = static_cast<uint64_t>(m >> 64);
        break;
      }
    }
    std::swap(perm[i - 1], perm[j]);
  }
  return perm;
}

// The pieces of the stream a sequence is made of: each document with the EOS that closes it,
// one longer than seq_len as data.overlong says (under bfd, "continue" cuts it into pieces of
// seq_len that each open a sequence).
std::vector<Dataset::State::Segment> document_pieces(const Dataset::State& s, bool bfd, DataReport& r) {
  const int64_t L = s.cfg.seq_len;
  std::vector<Dataset::State::Segment> pieces;
  pieces.reserve(static_cast<size_t>(s.num_docs));
  for (int64_t d = 0; d < s.num_docs; ++d) {
    const int64_t b = static_cast<int64_t>(s.doc_starts[d]);
    const int64_t e = d + 1 < s.num_docs ? static_cast<int64_t>(s.doc_starts[d + 1]) : s.num_tokens;
    int64_t len = e - b;
    if (len > L) {
      ++r.longer_than_sequence;
      if (s.cfg.overlong == "drop") {
        ++r.dropped_documents;
        r.dropped_document_tokens += len;
        continue;
      }
      if (s.cfg.overlong == "truncate") {
        ++r.truncated_documents;
        r.truncated_tokens += len - L;
        len = L;
      } else if (bfd) {
        ++r.cut_documents;
        for (int64_t k = 0; k < len; k += L) pieces.push_back({b + k, std::min(L, len - k), true});
        continue;
      }
    }
    pieces.push_back({b, len, true});
  }
  return pieces;
}

// Best-fit decreasing: the longest piece first, each into the sequence with the least room that
// holds it, a new sequence when none does; ties go by position in the corpus, so the layout is
// the same on every run and every rank.
void lay_out_bfd(Dataset::State& s, std::vector<Dataset::State::Segment> pieces) {
  const int64_t L = s.cfg.seq_len;
  std::vector<size_t> order(pieces.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return pieces[a].length > pieces[b].length; });
  std::set<std::pair<int64_t, int64_t>> room;  // (room left, sequence)
  std::vector<std::vector<size_t>> bins;
  for (size_t i : order) {
    const int64_t len = pieces[i].length;
    auto it = room.lower_bound({len, -1});
    int64_t bin;
    int64_t left;
    if (it == room.end()) {
      bin = static_cast<int64_t>(bins.size());
      bins.emplace_back();
      left = L;
    } else {
      bin = it->second;
      left = it->first;
      room.erase(it);
    }
    bins[static_cast<size_t>(bin)].push_back(i);
    if (left - len > 0) room.insert({left - len, bin});
  }
  s.segments.clear();
  s.seq_segments.assign(1, 0);
  for (const auto& bin : bins) {
    for (size_t i : bin) s.segments.push_back(pieces[i]);
    s.seq_segments.push_back(static_cast<int64_t>(s.segments.size()));
  }
}

// The pieces end to end, cut every seq_len; the final partial sequence kept unless drop_last.
void lay_out_stream(Dataset::State& s, const std::vector<Dataset::State::Segment>& pieces, DataReport& r) {
  const int64_t L = s.cfg.seq_len;
  s.segments.clear();
  s.seq_segments.assign(1, 0);
  int64_t fill = 0;
  for (const auto& p : pieces) {
    // A piece's EOS alone in the next sequence does not cut the document: its text is whole.
    const int64_t text = p.length - (p.start + p.length < s.num_tokens ? 1 : 0);
    if (text > 0 && fill + text > L) ++r.cut_documents;
    for (int64_t at = 0; at < p.length;) {
      const int64_t n = std::min(p.length - at, L - fill);
      s.segments.push_back({p.start + at, n, at == 0});
      at += n;
      fill += n;
      if (fill == L) {
        s.seq_segments.push_back(static_cast<int64_t>(s.segments.size()));
        fill = 0;
      }
    }
  }
  if (fill > 0) {
    if (s.cfg.drop_last || fill < 2) {
      r.dropped_tokens = fill;
      r.dropped_why = s.cfg.drop_last ? "the final partial sequence, as data.drop_last = true"
                                      : "a final sequence of one token has no label to learn";
      s.segments.resize(static_cast<size_t>(s.seq_segments.back()));
    } else {
      s.seq_segments.push_back(static_cast<int64_t>(s.segments.size()));
    }
  }
}

}  // namespace

std::string DataReport::summary() const {
  if (!mixture.empty()) {
    std::string s = str("data: ", mixture);
    if (untrained_sequences)
      s += str("; ", untrained_sequences, untrained_sequences == 1 ? " sequence has" : " sequences have",
               " no target that trains");
    if (held_out)
      s += held_out_side ? str("; evaluating the ", held_out, " of them held out (eval.split)")
                         : str("; ", held_out, " of them held out for evaluation (eval.split), not trained on");
    return s;
  }
  const bool chat = !loss_on.empty();
  const char* doc = chat ? " conversation" : " document";
  std::string s = str("data: ", files, files == 1 ? " file, " : " files, ", documents, doc, documents == 1 ? ", " : "s, ",
                      tokens, " tokens -> ", sequences, sequences == 1 ? " sequence" : " sequences");
  if (chat)
    s += str(" (", format, ", template ", chat_template, ", loss on ", loss_on, ": ", trained_tokens, " tokens train)");
  auto percent = [](int64_t part, int64_t whole) {
    return whole ? static_cast<double>(std::llround(1000.0 * static_cast<double>(part) / static_cast<double>(whole))) / 10 : 0.0;
  };
  if (packing == "bfd")
    s += str(" packed best-fit (", padding, " padding tokens, ", percent(padding, positions), "% of positions; tokens fill ",
             percent(positions - padding, sequences * seq_len), "% of sequences x seq_len)");
  else if (padding) s += str(" (", padding, " padding tokens in the last)");
  if (dropped_tokens) s += str(", ", dropped_tokens, " tokens dropped (", dropped_why, ")");
  std::vector<std::string> bad;
  auto add = [&](int64_t n, const char* what, const std::string& first) {
    if (n) bad.push_back(str(n, " ", what, " (first: ", first, ")"));
  };
  add(empty, "empty", first_empty);
  add(unreadable, "unreadable", first_unreadable);
  add(not_json, "not JSON", first_not_json);
  add(missing_field, "without the text field", first_missing_field);
  add(other_files, other_files == 1 ? "file that is no data" : "files that are no data", first_other_file);
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
             longer_than_sequence && overlong != "truncate" && overlong != "drop"
                 ? str(" (", longer_than_sequence, " longer than data.seq_len)")
                 : std::string());
  if (truncated_documents)
    s += str("; ", truncated_documents, doc, truncated_documents == 1 ? "" : "s", " longer than data.seq_len truncated (",
             truncated_tokens, " tokens cut, data.overlong = \"truncate\")");
  if (dropped_documents)
    s += str("; ", dropped_documents, doc, dropped_documents == 1 ? "" : "s", " longer than data.seq_len dropped (",
             dropped_document_tokens, " tokens, data.overlong = \"drop\")");
  if (untrained_sequences)
    s += str("; ", untrained_sequences, untrained_sequences == 1 ? " sequence has" : " sequences have",
             " no target that trains (its steps add nothing to the loss)");
  if (invalid_utf8_documents)
    s += str("; ", invalid_utf8_documents, " with invalid UTF-8, ", invalid_utf8_sequences,
             " sequences replaced by U+FFFD (first: ", first_invalid_utf8, ")");
  if (held_out)
    s += held_out_side ? str("; evaluating the ", held_out, " of them held out (eval.split)")
                       : str("; ", held_out, " of them held out for evaluation (eval.split), not trained on");
  s += from_cache ? str("; token cache ", cache_path) : (cache_path.empty() ? "" : str("; wrote token cache ", cache_path));
  return s;
}

Dataset Dataset::open(const DataConfig& cfg, const Tokenizer& tok, const Options& opt) {
  if (!cfg.sources.empty()) return open_mixture(cfg, tok, opt);
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
  std::vector<SourceFile> files = list_files(cfg, s->report);
  const std::string format = resolve_format(cfg, files, s->report);
  s->report.format = format;
  if (format == "tokens") {
    resolve_loss_on(cfg, format);
    open_token_source(*s, cfg, tok);
  } else {
    open_text_source(*s, cfg, format, files, tok, opt);
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
  const bool bfd = cfg.packing == "bfd";
  if (bfd || cfg.overlong != "continue") {
    std::vector<State::Segment> pieces = document_pieces(*s, bfd, r);
    if (bfd) lay_out_bfd(*s, std::move(pieces));
    else lay_out_stream(*s, pieces, r);
    s->num_sequences = static_cast<int64_t>(s->seq_segments.size()) - 1;
    if (s->num_sequences == 0)
      throw Error(str("data.source ", cfg.source, " leaves no sequence: every document is longer than data.seq_len = ", L,
                      " and data.overlong = \"drop\""),
                  "data.overlong", "set data.overlong = \"truncate\" or \"continue\", or raise data.seq_len");
    // Each sequence's targets that train, and its padding, counted once.
    std::vector<int32_t> tk(static_cast<size_t>(L));
    std::vector<int64_t> tg(static_cast<size_t>(L));
    std::vector<int64_t> bounds;
    s->seq_valid.resize(static_cast<size_t>(s->num_sequences));
    for (int64_t i = 0; i < s->num_sequences; ++i) {
      const int64_t n = s->padded_length(i);
      s->fill(i, tk.data(), tg.data(), n, bounds);
      int64_t v = 0;
      for (int64_t t = 0; t < n; ++t) v += tg[t] != -100;
      s->seq_valid[i] = v;
      r.padding += n - s->real_length(i);
      r.positions += n;
    }
  } else {
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
    // Documents cut by a sequence's end: continued in the next one, their masks with their tokens.
    for (int64_t d = 0; d < s->num_docs; ++d) {
      const int64_t b = static_cast<int64_t>(s->doc_starts[d]);
      const int64_t e = d + 1 < s->num_docs ? static_cast<int64_t>(s->doc_starts[d + 1]) - 1 : s->num_tokens;  // eos excluded
      if (e - b > L) ++r.longer_than_sequence;
      if (e > b && b / L != (e - 1) / L) ++r.cut_documents;
    }
    r.positions = (s->num_sequences - 1) * L + s->last_length;
  }
  r.sequences = s->num_sequences;
  r.packing = cfg.packing;
  r.seq_len = cfg.seq_len;
  r.overlong = cfg.overlong;
  return finish(std::move(s), opt);
}

// What every dataset does once its sequences are laid out: count those with nothing to train,
// hold out eval.split's share, log the summary, refuse one with no target at all.
Dataset Dataset::finish(std::shared_ptr<State> s, const Options& opt) {
  const DataConfig& cfg = s->cfg;
  DataReport& r = s->report;
  for (int64_t i = 0; i < s->num_sequences; ++i)
    if (s->valid_labels(i) == 0) ++r.untrained_sequences;
  if (opt.held_out > 0) {
    const int64_t n = s->num_sequences;
    const int64_t k = std::max<int64_t>(1, std::llround(opt.held_out * static_cast<double>(n)));
    if (k >= n)
      throw Error(str("eval.split = ", opt.held_out, " holds out ", k, " of the ", n, " sequences of ", data_name(cfg),
                      ", leaving none to train on"),
                  "eval.split", "use a smaller share, or give held-out data in eval.source");
    // Drawn apart from the epochs' shuffles, from the seed alone: the same share on every run,
    // resumed or not, whatever data.shuffle says.
    const std::vector<int64_t> perm = permutation(n, static_cast<uint64_t>(opt.seed) * 0xD1342543DE82EF95ull ^ 0x6576616c73706c74ull);
    std::vector<uint8_t> held(static_cast<size_t>(n), 0);
    for (int64_t j = 0; j < k; ++j) held[static_cast<size_t>(perm[j])] = 1;
    for (int64_t i = 0; i < n; ++i)
      if (held[static_cast<size_t>(i)] == (opt.held_out_side ? 1 : 0)) s->view.push_back(i);
    r.held_out = k;
    r.held_out_side = opt.held_out_side;
  }
  Dataset d;
  d.s_ = std::move(s);
  log::info(r.summary());
  // Every step would have no loss to take (a NaN, skipped): say why at the start.
  const int64_t valid = r.untrained_sequences == d.s_->num_sequences ? 0 : 1;
  if (valid == 0 && d.s_->mask)
    throw Error(str(data_name(cfg), " has no trainable target: no token of its conversations is selected by ",
                    "data.loss_on = \"", r.loss_on, "\" (", r.summary(), ")"),
                "data.loss_on", "give conversations with assistant turns, or set data.loss_on = \"all\"");
  if (valid == 0)
    throw Error(str(data_name(cfg), " has no trainable target: every token is the end of a document, which "
                    "predicts nothing"),
                "data.source", "give documents with text in them (a token file of only end-of-text ids has none)");
  if (r.dropped_tokens) log::warn(str("data: dropped ", r.dropped_tokens, " tokens at the end of the stream: ", r.dropped_why));
  return d;
}

// Each source read as [data] reads one (its own token cache, packing and report), then a fixed
// list of the mixture's sequences: from source k, c_k of them (weight: c_k / sum c = w_k / sum w,
// with sum c the sources' sequences together; fraction: c_k = f_k x its own), drawn from a
// permutation of its sequences seeded by run.seed and k (cycled where c_k exceeds them), the
// sources interleaved evenly (the j-th of c_k at (j + 1/2) / c_k). The epochs shuffle this list as
// they shuffle one source's, so a resumed run reads what the first one would have.
Dataset Dataset::open_mixture(const DataConfig& cfg, const Tokenizer& tok, const Options& opt) {
  auto s = std::make_shared<State>();
  s->cfg = cfg;
  s->seed = opt.seed;
  s->eos = tok.eos_id();
  DataReport& r = s->report;
  int64_t total = 0;
  double weights = 0;
  for (const DataSource& src : cfg.sources) {
    DataConfig one = cfg;
    one.sources.clear();
    one.source = src.path;
    Options o = opt;
    o.held_out = 0;
    const Dataset part = open(one, tok, o);
    const DataReport& p = part.report();
    r.files += p.files;
    r.documents += p.documents;
    r.tokens += p.tokens;
    r.trained_tokens += p.trained_tokens;
    total += part.num_sequences();
    weights += src.weight;
    s->parts.push_back(part.s_);
  }
  std::vector<std::tuple<double, int32_t, int64_t>> order;
  std::string parts;
  for (size_t k = 0; k < cfg.sources.size(); ++k) {
    const DataSource& src = cfg.sources[k];
    const int64_t n = s->parts[k]->num_sequences;
    const double want = src.weight > 0 ? static_cast<double>(total) * src.weight / weights : static_cast<double>(n) * src.fraction;
    const int64_t c = std::max<int64_t>(1, std::llround(want));
    const std::vector<int64_t> perm =
        permutation(n, (static_cast<uint64_t>(opt.seed) * 0xD1342543DE82EF95ull) ^ (0x6d697874ull + 0x9E3779B97F4A7C15ull * (k + 1)));
    for (int64_t j = 0; j < c; ++j)
      order.emplace_back((static_cast<double>(j) + 0.5) / static_cast<double>(c), static_cast<int32_t>(k), perm[j % n]);
    parts += str(k ? "; " : "", src.path, ": ", c, " of its ", n, src.weight > 0 ? str(", weight ", src.weight) : str(", fraction ", src.fraction));
  }
  std::sort(order.begin(), order.end());
  s->entries.reserve(order.size());
  for (const auto& [key, k, i] : order) s->entries.emplace_back(k, i);
  s->num_sequences = static_cast<int64_t>(s->entries.size());
  r.sequences = s->num_sequences;
  r.format = "mixture";
  r.mixture = str(cfg.sources.size(), " sources mixed -> ", r.sequences, " sequences an epoch (", parts, ")");
  return finish(std::move(s), opt);
}

int64_t Dataset::num_sequences() const { return s_->count(); }
int64_t Dataset::seq_len() const { return s_->cfg.seq_len; }
int64_t Dataset::num_documents() const { return s_->num_docs; }
const DataReport& Dataset::report() const { return s_->report; }

int64_t Dataset::length(int64_t index) const { return s_->padded_length(s_->at(index)); }

int64_t Dataset::valid_labels(int64_t index) const { return s_->valid_labels(s_->at(index)); }

// With masked documents each one's EOS predicts nothing: the next document is out of its sight.
int64_t Dataset::State::valid_labels(int64_t index) const {
  if (mixed()) return part(index).valid_labels(entries[index].second);
  const State& s = *this;
  if (s.laid_out()) return s.seq_valid[index];
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
  if (index < 0 || index >= num_sequences())
    throw Error(str("sequence ", index, " is outside the dataset's ", num_sequences()));
  return s_->get(s_->at(index));
}

Sequence Dataset::State::get(int64_t index) const {
  if (mixed()) return part(index).get(entries[index].second);
  const State& s = *this;
  const int64_t L = s.padded_length(index), real = s.real_length(index), a = index * s.cfg.seq_len;
  Sequence q;
  q.tokens = Tensor::empty({L}, DType::i32);
  q.targets = Tensor::empty({L}, DType::i64);
  int32_t* tk = q.tokens.data_as<int32_t>();
  int64_t* tg = q.targets.data_as<int64_t>();
  if (s.laid_out()) {
    s.fill(index, tk, tg, L, q.document_bounds);
    q.document_count = static_cast<int>(s.seq_segments[index + 1] - s.seq_segments[index]);
    return q;
  }
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
  const int64_t n = s.count();
  if (position < 0 || position >= n) throw Error(str("position ", position, " is outside the epoch"));
  if (!s.cfg.shuffle) return position;
  std::lock_guard<std::mutex> lock(s.perm_mu);
  if (s.perm_epoch != epoch) {
    uint64_t state = static_cast<uint64_t>(s.seed) * 0xD1342543DE82EF95ull + static_cast<uint64_t>(epoch);
    s.perm = permutation(n, state);
    s.perm_epoch = epoch;
  }
  return s.perm[position];
}

int64_t Dataset::steps_per_epoch(int64_t batch_size) const {
  if (batch_size < 1) throw Error(str("batch size ", batch_size, " must be at least 1"));
  return (s_->count() + batch_size - 1) / batch_size;
}

Batch Dataset::batch(int64_t step, int64_t batch_size) const {
  const int64_t spe = steps_per_epoch(batch_size);
  Batch b;
  b.epoch = step / spe;
  const int64_t begin = (step % spe) * batch_size, end = std::min(begin + batch_size, s_->count());
  for (int64_t p = begin; p < end; ++p) {
    int64_t i = index_at(b.epoch, p);
    b.sequences.push_back(get(i));
    b.tokens += s_->real_length(s_->at(i));
    b.valid_labels += valid_labels(i);
  }
  return b;
}

}  // namespace lcx
