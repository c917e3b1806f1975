#include "data/pre_tokenizer.h"

#include <utf8proc.h>

#include <array>
#include <memory>

#include "data/utf8.h"

namespace lcx::pretok {

const char* const kQwenPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

namespace {

CharClass classify(uint32_t cp) {
  if (cp == 0x85 || (cp >= 0x09 && cp <= 0x0D)) return kSpace;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: return kLetter;
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_NO: return kNumber;
    case UTF8PROC_CATEGORY_ZS: case UTF8PROC_CATEGORY_ZL: case UTF8PROC_CATEGORY_ZP: return kSpace;
    default: return kOther;
  }
}

// The Basic Multilingual Plane in a table (64 KiB), built once; the rest asks utf8proc.
const std::array<uint8_t, 0x10000>& bmp_table() {
  static const auto table = [] {
    auto t = std::make_unique<std::array<uint8_t, 0x10000>>();
    for (uint32_t cp = 0; cp < 0x10000; ++cp) (*t)[cp] = classify(cp);
    return t;
  }();
  return *table;
}

struct Cursor {
  const unsigned char* p;
  size_t n;
  // Code point at i with its class and length; i < n.
  uint32_t at(size_t i, CharClass& cls, int& len) const {
    if (p[i] < 0x80) {
      len = 1;
      cls = static_cast<CharClass>(bmp_table()[p[i]]);
      return p[i];
    }
    uint32_t cp = utf8::decode(p + i, len);
    cls = char_class(cp);
    return cp;
  }
};

inline bool is_crlf(uint32_t cp) { return cp == '\r' || cp == '\n'; }

// One of the letters after the apostrophe of (?i:'s|'t|'re|'ve|'m|'ll|'d), folded to lower case;
// U+017F (long s) case-folds to 's' as Oniguruma's (?i) applies.
int folded(uint32_t cp) {
  if (cp < 0x80) return (cp >= 'A' && cp <= 'Z') ? static_cast<int>(cp + 32) : static_cast<int>(cp);
  return cp == 0x17F ? 's' : -1;
}

}  // namespace

CharClass char_class(uint32_t cp) {
  if (cp < 0x10000) return static_cast<CharClass>(bmp_table()[cp]);
  return classify(cp);
}

size_t next_piece(std::string_view text, size_t pos) {
  Cursor c{reinterpret_cast<const unsigned char*>(text.data()), text.size()};
  const size_t n = c.n;
  CharClass cls0, cls1;
  int len0, len1;
  uint32_t c0 = c.at(pos, cls0, len0);
  size_t p1 = pos + len0;

  auto run = [&](size_t i, CharClass want) {  // end of the run of `want` starting at i
    CharClass k;
    int l;
    while (i < n) {
      c.at(i, k, l);
      if (k != want) break;
      i += l;
    }
    return i;
  };

  // (?i:'s|'t|'re|'ve|'m|'ll|'d)
  if (c0 == '\'' && p1 < n) {
    uint32_t c1 = c.at(p1, cls1, len1);
    size_t p2 = p1 + len1;
    int f = folded(c1);
    if (f == 's' || f == 't' || f == 'm' || f == 'd') return p2;
    if ((f == 'r' || f == 'v' || f == 'l') && p2 < n) {
      CharClass k;
      int l;
      int g = folded(c.at(p2, k, l));
      if ((f == 'l' && g == 'l') || (f != 'l' && g == 'e')) return p2 + l;
    }
  }
  // [^\r\n\p{L}\p{N}]?\p{L}+
  if (cls0 == kLetter) return run(p1, kLetter);
  if (cls0 != kNumber && !is_crlf(c0) && p1 < n) {
    c.at(p1, cls1, len1);
    if (cls1 == kLetter) return run(p1 + len1, kLetter);
  }
  // \p{N}
  if (cls0 == kNumber) return p1;
  // ' '?[^\s\p{L}\p{N}]+[\r\n]*
  size_t other_start = std::string_view::npos;
  if (cls0 == kOther) {
    other_start = pos;
  } else if (c0 == ' ' && p1 < n) {
    c.at(p1, cls1, len1);
    if (cls1 == kOther) other_start = p1;
  }
  if (other_start != std::string_view::npos) {
    size_t i = run(other_start, kOther);
    while (i < n && (c.p[i] == '\r' || c.p[i] == '\n')) ++i;
    return i;
  }
  // c0 is whitespace here. W = the whitespace run from pos.
  size_t last_crlf = std::string_view::npos, last_start = pos, i = pos;
  while (i < n) {
    CharClass k;
    int l;
    uint32_t cp = c.at(i, k, l);
    if (k != kSpace) break;
    if (is_crlf(cp)) last_crlf = i;
    last_start = i;
    i += l;
  }
  // \s*[\r\n]+ : backtracks to the last CR or LF of W.
  if (last_crlf != std::string_view::npos) return last_crlf + 1;
  // \s+(?!\S) : all of W at the end of the text, else W less its last code point.
  if (i == n) return n;
  if (last_start > pos) return last_start;
  // \s+
  return i;
}

bool is_safe_cut(std::string_view s, size_t pos) {
  if (pos == 0 || pos >= s.size()) return false;
  auto p = reinterpret_cast<const unsigned char*>(s.data());
  if (p[pos - 1] == '\n') {
    int len;
    uint32_t cp = utf8::decode(p + pos, len);
    if (cp < 0x80) return char_class(cp) != kSpace;
    // Letters and numbers neither compose with the '\n' nor normalize to whitespace.
    CharClass k = char_class(cp);
    return k == kLetter || k == kNumber;
  }
  auto ascii_letter = [](unsigned char b) { return (b | 0x20) >= 'a' && (b | 0x20) <= 'z'; };
  return p[pos] == ' ' && pos + 1 < s.size() && ascii_letter(p[pos - 1]) && ascii_letter(p[pos + 1]);
}

}  // namespace lcx::pretok
