// The Split pre-tokenizer of Qwen2/Qwen3 tokenizer.json files, hand-written as a state machine:
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// with behavior Isolated. Every code point is covered by some alternative, so the matches tile the
// text; next_piece() returns where the match starting at `pos` ends, trying the alternatives in
// order as Oniguruma (the regex engine `tokenizers` uses) does, backtracking included. Classes
// follow Oniguruma's Unicode definitions: \s is White_Space (TAB..CR, SPACE, NEL, Zs, Zl, Zp),
// \p{L} the L* categories, \p{N} the N* categories, from utf8proc's tables.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace lcx::pretok {

// The one pattern implemented; tokenizer.json files with another are refused.
extern const char* const kQwenPattern;

enum CharClass : uint8_t { kOther = 0, kLetter = 1, kNumber = 2, kSpace = 3 };
CharClass char_class(uint32_t cp);

// End (exclusive byte offset) of the piece that starts at `pos` (< s.size()). `s` is valid UTF-8.
size_t next_piece(std::string_view s, size_t pos);

// Whether cutting `s` at `pos` and pre-tokenizing both halves separately gives the same pieces as
// the whole: true right after a '\n' when the next code point is not whitespace (every piece that
// holds that '\n' ends there and nothing before it looks further), and at the space of
// "ASCII letter, space, ASCII letter" (a letter run ends at the space and " word" starts a piece).
// Both also keep NFC unchanged: the code points on either side never compose across the cut.
bool is_safe_cut(std::string_view s, size_t pos);

}  // namespace lcx::pretok
