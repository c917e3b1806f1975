#include "data/jinja/text.h"

#include <utf8proc.h>

#include <algorithm>

#include "data/utf8.h"
#include "lcx/error.h"

namespace lcx::jinja {

bool Text::any_data() const {
  if (mask_.empty()) return uniform_ && !s_.empty();
  return std::find(mask_.begin(), mask_.end(), 1) != mask_.end();
}

void Text::materialize() {
  if (mask_.empty()) mask_.assign(s_.size(), uniform_);
}

void check_text_size(size_t bytes) {
  if (bytes > kMaxTextBytes)
    throw Failure(str("a string longer than the ", kMaxTextBytes >> 20,
                      " MiB a template may build (it grows its output or a string without bound)"));
}

void Text::append(const Text& o, size_t begin, size_t end) {
  if (begin >= end) return;
  check_text_size(s_.size() + (end - begin));
  const bool o_uniform = o.mask_.empty();
  if (s_.empty() && mask_.empty() && o_uniform) uniform_ = o.uniform_;
  if (mask_.empty() && o_uniform && o.uniform_ == uniform_) {
    s_.append(o.s_, begin, end - begin);
    return;
  }
  materialize();
  s_.append(o.s_, begin, end - begin);
  if (o_uniform)
    mask_.insert(mask_.end(), end - begin, o.uniform_);
  else
    mask_.insert(mask_.end(), o.mask_.begin() + begin, o.mask_.begin() + end);
}

void Text::append(std::string_view s, uint8_t flag) {
  if (s.empty()) return;
  check_text_size(s_.size() + s.size());
  if (s_.empty() && mask_.empty()) uniform_ = flag;
  if (mask_.empty() && flag == uniform_) {
    s_.append(s);
    return;
  }
  materialize();
  s_.append(s);
  mask_.insert(mask_.end(), s.size(), flag);
}

void Text::flags_into(std::vector<uint8_t>& out) const {
  if (mask_.empty())
    out.insert(out.end(), s_.size(), uniform_);
  else
    out.insert(out.end(), mask_.begin(), mask_.end());
}

uint32_t decode_at(std::string_view s, size_t i, int& len) {
  return utf8::decode(reinterpret_cast<const unsigned char*>(s.data()) + i, len);
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t count_code_points(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

std::vector<size_t> code_point_offsets(std::string_view s) {
  std::vector<size_t> off;
  off.reserve(s.size() + 1);
  for (size_t i = 0; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) off.push_back(i);
  off.push_back(s.size());
  return off;
}

bool py_isspace(uint32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x1F);
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 ||
         c == 0x202F || c == 0x205F || c == 0x3000;
}

bool py_isprintable(uint32_t c) {
  if (c < 0x80) return c >= 0x20 && c < 0x7F;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_CC: case UTF8PROC_CATEGORY_CF: case UTF8PROC_CATEGORY_CS: case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN: case UTF8PROC_CATEGORY_ZL: case UTF8PROC_CATEGORY_ZP: case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

namespace {

// Letters whose Python case mapping is not one code point for one (SpecialCasing) or depends on
// the neighbours (final sigma), and modifier letters Python counts as cased without a mapping.
bool special_case(uint32_t c) {
  return c == 0xDF || c == 0x130 || c == 0x149 || c == 0x1F0 || c == 0x390 || c == 0x3A3 || c == 0x3B0 ||
         c == 0x587 || c == 0xAA || c == 0xBA || (c >= 0x1E96 && c <= 0x1E9E) || (c >= 0x1F00 && c <= 0x1FFF) ||
         (c >= 0xFB00 && c <= 0xFB17) || utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_LM;
}

enum class Map { upper, lower, title };

// One code point mapped; `cased` says whether Python's str.title counts it as cased.
uint32_t map_cp(uint32_t c, Map m, bool* cased) {
  if (c < 0x80) {
    const bool up = c >= 'A' && c <= 'Z', low = c >= 'a' && c <= 'z';
    if (cased) *cased = up || low;
    if (m == Map::lower) return up ? c + 32 : c;
    return low ? c - 32 : c;
  }
  const auto ci = static_cast<utf8proc_int32_t>(c);
  const uint32_t u = static_cast<uint32_t>(utf8proc_toupper(ci)), l = static_cast<uint32_t>(utf8proc_tolower(ci)),
                 t = static_cast<uint32_t>(utf8proc_totitle(ci));
  const auto cat = utf8proc_category(ci);
  const bool has_case = u != c || l != c || t != c || cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL ||
                        cat == UTF8PROC_CATEGORY_LT;
  if (cased) *cased = has_case;
  if (!has_case && !special_case(c)) return c;
  if (special_case(c))
    throw Failure(str("changing the case of U+", std::hex, std::uppercase, c,
                      " is not implemented (Python's mapping for it is not one letter for one)"));
  return m == Map::upper ? u : m == Map::lower ? l : t;
}

template <typename F>
Text map_each(const Text& s, F f) {
  Text out;
  const std::string& b = s.str();
  std::string piece;
  for (size_t i = 0; i < b.size();) {
    int len;
    const uint32_t c = decode_at(b, i, len);
    piece.clear();
    append_utf8(piece, f(c));
    // A case change keeps the flag of the letter it came from.
    out.append(piece, s.flag_at(i));
    i += len;
  }
  return out;
}

}  // namespace

Text py_case(const Text& s, Case c) {
  if (ascii_only(s.str())) {
    std::string r = s.str();
    for (char& ch : r) {
      if (c == Case::upper && ch >= 'a' && ch <= 'z') ch -= 32;
      if (c == Case::lower && ch >= 'A' && ch <= 'Z') ch += 32;
    }
    Text out = s;
    Text res;
    // Same length, same flags: copy the flags by rebuilding from slices of equal size.
    for (size_t i = 0; i < r.size();) {
      size_t j = i;
      while (j < r.size() && s.flag_at(j) == s.flag_at(i)) ++j;
      res.append(std::string_view(r).substr(i, j - i), s.flag_at(i));
      i = j;
    }
    return res;
  }
  return map_each(s, [c](uint32_t cp) { return map_cp(cp, c == Case::upper ? Map::upper : Map::lower, nullptr); });
}

Text py_title(const Text& s) {
  bool prev_cased = false;
  return map_each(s, [&](uint32_t cp) {
    bool cased;
    const uint32_t r = map_cp(cp, prev_cased ? Map::lower : Map::title, &cased);
    prev_cased = cased;
    return r;
  });
}

Text py_capitalize(const Text& s) {
  bool first = true;
  return map_each(s, [&](uint32_t cp) {
    const uint32_t r = map_cp(cp, first ? Map::title : Map::lower, nullptr);
    first = false;
    return r;
  });
}

Text jinja_title(const Text& s) {
  // re.split(r"([-\s({\[<]+)") and item[0].upper() + item[1:].lower() for each piece.
  auto is_sep = [](uint32_t c) { return c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_isspace(c); };
  Text out;
  const std::string& b = s.str();
  size_t i = 0;
  while (i < b.size()) {
    int len;
    const bool sep = is_sep(decode_at(b, i, len));
    size_t j = i;
    while (j < b.size()) {
      int l2;
      if (is_sep(decode_at(b, j, l2)) != sep) break;
      j += l2;
    }
    Text piece = s.sub(i, j);
    int first_len;
    decode_at(b, i, first_len);
    out.append(py_case(piece.sub(0, first_len), Case::upper));
    out.append(py_case(piece.sub(first_len, piece.size()), Case::lower));
    i = j;
  }
  return out;
}

Text py_strip(const Text& s, const Text* chars, bool left, bool right) {
  std::vector<uint32_t> set;
  if (chars) {
    const std::string& c = chars->str();
    for (size_t i = 0; i < c.size();) {
      int len;
      set.push_back(decode_at(c, i, len));
      i += len;
    }
  }
  auto strip_cp = [&](uint32_t c) {
    return chars ? std::find(set.begin(), set.end(), c) != set.end() : py_isspace(c);
  };
  const std::string& b = s.str();
  size_t begin = 0, end = b.size();
  if (left) {
    while (begin < end) {
      int len;
      if (!strip_cp(decode_at(b, begin, len))) break;
      begin += len;
    }
  }
  if (right) {
    while (end > begin) {
      size_t k = end - 1;
      while (k > begin && (static_cast<unsigned char>(b[k]) & 0xC0) == 0x80) --k;
      int len;
      if (!strip_cp(decode_at(b, k, len))) break;
      end = k;
    }
  }
  return s.sub(begin, end);
}

std::vector<Text> py_split(const Text& s, const Text* sep, int64_t maxsplit, bool from_right) {
  std::vector<Text> out;
  const std::string& b = s.str();
  if (sep) {
    const std::string& p = sep->str();
    if (p.empty()) throw Failure("empty separator (Python's ValueError)");
    if (!from_right) {
      size_t pos = 0;
      while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
        const size_t f = b.find(p, pos);
        if (f == std::string::npos) break;
        out.push_back(s.sub(pos, f));
        pos = f + p.size();
      }
      out.push_back(s.sub(pos, b.size()));
    } else {
      size_t end = b.size();
      std::vector<Text> rev;
      while (maxsplit < 0 || static_cast<int64_t>(rev.size()) < maxsplit) {
        if (end < p.size()) break;
        const size_t f = b.rfind(p, end - p.size());
        if (f == std::string::npos) break;
        rev.push_back(s.sub(f + p.size(), end));
        end = f;
      }
      rev.push_back(s.sub(0, end));
      out.assign(rev.rbegin(), rev.rend());
    }
    return out;
  }
  // Whitespace runs separate; leading and trailing whitespace gives no empty pieces.
  std::vector<std::pair<size_t, size_t>> words;  // byte ranges
  std::vector<std::pair<size_t, uint32_t>> cps;
  for (size_t i = 0; i < b.size();) {
    int len;
    cps.push_back({i, decode_at(b, i, len)});
    i += len;
  }
  cps.push_back({b.size(), 0});
  const size_t n = cps.size() - 1;
  if (!from_right) {
    size_t i = 0;
    while (i < n) {
      while (i < n && py_isspace(cps[i].second)) ++i;
      if (i == n) break;
      if (maxsplit >= 0 && static_cast<int64_t>(words.size()) == maxsplit) {
        // Python keeps the remainder's trailing whitespace.
        words.push_back({cps[i].first, b.size()});
        break;
      }
      size_t j = i;
      while (j < n && !py_isspace(cps[j].second)) ++j;
      words.push_back({cps[i].first, cps[j].first});
      i = j;
    }
  } else {
    size_t e = n;
    std::vector<std::pair<size_t, size_t>> rev;
    while (e > 0) {
      while (e > 0 && py_isspace(cps[e - 1].second)) --e;
      if (e == 0) break;
      if (maxsplit >= 0 && static_cast<int64_t>(rev.size()) == maxsplit) {
        rev.push_back({0, cps[e].first});  // and rsplit the remainder's leading whitespace
        break;
      }
      size_t i = e;
      while (i > 0 && !py_isspace(cps[i - 1].second)) --i;
      rev.push_back({cps[i].first, cps[e].first});
      e = i;
    }
    words.assign(rev.rbegin(), rev.rend());
  }
  for (auto [a, z] : words) out.push_back(s.sub(a, z));
  return out;
}

std::vector<Text> py_splitlines(const Text& s) {
  auto is_break = [](uint32_t c) {
    return c == '\n' || c == '\r' || c == 0x0B || c == 0x0C || c == 0x1C || c == 0x1D || c == 0x1E || c == 0x85 ||
           c == 0x2028 || c == 0x2029;
  };
  std::vector<Text> out;
  const std::string& b = s.str();
  size_t start = 0, i = 0;
  while (i < b.size()) {
    int len;
    const uint32_t c = decode_at(b, i, len);
    if (is_break(c)) {
      out.push_back(s.sub(start, i));
      i += len;
      if (c == '\r' && i < b.size() && b[i] == '\n') ++i;
      start = i;
    } else {
      i += len;
    }
  }
  if (start < b.size()) out.push_back(s.sub(start, b.size()));
  return out;
}

Text py_replace(const Text& s, const Text& old, const Text& repl, int64_t count) {
  Text out;
  const std::string& b = s.str();
  const std::string& o = old.str();
  int64_t done = 0;
  if (o.empty()) {
    // Python inserts the replacement before every code point and at the end.
    size_t i = 0;
    while (i <= b.size()) {
      if (count >= 0 && done >= count) {
        out.append(s, i, b.size());
        return out;
      }
      out.append(repl);
      ++done;
      if (i == b.size()) break;
      int len;
      decode_at(b, i, len);
      out.append(s, i, i + len);
      i += len;
    }
    return out;
  }
  size_t pos = 0;
  while (count < 0 || done < count) {
    const size_t f = b.find(o, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f);
    out.append(repl);
    pos = f + o.size();
    ++done;
  }
  out.append(s, pos, b.size());
  return out;
}

int64_t py_find(const Text& s, const Text& sub, bool last) {
  const size_t f = last ? s.str().rfind(sub.str()) : s.str().find(sub.str());
  if (f == std::string::npos) return -1;
  return static_cast<int64_t>(count_code_points(std::string_view(s.str()).substr(0, f)));
}

bool ascii_only(std::string_view s) {
  for (unsigned char c : s)
    if (c >= 0x80) return false;
  return true;
}

}  // namespace lcx::jinja
