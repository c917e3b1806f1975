#include "data/utf8.h"

#include <utf8proc.h>

#include <cstdlib>

#include "lcx/error.h"

namespace lcx::utf8 {
namespace {

// Length of the well-formed sequence at p (1..4), or -k where k >= 1 is the length of the maximal
// ill-formed subpart to replace (Unicode 3.9, "best practice for U+FFFD substitution").
int scan(const unsigned char* p, size_t left) {
  unsigned c = p[0];
  if (c < 0x80) return 1;
  int need;
  unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) need = 1;
  else if (c == 0xE0) need = 2, lo = 0xA0;
  else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) need = 2;
  else if (c == 0xED) need = 2, hi = 0x9F;
  else if (c == 0xF0) need = 3, lo = 0x90;
  else if (c >= 0xF1 && c <= 0xF3) need = 3;
  else if (c == 0xF4) need = 3, hi = 0x8F;
  else return -1;
  for (int k = 1; k <= need; ++k) {
    if (static_cast<size_t>(k) >= left) return -k;
    unsigned b = p[k];
    bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) return -k;
  }
  return need + 1;
}

}  // namespace

size_t first_invalid(std::string_view s) {
  auto p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0;
  while (i < n) {
    if (p[i] < 0x80) {
      ++i;
      continue;
    }
    int k = scan(p + i, n - i);
    if (k < 0) return i;
    i += k;
  }
  return std::string_view::npos;
}

std::string repair(std::string_view s, int64_t* replaced) {
  auto p = reinterpret_cast<const unsigned char*>(s.data());
  size_t n = s.size(), i = 0;
  int64_t count = 0;
  std::string out;
  out.reserve(n + 16);
  while (i < n) {
    int k = scan(p + i, n - i);
    if (k > 0) {
      out.append(s.data() + i, k);
      i += k;
    } else {
      out.append("\xEF\xBF\xBD");
      ++count;
      i += -k;
    }
  }
  if (replaced) *replaced = count;
  return out;
}

void append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool may_change_under_nfc(std::string_view s) {
  // U+0300 is the first code point that is not NFC-inert; its lead byte is 0xCC.
  for (unsigned char c : s)
    if (c >= 0xCC) return true;
  return false;
}

std::string nfc(std::string_view s) {
  if (!may_change_under_nfc(s)) return std::string(s);
  utf8proc_uint8_t* out = nullptr;
  auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()),
                        &out, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) throw Error(str("NFC normalization failed: ", utf8proc_errmsg(n)));
  std::string r(reinterpret_cast<char*>(out), static_cast<size_t>(n));
  std::free(out);
  return r;
}

}  // namespace lcx::utf8
