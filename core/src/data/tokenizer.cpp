#include "data/tokenizer.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "data/bpe.h"
#include "data/pre_tokenizer.h"
#include "data/utf8.h"
#include "lcx/error.h"
#include "lcx/log.h"
#include "util/file.h"
#include "util/sha256.h"

namespace lcx {
namespace {

using json = nlohmann::json;

// GPT-2's reversible map from bytes to printable code points (ByteLevel's alphabet).
std::vector<uint32_t> byte_to_char() {
  std::vector<uint32_t> map(256, 0);
  std::vector<bool> direct(256, false);
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) map[b] = direct[b] ? b : next++;
  return map;
}

// The ByteLevel decoder's rule for one token string: its bytes when every code point is in the
// alphabet, otherwise the string's own UTF-8 bytes.
std::string byte_level_bytes(const std::string& token, bool* all_mapped = nullptr) {
  static const auto char_to_byte = [] {
    std::vector<int> m(512, -1);
    auto b2c = byte_to_char();
    for (int b = 0; b < 256; ++b) m[b2c[b]] = b;
    return m;
  }();
  std::string out;
  auto p = reinterpret_cast<const unsigned char*>(token.data());
  if (utf8::first_invalid(token) != std::string_view::npos) {
    if (all_mapped) *all_mapped = false;
    return token;
  }
  for (size_t i = 0; i < token.size();) {
    int len;
    uint32_t cp = utf8::decode(p + i, len);
    if (cp >= 512 || char_to_byte[cp] < 0) {
      if (all_mapped) *all_mapped = false;
      return token;
    }
    out.push_back(static_cast<char>(char_to_byte[cp]));
    i += len;
  }
  if (all_mapped) *all_mapped = true;
  return out;
}

constexpr int64_t kMaxVocabId = int64_t{1} << 24;

[[noreturn]] void refuse(const std::string& path, const std::string& key, const json& value,
                         const std::string& supported) {
  throw Error(str(path, ": tokenizer.json ", key, " = ", value.dump(), " is not supported by lcx"), key,
              "lcx implements " + supported);
}

// j[key] without copying it (json::value returns a copy: the model holds 300k strings).
const json& member(const json& j, const char* key) {
  static const json null;
  auto it = j.find(key);
  return it == j.end() ? null : *it;
}

bool is_null_or(const json& j, const char* key, const json& allowed) {
  return !j.contains(key) || j[key].is_null() || j[key] == allowed;
}

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

struct Match {
  size_t start, stop;
  int32_t id;
};

// Leftmost-longest matching of a set of added tokens, then the single_word / lstrip / rstrip
// rules exactly as tokenizers' AddedVocabulary::find_matches applies them.
class AddedMatcher {
 public:
  void build(std::vector<AddedToken> tokens) {
    tokens_ = std::move(tokens);
    by_first_.assign(256, {});
    for (size_t i = 0; i < tokens_.size(); ++i)
      if (!tokens_[i].content.empty()) by_first_[static_cast<unsigned char>(tokens_[i].content[0])].push_back(i);
    for (auto& v : by_first_)
      std::stable_sort(v.begin(), v.end(), [&](size_t a, size_t b) {
        return tokens_[a].content.size() > tokens_[b].content.size();
      });
  }
  bool empty() const { return tokens_.empty(); }

  std::vector<Match> find(std::string_view s) const {
    std::vector<Match> out;
    if (tokens_.empty()) return out;
    size_t start_offset = 0, i = 0;
    while (i < s.size()) {
      const auto& cands = by_first_[static_cast<unsigned char>(s[i])];
      const AddedToken* hit = nullptr;
      for (size_t k : cands)
        if (s.compare(i, tokens_[k].content.size(), tokens_[k].content) == 0) {
          hit = &tokens_[k];
          break;
        }
      if (!hit) {
        ++i;
        continue;
      }
      size_t start = i, stop = i + hit->content.size();
      i = stop;  // matches never overlap, even when the one found is then rejected
      if (hit->single_word) {
        bool start_space = start == 0 || !ends_with_word(s.substr(0, start));
        bool stop_space = stop == s.size() || !starts_with_word(s.substr(stop));
        if (!start_space || !stop_space) continue;
      }
      if (hit->lstrip) start = std::max(space_leftmost_at_end(s.substr(0, start)), start_offset);
      if (hit->rstrip) stop += space_rightmost_at_start(s.substr(stop));
      out.push_back({start, stop, hit->id});
      start_offset = stop;
      i = std::max(i, stop);
    }
    return out;
  }

 private:
  static bool is_alnum(uint32_t cp) {
    auto k = pretok::char_class(cp);
    return k == pretok::kLetter || k == pretok::kNumber;
  }
  static bool ends_with_word(std::string_view s) {
    if (s.empty()) return false;
    size_t j = s.size() - 1;  // start of the last code point
    while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
    int len;
    return is_alnum(utf8::decode(reinterpret_cast<const unsigned char*>(s.data()) + j, len));
  }
  static bool starts_with_word(std::string_view s) {
    if (s.empty()) return false;
    int len;
    return is_alnum(utf8::decode(reinterpret_cast<const unsigned char*>(s.data()), len));
  }
  // Rust's char::is_whitespace is the White_Space property, the same set as the regex's \s.
  static bool is_space_at(std::string_view s, size_t i, int& len) {
    return pretok::char_class(utf8::decode(reinterpret_cast<const unsigned char*>(s.data()) + i, len)) ==
           pretok::kSpace;
  }
  static size_t space_leftmost_at_end(std::string_view s) {
    size_t i = s.size();
    while (i > 0) {
      size_t j = i - 1;
      while (j > 0 && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) --j;
      int len;
      if (!is_space_at(s, j, len)) break;
      i = j;
    }
    return i;
  }
  static size_t space_rightmost_at_start(std::string_view s) {
    size_t i = 0;
    int len;
    while (i < s.size() && is_space_at(s, i, len)) i += len;
    return i;
  }

  std::vector<AddedToken> tokens_;
  std::vector<std::vector<size_t>> by_first_;
};

}  // namespace

struct Tokenizer::Impl {
  // A normalizer of tokenizer.json, in the order the file lists them.
  struct NormOp {
    enum Kind : uint8_t { kNfc, kReplace, kPrepend } kind = kNfc;
    std::string from, to;  // kReplace: every `from` becomes `to`; kPrepend: `to` before a non-empty text
  };
  // A decoder of tokenizer.json, applied to the list of token strings in order.
  struct DecodeOp {
    enum Kind : uint8_t { kReplace, kByteFallback, kFuse, kStrip } kind = kReplace;
    std::string from, to;      // kReplace; kStrip: `from` is the character stripped
    size_t start = 0, stop = 0;  // kStrip: at most this many at each end of every token
  };

  std::string path, hash;
  std::vector<NormOp> norm_ops;
  bool nfc_only = false;  // norm_ops is exactly NFC: offsets through the piecewise map below
  pretok::Steps steps;
  bool byte_level = true;  // ByteLevel pre-tokenizer and decoder; else characters and decode_ops
  std::vector<DecodeOp> decode_ops;
  std::vector<int32_t> prefix_ids, suffix_ids;  // the post-processor's template around one text
  std::unique_ptr<BpeModel> bpe;
  AddedMatcher raw_added;         // normalized: false, matched on the input
  AddedMatcher normalized_added;  // normalized: true, matched after normalizing
  std::vector<std::string> added_bytes;  // by id - first_added: what the decoder writes
  std::vector<char> added_special;
  std::vector<std::pair<std::string, int32_t>> added_by_content;
  int32_t first_added = 0;
  int64_t vocab_size = 0;
  std::vector<uint32_t> token_bytes;  // by BPE id: the bytes of normalized text it stands for
  int32_t eos = -1;

  mutable std::mutex cache_mu;
  mutable std::vector<std::unique_ptr<WordCache>> caches;

  std::unique_ptr<WordCache> take_cache() const {
    std::lock_guard<std::mutex> lock(cache_mu);
    if (caches.empty()) return std::make_unique<WordCache>();
    auto c = std::move(caches.back());
    caches.pop_back();
    return c;
  }
  void give_cache(std::unique_ptr<WordCache> c) const {
    std::lock_guard<std::mutex> lock(cache_mu);
    caches.push_back(std::move(c));
  }

  bool only_nfc_or_nothing() const { return norm_ops.empty() || nfc_only; }

  // Whether text[0, cut) encodes apart from what follows (text holds a little past the cut as
  // the regex's lookahead, and begins where the whole input has a piece boundary): no added token
  // spans the cut, and the pre-tokenizer's last piece before it ends there.
  bool cuts_whole_at(std::string_view text, size_t cut) const {
    size_t from = 0;
    for (const Match& m : raw_added.find(text)) {
      if (m.start < cut && m.stop > cut) return false;
      if (m.stop <= cut) from = m.stop;
    }
    // As encode() sees it: repaired, then NFC, each side of the cut alone (a cut follows a
    // newline, which neither repair nor NFC joins to what comes after it).
    auto prepared = [&](std::string_view part) {
      std::string p = utf8::first_invalid(part) == std::string_view::npos ? std::string(part) : utf8::repair(part, nullptr);
      return nfc_only && utf8::may_change_under_nfc(p) ? utf8::nfc(p) : p;
    };
    const std::string before = prepared(text.substr(from, cut - from)), after = prepared(text.substr(cut));
    const std::string joined = before + after;
    return steps.for_each_piece(std::string_view(joined), before.size(), [](const pretok::Piece&) {});
  }

  // `raw` normalized. `src`, when given, gets for each byte of the result the byte of `raw` it
  // comes from (a prepended text: 0), plus raw.size() at the end.
  std::string normalize(std::string_view raw, std::vector<uint32_t>* src = nullptr) const {
    std::string s(raw);
    if (src) {
      src->resize(raw.size() + 1);
      for (size_t i = 0; i <= raw.size(); ++i) (*src)[i] = static_cast<uint32_t>(i);
    }
    for (const NormOp& op : norm_ops) {
      if (op.kind == NormOp::kNfc) {
        if (utf8::may_change_under_nfc(s)) s = utf8::nfc(s);
      } else if (op.kind == NormOp::kPrepend) {
        if (s.empty()) continue;
        s.insert(0, op.to);
        if (src) src->insert(src->begin(), op.to.size(), 0);
      } else {
        std::string out;
        std::vector<uint32_t> map;
        for (size_t i = 0; i < s.size();) {
          if (s.compare(i, op.from.size(), op.from) == 0) {
            out += op.to;
            if (src) map.insert(map.end(), op.to.size(), (*src)[i]);
            i += op.from.size();
          } else {
            out += s[i];
            if (src) map.push_back((*src)[i]);
            ++i;
          }
        }
        if (src) {
          map.push_back(static_cast<uint32_t>(raw.size()));
          *src = std::move(map);
        }
        s = std::move(out);
      }
    }
    return s;
  }

  // The pieces of s[0, n) (s may go on past n: lookahead for the regex), each through BPE.
  // `spans`, when given, gets each id's bytes in `s`'s coordinates, from `at` on. Returns
  // Steps::split's answer.
  bool pre_tokenize(std::string_view s, size_t n, size_t at, WordCache& cache, std::vector<int32_t>& out,
                    std::vector<TokenSpan>* spans) const {
    std::string word;
    return steps.for_each_piece(s, n, [&](const pretok::Piece& p) {
      std::string_view w = s.substr(p.begin, p.end - p.begin);
      if (p.prefixed) {
        word.assign(1, ' ');
        word.append(w);
        w = word;
      }
      const size_t first = out.size();
      cache.lookup(*bpe, w, out);
      if (spans) {
        // A word's tokens are its bytes cut in order; a prefix space belongs to no byte of s.
        const size_t prefix = p.prefixed ? 1 : 0;
        size_t x = 0;
        auto to_s = [&](size_t wx) { return static_cast<uint32_t>(at + p.begin + (wx > prefix ? wx - prefix : 0)); };
        for (size_t k = first; k < out.size(); ++k) {
          const size_t e = k + 1 == out.size() ? w.size() : std::min(w.size(), x + token_bytes[static_cast<size_t>(out[k])]);
          spans->push_back({to_s(x), to_s(e)});
          x = e;
        }
      }
    });
  }

  // A stretch of input between added tokens, raw[0, raw_n), with raw[raw_n, ...) after it as
  // lookahead: normalize, split on normalized added tokens, pre-tokenize and run BPE. `spans`,
  // when given, gets each id's bytes in `raw`, plus `base`. Returns false when the stretch's end
  // is not a piece boundary of the whole input (the caller encodes a longer stretch instead).
  bool encode_plain(std::string_view raw, size_t raw_n, WordCache& cache, std::vector<int32_t>& out,
                    std::vector<TokenSpan>* spans = nullptr, size_t base = 0) const {
    std::string normalized;
    std::vector<uint32_t> src;
    std::string_view s = raw;
    size_t n = raw_n;
    if (nfc_only) {
      if (utf8::may_change_under_nfc(raw)) {
        normalized = utf8::nfc(raw.substr(0, raw_n));
        n = normalized.size();
        if (raw_n < raw.size()) normalized += utf8::nfc(raw.substr(raw_n));
        if (normalized != raw) s = normalized;
        else n = raw_n;
      }
    } else if (!norm_ops.empty()) {
      // Only NFC lets a text be cut, so here the stretch has no lookahead.
      normalized = normalize(raw.substr(0, raw_n), spans ? &src : nullptr);
      s = normalized;
      n = normalized.size();
    }
    const size_t first = spans ? spans->size() : 0;
    size_t at = 0;
    if (!normalized_added.empty())
      for (const Match& m : normalized_added.find(s.substr(0, n))) {
        pre_tokenize(s.substr(at, m.start - at), m.start - at, at, cache, out, spans);
        out.push_back(m.id);
        if (spans) spans->push_back({static_cast<uint32_t>(m.start), static_cast<uint32_t>(m.stop)});
        at = m.stop;
      }
    const bool ok = pre_tokenize(s.substr(at), n - at, at, cache, out, spans);
    if (!spans) return ok;
    const auto span_begin = spans->begin() + static_cast<std::ptrdiff_t>(first);
    if (!src.empty()) {
      for (auto it = span_begin; it != spans->end(); ++it) it->begin = src[it->begin], it->end = src[it->end];
    } else if (s.data() != raw.data()) {
      to_raw_spans(raw.substr(0, raw_n), s.substr(0, n), span_begin, spans->end());
    }
    for (auto it = span_begin; it != spans->end(); ++it)
      it->begin += static_cast<uint32_t>(base), it->end += static_cast<uint32_t>(base);
    return ok;
  }

  // Spans in the NFC of `raw` back to `raw`. NFC never composes across an ASCII character (each
  // is a starter that neither decomposes nor takes part in a composition as the second), so the
  // text normalizes piece by piece, each piece one ASCII character and the non-ASCII bytes after
  // it; a span inside a piece NFC changed widens to the whole piece.
  template <typename It>
  static void to_raw_spans(std::string_view raw, std::string_view norm, It first, It last) {
    struct Piece {
      size_t norm_begin, raw_begin, raw_end;
      bool same;
    };
    std::vector<Piece> pieces;
    size_t n = 0;
    for (size_t i = 0; i < raw.size();) {
      size_t j = i + 1;
      while (j < raw.size() && static_cast<unsigned char>(raw[j]) >= 0x80) ++j;
      const std::string_view piece = raw.substr(i, j - i);
      const std::string p = utf8::nfc(piece);
      pieces.push_back({n, i, j, p == piece});
      n += p.size();
      i = j;
    }
    if (n != norm.size()) pieces.assign(1, {0, 0, raw.size(), false});  // not piecewise: the whole text
    auto piece_of = [&](size_t at) {
      auto it = std::upper_bound(pieces.begin(), pieces.end(), at, [](size_t v, const Piece& p) { return v < p.norm_begin; });
      return it == pieces.begin() ? pieces.begin() : it - 1;
    };
    for (It it = first; it != last; ++it) {
      auto b = piece_of(it->begin), e = piece_of(it->end == 0 ? 0 : it->end - 1);
      const size_t rb = b->same ? b->raw_begin + (it->begin - b->norm_begin) : b->raw_begin;
      const size_t re = e->same ? e->raw_begin + (it->end - e->norm_begin) : e->raw_end;
      it->begin = static_cast<uint32_t>(rb);
      it->end = static_cast<uint32_t>(std::max(rb, re));
    }
  }

  int32_t token_to_id(std::string_view token) const;
  int32_t token_to_id_in_model(std::string_view token) const;
  bool is_special(int32_t id) const {
    const int64_t a = static_cast<int64_t>(id) - first_added;
    return a >= 0 && a < static_cast<int64_t>(added_special.size()) && added_special[static_cast<size_t>(a)];
  }
};

namespace {

AddedToken parse_added(const std::string& path, const json& t, size_t index) {
  auto key = str("added_tokens[", index, "]");
  if (!t.contains("id") || !t.contains("content")) refuse(path, key, t, "added tokens with id and content");
  AddedToken a;
  a.id = t["id"].get<int32_t>();
  a.content = t["content"].get<std::string>();
  a.single_word = t.value("single_word", false);
  a.lstrip = t.value("lstrip", false);
  a.rstrip = t.value("rstrip", false);
  a.normalized = t.value("normalized", !t.value("special", false));
  a.special = t.value("special", false);
  if (a.content.empty()) refuse(path, key + ".content", t["content"], "non-empty added tokens");
  return a;
}

using NormOp = Tokenizer::Impl::NormOp;
using DecodeOp = Tokenizer::Impl::DecodeOp;

std::string type_of(const json& j) { return j.is_object() ? j.value("type", "") : ""; }
json type_json(const json& j) { return j.is_object() ? j.value("type", json()) : j; }

// A Replace's or Split's pattern {"String": s} (the only kind lcx takes where `regex_ok` is false).
std::string literal_pattern(const std::string& path, const std::string& key, const json& pattern, const std::string& what) {
  if (!pattern.is_object() || !pattern.contains("String") || !pattern["String"].is_string())
    refuse(path, key, pattern, what);
  return pattern["String"].get<std::string>();
}

const char* const kNormalizers = "the normalizers NFC, Replace (a String pattern), Prepend and a Sequence of them";

void parse_normalizer(const std::string& path, const std::string& key, const json& n, std::vector<NormOp>& ops) {
  if (n.is_null()) return;
  const std::string type = type_of(n);
  if (type == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
    for (size_t i = 0; i < n["normalizers"].size(); ++i)
      parse_normalizer(path, str(key, ".normalizers[", i, "]"), n["normalizers"][i], ops);
  } else if (type == "NFC") {
    ops.push_back({NormOp::kNfc, "", ""});
  } else if (type == "Replace") {
    NormOp op{NormOp::kReplace, literal_pattern(path, key + ".pattern", member(n, "pattern"), kNormalizers), ""};
    if (op.from.empty()) refuse(path, key + ".pattern", n["pattern"], kNormalizers);
    if (!n.contains("content") || !n["content"].is_string()) refuse(path, key + ".content", member(n, "content"), kNormalizers);
    op.to = n["content"].get<std::string>();
    ops.push_back(op);
  } else if (type == "Prepend") {
    if (!n.contains("prepend") || !n["prepend"].is_string()) refuse(path, key + ".prepend", member(n, "prepend"), kNormalizers);
    ops.push_back({NormOp::kPrepend, "", n["prepend"].get<std::string>()});
  } else {
    refuse(path, key + ".type", type_json(n), kNormalizers);
  }
}

const char* const kPreTokenizers =
    "the pre-tokenizers Split (a Regex or String pattern; behavior Isolated, Removed, MergedWithPrevious, "
    "MergedWithNext or Contiguous), ByteLevel and a Sequence of them";

pretok::Behavior parse_behavior(const std::string& path, const std::string& key, const json& b) {
  static const std::pair<const char*, pretok::Behavior> kNames[] = {
      {"Isolated", pretok::Behavior::kIsolated},
      {"Removed", pretok::Behavior::kRemoved},
      {"MergedWithPrevious", pretok::Behavior::kMergedWithPrevious},
      {"MergedWithNext", pretok::Behavior::kMergedWithNext},
      {"Contiguous", pretok::Behavior::kContiguous}};
  if (b.is_string())
    for (const auto& [name, value] : kNames)
      if (b == name) return value;
  refuse(path, key, b, kPreTokenizers);
}

std::shared_ptr<const pretok::Regex> compile(const std::string& path, const std::string& key, const std::string& pattern) {
  try {
    return std::make_shared<const pretok::Regex>(pattern);
  } catch (const std::invalid_argument& e) {
    throw Error(str(path, ": tokenizer.json ", key, " = ", json(pattern).dump(), " does not compile as a regex: ", e.what()),
                key, "fix the pattern, or use the model's own tokenizer.json");
  }
}

void parse_pre_tokenizer(const std::string& path, const std::string& key, const json& p, pretok::Steps& steps,
                         bool& byte_level) {
  if (p.is_null()) return;
  const std::string type = type_of(p);
  if (type == "Sequence" && p.contains("pretokenizers") && p["pretokenizers"].is_array()) {
    for (size_t i = 0; i < p["pretokenizers"].size(); ++i)
      parse_pre_tokenizer(path, str(key, ".pretokenizers[", i, "]"), p["pretokenizers"][i], steps, byte_level);
  } else if (type == "Split") {
    pretok::Step step;
    const json& pattern = member(p, "pattern");
    if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string()) {
      const std::string re = pattern["Regex"].get<std::string>();
      if (re == pretok::kQwenPattern || re == pretok::kLlama3Pattern) {
        step.kind = pretok::Step::kQwenSplit;
        step.max_digits = re == pretok::kLlama3Pattern ? 3 : 1;
      } else {
        step.kind = pretok::Step::kRegexSplit;
        step.regex = compile(path, key + ".pattern.Regex", re);
      }
    } else {
      step.kind = pretok::Step::kStringSplit;
      step.literal = literal_pattern(path, key + ".pattern", pattern, kPreTokenizers);
      if (step.literal.empty()) refuse(path, key + ".pattern", pattern, kPreTokenizers);
    }
    step.behavior = parse_behavior(path, key + ".behavior", member(p, "behavior"));
    step.invert = p.value("invert", false);
    steps.steps.push_back(step);
  } else if (type == "ByteLevel") {
    byte_level = true;
    if (p.value("add_prefix_space", false)) steps.steps.push_back({pretok::Step::kPrefixSpace, nullptr, "", {}, false});
    if (p.value("use_regex", true)) {
      static const auto gpt2 = std::make_shared<const pretok::Regex>(pretok::kGpt2Pattern);
      steps.steps.push_back({pretok::Step::kRegexSplit, gpt2, "", pretok::Behavior::kIsolated, false});
    }
  } else {
    refuse(path, key + ".type", type_json(p), kPreTokenizers);
  }
}

const char* const kDecoders = "the decoders ByteLevel (alone), Replace (a String pattern), ByteFallback, Fuse, Strip "
                              "and a Sequence of them";

void parse_decoder(const std::string& path, const std::string& key, const json& d, std::vector<DecodeOp>& ops,
                   bool& byte_level) {
  const std::string type = type_of(d);
  if (type == "Sequence" && d.contains("decoders") && d["decoders"].is_array()) {
    for (size_t i = 0; i < d["decoders"].size(); ++i)
      parse_decoder(path, str(key, ".decoders[", i, "]"), d["decoders"][i], ops, byte_level);
  } else if (type == "ByteLevel" && key == "decoder") {
    byte_level = true;
  } else if (type == "Replace") {
    DecodeOp op{DecodeOp::kReplace, literal_pattern(path, key + ".pattern", member(d, "pattern"), kDecoders), "", 0, 0};
    if (op.from.empty() || !d.contains("content") || !d["content"].is_string()) refuse(path, key, d, kDecoders);
    op.to = d["content"].get<std::string>();
    ops.push_back(op);
  } else if (type == "ByteFallback") {
    ops.push_back({DecodeOp::kByteFallback, "", "", 0, 0});
  } else if (type == "Fuse") {
    ops.push_back({DecodeOp::kFuse, "", "", 0, 0});
  } else if (type == "Strip") {
    if (!d.contains("content") || !d["content"].is_string()) refuse(path, key + ".content", member(d, "content"), kDecoders);
    ops.push_back({DecodeOp::kStrip, d["content"].get<std::string>(), "", d.value("start", size_t{0}), d.value("stop", size_t{0})});
  } else {
    refuse(path, key + ".type", type_json(d), kDecoders);
  }
}

const char* const kPostProcessors = "the post-processors ByteLevel, TemplateProcessing and a Sequence of them";

// TemplateProcessing's `single`: the special tokens before and after the text ($A).
void parse_post_processor(const std::string& path, const std::string& key, const json& pp, std::vector<int32_t>& prefix,
                          std::vector<int32_t>& suffix) {
  if (pp.is_null()) return;
  const std::string type = type_of(pp);
  if (type == "Sequence" && pp.contains("processors") && pp["processors"].is_array()) {
    for (size_t i = 0; i < pp["processors"].size(); ++i)
      parse_post_processor(path, str(key, ".processors[", i, "]"), pp["processors"][i], prefix, suffix);
  } else if (type == "ByteLevel") {
    // Adds no token (its trim_offsets changes offsets only).
  } else if (type == "TemplateProcessing") {
    const json& single = member(pp, "single");
    const json& specials = member(pp, "special_tokens");
    if (!single.is_array()) refuse(path, key + ".single", single, kPostProcessors);
    bool after = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const json& item = single[i];
      const std::string item_key = str(key, ".single[", i, "]");
      if (item.contains("Sequence")) {
        if (after) refuse(path, item_key, item, "a template with the text once");
        after = true;
      } else if (item.contains("SpecialToken") && item["SpecialToken"].contains("id")) {
        const json& name = item["SpecialToken"]["id"];
        const json& entry = name.is_string() ? member(specials, name.get<std::string>().c_str()) : json();
        if (!entry.is_object() || !entry.contains("ids") || !entry["ids"].is_array())
          refuse(path, item_key, item, "special tokens listed in special_tokens with their ids");
        for (const auto& id : entry["ids"]) (after ? suffix : prefix).push_back(id.get<int32_t>());
      } else {
        refuse(path, item_key, item, kPostProcessors);
      }
    }
  } else {
    refuse(path, key + ".type", type_json(pp), kPostProcessors);
  }
}

// A token as tokenizer_config.json writes it: a string or {"content": ...}.
std::string config_token(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"].get<std::string>();
  return "";
}

// tokenizer_config.json beside the file: add_bos_token / add_eos_token, where set, decide the
// template around a text as transformers' Llama and Gemma tokenizers rebuild their post-processor.
void apply_config_special_tokens(const std::string& path, Tokenizer::Impl& impl) {
  const std::filesystem::path config = std::filesystem::path(path).parent_path() / "tokenizer_config.json";
  std::error_code ec;
  if (!std::filesystem::is_regular_file(config, ec)) return;
  json c;
  try {
    c = json::parse(read_file(config.string(), "data.tokenizer", "give the tokenizer_config.json of the model"));
  } catch (const json::exception& e) {
    throw Error(str(config.string(), ": not valid JSON: ", e.what()), "data.tokenizer", "give the model's own tokenizer_config.json");
  }
  auto set = [&](const char* flag, const char* token_key, std::vector<int32_t>& ids) {
    const json& on = member(c, flag);
    if (!on.is_boolean()) return;
    ids.clear();
    if (!on.get<bool>()) return;
    const std::string token = config_token(member(c, token_key));
    const int32_t id = token.empty() ? -1 : impl.token_to_id(token);
    if (id < 0)
      throw Error(str(config.string(), ": ", flag, " is true but ", token_key, " = ", member(c, token_key).dump(),
                      " is not a token of ", path),
                  "data.tokenizer", str("set ", token_key, " to one of the tokenizer's added tokens, or ", flag, " to false"));
    ids.push_back(id);
  };
  set("add_bos_token", "bos_token", impl.prefix_ids);
  set("add_eos_token", "eos_token", impl.suffix_ids);
}

}  // namespace

int32_t Tokenizer::Impl::token_to_id(std::string_view token) const {
  for (const auto& [content, id] : added_by_content)
    if (content == token) return id;
  return token_to_id_in_model(token);
}

int32_t Tokenizer::Impl::token_to_id_in_model(std::string_view token) const {
  if (!byte_level) return bpe->id_of(token);
  bool mapped = false;
  std::string bytes = byte_level_bytes(std::string(token), &mapped);
  return mapped ? bpe->id_of(bytes) : -1;
}

Tokenizer Tokenizer::load(const std::string& path) {
  const std::string text = read_file(path, "data.tokenizer",
                                     "give the path of a tokenizer.json (scripts/fetch_data.sh fetches Qwen3's into data/qwen3/)");
  json j;
  try {
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw Error(str(path, ": not valid JSON: ", e.what()), "data.tokenizer", "give a Hugging Face tokenizer.json");
  }
  auto impl = std::make_shared<Impl>();
  impl->path = path;
  impl->hash = sha256_string(text);

  for (const char* key : {"truncation", "padding"})
    if (j.contains(key) && !j[key].is_null()) refuse(path, key, j[key], "no truncation and no padding in the file (lcx packs sequences itself)");
  parse_normalizer(path, "normalizer", member(j, "normalizer"), impl->norm_ops);
  impl->nfc_only = impl->norm_ops.size() == 1 && impl->norm_ops[0].kind == NormOp::kNfc;
  bool pre_byte_level = false, dec_byte_level = false;
  parse_pre_tokenizer(path, "pre_tokenizer", member(j, "pre_tokenizer"), impl->steps, pre_byte_level);
  parse_post_processor(path, "post_processor", member(j, "post_processor"), impl->prefix_ids, impl->suffix_ids);
  const json& dec = member(j, "decoder");
  if (dec.is_null()) refuse(path, "decoder", dec, kDecoders);
  parse_decoder(path, "decoder", dec, impl->decode_ops, dec_byte_level);
  // The vocabulary is in ByteLevel's alphabet exactly when the pre-tokenizer maps the text into it;
  // the decoder must then map it back, and only then.
  if (pre_byte_level != dec_byte_level)
    refuse(path, "decoder.type", type_json(dec),
           pre_byte_level ? "the ByteLevel decoder with the ByteLevel pre-tokenizer"
                          : "a decoder without ByteLevel when the pre-tokenizer has no ByteLevel");
  impl->byte_level = pre_byte_level;

  const json& m = member(j, "model");
  const std::string bpe_what = "BPE (byte-level, or characters with byte_fallback/unk_token) without dropout, "
                               "subword prefix or word suffix; WordPiece, Unigram and WordLevel models are not implemented";
  if (type_of(m) != "BPE") refuse(path, "model.type", type_json(m), bpe_what);
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0) refuse(path, "model.dropout", m["dropout"], bpe_what);
  if (!is_null_or(m, "continuing_subword_prefix", "")) refuse(path, "model.continuing_subword_prefix", m["continuing_subword_prefix"], bpe_what);
  if (!is_null_or(m, "end_of_word_suffix", "")) refuse(path, "model.end_of_word_suffix", m["end_of_word_suffix"], bpe_what);
  BpeOptions options;
  options.byte_level = impl->byte_level;
  options.ignore_merges = m.value("ignore_merges", false);
  options.byte_fallback = m.value("byte_fallback", false);
  options.fuse_unk = m.value("fuse_unk", false);
  if (impl->byte_level && options.byte_fallback)
    refuse(path, "model.byte_fallback", m["byte_fallback"], "byte_fallback only without ByteLevel (every byte is a token there)");

  // A file cut or hand-edited: named, not a JSON library's exception.
  if (!m.contains("vocab") || !m["vocab"].is_object() || !m.contains("merges") || !m["merges"].is_array())
    throw Error(str(path, ": tokenizer.json has no ", !m.contains("vocab") || !m["vocab"].is_object() ? "model.vocab object" : "model.merges array",
                    " (a byte-level BPE tokenizer has both)"),
                "data.tokenizer",
                "give the model's own tokenizer.json, as tokenizers' Tokenizer.save writes it (scripts/fetch_data.sh fetches "
                "Qwen3's into data/qwen3/)");

  // Vocabulary: byte-level strings back to the bytes they stand for.
  std::vector<std::string> vocab;
  int64_t entries = 0;
  for (const auto& [token, id_json] : m.at("vocab").items()) {
    if (!id_json.is_number_integer()) refuse(path, "model.vocab[\"" + token + "\"]", id_json, "integer ids");
    if (id_json.get<int64_t>() < 0) refuse(path, "model.vocab[\"" + token + "\"]", id_json, "non-negative ids");
    // Ids index tables (a string per id): one past any vocabulary in use (Gemma's 262144) by far
    // would allocate gigabytes for a file that is damaged, not a tokenizer.
    if (id_json.get<int64_t>() >= kMaxVocabId)
      throw Error(str(path, ": tokenizer.json model.vocab[\"", token, "\"] = ", id_json.dump(), " is past ", kMaxVocabId,
                      " (2^24), the most ids lcx reads (the largest vocabularies in use hold 262144)"),
                  "data.tokenizer", "the file is damaged: fetch the model's own tokenizer.json again");
    const int32_t id = static_cast<int32_t>(id_json.get<int64_t>());
    if (static_cast<size_t>(id) >= vocab.size()) vocab.resize(id + 1);
    vocab[id] = impl->byte_level ? byte_level_bytes(token) : token;
    ++entries;
  }
  const json& unk = member(m, "unk_token");
  if (unk.is_string()) {
    const json& unk_id = member(m.at("vocab"), unk.get<std::string>().c_str());
    if (!unk_id.is_number_integer()) refuse(path, "model.unk_token", unk, "an unk_token that is in model.vocab");
    options.unk = unk_id.get<int32_t>();
  }

  impl->vocab_size = static_cast<int64_t>(vocab.size());
  impl->bpe = std::make_unique<BpeModel>(std::move(vocab), options);
  if (impl->byte_level)
    for (int b = 0; b < 256; ++b)
      if (impl->bpe->id_of(std::string(1, static_cast<char>(b))) < 0)
        refuse(path, "model.vocab", json(str("no token for byte ", b)), "a vocabulary holding all 256 ByteLevel bytes");

  // Merges: ["a", "b"] pairs (or "a b" strings, the older form), as ids.
  std::vector<std::pair<int32_t, int32_t>> merges;
  const json& mj = m.at("merges");
  merges.reserve(mj.size());
  for (size_t r = 0; r < mj.size(); ++r) {
    std::string a, b;
    if (mj[r].is_array() && mj[r].size() == 2) {
      a = mj[r][0].get<std::string>();
      b = mj[r][1].get<std::string>();
    } else if (mj[r].is_string()) {
      const std::string& s = mj[r].get_ref<const std::string&>();
      auto sp = s.find(' ');
      if (sp == std::string::npos) refuse(path, str("model.merges[", r, "]"), mj[r], "merges as pairs");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      refuse(path, str("model.merges[", r, "]"), mj[r], "merges as pairs");
    }
    std::string ba = impl->byte_level ? byte_level_bytes(a) : a, bb = impl->byte_level ? byte_level_bytes(b) : b;
    int32_t ia = impl->bpe->id_of(ba), ib = impl->bpe->id_of(bb);
    if (ia < 0 || ib < 0 || impl->bpe->id_of(ba + bb) < 0)
      refuse(path, str("model.merges[", r, "]"), mj[r], "merges whose parts and result are in the vocabulary");
    merges.emplace_back(ia, ib);
  }
  impl->bpe->set_merges(merges);
  impl->token_bytes.resize(impl->bpe->size());
  for (size_t id = 0; id < impl->bpe->size(); ++id)
    impl->token_bytes[id] = static_cast<uint32_t>(impl->bpe->bytes_of(static_cast<int32_t>(id)).size());
  // A <0xNN> token stands for one byte; the unknown token for what its word has left (pre_tokenize
  // gives a word's last token the rest).
  for (int b = 0; b < 256; ++b)
    if (int32_t id = impl->bpe->fallback_id(static_cast<uint8_t>(b)); id >= 0) impl->token_bytes[static_cast<size_t>(id)] = 1;
  if (options.unk >= 0) impl->token_bytes[static_cast<size_t>(options.unk)] = 0;

  // Added tokens.
  std::vector<AddedToken> raw, normalized;
  std::vector<AddedToken> all;
  if (j.contains("added_tokens"))
    for (size_t i = 0; i < j["added_tokens"].size(); ++i) all.push_back(parse_added(path, j["added_tokens"][i], i));
  // Ids as tokenizers assigns them when it reads the file (the "id" fields only draw a warning
  // there): a content that is a vocabulary string takes that id, any other the next free id.
  {
    const int64_t model_size = entries;  // the model's get_vocab_size(): its number of entries
    int64_t max_added = -1;
    std::vector<AddedToken> kept;
    for (auto& a : all) {
      bool seen = false;
      for (const auto& k : kept) seen = seen || (k.content == a.content && k.special == a.special && k.lstrip == a.lstrip &&
                                                 k.rstrip == a.rstrip && k.single_word == a.single_word && k.normalized == a.normalized);
      if (seen) continue;
      int32_t in_vocab = impl->token_to_id_in_model(a.content);
      int32_t id = in_vocab >= 0 ? in_vocab
                   : static_cast<int32_t>(max_added < 0 ? model_size : (max_added >= model_size ? max_added + 1 : model_size));
      if (id != a.id)
        log::warn(str(path, ": added token ", json(a.content).dump(), " has id ", a.id, " in the file; using ", id,
                      " as tokenizers does"));
      a.id = id;
      max_added = std::max<int64_t>(max_added, id);
      kept.push_back(a);
    }
    all = std::move(kept);
  }
  int32_t min_id = INT32_MAX, max_id = -1;
  for (auto& a : all) {
    min_id = std::min(min_id, a.id);
    max_id = std::max(max_id, a.id);
    impl->added_by_content.emplace_back(a.content, a.id);
    if (a.normalized) {
      AddedToken n = a;
      n.content = impl->normalize(a.content);
      normalized.push_back(n);
    } else {
      raw.push_back(a);
    }
  }
  if (!all.empty()) {
    impl->first_added = min_id;
    impl->added_bytes.assign(max_id - min_id + 1, std::string());
    impl->added_special.assign(max_id - min_id + 1, 0);
    for (auto& a : all) {
      impl->added_bytes[a.id - min_id] = impl->byte_level ? byte_level_bytes(a.content) : a.content;
      impl->added_special[a.id - min_id] = a.special;
    }
    impl->vocab_size = std::max<int64_t>(impl->vocab_size, max_id + 1);
  }
  impl->raw_added.build(std::move(raw));
  impl->normalized_added.build(std::move(normalized));
  apply_config_special_tokens(path, *impl);
  // The end of a document: the first of these names that is a special added token (Gemma's
  // vocabulary also has a plain "</s>"), else the first that is a token at all.
  const char* const kEosNames[] = {"<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"};
  for (const char* name : kEosNames)
    if (int32_t id = impl->token_to_id(name); id >= 0 && impl->eos < 0 && impl->is_special(id)) impl->eos = id;
  for (const char* name : kEosNames)
    if (int32_t id = impl->token_to_id(name); id >= 0 && impl->eos < 0) impl->eos = id;
  Tokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

int32_t Tokenizer::token_to_id(std::string_view token) const { return impl_->token_to_id(token); }

int32_t Tokenizer::eos_id() const {
  if (impl_->eos < 0)
    throw Error(str(impl_->path, ": no end-of-text token (<|endoftext|>, </s>, <|end_of_text|>, <eos>)"),
                "data.tokenizer", "use a tokenizer.json whose added tokens include one of them");
  return impl_->eos;
}
int64_t Tokenizer::vocab_size() const { return impl_->vocab_size; }
const std::vector<int32_t>& Tokenizer::prefix_ids() const { return impl_->prefix_ids; }
const std::vector<int32_t>& Tokenizer::suffix_ids() const { return impl_->suffix_ids; }
const std::string& Tokenizer::hash() const { return impl_->hash; }
const std::string& Tokenizer::path() const { return impl_->path; }

namespace {

// The decoders of a SentencePiece conversion, over the list of token strings as tokenizers runs them.
std::string decode_chain(std::vector<std::string> tokens, const std::vector<DecodeOp>& ops) {
  for (const DecodeOp& op : ops) {
    switch (op.kind) {
      case DecodeOp::kReplace:
        for (std::string& t : tokens) {
          std::string out;
          for (size_t i = 0; i < t.size();) {
            if (t.compare(i, op.from.size(), op.from) == 0) {
              out += op.to;
              i += op.from.size();
            } else {
              out += t[i++];
            }
          }
          t = std::move(out);
        }
        break;
      case DecodeOp::kByteFallback: {
        // Runs of <0xNN> tokens become their bytes when those are valid UTF-8, else one U+FFFD each.
        std::vector<std::string> out;
        std::string run;
        size_t run_tokens = 0;
        auto flush = [&] {
          if (run_tokens == 0) return;
          if (utf8::first_invalid(run) == std::string::npos) out.push_back(run);
          else
            for (size_t k = 0; k < run_tokens; ++k) out.push_back("\xEF\xBF\xBD");
          run.clear();
          run_tokens = 0;
        };
        for (std::string& t : tokens) {
          unsigned value = 0;
          if (t.size() == 6 && t.compare(0, 3, "<0x") == 0 && t[5] == '>' && std::isxdigit(static_cast<unsigned char>(t[3])) &&
              std::isxdigit(static_cast<unsigned char>(t[4]))) {
            value = static_cast<unsigned>(std::stoul(t.substr(3, 2), nullptr, 16));
            run.push_back(static_cast<char>(value));
            ++run_tokens;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        tokens = std::move(out);
        break;
      }
      case DecodeOp::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        break;
      }
      case DecodeOp::kStrip:
        for (std::string& t : tokens) {
          size_t b = 0, e = t.size();
          for (size_t k = 0; k < op.start && t.compare(b, op.from.size(), op.from) == 0; ++k) b += op.from.size();
          for (size_t k = 0; k < op.stop && e >= b + op.from.size() && t.compare(e - op.from.size(), op.from.size(), op.from) == 0; ++k)
            e -= op.from.size();
          t = t.substr(b, e - b);
        }
        break;
    }
  }
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

}  // namespace

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  const Impl& im = *impl_;
  std::vector<std::string> tokens;
  std::string bytes;
  for (int32_t id : ids) {
    int32_t a = id - im.first_added;
    const std::string* t = nullptr;
    if (!im.added_bytes.empty() && a >= 0 && a < static_cast<int32_t>(im.added_bytes.size()) && !im.added_bytes[a].empty()) {
      if (skip_special && im.added_special[a]) continue;
      t = &im.added_bytes[a];
    } else {
      if (id < 0 || static_cast<size_t>(id) >= im.bpe->size())
        throw Error(str("token id ", id, " is outside the vocabulary of ", im.path, " (", im.vocab_size, " ids)"));
      t = &im.bpe->bytes_of(id);
    }
    if (im.byte_level) bytes += *t;
    else tokens.push_back(*t);
  }
  if (!im.byte_level) bytes = decode_chain(std::move(tokens), im.decode_ops);
  if (utf8::first_invalid(bytes) == std::string::npos) return bytes;
  return utf8::repair(bytes, nullptr);
}

void Tokenizer::encode_stream(const std::function<size_t(char*, size_t)>& read,
                              const std::function<void(std::vector<int32_t>&&)>& emit, int threads, EncodeStats* stats,
                              size_t block) const {
  const Impl& im = *impl_;
  const bool may_cut = im.normalized_added.empty() && im.only_nfc_or_nothing() && im.steps.cuts_allowed();
  constexpr size_t kLookahead = 4096;
  block = std::max<size_t>(block, 2 * kLookahead);
  std::string buf;
  bool at_end = false;
  auto fill = [&](size_t want) {
    while (!at_end && buf.size() < want) {
      const size_t had = buf.size();
      buf.resize(want);
      const size_t n = read(buf.data() + had, want - had);
      buf.resize(had + n);
      at_end = n == 0;
    }
  };
  EncodeStats total;
  auto encode_part = [&](std::string_view part) {
    EncodeStats st;
    std::vector<int32_t> ids = encode(part, threads, &st);
    total.invalid_utf8 += st.invalid_utf8;
    emit(std::move(ids));
  };
  size_t want = block;
  while (true) {
    fill(want + kLookahead);
    if (at_end) break;
    // The last place in the block's second half where the text may be cut; none: a longer block.
    size_t cut = 0;
    if (may_cut) {
      int tried = 0;
      for (size_t c = want; c > want / 2 && tried < 8; --c) {
        if (!pretok::is_safe_cut(buf, c)) continue;
        ++tried;
        // Lookahead ends on a character's first byte.
        size_t end = std::min(buf.size(), c + kLookahead);
        while (end > c && end < buf.size() && (static_cast<unsigned char>(buf[end]) & 0xC0) == 0x80) --end;
        if (im.cuts_whole_at(std::string_view(buf).substr(0, end), c)) {
          cut = c;
          break;
        }
      }
    }
    if (cut == 0) {
      want *= 2;
      continue;
    }
    encode_part(std::string_view(buf).substr(0, cut));
    buf.erase(0, cut);
    want = block;
  }
  if (!buf.empty()) encode_part(buf);
  if (stats) *stats = total;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, int threads, EncodeStats* stats) const {
  std::vector<EncodeStats> st;
  auto out = encode_batch({text}, threads, stats ? &st : nullptr);
  if (stats) *stats = st[0];
  return std::move(out[0]);
}

namespace {

// encode_batch and encode_batch_with_offsets: spans are computed only when `with_spans`.
std::vector<Encoding> encode_all(const Tokenizer::Impl& im, const std::vector<std::string_view>& texts, int threads,
                                 std::vector<EncodeStats>* stats, bool with_spans) {
  // Valid UTF-8 for every text (repaired copies where needed).
  std::vector<std::string> repaired(texts.size());
  std::vector<std::string_view> views(texts.begin(), texts.end());
  if (stats) stats->assign(texts.size(), EncodeStats{});
  size_t total = 0;
  for (size_t t = 0; t < texts.size(); ++t) {
    total += texts[t].size();
    if (utf8::first_invalid(texts[t]) == std::string_view::npos) continue;
    int64_t n = 0;
    repaired[t] = utf8::repair(texts[t], &n);
    views[t] = repaired[t];
    if (stats) (*stats)[t].invalid_utf8 = n;
  }
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (total < (256u << 10)) threads = 1;

  // Work items: an added token, or a stretch of plain text cut where the cut may change nothing.
  // A cut item sees `kLookahead` bytes past its end, as the regex would in the whole text, and
  // reports whether its last piece ended exactly at the cut; where one did not, it and the item
  // after it are encoded again as one (rare: cuts are made after a newline, before a letter).
  struct Item {
    uint32_t text;
    int32_t added;  // -1 for plain text
    size_t begin, end, lookahead_end;
  };
  constexpr size_t kLookahead = 256;
  std::vector<Item> items;
  const size_t target = std::clamp<size_t>(total / (static_cast<size_t>(threads) * 8), 64u << 10, 1u << 20);
  const bool may_cut = threads > 1 && im.normalized_added.empty() && im.only_nfc_or_nothing() && im.steps.cuts_allowed();
  auto add_plain = [&](uint32_t t, size_t b, size_t e) {
    std::string_view s = views[t];
    while (may_cut && e - b > target + target / 2) {
      size_t cut = b + target;
      while (cut < e && !pretok::is_safe_cut(s, cut)) ++cut;
      if (cut >= e) break;
      items.push_back({t, -1, b, cut, std::min(e, cut + kLookahead)});
      b = cut;
    }
    if (e > b) items.push_back({t, -1, b, e, e});
  };
  for (uint32_t t = 0; t < views.size(); ++t) {
    size_t at = 0;
    for (const Match& m : im.raw_added.find(views[t])) {
      add_plain(t, at, m.start);
      items.push_back({t, m.id, m.start, m.stop, m.stop});
      at = m.stop;
    }
    add_plain(t, at, views[t].size());
  }

  std::vector<Encoding> pieces(items.size());
  std::vector<char> ends_at_cut(items.size(), 1);
  auto encode_item = [&](const Item& it, WordCache& cache, Encoding& e) {
    if (it.added >= 0) {
      e.ids.push_back(it.added);
      if (with_spans) e.spans.push_back({static_cast<uint32_t>(it.begin), static_cast<uint32_t>(it.end)});
      return true;
    }
    return im.encode_plain(views[it.text].substr(it.begin, it.lookahead_end - it.begin), it.end - it.begin, cache, e.ids,
                           with_spans ? &e.spans : nullptr, it.begin);
  };
  auto work = [&](size_t i, WordCache& cache) {
    // Filled locally and moved in: neighbouring vectors in `pieces` share cache lines.
    Encoding e;
    ends_at_cut[i] = encode_item(items[i], cache, e);
    pieces[i] = std::move(e);
  };
  threads = static_cast<int>(std::min<size_t>(threads, items.size()));
  if (threads <= 1) {
    auto cache = im.take_cache();
    for (size_t i = 0; i < items.size(); ++i) work(i, *cache);
    im.give_cache(std::move(cache));
  } else {
    std::atomic<size_t> next{0};
    std::vector<std::thread> pool;
    std::exception_ptr failure;
    std::mutex failure_mu;
    for (int w = 0; w < threads; ++w)
      pool.emplace_back([&] {
        auto cache = im.take_cache();
        try {
          for (size_t i; (i = next.fetch_add(1)) < items.size();) work(i, *cache);
        } catch (...) {
          std::lock_guard<std::mutex> lock(failure_mu);
          failure = std::current_exception();
        }
        im.give_cache(std::move(cache));
      });
    for (auto& th : pool) th.join();
    if (failure) std::rethrow_exception(failure);
  }
  // A cut that split a piece: the items on both sides again as one, until the end is a boundary
  // (the last item of a stretch always is).
  for (size_t i = 0; i < items.size(); ++i) {
    if (ends_at_cut[i]) continue;
    auto cache = im.take_cache();
    Item merged = items[i];
    size_t j = i;
    bool ok = false;
    while (!ok) {
      ++j;
      merged.end = items[j].end;
      merged.lookahead_end = items[j].lookahead_end;
      pieces[j] = Encoding{};
      Encoding e;
      ok = encode_item(merged, *cache, e);
      pieces[i] = std::move(e);
    }
    im.give_cache(std::move(cache));
    i = j;
  }

  std::vector<Encoding> out(texts.size());
  std::vector<size_t> sizes(texts.size(), 0);
  for (size_t i = 0; i < items.size(); ++i) sizes[items[i].text] += pieces[i].ids.size();
  for (size_t t = 0; t < out.size(); ++t) {
    out[t].ids.reserve(sizes[t]);
    if (with_spans) out[t].spans.reserve(sizes[t]);
  }
  for (size_t i = 0; i < items.size(); ++i) {
    auto& dst = out[items[i].text];
    dst.ids.insert(dst.ids.end(), pieces[i].ids.begin(), pieces[i].ids.end());
    dst.spans.insert(dst.spans.end(), pieces[i].spans.begin(), pieces[i].spans.end());
  }
  return out;
}

}  // namespace

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(const std::vector<std::string_view>& texts, int threads,
                                                          std::vector<EncodeStats>* stats) const {
  auto enc = encode_all(*impl_, texts, threads, stats, false);
  std::vector<std::vector<int32_t>> out(enc.size());
  for (size_t t = 0; t < enc.size(); ++t) out[t] = std::move(enc[t].ids);
  return out;
}

std::vector<Encoding> Tokenizer::encode_batch_with_offsets(const std::vector<std::string_view>& texts, int threads,
                                                           std::vector<EncodeStats>* stats) const {
  for (const auto& t : texts)
    if (t.size() >= (uint64_t{1} << 32))
      throw Error(str("a text of ", t.size(), " bytes is too long for token offsets (4 GiB at most)"));
  return encode_all(*impl_, texts, threads, stats, true);
}

}  // namespace lcx
