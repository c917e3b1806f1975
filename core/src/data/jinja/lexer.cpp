#include "data/jinja/lexer.h"

#include <cstring>

#include "data/jinja/text.h"
#include "lcx/error.h"

namespace lcx::jinja {

namespace {

bool is_ws_at(const std::string& s, size_t i, int& len) {
  if (i >= s.size()) return false;
  return py_isspace(decode_at(s, i, len));
}

// Index just past the Python whitespace (\s) starting at i.
size_t skip_ws(const std::string& s, size_t i) {
  int len;
  while (is_ws_at(s, i, len)) i += len;
  return i;
}

// s with trailing Python whitespace removed (str.rstrip()).
std::string rstrip(const std::string& s) {
  size_t end = s.size();
  while (end > 0) {
    size_t k = end - 1;
    while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    int len;
    if (!py_isspace(decode_at(s, k, len))) break;
    end = k;
  }
  return s.substr(0, end);
}

bool all_ws(const std::string& s, size_t from) {
  if (from >= s.size()) return false;  // jinja2 matches \s+: an empty tail is not stripped
  for (size_t i = from; i < s.size();) {
    int len;
    if (!py_isspace(decode_at(s, i, len))) return false;
    i += len;
  }
  return true;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The body of a string literal decoded as jinja2 does (Python's unicode-escape).
std::string unescape(const std::string& body) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out += c;
      continue;
    }
    const char e = body[++i];
    switch (e) {
      case '\n': break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'n': out += '\n'; break;
      case 'r': out += '\r'; break;
      case 't': out += '\t'; break;
      case 'v': out += '\v'; break;
      case 'x':
      case 'u':
      case 'U': {
        const int n = e == 'x' ? 2 : e == 'u' ? 4 : 8;
        uint32_t cp = 0;
        for (int k = 0; k < n; ++k) {
          const int h = i + 1 + k < body.size() ? hex_value(body[i + 1 + k]) : -1;
          if (h < 0) throw Failure(str("truncated \\", e, " escape in a string literal"));
          cp = cp * 16 + static_cast<uint32_t>(h);
        }
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
          throw Failure("a string literal escapes a code point that is not a character");
        append_utf8(out, cp);
        i += n;
        break;
      }
      case 'N': throw Failure("\\N{...} escapes in string literals are not implemented");
      default:
        if (e >= '0' && e <= '7') {
          uint32_t cp = e - '0';
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k)
            cp = cp * 8 + static_cast<uint32_t>(body[++i] - '0');
          append_utf8(out, cp);
        } else if (static_cast<unsigned char>(e) >= 0x80) {
          // jinja2 would turn the character into its own \u escape first and keep it as text.
          throw Failure("a backslash before a non-ASCII character in a string literal is not implemented");
        } else {
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_name_char(char c) { return is_name_start(c) || is_digit(c); }

// Length of digits with single underscores between them ((\d+_)*\d+) at i, 0 when none.
size_t digit_run(const std::string& s, size_t i) {
  size_t j = i;
  if (j >= s.size() || !is_digit(s[j])) return 0;
  while (j < s.size()) {
    if (is_digit(s[j])) ++j;
    else if (s[j] == '_' && j + 1 < s.size() && is_digit(s[j + 1])) ++j;
    else break;
  }
  return j - i;
}

// jinja2's float: digits then a fraction, an exponent, or both; 0 when not a float.
size_t float_len(const std::string& s, size_t i) {
  if (i > 0 && s[i - 1] == '.') return 0;
  const size_t a = digit_run(s, i);
  if (!a) return 0;
  size_t j = i + a;
  bool frac = false;
  if (j < s.size() && s[j] == '.') {
    const size_t b = digit_run(s, j + 1);
    if (b) {
      j += 1 + b;
      frac = true;
    }
  }
  if (j < s.size() && (s[j] == 'e' || s[j] == 'E')) {
    size_t k = j + 1;
    if (k < s.size() && (s[k] == '+' || s[k] == '-')) ++k;
    const size_t c = digit_run(s, k);
    if (c) return k + c - i;
  }
  return frac ? j - i : 0;
}

size_t integer_len(const std::string& s, size_t i) {
  if (s[i] == '0' && i + 1 < s.size() && std::strchr("bBoOxX", s[i + 1])) {
    const char base = static_cast<char>(s[i + 1] | 0x20);
    auto ok = [&](char c) {
      return base == 'b' ? (c == '0' || c == '1') : base == 'o' ? (c >= '0' && c <= '7') : hex_value(c) >= 0;
    };
    size_t j = i + 2;
    while (j < s.size() && (ok(s[j]) || (s[j] == '_' && j + 1 < s.size() && ok(s[j + 1])))) ++j;
    if (j > i + 2) return j - i;
    return 1;
  }
  return digit_run(s, i);
}

const char* const kOps[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[", "]", "(",
                            ")", "{", "}", ">", "<", "=", ".", ":", "|", ",", ";"};

}  // namespace

std::vector<Token> lex(const std::string& raw_source, int* error_line) {
  // Newlines as jinja2 normalizes them, and its one dropped trailing newline.
  std::string src;
  src.reserve(raw_source.size());
  for (size_t i = 0; i < raw_source.size(); ++i) {
    if (raw_source[i] == '\r') {
      src += '\n';
      if (i + 1 < raw_source.size() && raw_source[i + 1] == '\n') ++i;
    } else {
      src += raw_source[i];
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();

  std::vector<Token> out;
  int line = 1;
  auto count_lines = [&](size_t a, size_t b) {
    for (size_t k = a; k < b; ++k) line += src[k] == '\n';
  };
  auto fail = [&](const std::string& msg) -> Failure {
    *error_line = line;
    return Failure(msg);
  };
  auto emit_text = [&](std::string t, int at) {
    if (!t.empty()) out.push_back({Tok::text, std::move(t), at});
  };

  size_t pos = 0;
  bool line_starting = true;
  while (pos < src.size()) {
    size_t start = pos;
    while (true) {
      start = src.find('{', start);
      if (start == std::string::npos || start + 1 >= src.size()) {
        start = std::string::npos;
        break;
      }
      const char n = src[start + 1];
      if (n == '{' || n == '%' || n == '#') break;
      ++start;
    }
    if (start == std::string::npos) {
      emit_text(src.substr(pos), line);
      count_lines(pos, src.size());
      break;
    }
    const char kind = src[start + 1];
    const char control = start + 2 < src.size() && (src[start + 2] == '-' || src[start + 2] == '+') ? src[start + 2] : 0;
    std::string text = src.substr(pos, start - pos);
    const int text_line = line;
    count_lines(pos, start);

    // {% raw %}: its body is text, untouched.
    if (kind == '%') {
      size_t k = skip_ws(src, start + 2 + (control ? 1 : 0));
      if (src.compare(k, 3, "raw") == 0 && (k + 3 >= src.size() || !is_name_char(src[k + 3]))) {
        size_t e = skip_ws(src, k + 3);
        bool strip_after = false;
        if (src.compare(e, 3, "-%}") == 0) {
          strip_after = true;
          e += 3;
        } else if (src.compare(e, 2, "%}") == 0) {
          e += 2;
        } else {
          throw fail("a malformed {% raw %} tag");
        }
        if (control == '-') text = rstrip(text);
        else if (control != '+') {
          const size_t l = text.rfind('\n') + 1;
          if ((l > 0 || line_starting) && all_ws(text, l)) text.resize(l);
        }
        emit_text(text, text_line);
        count_lines(start, e);
        if (strip_after) {
          const size_t w = skip_ws(src, e);
          count_lines(e, w);
          e = w;
        }
        // Find {% endraw %} (with its own whitespace control).
        size_t f = e;
        while (true) {
          f = src.find("{%", f);
          if (f == std::string::npos) throw fail("{% raw %} without {% endraw %}");
          size_t g = f + 2;
          const char c2 = g < src.size() && (src[g] == '-' || src[g] == '+') ? src[g] : 0;
          if (c2) ++g;
          g = skip_ws(src, g);
          if (src.compare(g, 6, "endraw") == 0) {
            size_t h = skip_ws(src, g + 6);
            std::string body = src.substr(e, f - e);
            if (c2 == '-') body = rstrip(body);
            emit_text(body, line);
            count_lines(e, f);
            if (src.compare(h, 3, "-%}") == 0) h = skip_ws(src, h + 3);
            else if (src.compare(h, 3, "+%}") == 0) h += 3;
            else if (src.compare(h, 2, "%}") == 0) {
              h += 2;
              if (h < src.size() && src[h] == '\n') ++h;
            } else {
              throw fail("a malformed {% endraw %} tag");
            }
            count_lines(f, h);
            line_starting = src[h - 1] == '\n';
            pos = h;
            break;
          }
          f += 2;
        }
        continue;
      }
    }

    if (control == '-') {
      text = rstrip(text);
    } else if (control != '+' && kind != '{') {
      const size_t l = text.rfind('\n') + 1;
      if ((l > 0 || line_starting) && all_ws(text, l)) text.resize(l);
    }
    emit_text(text, text_line);

    size_t i = start + 2 + (control ? 1 : 0);
    if (kind == '#') {
      const size_t e = src.find("#}", i);
      if (e == std::string::npos) throw fail("a comment without its closing #}");
      size_t after = e + 2;
      if (e > i && src[e - 1] == '-')
        after = skip_ws(src, after);
      else if (!(e > i && src[e - 1] == '+') && after < src.size() && src[after] == '\n')
        ++after;
      count_lines(start, after);
      line_starting = src[after - 1] == '\n';
      pos = after;
      continue;
    }

    const bool block = kind == '%';
    out.push_back({block ? Tok::block_begin : Tok::var_begin, "", line});
    int depth = 0;
    size_t closer_end = 0;
    while (true) {
      if (i >= src.size()) throw fail(block ? "a tag without its closing %}" : "an expression without its closing }}");
      if (depth == 0) {
        // The closer is tried before any other token, as jinja2's lexer does.
        const char* close = block ? "%}" : "}}";
        if (src[i] == '-' && src.compare(i + 1, 2, close) == 0) {
          out.push_back({block ? Tok::block_end : Tok::var_end, "", line});
          closer_end = i + 3;
          i = skip_ws(src, i + 3);
          break;
        }
        if (block && src[i] == '+' && src.compare(i + 1, 2, close) == 0) {
          out.push_back({Tok::block_end, "", line});
          i += 3;
          closer_end = i;
          break;
        }
        if (src.compare(i, 2, close) == 0) {
          out.push_back({block ? Tok::block_end : Tok::var_end, "", line});
          i += 2;
          closer_end = i;
          if (block && i < src.size() && src[i] == '\n') ++i;
          break;
        }
      }
      int wl;
      if (is_ws_at(src, i, wl)) {
        if (src[i] == '\n') ++line;
        i += wl;
        continue;
      }
      const char c = src[i];
      if (size_t n = is_digit(c) ? float_len(src, i) : 0) {
        std::string digits;
        for (size_t k = i; k < i + n; ++k)
          if (src[k] != '_') digits += src[k];
        out.push_back({Tok::floating, digits, line});
        i += n;
        continue;
      }
      if (is_digit(c)) {
        const size_t n = integer_len(src, i);
        std::string digits;
        for (size_t k = i; k < i + n; ++k)
          if (src[k] != '_') digits += src[k];
        out.push_back({Tok::integer, digits, line});
        i += n;
        continue;
      }
      if (is_name_start(c)) {
        size_t j = i;
        while (j < src.size() && is_name_char(src[j])) ++j;
        if (j < src.size() && static_cast<unsigned char>(src[j]) >= 0x80)
          throw fail("names with non-ASCII letters are not implemented");
        out.push_back({Tok::name, src.substr(i, j - i), line});
        i = j;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t j = i + 1;
        while (j < src.size() && src[j] != c) j += src[j] == '\\' ? 2 : 1;
        if (j >= src.size()) throw fail("a string literal without its closing quote");
        const int at = line;
        count_lines(i, j);
        std::string value;
        try {
          value = unescape(src.substr(i + 1, j - i - 1));
        } catch (const Failure& e) {
          throw fail(e.what());
        }
        out.push_back({Tok::string, std::move(value), at});
        i = j + 1;
        continue;
      }
      bool matched = false;
      for (const char* op : kOps) {
        const size_t n = std::strlen(op);
        if (src.compare(i, n, op) == 0) {
          if (op[0] == '(' || op[0] == '[' || op[0] == '{') ++depth;
          if ((op[0] == ')' || op[0] == ']' || op[0] == '}') && n == 1) {
            if (depth == 0) throw fail(str("unexpected '", op, "'"));
            --depth;
          }
          out.push_back({Tok::op, op, line});
          i += n;
          matched = true;
          break;
        }
      }
      if (!matched) throw fail(str("unexpected character '", std::string(1, c), "'"));
    }
    count_lines(closer_end, i);  // the newline of trim_blocks, or the whitespace after -%}
    line_starting = src[i - 1] == '\n';
    pos = i;
  }
  out.push_back({Tok::eof, "", line});
  return out;
}

}  // namespace lcx::jinja
