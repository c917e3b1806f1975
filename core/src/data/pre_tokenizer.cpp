#include "data/pre_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <memory>
#include <stdexcept>

#include "data/utf8.h"

namespace lcx::pretok {

const char* const kQwenPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
const char* const kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

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

size_t next_piece(std::string_view text, size_t pos, int max_digits) {
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
  // \p{N}, or \p{N}{1,max_digits}
  if (cls0 == kNumber) {
    size_t i = p1;
    for (int d = 1; d < max_digits && i < n; ++d) {
      CharClass k;
      int l;
      c.at(i, k, l);
      if (k != kNumber) break;
      i += l;
    }
    return i;
  }
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

const char* const kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

namespace {

// Unicode's White_Space property as the body of a character class.
constexpr const char* kWhiteSpace = R"(\t-\r\x{20}\x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000})";

struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(4, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 << 10, 8 << 20, nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

size_t char_len(std::string_view s, size_t i) {
  size_t j = i + 1;
  while (j < s.size() && (static_cast<unsigned char>(s[j]) & 0xC0) == 0x80) ++j;
  return j - i;
}

}  // namespace

std::string oniguruma_to_pcre2(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char n = p[i + 1];
      ++i;
      if (n == 's') {
        out += in_class ? std::string(kWhiteSpace) : "[" + std::string(kWhiteSpace) + "]";
      } else if (n == 'S') {
        if (in_class) throw std::invalid_argument("\\S inside a character class");
        out += "[^" + std::string(kWhiteSpace) + "]";
      } else {
        out += c;
        out += n;
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (c == '[' && in_class && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
      size_t close = p.find(":]", i + 2);
      if (close != std::string::npos) {
        out.append(p, i, close + 2 - i);
        i = close + 1;
        continue;
      }
    }
    if (c == '[' && in_class) throw std::invalid_argument("a nested character class");
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

Regex::Regex(const std::string& pattern) : pattern_(pattern) {
  const std::string p = oniguruma_to_pcre2(pattern);
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), PCRE2_UTF | PCRE2_UCP, &err,
                                   &offset, nullptr);
  if (!code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw std::invalid_argument(std::string(reinterpret_cast<const char*>(msg)) + " at offset " +
                                std::to_string(offset) + " of " + p);
  }
  // Without the JIT (a build without it) pcre2_match interprets: slower, the same matches.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = code;
  lookbehind_ = pattern.find("(?<=") != std::string::npos || pattern.find("(?<!") != std::string::npos;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

bool Regex::find(std::string_view s, size_t from, size_t& start, size_t& end) const {
  thread_local MatchState state;
  const int rc = pcre2_match(static_cast<const pcre2_code*>(code_), reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(),
                             from, PCRE2_NO_UTF_CHECK, state.data, state.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(rc, msg, sizeof msg);
    throw std::runtime_error("regex " + pattern_ + ": " + reinterpret_cast<const char*>(msg));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state.data);
  start = ov[0];
  end = ov[1];
  return true;
}

namespace {

struct Seg {
  size_t b, e;
  bool match;
};

// The pieces tokenizers' NormalizedString::split makes of `segs` (gaps and matches tiling the
// subject, in order), empty ones dropped.
void apply_behavior(const std::vector<Seg>& segs, Behavior behavior, bool invert,
                    std::vector<std::pair<size_t, size_t>>& out) {
  auto is_match = [&](const Seg& s) { return s.match != invert; };
  if (behavior == Behavior::kIsolated || behavior == Behavior::kRemoved) {
    for (const Seg& s : segs)
      if (s.e > s.b && (behavior == Behavior::kIsolated || !is_match(s))) out.emplace_back(s.b, s.e);
    return;
  }
  std::vector<Seg> acc;
  bool previous = false;
  switch (behavior) {
    case Behavior::kIsolated:
    case Behavior::kRemoved:
      break;
    case Behavior::kMergedWithPrevious:
      for (const Seg& s : segs) {
        if (is_match(s) && !previous && !acc.empty()) acc.back().e = s.e;
        else acc.push_back(s);
        previous = is_match(s);
      }
      break;
    case Behavior::kMergedWithNext:
      for (size_t k = segs.size(); k-- > 0;) {
        const Seg& s = segs[k];
        if (is_match(s) && !previous && !acc.empty()) acc.back().b = s.b;
        else acc.push_back(s);
        previous = is_match(s);
      }
      std::reverse(acc.begin(), acc.end());
      break;
    case Behavior::kContiguous:
      for (const Seg& s : segs) {
        if (is_match(s) == previous && !acc.empty()) acc.back().e = s.e;
        else acc.push_back(s);
        previous = is_match(s);
      }
      break;
  }
  for (const Seg& s : acc)
    if (s.e > s.b) out.emplace_back(s.b, s.e);
}

// Gaps and matches of one split step over subject[0, n); `ok` as Steps::split returns it.
void segments(const Step& step, std::string_view subject, size_t n, std::vector<Seg>& segs, bool& ok) {
  size_t prev = 0;
  if (step.kind == Step::kQwenSplit) {
    while (prev < n) {
      const size_t e = next_piece(subject, prev, step.max_digits);
      segs.push_back({prev, e, true});
      prev = e;
    }
  } else {
    size_t pos = 0;
    while (pos <= subject.size()) {
      size_t st, en;
      if (step.kind == Step::kRegexSplit) {
        if (!step.regex->find(subject, pos, st, en)) break;
      } else {
        st = subject.find(step.literal, pos);
        if (st == std::string_view::npos) break;
        en = st + step.literal.size();
      }
      if (st >= n) break;
      if (st > prev) segs.push_back({prev, st, false});
      segs.push_back({st, en, true});
      prev = en;
      if (en > st) pos = en;
      else if (st < subject.size()) pos = st + char_len(subject, st);
      else break;
    }
    if (prev < n) {
      segs.push_back({prev, n, false});
      ok = n == subject.size();
      return;
    }
  }
  ok = prev == n || n == subject.size();
}

}  // namespace

bool Steps::cuts_allowed() const {
  if (steps.empty()) return false;
  const Step& first = steps[0];
  const bool regex = first.kind == Step::kQwenSplit || (first.kind == Step::kRegexSplit && !first.regex->has_lookbehind());
  if (!regex || first.invert || (first.behavior != Behavior::kIsolated && first.behavior != Behavior::kRemoved)) return false;
  for (const Step& s : steps)
    if (s.kind == Step::kPrefixSpace) return false;
  return true;
}

bool Steps::split(std::string_view text, size_t n, std::vector<Piece>& out) const {
  const size_t first_out = out.size();
  if (steps.empty()) {
    if (n > 0) out.push_back({0, static_cast<uint32_t>(n), false});
    return true;
  }
  const Step& first = steps[0];
  if (steps.size() == 1 && first.behavior == Behavior::kIsolated && !first.invert &&
      (first.kind == Step::kQwenSplit || first.kind == Step::kRegexSplit)) {
    // The usual file (one regex, Isolated): pieces straight from the matches, gaps included.
    size_t prev = 0;
    if (first.kind == Step::kQwenSplit) {
      while (prev < n) {
        const size_t e = next_piece(text, prev, first.max_digits);
        out.push_back({static_cast<uint32_t>(prev), static_cast<uint32_t>(e), false});
        prev = e;
      }
      return prev == n || n == text.size();
    }
    for (size_t pos = 0; pos <= text.size();) {
      size_t st, en;
      if (!first.regex->find(text, pos, st, en) || st >= n) break;
      if (st > prev) out.push_back({static_cast<uint32_t>(prev), static_cast<uint32_t>(st), false});
      if (en > st) out.push_back({static_cast<uint32_t>(st), static_cast<uint32_t>(en), false});
      prev = en;
      if (en > st) pos = en;
      else if (st < text.size()) pos = st + char_len(text, st);
      else break;
    }
    if (prev < n) {
      out.push_back({static_cast<uint32_t>(prev), static_cast<uint32_t>(n), false});
      return n == text.size();
    }
    return prev == n || n == text.size();
  }
  bool ok = true;
  std::vector<Seg> segs;
  std::vector<std::pair<size_t, size_t>> ranges;
  {
    segments(steps[0], text, n, segs, ok);
    apply_behavior(segs, steps[0].behavior, steps[0].invert, ranges);
    for (auto [b, e] : ranges) out.push_back({static_cast<uint32_t>(b), static_cast<uint32_t>(e), false});
  }
  std::vector<Piece> next;
  std::string subject;
  for (size_t k = 1; k < steps.size(); ++k) {
    const Step& step = steps[k];
    next.clear();
    for (size_t i = first_out; i < out.size(); ++i) {
      const Piece p = out[i];
      if (step.kind == Step::kPrefixSpace) {
        Piece q = p;
        if (!p.prefixed && (p.end == p.begin || text[p.begin] != ' ')) q.prefixed = true;
        next.push_back(q);
        continue;
      }
      std::string_view sub = text.substr(p.begin, p.end - p.begin);
      if (p.prefixed) {
        subject.assign(1, ' ');
        subject.append(sub);
        sub = subject;
      }
      segs.clear();
      ranges.clear();
      bool sub_ok;
      segments(step, sub, sub.size(), segs, sub_ok);
      apply_behavior(segs, step.behavior, step.invert, ranges);
      const size_t shift = p.prefixed ? 1 : 0;
      for (auto [b, e] : ranges) {
        if (p.prefixed && b == 0) next.push_back({p.begin, static_cast<uint32_t>(p.begin + e - 1), true});
        else next.push_back({static_cast<uint32_t>(p.begin + b - shift), static_cast<uint32_t>(p.begin + e - shift), false});
      }
    }
    out.resize(first_out);
    out.insert(out.end(), next.begin(), next.end());
  }
  return ok;
}

}  // namespace lcx::pretok
