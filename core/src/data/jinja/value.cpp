#include "data/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "lcx/error.h"

namespace lcx::jinja {

Value Value::undefined(std::string hint) {
  Value v;
  v.kind = Kind::undefined;
  if (!hint.empty()) v.p = std::make_shared<const std::string>(std::move(hint));
  return v;
}
Value Value::none(uint8_t data) {
  Value v;
  v.kind = Kind::none;
  v.data = data;
  return v;
}
Value Value::boolean(bool b, uint8_t data) {
  Value v;
  v.kind = Kind::boolean;
  v.i = 0;
  v.b = b;
  v.data = data;
  return v;
}
Value Value::integer(int64_t x, uint8_t data) {
  Value v;
  v.kind = Kind::integer;
  v.i = x;
  v.data = data;
  return v;
}
Value Value::floating(double x, uint8_t data) {
  Value v;
  v.kind = Kind::floating;
  v.f = x;
  v.data = data;
  return v;
}
Value Value::string(Text t) {
  Value v;
  v.kind = Kind::string;
  v.p = std::make_shared<const Text>(std::move(t));
  return v;
}
Value Value::list(std::vector<Value> items, Seq seq, uint8_t data) {
  Value v;
  v.kind = Kind::list;
  v.seq = seq;
  v.data = data;
  v.p = std::make_shared<const List>(List{std::move(items)});
  return v;
}
Value Value::dict(std::shared_ptr<const Dict> d, uint8_t data) {
  Value v;
  v.kind = Kind::dict;
  v.data = data;
  v.p = std::move(d);
  return v;
}

const std::string& Value::hint() const {
  static const std::string none;
  return kind == Kind::undefined && p ? *static_cast<const std::string*>(p.get()) : none;
}

const Value* Dict::find(const Value& key) const {
  for (const auto& [k, v] : items)
    if (equal(k, key)) return &v;
  return nullptr;
}
const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k.kind == Kind::string && k.text().str() == key) return &v;
  return nullptr;
}

const Value* Namespace::find(const std::string& name) const {
  for (const auto& [k, v] : attrs)
    if (k == name) return &v;
  return nullptr;
}
void Namespace::set(const std::string& name, Value v) {
  for (auto& [k, old] : attrs)
    if (k == name) {
      old = std::move(v);
      return;
    }
  attrs.emplace_back(name, std::move(v));
}

static Value from_json_at(const nlohmann::ordered_json& j, uint8_t data, bool message) {
  using J = nlohmann::ordered_json;
  switch (j.type()) {
    case J::value_t::null: return Value::none(data);
    case J::value_t::boolean: return Value::boolean(j.get<bool>(), data);
    case J::value_t::number_integer: return Value::integer(j.get<int64_t>(), data);
    case J::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) throw Failure(str("the integer ", u, " is beyond 64 bits"));
      return Value::integer(static_cast<int64_t>(u), data);
    }
    case J::value_t::number_float: return Value::floating(j.get<double>(), data);
    case J::value_t::string: return Value::string(j.get<std::string>(), data);
    case J::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(from_json_at(e, data, false));
      return Value::list(std::move(items), Seq::list, data);
    }
    case J::value_t::object: {
      auto d = std::make_shared<Dict>();
      d->items.reserve(j.size());
      for (const auto& [k, e] : j.items()) {
        // The reader checked each message's role against a closed list: it is structure.
        const bool role = message && k == "role" && e.is_string();
        d->items.emplace_back(Value::string(k, data), from_json_at(e, role ? 0 : data, false));
      }
      return Value::dict(std::move(d), data);
    }
    default: throw Failure("binary values are not JSON");
  }
}

Value from_json(const nlohmann::ordered_json& j, uint8_t data) { return from_json_at(j, data, false); }

Value from_json_messages(const nlohmann::ordered_json& j) {
  if (!j.is_array()) return from_json(j, 1);
  std::vector<Value> items;
  items.reserve(j.size());
  for (const auto& m : j) items.push_back(from_json_at(m, 1, true));
  return Value::list(std::move(items), Seq::list, 1);
}

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::undefined:
    case Kind::none: return false;
    case Kind::boolean: return v.b;
    case Kind::integer: return v.i != 0;
    case Kind::floating: return v.f != 0;
    case Kind::string: return !v.text().empty();
    case Kind::list: return v.seq == Seq::iterator || !v.items().empty();
    case Kind::dict: return !v.dict().items.empty();
    default: return true;
  }
}

std::string type_name(const Value& v) {
  switch (v.kind) {
    case Kind::undefined: return "Undefined";
    case Kind::none: return "NoneType";
    case Kind::boolean: return "bool";
    case Kind::integer: return "int";
    case Kind::floating: return "float";
    case Kind::string: return "str";
    case Kind::list:
      return v.seq == Seq::list ? "list" : v.seq == Seq::tuple ? "tuple" : v.seq == Seq::view ? "dict view" : "generator";
    case Kind::dict: return "dict";
    case Kind::ns: return "Namespace";
    case Kind::loop: return "LoopContext";
    case Kind::callable: return "function";
  }
  return "?";
}

std::string float_repr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof buf, f, std::chars_format::scientific);
  std::string s(buf, res.ptr);
  std::string sign;
  if (s[0] == '-') {
    sign = "-";
    s.erase(0, 1);
  }
  const size_t e = s.find('e');
  std::string digits = s.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(s.substr(e + 1));
  const int decpt = exp + 1;
  const int n = static_cast<int>(digits.size());
  std::string out;
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0)
      out = "0." + std::string(-decpt, '0') + digits;
    else if (decpt >= n)
      out = digits + std::string(decpt - n, '0') + ".0";
    else
      out = digits.substr(0, decpt) + "." + digits.substr(decpt);
  } else {
    out = digits.substr(0, 1);
    if (n > 1) out += "." + digits.substr(1);
    const int x = decpt - 1;
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", x < 0 ? '-' : '+', x < 0 ? -x : x);
    out += eb;
  }
  return sign + out;
}

static void repr_into(Text& out, const Value& v);

static void repr_string(Text& out, const Text& t) {
  const std::string& s = t.str();
  const bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  const char q = has_single && !has_double ? '"' : '\'';
  const uint8_t qflag = t.any_data();
  out.append(std::string_view(&q, 1), qflag);
  std::string piece;
  for (size_t i = 0; i < s.size();) {
    int len;
    const uint32_t c = decode_at(s, i, len);
    piece.clear();
    if (c == '\\') piece = "\\\\";
    else if (c == static_cast<uint32_t>(q)) piece = std::string("\\") + q;
    else if (c == '\t') piece = "\\t";
    else if (c == '\n') piece = "\\n";
    else if (c == '\r') piece = "\\r";
    else if (!py_isprintable(c)) {
      char b[16];
      if (c < 0x100) std::snprintf(b, sizeof b, "\\x%02x", c);
      else if (c < 0x10000) std::snprintf(b, sizeof b, "\\u%04x", c);
      else std::snprintf(b, sizeof b, "\\U%08x", c);
      piece = b;
    }
    if (piece.empty())
      out.append(t, i, i + len);
    else
      out.append(piece, t.flag_at(i));
    i += len;
  }
  out.append(std::string_view(&q, 1), qflag);
}

static void repr_into(Text& out, const Value& v) {
  const uint8_t d = v.data;
  switch (v.kind) {
    case Kind::string: repr_string(out, v.text()); return;
    case Kind::list: {
      if (v.seq == Seq::iterator || v.seq == Seq::view)
        throw Failure(str("printing a ", type_name(v), " object is not implemented (add |list)"));
      const bool tuple = v.seq == Seq::tuple;
      out.append(tuple ? "(" : "[", d);
      const auto& items = v.items();
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out.append(", ", d);
        repr_into(out, items[k]);
      }
      if (tuple && items.size() == 1) out.append(",", d);
      out.append(tuple ? ")" : "]", d);
      return;
    }
    case Kind::dict: {
      out.append("{", d);
      bool first = true;
      for (const auto& [k, e] : v.dict().items) {
        if (!first) out.append(", ", d);
        first = false;
        repr_into(out, k);
        out.append(": ", d);
        repr_into(out, e);
      }
      out.append("}", d);
      return;
    }
    case Kind::undefined: out.append("Undefined", 0); return;  // jinja2's Undefined.__repr__
    default: out.append(to_text(v)); return;
  }
}

Text repr(const Value& v) {
  Text t;
  repr_into(t, v);
  return t;
}

Text to_text(const Value& v) {
  const uint8_t d = v.data;
  switch (v.kind) {
    case Kind::undefined: return Text();
    case Kind::none: return Text("None", d);
    case Kind::boolean: return Text(v.b ? "True" : "False", d);
    case Kind::integer: return Text(std::to_string(v.i), d);
    case Kind::floating: return Text(float_repr(v.f), d);
    case Kind::string: return v.text();
    case Kind::list:
    case Kind::dict: return repr(v);
    default: throw Failure(str("printing a ", type_name(v), " is not implemented"));
  }
}

static double as_double(const Value& v) {
  return v.kind == Kind::floating ? v.f : v.kind == Kind::boolean ? (v.b ? 1.0 : 0.0) : static_cast<double>(v.i);
}
static int64_t as_int(const Value& v) { return v.kind == Kind::boolean ? (v.b ? 1 : 0) : v.i; }

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::floating || b.kind == Kind::floating) return as_double(a) == as_double(b);
    return as_int(a) == as_int(b);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::undefined:
    case Kind::none: return true;
    case Kind::string: return a.text().str() == b.text().str();
    case Kind::list: {
      if (a.seq != b.seq || a.seq == Seq::iterator || a.seq == Seq::view) return a.p == b.p;
      const auto &x = a.items(), &y = b.items();
      if (x.size() != y.size()) return false;
      for (size_t k = 0; k < x.size(); ++k)
        if (!equal(x[k], y[k])) return false;
      return true;
    }
    case Kind::dict: {
      const auto &x = a.dict().items, &y = b.dict().items;
      if (x.size() != y.size()) return false;
      for (const auto& [k, e] : x) {
        const Value* o = b.dict().find(k);
        if (!o || !equal(e, *o)) return false;
      }
      return true;
    }
    default: return a.p == b.p;
  }
}

bool less(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::floating || b.kind == Kind::floating) return as_double(a) < as_double(b);
    return as_int(a) < as_int(b);
  }
  if (a.kind == Kind::string && b.kind == Kind::string) return a.text().str() < b.text().str();
  if (a.kind == Kind::list && b.kind == Kind::list && a.seq == b.seq && (a.seq == Seq::list || a.seq == Seq::tuple)) {
    const auto &x = a.items(), &y = b.items();
    for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
      if (equal(x[k], y[k])) continue;
      return less(x[k], y[k]);
    }
    return x.size() < y.size();
  }
  throw Failure(str("'<' is not supported between instances of '", type_name(a), "' and '", type_name(b), "'"));
}

static void json_string(Text& out, const Text& t, bool ensure_ascii) {
  const std::string& s = t.str();
  const uint8_t qflag = t.any_data();
  out.append("\"", qflag);
  std::string piece;
  size_t run = 0;  // start of the bytes copied as they are
  for (size_t i = 0; i < s.size();) {
    int len;
    const uint32_t c = decode_at(s, i, len);
    piece.clear();
    switch (c) {
      case '"': piece = "\\\""; break;
      case '\\': piece = "\\\\"; break;
      case '\n': piece = "\\n"; break;
      case '\r': piece = "\\r"; break;
      case '\t': piece = "\\t"; break;
      case '\b': piece = "\\b"; break;
      case '\f': piece = "\\f"; break;
      default: {
        char b[16];
        if (c < 0x20 || (ensure_ascii && c >= 0x7F)) {
          if (c < 0x10000) {
            std::snprintf(b, sizeof b, "\\u%04x", c);
          } else {
            const uint32_t x = c - 0x10000;
            std::snprintf(b, sizeof b, "\\u%04x\\u%04x", 0xD800 + (x >> 10), 0xDC00 + (x & 0x3FF));
          }
          piece = b;
        }
      }
    }
    if (!piece.empty()) {
      out.append(t, run, i);
      out.append(piece, t.flag_at(i));
      run = i + len;
    }
    i += len;
  }
  out.append(t, run, s.size());
  out.append("\"", qflag);
}

static std::string json_key(const Value& k) {
  switch (k.kind) {
    case Kind::string: return k.text().str();
    case Kind::integer: return std::to_string(k.i);
    case Kind::boolean: return k.b ? "true" : "false";
    case Kind::none: return "null";
    case Kind::floating: return float_repr(k.f);
    default: throw Failure(str("keys must be str, int, float, bool or None, not ", type_name(k)));
  }
}

static void json_into(Text& out, const Value& v, const JsonOptions& o, int level) {
  const uint8_t d = v.data;
  auto newline = [&](int lvl) {
    std::string s = "\n";
    for (int k = 0; k < lvl; ++k) s += o.indent;
    out.append(s, d);
  };
  switch (v.kind) {
    case Kind::none: out.append("null", d); return;
    case Kind::boolean: out.append(v.b ? "true" : "false", d); return;
    case Kind::integer: out.append(std::to_string(v.i), d); return;
    case Kind::floating:
      out.append(std::isnan(v.f) ? "NaN" : std::isinf(v.f) ? (v.f < 0 ? "-Infinity" : "Infinity") : float_repr(v.f), d);
      return;
    case Kind::string: json_string(out, v.text(), o.ensure_ascii); return;
    case Kind::list: {
      if (v.seq == Seq::iterator || v.seq == Seq::view)
        throw Failure(str("Object of type ", type_name(v), " is not JSON serializable"));
      const auto& items = v.items();
      if (items.empty()) {
        out.append("[]", d);
        return;
      }
      out.append("[", d);
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out.append(o.item_sep, d);
        if (o.indent_set) newline(level + 1);
        json_into(out, items[k], o, level + 1);
      }
      if (o.indent_set) newline(level);
      out.append("]", d);
      return;
    }
    case Kind::dict: {
      if (v.dict().items.empty()) {
        out.append("{}", d);
        return;
      }
      std::vector<const std::pair<Value, Value>*> items;
      for (const auto& e : v.dict().items) items.push_back(&e);
      if (o.sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return less(a->first, b->first); });
      out.append("{", d);
      bool first = true;
      for (const auto* e : items) {
        if (!first) out.append(o.item_sep, d);
        first = false;
        if (o.indent_set) newline(level + 1);
        if (e->first.kind == Kind::string)
          json_string(out, e->first.text(), o.ensure_ascii);
        else
          json_string(out, Text(json_key(e->first), e->first.data), o.ensure_ascii);
        out.append(o.key_sep, d);
        json_into(out, e->second, o, level + 1);
      }
      if (o.indent_set) newline(level);
      out.append("}", d);
      return;
    }
    default: throw Failure(str("Object of type ", type_name(v), " is not JSON serializable"));
  }
}

Text to_json(const Value& v, const JsonOptions& o) {
  Text t;
  json_into(t, v, o, 0);
  return t;
}

}  // namespace lcx::jinja
