// The values a chat template computes with, as Python (under jinja2's sandbox) has them:
// undefined, None, bool, int, float, str (Text, with provenance), list, tuple, dict (insertion
// ordered), the lazy iterators filters return, namespaces, the loop object and callables.
// Containers are immutable (ImmutableSandboxedEnvironment refuses to change them); only a
// namespace's attributes change. Scalars and containers carry one provenance flag, `data`.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "data/jinja/text.h"

namespace lcx::jinja {

enum class Kind : uint8_t { undefined, none, boolean, integer, floating, string, list, dict, ns, loop, callable };
// What a list-kind value is in Python: a list, a tuple, an iterator (generator, reversed: no len,
// no index, always true) or a dict view (items(), keys(), values(): a len, no index).
enum class Seq : uint8_t { list, tuple, iterator, view };

struct Value;
struct List {
  std::vector<Value> items;
};
struct Dict;
struct Namespace;
struct LoopInfo;
struct Callable;

struct Value {
  Kind kind = Kind::undefined;
  Seq seq = Seq::list;
  uint8_t data = 0;     // came from the conversation's data (strings keep theirs per byte)
  bool markup = false;  // a string marked `safe` (Markup in jinja2)
  union {
    bool b;
    int64_t i;
    double f;
  };
  std::shared_ptr<const void> p;  // Text, List, Dict, Namespace, LoopInfo, Callable; the undefined's hint

  Value() : i(0) {}
  static Value undefined(std::string hint = {});
  static Value none(uint8_t data = 0);
  static Value boolean(bool v, uint8_t data = 0);
  static Value integer(int64_t v, uint8_t data = 0);
  static Value floating(double v, uint8_t data = 0);
  static Value string(Text t);
  static Value string(std::string s, uint8_t flag = 0) { return string(Text(std::move(s), flag)); }
  static Value list(std::vector<Value> items, Seq seq = Seq::list, uint8_t data = 0);
  static Value dict(std::shared_ptr<const Dict> d, uint8_t data = 0);

  bool is_undefined() const { return kind == Kind::undefined; }
  bool is_string() const { return kind == Kind::string; }
  bool is_number() const { return kind == Kind::integer || kind == Kind::floating || kind == Kind::boolean; }
  const Text& text() const { return *static_cast<const Text*>(p.get()); }
  const std::vector<Value>& items() const { return static_cast<const List*>(p.get())->items; }
  const Dict& dict() const { return *static_cast<const Dict*>(p.get()); }
  Namespace& ns() const { return *const_cast<Namespace*>(static_cast<const Namespace*>(p.get())); }
  const LoopInfo& loop() const { return *static_cast<const LoopInfo*>(p.get()); }
  const Callable& callable() const { return *static_cast<const Callable*>(p.get()); }
  const std::string& hint() const;  // an undefined's: what was looked up
};

struct Dict {
  std::vector<std::pair<Value, Value>> items;
  const Value* find(const Value& key) const;
  const Value* find(std::string_view key) const;
};

struct Namespace {
  std::vector<std::pair<std::string, Value>> attrs;
  const Value* find(const std::string& name) const;
  void set(const std::string& name, Value v);
};

struct LoopInfo {
  int64_t index0 = 0, length = 0;
  const std::vector<Value>* items = nullptr;  // the iterated values, for previtem and nextitem
};

// A macro, a global function or a bound method. `fn` gets the positional and keyword arguments.
struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
};
struct Callable {
  std::string name;
  std::function<Value(Args&)> fn;
};

Value from_json(const nlohmann::ordered_json& j, uint8_t data);
// Messages: every string is data except the string value of each message's "role".
Value from_json_messages(const nlohmann::ordered_json& j);

bool truthy(const Value& v);
std::string type_name(const Value& v);  // Python's, for errors: 'str', 'int', 'NoneType'
// str(v): what {{ v }} prints. Undefined prints nothing.
Text to_text(const Value& v);
Text repr(const Value& v);
std::string float_repr(double f);  // Python's repr of a float: 1.0, 0.1, 1e-05, 1e+16, inf
bool equal(const Value& a, const Value& b);
// a < b with Python's rules; throws Failure for types Python does not order.
bool less(const Value& a, const Value& b);

struct JsonOptions {
  bool ensure_ascii = false;
  bool indent_set = false;
  std::string indent;  // the string of one level (an int n gives n spaces)
  std::string item_sep = ", ", key_sep = ": ";
  bool sort_keys = false;
};
// json.dumps(v, ...) as Python writes it; bytes keep the provenance of what they spell.
Text to_json(const Value& v, const JsonOptions& o);

}  // namespace lcx::jinja
