#include "data/tokenizer.h"

#include <algorithm>
#include <atomic>
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
  std::string path, hash;
  bool nfc = false;
  std::unique_ptr<BpeModel> bpe;
  AddedMatcher raw_added;         // normalized: false, matched on the input
  AddedMatcher normalized_added;  // normalized: true, matched after NFC
  std::vector<std::string> added_bytes;  // by id - first_added: what the decoder writes
  std::vector<char> added_special;
  std::vector<std::pair<std::string, int32_t>> added_by_content;
  int32_t first_added = 0;
  int64_t vocab_size = 0;
  std::vector<uint32_t> token_bytes;  // by BPE id: its length in bytes, for offsets without a lookup of its string
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

  // `spans`, when given, gets each id's bytes in `s`'s coordinates, from `at` on.
  void pre_tokenize(std::string_view s, size_t at, WordCache& cache, std::vector<int32_t>& out,
                    std::vector<TokenSpan>* spans) const {
    for (size_t pos = 0; pos < s.size();) {
      size_t end = pretok::next_piece(s, pos);
      const size_t first = out.size();
      cache.lookup(*bpe, s.substr(pos, end - pos), out);
      if (spans) {
        // Byte-level BPE: a word's tokens are its bytes cut in order.
        uint32_t b = static_cast<uint32_t>(at + pos);
        for (size_t k = first; k < out.size(); ++k) {
          const uint32_t e = b + token_bytes[static_cast<size_t>(out[k])];
          spans->push_back({b, e});
          b = e;
        }
      }
      pos = end;
    }
  }

  // A stretch of input between added tokens: normalize, split on normalized added tokens, then
  // pre-tokenize and run BPE. `spans`, when given, gets each id's bytes in `raw`, plus `base`.
  void encode_plain(std::string_view raw, WordCache& cache, std::vector<int32_t>& out,
                    std::vector<TokenSpan>* spans = nullptr, size_t base = 0) const {
    std::string normalized;
    std::string_view s = raw;
    if (nfc && utf8::may_change_under_nfc(raw)) {
      normalized = utf8::nfc(raw);
      if (normalized != raw) s = normalized;
    }
    const size_t first = spans ? spans->size() : 0;
    size_t at = 0;
    if (!normalized_added.empty())
      for (const Match& m : normalized_added.find(s)) {
        pre_tokenize(s.substr(at, m.start - at), at, cache, out, spans);
        out.push_back(m.id);
        if (spans) spans->push_back({static_cast<uint32_t>(m.start), static_cast<uint32_t>(m.stop)});
        at = m.stop;
      }
    pre_tokenize(s.substr(at), at, cache, out, spans);
    if (!spans) return;
    if (s.data() != raw.data()) to_raw_spans(raw, s, spans->begin() + static_cast<std::ptrdiff_t>(first), spans->end());
    for (auto it = spans->begin() + static_cast<std::ptrdiff_t>(first); it != spans->end(); ++it)
      it->begin += static_cast<uint32_t>(base), it->end += static_cast<uint32_t>(base);
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

void check_normalizer(const std::string& path, const json& n, bool& nfc) {
  nfc = false;
  if (n.is_null()) return;
  std::string type = n.value("type", "");
  if (type == "NFC") {
    nfc = true;
  } else if (type == "Sequence" && n.contains("normalizers")) {
    for (const auto& sub : n["normalizers"]) {
      if (sub.value("type", "") != "NFC") refuse(path, "normalizer.normalizers[].type", sub.value("type", json()), "the NFC normalizer");
      nfc = true;
    }
  } else {
    refuse(path, "normalizer.type", n.value("type", json()), "the NFC normalizer (or none)");
  }
}

void check_pre_tokenizer(const std::string& path, const json& p) {
  const std::string what = "pre_tokenizer Sequence[Split(Qwen2/Qwen3 regex, Isolated), ByteLevel(add_prefix_space false, use_regex false)]";
  if (p.is_null() || p.value("type", "") != "Sequence") refuse(path, "pre_tokenizer.type", p.is_null() ? p : p.value("type", json()), what);
  const json& list = p["pretokenizers"];
  if (!list.is_array() || list.size() != 2) refuse(path, "pre_tokenizer.pretokenizers", list, what);
  const json& split = list[0];
  if (split.value("type", "") != "Split") refuse(path, "pre_tokenizer.pretokenizers[0].type", split.value("type", json()), what);
  if (!split.contains("pattern") || !split["pattern"].contains("Regex") ||
      split["pattern"]["Regex"] != pretok::kQwenPattern)
    refuse(path, "pre_tokenizer.pretokenizers[0].pattern", split.value("pattern", json()), what);
  if (split.value("behavior", "") != "Isolated") refuse(path, "pre_tokenizer.pretokenizers[0].behavior", split.value("behavior", json()), what);
  if (split.value("invert", false)) refuse(path, "pre_tokenizer.pretokenizers[0].invert", split["invert"], what);
  const json& bl = list[1];
  if (bl.value("type", "") != "ByteLevel") refuse(path, "pre_tokenizer.pretokenizers[1].type", bl.value("type", json()), what);
  if (bl.value("add_prefix_space", false)) refuse(path, "pre_tokenizer.pretokenizers[1].add_prefix_space", bl["add_prefix_space"], what);
  if (bl.value("use_regex", true)) refuse(path, "pre_tokenizer.pretokenizers[1].use_regex", bl.value("use_regex", json(true)), what);
}

}  // namespace

int32_t Tokenizer::Impl::token_to_id(std::string_view token) const {
  for (const auto& [content, id] : added_by_content)
    if (content == token) return id;
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
  check_normalizer(path, member(j, "normalizer"), impl->nfc);
  check_pre_tokenizer(path, member(j, "pre_tokenizer"));
  const json& pp = member(j, "post_processor");
  if (!pp.is_null() && pp.value("type", "") != "ByteLevel")
    refuse(path, "post_processor.type", pp.value("type", json()), "no post-processor or ByteLevel (which adds no tokens)");
  const json& dec = member(j, "decoder");
  if (dec.is_null() || dec.value("type", "") != "ByteLevel")
    refuse(path, "decoder.type", dec.is_null() ? dec : dec.value("type", json()), "the ByteLevel decoder");

  const json& m = member(j, "model");
  const std::string bpe_what = "byte-level BPE without dropout, byte fallback, subword prefix or word suffix";
  if (m.value("type", "") != "BPE") refuse(path, "model.type", m.value("type", json()), bpe_what);
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0) refuse(path, "model.dropout", m["dropout"], bpe_what);
  if (m.value("byte_fallback", false)) refuse(path, "model.byte_fallback", m["byte_fallback"], bpe_what);
  if (!is_null_or(m, "continuing_subword_prefix", "")) refuse(path, "model.continuing_subword_prefix", m["continuing_subword_prefix"], bpe_what);
  if (!is_null_or(m, "end_of_word_suffix", "")) refuse(path, "model.end_of_word_suffix", m["end_of_word_suffix"], bpe_what);
  bool ignore_merges = m.value("ignore_merges", false);

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
    int32_t id = id_json.get<int32_t>();
    if (id < 0) refuse(path, "model.vocab[\"" + token + "\"]", id_json, "non-negative ids");
    if (static_cast<size_t>(id) >= vocab.size()) vocab.resize(id + 1);
    vocab[id] = byte_level_bytes(token);
    ++entries;
  }

  impl->vocab_size = static_cast<int64_t>(vocab.size());
  impl->bpe = std::make_unique<BpeModel>(std::move(vocab), ignore_merges);
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
    std::string ba = byte_level_bytes(a), bb = byte_level_bytes(b);
    int32_t ia = impl->bpe->id_of(ba), ib = impl->bpe->id_of(bb);
    if (ia < 0 || ib < 0 || impl->bpe->id_of(ba + bb) < 0)
      refuse(path, str("model.merges[", r, "]"), mj[r], "merges whose parts and result are in the vocabulary");
    merges.emplace_back(ia, ib);
  }
  impl->bpe->set_merges(merges);
  impl->token_bytes.resize(impl->bpe->size());
  for (size_t id = 0; id < impl->bpe->size(); ++id)
    impl->token_bytes[id] = static_cast<uint32_t>(impl->bpe->bytes_of(static_cast<int32_t>(id)).size());

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
      bool mapped = false;
      std::string bytes = byte_level_bytes(a.content, &mapped);
      int32_t in_vocab = mapped ? impl->bpe->id_of(bytes) : -1;
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
      n.content = impl->nfc ? utf8::nfc(a.content) : a.content;
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
      impl->added_bytes[a.id - min_id] = byte_level_bytes(a.content);
      impl->added_special[a.id - min_id] = a.special;
    }
    impl->vocab_size = std::max<int64_t>(impl->vocab_size, max_id + 1);
  }
  impl->raw_added.build(std::move(raw));
  impl->normalized_added.build(std::move(normalized));
  for (const char* name : {"<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"})
    if (int32_t id = impl->token_to_id(name); id >= 0) {
      impl->eos = id;
      break;
    }
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
const std::string& Tokenizer::hash() const { return impl_->hash; }
const std::string& Tokenizer::path() const { return impl_->path; }

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  const Impl& im = *impl_;
  std::string bytes;
  for (int32_t id : ids) {
    int32_t a = id - im.first_added;
    if (!im.added_bytes.empty() && a >= 0 && a < static_cast<int32_t>(im.added_bytes.size()) &&
        !im.added_bytes[a].empty()) {
      if (!(skip_special && im.added_special[a])) bytes += im.added_bytes[a];
      continue;
    }
    if (id < 0 || static_cast<size_t>(id) >= im.bpe->size())
      throw Error(str("token id ", id, " is outside the vocabulary of ", im.path, " (", im.vocab_size, " ids)"));
    bytes += im.bpe->bytes_of(id);
  }
  if (utf8::first_invalid(bytes) == std::string::npos) return bytes;
  return utf8::repair(bytes, nullptr);
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

  // Work items: an added token, or a stretch of plain text cut where the cut changes nothing.
  struct Item {
    uint32_t text;
    int32_t added;  // -1 for plain text
    size_t begin, end;
  };
  std::vector<Item> items;
  const size_t target = std::clamp<size_t>(total / (static_cast<size_t>(threads) * 8), 64u << 10, 1u << 20);
  const bool may_cut = threads > 1 && im.normalized_added.empty();
  auto add_plain = [&](uint32_t t, size_t b, size_t e) {
    std::string_view s = views[t];
    while (may_cut && e - b > target + target / 2) {
      size_t cut = b + target;
      while (cut < e && !pretok::is_safe_cut(s, cut)) ++cut;
      if (cut >= e) break;
      items.push_back({t, -1, b, cut});
      b = cut;
    }
    if (e > b) items.push_back({t, -1, b, e});
  };
  for (uint32_t t = 0; t < views.size(); ++t) {
    size_t at = 0;
    for (const Match& m : im.raw_added.find(views[t])) {
      add_plain(t, at, m.start);
      items.push_back({t, m.id, m.start, m.stop});
      at = m.stop;
    }
    add_plain(t, at, views[t].size());
  }

  std::vector<Encoding> pieces(items.size());
  auto work = [&](size_t i, WordCache& cache) {
    const Item& it = items[i];
    // Filled locally and moved in: neighbouring vectors in `pieces` share cache lines.
    Encoding e;
    if (it.added >= 0) {
      e.ids.push_back(it.added);
      if (with_spans) e.spans.push_back({static_cast<uint32_t>(it.begin), static_cast<uint32_t>(it.end)});
    } else {
      im.encode_plain(views[it.text].substr(it.begin, it.end - it.begin), cache, e.ids, with_spans ? &e.spans : nullptr,
                      it.begin);
    }
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
