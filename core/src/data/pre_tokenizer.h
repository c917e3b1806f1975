// Pre-tokenization of tokenizer.json: the steps that cut a normalized text into the words BPE
// sees, as `tokenizers` applies them (each step splits every piece the step before made).
//
//   Split      a regex (PCRE2 with its JIT) or a literal string; behavior Isolated, Removed,
//              MergedWithPrevious, MergedWithNext or Contiguous; invert
//   ByteLevel  add_prefix_space (a space before each piece that lacks one), use_regex (GPT-2's
//              pattern, Isolated); its byte-to-character map is undone in the vocabulary instead
//
// Regexes are read as Oniguruma (the engine `tokenizers` uses) reads them: \s and \S become the
// Unicode White_Space set (TAB..CR, SPACE, NEL, Zs, Zl, Zp), which PCRE2's \s is not quite
// (it also takes U+180E). The Qwen2/Qwen3 pattern also has a hand-written state machine
// (next_piece), which the Split step uses for exactly that pattern because it is faster than the
// JIT on it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lcx::pretok {

extern const char* const kQwenPattern;
// Llama 3's: the Qwen pattern with digits in runs of up to three (\p{N}{1,3}).
extern const char* const kLlama3Pattern;
extern const char* const kGpt2Pattern;  // ByteLevel's own regex (use_regex)

enum CharClass : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };
CharClass char_class(uint32_t cp);

// The Qwen pattern (max_digits 1) or Llama 3's (max_digits 3): end (exclusive byte offset) of the
// piece that starts at `pos` (< s.size()).
size_t next_piece(std::string_view s, size_t pos, int max_digits = 1);

// Whether cutting `s` at `pos` may leave the pieces unchanged: right after a '\n' when the next code
// point is not whitespace, and at the space of "ASCII letter, space, ASCII letter". Both keep NFC
// unchanged (nothing composes across the cut). For the Qwen pattern the pieces are the same; for
// any other regex the encoder verifies it (Pipeline::split_pieces reports where a cut was crossed).
bool is_safe_cut(std::string_view s, size_t pos);

// A compiled regex of tokenizer.json. Safe to share between threads (each thread matches with
// its own match data).
class Regex {
 public:
  // Throws std::invalid_argument with PCRE2's message and offset when the pattern does not compile.
  explicit Regex(const std::string& pattern);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  const std::string& pattern() const { return pattern_; }
  bool has_lookbehind() const { return lookbehind_; }
  // The leftmost match of `s` starting at or after `from`: [start, end), possibly empty.
  bool find(std::string_view s, size_t from, size_t& start, size_t& end) const;

 private:
  std::string pattern_;
  bool lookbehind_ = false;
  void* code_ = nullptr;  // pcre2_code_8
};

// The pattern rewritten for PCRE2 (\s and \S as the White_Space set); exposed for tests.
std::string oniguruma_to_pcre2(const std::string& pattern);

enum class Behavior : uint8_t { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

// One piece: bytes [begin, end) of the normalized text, after a space that ByteLevel's
// add_prefix_space put in front when `prefixed` (written by no byte of the text).
struct Piece {
  uint32_t begin = 0, end = 0;
  bool prefixed = false;
};

struct Step {
  enum Kind : uint8_t { kRegexSplit, kStringSplit, kQwenSplit, kPrefixSpace } kind = kRegexSplit;
  std::shared_ptr<const Regex> regex;  // kRegexSplit
  std::string literal;                 // kStringSplit
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
  uint8_t max_digits = 1;  // kQwenSplit: 1 (Qwen2/3's pattern) or 3 (Llama 3's)
};

// The steps of a tokenizer.json pre_tokenizer, flattened.
class Steps {
 public:
  std::vector<Step> steps;
  bool empty() const { return steps.empty(); }
  // Whether a text may be cut (at is_safe_cut positions) and its parts pre-tokenized apart, each
  // cut then verified by split()'s answer: true when the first step splits by a regex (Isolated
  // or Removed, not inverted, no lookbehind) and no step adds a prefix.
  bool cuts_allowed() const;
  // Appends the pieces of text[0, n). The text may go on past n: the first step's regex sees it
  // as lookahead, as it would see the rest of the input, and stops at the first match starting at
  // or after n. Returns true when the first step's last match ended exactly at n (or n is the
  // text's end), i.e. when the whole input has a piece boundary at n too.
  bool split(std::string_view text, size_t n, std::vector<Piece>& out) const;
  // split(), calling f(piece) for each piece instead: the Qwen pattern's pieces stream without a
  // list between the regex and BPE.
  template <typename F>
  bool for_each_piece(std::string_view text, size_t n, F&& f) const {
    if (steps.size() == 1 && steps[0].kind == Step::kQwenSplit && steps[0].behavior == Behavior::kIsolated &&
        !steps[0].invert) {
      size_t prev = 0;
      while (prev < n) {
        const size_t e = next_piece(text, prev, steps[0].max_digits);
        f(Piece{static_cast<uint32_t>(prev), static_cast<uint32_t>(e), false});
        prev = e;
      }
      return prev == n || n == text.size();
    }
    thread_local std::vector<Piece> pieces;
    pieces.clear();
    const bool ok = split(text, n, pieces);
    for (const Piece& p : pieces) f(p);
    return ok;
  }
};

}  // namespace lcx::pretok
