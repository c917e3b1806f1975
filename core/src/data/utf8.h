// UTF-8 helpers for the tokenizer: repair of ill-formed input, decoding of one code point, NFC.
// Python cannot hand invalid UTF-8 to `tokenizers` (a str holds only code points), so the faithful
// equivalent of tokenizing raw bytes is bytes.decode('utf-8', errors='replace') first: each maximal
// ill-formed subpart becomes one U+FFFD. repair() does exactly that and counts the replacements.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace lcx::utf8 {

// Byte offset of the first ill-formed sequence, or npos when `s` is valid UTF-8.
size_t first_invalid(std::string_view s);

// `s` with every maximal ill-formed subpart replaced by U+FFFD (as Python's errors='replace');
// returns the number of replacements through `replaced`.
std::string repair(std::string_view s, int64_t* replaced);

// Decodes the code point at `p` (valid UTF-8 assumed, at least one byte left); sets `len`.
inline uint32_t decode(const unsigned char* p, int& len) {
  uint32_t c = p[0];
  if (c < 0x80) { len = 1; return c; }
  if (c < 0xE0) { len = 2; return ((c & 0x1F) << 6) | (p[1] & 0x3F); }
  if (c < 0xF0) { len = 3; return ((c & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F); }
  len = 4;
  return ((c & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

void append(std::string& out, uint32_t cp);

// NFC of valid UTF-8. Text whose code points are all below U+0300 is returned unchanged without
// calling utf8proc: nothing there decomposes, composes or reorders.
std::string nfc(std::string_view s);
bool may_change_under_nfc(std::string_view s);

}  // namespace lcx::utf8
