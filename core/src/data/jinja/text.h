// Text as the Jinja engine holds it: UTF-8 bytes with one provenance flag per byte (1 where the
// byte came from the conversation's data), and the Python str operations chat templates call,
// with Python's semantics (indices count code points, whitespace is str.isspace's).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace lcx::jinja {

// What the engine cannot do (a type without that operation, a construct known only when
// rendering); the interpreter adds the template's name and line.
class Failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The longest string a template may build, its output included: templates come from files anyone
// hands out, and one that doubles a string in a loop would take all memory before failing. A
// rendered conversation of a million tokens is a few MB.
constexpr size_t kMaxTextBytes = size_t{256} << 20;
// Throws Failure for a string of `bytes` past kMaxTextBytes.
void check_text_size(size_t bytes);

class Text {
 public:
  Text() = default;
  Text(std::string s, uint8_t flag) : s_(std::move(s)), uniform_(flag) {}

  const std::string& str() const { return s_; }
  size_t size() const { return s_.size(); }
  bool empty() const { return s_.empty(); }
  uint8_t flag_at(size_t i) const { return mask_.empty() ? uniform_ : mask_[i]; }
  bool any_data() const;

  void append(const Text& o) { append(o, 0, o.size()); }
  void append(const Text& o, size_t begin, size_t end);  // bytes [begin, end) of o
  void append(std::string_view s, uint8_t flag);
  Text sub(size_t begin, size_t end) const {
    Text t;
    t.append(*this, begin, end);
    return t;
  }
  // The flags written out one per byte (for the rendered result).
  void flags_into(std::vector<uint8_t>& out) const;

 private:
  void materialize();
  std::string s_;
  std::vector<uint8_t> mask_;  // empty: every byte is uniform_
  uint8_t uniform_ = 0;
};

// Code points and UTF-8.
uint32_t decode_at(std::string_view s, size_t i, int& len);
void append_utf8(std::string& out, uint32_t cp);
size_t count_code_points(std::string_view s);
// Byte offset of each code point of s, plus s.size() at the end.
std::vector<size_t> code_point_offsets(std::string_view s);
bool ascii_only(std::string_view s);
bool py_isspace(uint32_t cp);  // str.isspace: bidi WS, B, S or category Zs
bool py_isprintable(uint32_t cp);  // str.isprintable (repr escapes the others)

// Python's str methods on Text; the results keep the input's flags byte for byte. Case changes
// of letters whose Python mapping is not utf8proc's simple one (sharp s, final sigma, ligatures,
// Greek extended) throw Failure rather than differ.
enum class Case { upper, lower };
Text py_case(const Text& s, Case c);  // str.upper / str.lower
Text py_title(const Text& s);         // str.title
Text py_capitalize(const Text& s);    // str.capitalize
Text jinja_title(const Text& s);      // the `title` filter: first letter of each word up, rest down
Text py_strip(const Text& s, const Text* chars, bool left, bool right);
std::vector<Text> py_split(const Text& s, const Text* sep, int64_t maxsplit, bool from_right);
std::vector<Text> py_splitlines(const Text& s);
Text py_replace(const Text& s, const Text& old, const Text& repl, int64_t count);
// Code point index of the first (or last) occurrence of sub in s[start:end] (code points), or -1.
int64_t py_find(const Text& s, const Text& sub, bool last);

}  // namespace lcx::jinja
