#include "data/jinja/builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <set>

#include <utf8proc.h>

#include "lcx/error.h"

namespace lcx::jinja {

namespace {

// Arguments by position or keyword, as Python binds them.
struct Bind {
  Args& args;
  std::string what;
  std::vector<std::string> names;
  Bind(Args& a, std::string w, std::vector<std::string> n) : args(a), what(std::move(w)), names(std::move(n)) {
    if (args.pos.size() > names.size())
      throw Failure(str(what, " takes at most ", names.size(), " argument(s), ", args.pos.size(), " given"));
    for (const auto& [k, v] : args.kw)
      if (std::find(names.begin(), names.end(), k) == names.end())
        throw Failure(str(what, " got an unexpected keyword argument '", k, "'"));
  }
  const Value* get(const std::string& name) const {
    for (size_t k = 0; k < names.size(); ++k)
      if (names[k] == name) {
        if (k < args.pos.size()) return &args.pos[k];
        break;
      }
    for (const auto& [k, v] : args.kw)
      if (k == name) return &v;
    return nullptr;
  }
  Value operator()(const std::string& name, Value fallback) const {
    const Value* v = get(name);
    return v ? *v : fallback;
  }
};

int64_t as_int(const Value& v, const char* what) {
  if (v.kind == Kind::integer) return v.i;
  if (v.kind == Kind::boolean) return v.b;
  throw Failure(str(what, " must be an int, not ", type_name(v)));
}
double as_double(const Value& v) {
  return v.kind == Kind::floating ? v.f : v.kind == Kind::boolean ? (v.b ? 1.0 : 0.0) : static_cast<double>(v.i);
}
const Text& as_text(const Value& v, const char* what) {
  if (!v.is_string()) {
    if (v.is_undefined()) fail_undefined(v);
    throw Failure(str(what, " must be a str, not ", type_name(v)));
  }
  return v.text();
}

Value method(const std::string& name, std::function<Value(Args&)> fn) {
  Value v;
  v.kind = Kind::callable;
  v.p = std::make_shared<const Callable>(Callable{name, std::move(fn)});
  return v;
}

std::vector<Value> chars_of(const Text& t) {
  std::vector<Value> out;
  const std::string& s = t.str();
  for (size_t i = 0; i < s.size();) {
    int len;
    decode_at(s, i, len);
    out.push_back(Value::string(t.sub(i, i + len)));
    i += len;
  }
  return out;
}


// Python's str predicates on ASCII text; other text is refused rather than guessed.
Value str_predicate(const Text& t, const std::string& name) {
  const std::string& s = t.str();
  if (!ascii_only(s)) throw Failure(str("str.", name, "() of non-ASCII text is not implemented"));
  if (s.empty()) return Value::boolean(false);
  bool any_cased = false, upper = false, lower = false;
  bool all = true;
  for (unsigned char c : s) {
    const bool d = c >= '0' && c <= '9', a = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
    if (c >= 'A' && c <= 'Z') upper = true, any_cased = true;
    if (c >= 'a' && c <= 'z') lower = true, any_cased = true;
    if (name == "isdigit" || name == "isdecimal" || name == "isnumeric") all &= d;
    if (name == "isalpha") all &= a;
    if (name == "isalnum") all &= a || d;
    if (name == "isspace") all &= py_isspace(c);
  }
  if (name == "isupper") return Value::boolean(any_cased && !lower);
  if (name == "islower") return Value::boolean(any_cased && !upper);
  return Value::boolean(all);
}

const std::set<std::string>& str_methods() {
  static const std::set<std::string> m = {
      "capitalize", "casefold", "center", "count", "encode", "endswith", "expandtabs", "find", "format",
      "format_map", "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit", "isidentifier", "islower",
      "isnumeric", "isprintable", "isspace", "istitle", "isupper", "join", "ljust", "lower", "lstrip", "maketrans",
      "partition", "removeprefix", "removesuffix", "replace", "rfind", "rindex", "rjust", "rpartition", "rsplit",
      "rstrip", "split", "splitlines", "startswith", "strip", "swapcase", "title", "translate", "upper", "zfill"};
  return m;
}

Value str_method(const Value& self, const std::string& name) {
  const Text t = self.text();
  if (self.markup) throw Failure(str("str.", name, "() on a `safe` (Markup) string is not implemented"));
  auto opt_text = [](const Value* v) -> const Text* {
    if (!v || v->kind == Kind::none) return nullptr;
    return &as_text(*v, "the argument");
  };
  if (name == "startswith" || name == "endswith") {
    return method(name, [t, name](Args& a) {
      Bind b(a, "str." + name, {"prefix", "start", "end"});
      if (b.get("start") || b.get("end")) throw Failure(str("str.", name, "() with start or end is not implemented"));
      const Value* p = b.get("prefix");
      if (!p) throw Failure(str("str.", name, "() takes one argument"));
      std::vector<Value> options = p->kind == Kind::list && p->seq == Seq::tuple ? p->items() : std::vector<Value>{*p};
      for (const Value& o : options) {
        const std::string& x = as_text(o, "the prefix").str();
        const std::string& s = t.str();
        const bool hit = name == "startswith" ? s.compare(0, x.size(), x) == 0 && s.size() >= x.size()
                                              : s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0;
        if (hit) return Value::boolean(true);
      }
      return Value::boolean(false);
    });
  }
  if (name == "split" || name == "rsplit") {
    return method(name, [t, name, opt_text](Args& a) {
      Bind b(a, "str." + name, {"sep", "maxsplit"});
      const Text* sep = opt_text(b.get("sep"));
      const int64_t maxsplit = as_int(b("maxsplit", Value::integer(-1)), "maxsplit");
      std::vector<Value> out;
      for (auto& piece : py_split(t, sep, maxsplit, name == "rsplit")) out.push_back(Value::string(std::move(piece)));
      return Value::list(std::move(out));
    });
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    return method(name, [t, name, opt_text](Args& a) {
      Bind b(a, "str." + name, {"chars"});
      return Value::string(py_strip(t, opt_text(b.get("chars")), name != "rstrip", name != "lstrip"));
    });
  }
  if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
    return method(name, [t, name](Args& a) {
      Bind b(a, "str." + name, {});
      if (name == "upper") return Value::string(py_case(t, Case::upper));
      if (name == "lower") return Value::string(py_case(t, Case::lower));
      if (name == "title") return Value::string(py_title(t));
      return Value::string(py_capitalize(t));
    });
  }
  if (name == "replace") {
    return method(name, [t](Args& a) {
      Bind b(a, "str.replace", {"old", "new", "count"});
      const Value* o = b.get("old");
      const Value* n = b.get("new");
      if (!o || !n) throw Failure("str.replace() takes at least 2 arguments");
      return Value::string(py_replace(t, as_text(*o, "old"), as_text(*n, "new"),
                                      as_int(b("count", Value::integer(-1)), "count")));
    });
  }
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex" || name == "count") {
    return method(name, [t, name](Args& a) {
      Bind b(a, "str." + name, {"sub", "start", "end"});
      if (b.get("start") || b.get("end")) throw Failure(str("str.", name, "() with start or end is not implemented"));
      const Value* s = b.get("sub");
      if (!s) throw Failure(str("str.", name, "() takes at least 1 argument"));
      const Text& sub = as_text(*s, "the substring");
      if (name == "count") {
        const std::string &h = t.str(), &n = sub.str();
        if (n.empty()) return Value::integer(static_cast<int64_t>(count_code_points(h)) + 1);
        int64_t c = 0;
        for (size_t p = h.find(n); p != std::string::npos; p = h.find(n, p + n.size())) ++c;
        return Value::integer(c);
      }
      const int64_t r = py_find(t, sub, name[0] == 'r');
      if (r < 0 && (name == "index" || name == "rindex")) throw Failure("substring not found (Python's ValueError)");
      return Value::integer(r);
    });
  }
  if (name == "join") {
    return method(name, [t](Args& a) {
      Bind b(a, "str.join", {"iterable"});
      const Value* it = b.get("iterable");
      if (!it) throw Failure("str.join() takes exactly one argument");
      Text out;
      bool first = true;
      for (const Value& v : iterate(*it)) {
        if (!first) out.append(t);
        first = false;
        out.append(as_text(v, "each item joined"));
      }
      return Value::string(std::move(out));
    });
  }
  if (name == "splitlines") {
    return method(name, [t](Args& a) {
      Bind b(a, "str.splitlines", {"keepends"});
      if (b.get("keepends") && truthy(*b.get("keepends"))) throw Failure("str.splitlines(keepends=True) is not implemented");
      std::vector<Value> out;
      for (auto& piece : py_splitlines(t)) out.push_back(Value::string(std::move(piece)));
      return Value::list(std::move(out));
    });
  }
  if (name == "removeprefix" || name == "removesuffix") {
    return method(name, [t, name](Args& a) {
      Bind b(a, "str." + name, {"affix"});
      const Value* x = b.get("affix");
      if (!x) throw Failure(str("str.", name, "() takes exactly one argument"));
      const std::string& f = as_text(*x, "the affix").str();
      const std::string& s = t.str();
      if (name == "removeprefix" && s.compare(0, f.size(), f) == 0 && s.size() >= f.size())
        return Value::string(t.sub(f.size(), s.size()));
      if (name == "removesuffix" && !f.empty() && s.size() >= f.size() &&
          s.compare(s.size() - f.size(), f.size(), f) == 0)
        return Value::string(t.sub(0, s.size() - f.size()));
      return Value::string(t);
    });
  }
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric" || name == "isalpha" || name == "isalnum" ||
      name == "isspace" || name == "isupper" || name == "islower") {
    return method(name, [t, name](Args& a) {
      Bind b(a, "str." + name, {});
      return str_predicate(t, name);
    });
  }
  if (name == "format" || name == "format_map")
    return method(name, [name](Args&) -> Value { throw Failure(str("str.", name, "() is not supported")); });
  return method(name, [name](Args&) -> Value { throw Failure(str("the str method ", name, "() is not implemented")); });
}

// What the sandbox gives for a method that would change a container: an undefined that prints
// as nothing and fails when called.
Value unsafe(const Value& obj, const std::string& name) {
  return Value::undefined(str("access to attribute '", name, "' of '", type_name(obj), "' object is unsafe."));
}

Value dict_method(const Value& self, const std::string& name) {
  if (name == "items" || name == "keys" || name == "values") {
    return method(name, [self, name](Args& a) {
      Bind b(a, "dict." + name, {});
      std::vector<Value> out;
      for (const auto& [k, v] : self.dict().items) {
        if (name == "items")
          out.push_back(Value::list({k, v}, Seq::tuple, self.data));
        else
          out.push_back(name == "keys" ? k : v);
      }
      return Value::list(std::move(out), Seq::view, self.data);
    });
  }
  if (name == "get") {
    return method(name, [self](Args& a) {
      Bind b(a, "dict.get", {"key", "default"});
      const Value* k = b.get("key");
      if (!k) throw Failure("dict.get() takes at least 1 argument");
      const Value* v = self.dict().find(*k);
      return v ? *v : b("default", Value::none());
    });
  }
  if (name == "copy" || name == "fromkeys")
    return method(name, [name](Args&) -> Value { throw Failure(str("dict.", name, "() is not implemented")); });
  return unsafe(self, name);
}

bool is_dict_method(const std::string& n) {
  static const std::set<std::string> m = {"clear", "copy", "fromkeys", "get", "items", "keys",
                                          "pop", "popitem", "setdefault", "update", "values"};
  return m.count(n) > 0;
}
bool is_list_method(const std::string& n) {
  static const std::set<std::string> m = {"append", "clear", "copy", "count", "extend", "index",
                                          "insert", "pop", "remove", "reverse", "sort"};
  return m.count(n) > 0;
}

Value loop_attr(const LoopInfo& l, const std::string& name) {
  if (name == "index") return Value::integer(l.index0 + 1);
  if (name == "index0") return Value::integer(l.index0);
  if (name == "revindex") return Value::integer(l.length - l.index0);
  if (name == "revindex0") return Value::integer(l.length - l.index0 - 1);
  if (name == "first") return Value::boolean(l.index0 == 0);
  if (name == "last") return Value::boolean(l.index0 == l.length - 1);
  if (name == "length") return Value::integer(l.length);
  if (name == "depth") return Value::integer(1);
  if (name == "depth0") return Value::integer(0);
  if (name == "previtem")
    return l.index0 > 0 ? (*l.items)[l.index0 - 1] : Value::undefined("there is no previous item");
  if (name == "nextitem")
    return l.index0 + 1 < l.length ? (*l.items)[l.index0 + 1] : Value::undefined("there is no next item");
  if (name == "cycle" || name == "changed")
    return method(name, [name](Args&) -> Value { throw Failure(str("loop.", name, "() is not implemented")); });
  return Value::undefined(str("'jinja2.runtime.LoopContext object' has no attribute '", name, "'"));
}

// make_attrgetter: "a.b.0" looks up each part as jinja2's getitem does; with a default, an
// undefined part becomes the default before the next part is looked up in it.
Value attr_path(const Value& item, const std::string& path, const Value* fallback = nullptr) {
  Value v = item;
  size_t start = 0;
  while (true) {
    const size_t dot = path.find('.', start);
    const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; });
    v = get_item(v, digits ? Value::integer(std::stoll(part)) : Value::string(part, 0));
    if (fallback && v.is_undefined()) v = *fallback;
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

Value lowered(const Value& v, bool case_sensitive) {
  if (!case_sensitive && v.is_string()) return Value::string(py_case(v.text(), Case::lower));
  return v;
}

Value filter_arg_call(bool test, const std::string& what, const Value& subject, const Args& extra) {
  Args a;
  a.pos = extra.pos;
  a.kw = extra.kw;
  if (test) return Value::boolean(call_test(what, subject, a));
  return call_filter(what, subject, a);
}

// select / reject / selectattr / rejectattr (like map, they go through nothing when the value
// is false, whatever its type).
Value select_like(const Value& seq, Args& a, bool attr, bool keep_true) {
  if (!truthy(seq)) return Value::list({}, Seq::iterator);
  std::string attribute;
  size_t first = 0;
  if (attr) {
    if (a.pos.empty()) throw Failure("selectattr and rejectattr need an attribute name");
    attribute = as_text(a.pos[0], "the attribute").str();
    first = 1;
  }
  std::string test;
  Args extra;
  if (a.pos.size() > first) {
    test = as_text(a.pos[first], "the test name").str();
    if (!has_test(test)) throw Failure(str("the test '", test, "' is not implemented"));
    extra.pos.assign(a.pos.begin() + static_cast<std::ptrdiff_t>(first + 1), a.pos.end());
  }
  extra.kw = a.kw;
  std::vector<Value> out;
  for (const Value& item : iterate(seq)) {
    const Value probe = attr ? attr_path(item, attribute) : item;
    const bool ok = test.empty() ? truthy(probe) : truthy(filter_arg_call(true, test, probe, extra));
    if (ok == keep_true) out.push_back(item);
  }
  return Value::list(std::move(out), Seq::iterator, seq.data);
}

double py_round(double x, int64_t ndigits) {
  if (ndigits == 0) return std::nearbyint(x);
  if (ndigits < 0 || ndigits > 300) throw Failure("round() with that precision is not implemented");
  if (!std::isfinite(x)) return x;
  char buf[512];
  std::snprintf(buf, sizeof buf, "%.*f", static_cast<int>(ndigits), x);
  return std::strtod(buf, nullptr);
}

Value to_int_value(const Value& v, const Value& fallback, int64_t base) {
  auto parse = [&](std::string s, int b, int64_t& out) {
    // int(str, base): surrounding whitespace, a sign, single underscores between digits.
    while (!s.empty() && py_isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
    size_t i = 0;
    while (i < s.size() && py_isspace(static_cast<unsigned char>(s[i]))) ++i;
    s = s.substr(i);
    if (s.empty()) return false;
    std::string digits;
    size_t k = 0;
    if (s[0] == '+' || s[0] == '-') digits += s[k++];
    if (b == 16 && s.size() > k + 1 && s[k] == '0' && (s[k + 1] | 0x20) == 'x') k += 2;
    bool prev_digit = false;
    for (; k < s.size(); ++k) {
      const char c = s[k];
      if (c == '_' && prev_digit && k + 1 < s.size() && s[k + 1] != '_') {
        prev_digit = false;
        continue;
      }
      const int d = c >= '0' && c <= '9' ? c - '0' : (c | 0x20) >= 'a' && (c | 0x20) <= 'z' ? (c | 0x20) - 'a' + 10 : 99;
      if (d >= b) return false;
      digits += c;
      prev_digit = true;
    }
    if (digits.empty() || digits == "+" || digits == "-") return false;
    errno = 0;
    out = std::strtoll(digits.c_str(), nullptr, b);
    if (errno == ERANGE) throw Failure("an integer beyond 64 bits");
    return true;
  };
  int64_t r;
  if (v.is_string()) {
    if (parse(v.text().str(), static_cast<int>(base), r)) return Value::integer(r, v.text().any_data());
  } else if (v.kind == Kind::integer || v.kind == Kind::boolean) {
    return Value::integer(as_int(v, "the value"), v.data);
  } else if (v.kind == Kind::floating) {
    if (std::isinf(v.f)) throw Failure("cannot convert float infinity to integer");
    if (!std::isnan(v.f)) return Value::integer(static_cast<int64_t>(std::trunc(v.f)), v.data);
  }
  if (v.is_string()) {
    char* end = nullptr;
    std::string s = v.text().str();
    const double d = std::strtod(s.c_str(), &end);
    bool rest_ws = end != s.c_str();
    for (const char* c = end; rest_ws && *c; ++c) rest_ws = py_isspace(static_cast<unsigned char>(*c));
    if (rest_ws && std::isfinite(d) && s.find_first_of("xXpP") == std::string::npos)
      return Value::integer(static_cast<int64_t>(std::trunc(d)), v.text().any_data());
  }
  return fallback;
}

Value filter_impl(const std::string& name, const Value& v, Args& a) {
  auto need_defined = [&] {
    if (v.is_undefined()) fail_undefined(v);
  };
  if (name == "default" || name == "d") {
    Bind b(a, name, {"default_value", "boolean"});
    const bool boolean = truthy(b("boolean", Value::boolean(false)));
    if (v.is_undefined() || (boolean && !truthy(v))) return b("default_value", Value::string("", 0));
    return v;
  }
  if (name == "length" || name == "count") {
    Bind b(a, name, {});
    return Value::integer(py_len(v), v.is_string() ? v.text().any_data() : v.data);
  }
  if (name == "tojson") {
    Bind b(a, name, {"ensure_ascii", "indent", "separators", "sort_keys"});
    JsonOptions o;
    o.ensure_ascii = truthy(b("ensure_ascii", Value::boolean(false)));
    const Value indent = b("indent", Value::none());
    if (indent.kind == Kind::integer || indent.kind == Kind::boolean) {
      o.indent_set = true;
      o.indent = std::string(static_cast<size_t>(std::max<int64_t>(0, as_int(indent, "indent"))), ' ');
    } else if (indent.is_string()) {
      o.indent_set = true;
      o.indent = indent.text().str();
    } else if (indent.kind != Kind::none) {
      throw Failure(str("tojson's indent must be an int or a str, not ", type_name(indent)));
    }
    if (o.indent_set) o.item_sep = ",";
    const Value sep = b("separators", Value::none());
    if (sep.kind == Kind::list && (sep.seq == Seq::list || sep.seq == Seq::tuple) && sep.items().size() == 2) {
      o.item_sep = as_text(sep.items()[0], "the separator").str();
      o.key_sep = as_text(sep.items()[1], "the separator").str();
    } else if (sep.kind != Kind::none) {
      throw Failure("tojson's separators must be a pair of strings");
    }
    o.sort_keys = truthy(b("sort_keys", Value::boolean(false)));
    return Value::string(to_json(v, o));
  }
  if (name == "trim") {
    Bind b(a, name, {"chars"});
    const Value chars = b("chars", Value::none());
    const Text s = to_text(v);
    return Value::string(py_strip(s, chars.kind == Kind::none ? nullptr : &as_text(chars, "chars"), true, true));
  }
  if (name == "string") {
    Bind b(a, name, {});
    if (v.is_string()) return v;
    return Value::string(to_text(v));
  }
  if (name == "safe") {
    Bind b(a, name, {});
    Value r = v.is_string() ? v : Value::string(to_text(v));
    r.markup = true;
    return r;
  }
  if (name == "upper" || name == "lower" || name == "capitalize" || name == "title") {
    Bind b(a, name, {});
    const Text s = to_text(v);
    if (name == "upper") return Value::string(py_case(s, Case::upper));
    if (name == "lower") return Value::string(py_case(s, Case::lower));
    if (name == "capitalize") return Value::string(py_capitalize(s));
    return Value::string(jinja_title(s));
  }
  if (name == "replace") {
    Bind b(a, name, {"old", "new", "count"});
    const Value* o = b.get("old");
    const Value* n = b.get("new");
    if (!o || !n) throw Failure("replace needs old and new");
    const Value count = b("count", Value::none());
    return Value::string(py_replace(to_text(v), to_text(*o), to_text(*n),
                                    count.kind == Kind::none ? -1 : as_int(count, "count")));
  }
  if (name == "first" || name == "last") {
    Bind b(a, name, {});
    if (name == "last" && v.kind == Kind::list && v.seq == Seq::iterator)
      throw Failure("'generator' object is not reversible");
    const std::vector<Value> items = iterate(v);
    if (items.empty()) return Value::undefined(str("No ", name, " item, sequence was empty."));
    return name == "first" ? items.front() : items.back();
  }
  if (name == "list") {
    Bind b(a, name, {});
    return Value::list(iterate(v), Seq::list, v.data);
  }
  if (name == "items") {
    Bind b(a, name, {});
    if (v.is_undefined()) return Value::list({}, Seq::iterator);
    if (v.kind != Kind::dict) throw Failure(str("can only get item pairs from a mapping, not ", type_name(v)));
    std::vector<Value> out;
    for (const auto& [k, e] : v.dict().items) out.push_back(Value::list({k, e}, Seq::tuple, v.data));
    return Value::list(std::move(out), Seq::iterator, v.data);
  }
  if (name == "join") {
    Bind b(a, name, {"d", "attribute"});
    const Value sep = b("d", Value::string("", 0));
    const Value attribute = b("attribute", Value::none());
    Text out;
    bool first = true;
    for (const Value& item : iterate(v)) {
      if (!first) out.append(to_text(sep));
      first = false;
      const Value x = attribute.kind == Kind::none ? item : attr_path(item, to_text(attribute).str());
      out.append(to_text(x));
    }
    return Value::string(std::move(out));
  }
  if (name == "reverse") {
    Bind b(a, name, {});
    if (v.is_string()) {
      Text out;
      const std::string& s = v.text().str();
      std::vector<size_t> off = code_point_offsets(s);
      for (size_t k = off.size() - 1; k > 0; --k) out.append(v.text(), off[k - 1], off[k]);
      return Value::string(std::move(out));
    }
    std::vector<Value> items = iterate(v);
    std::reverse(items.begin(), items.end());
    const bool reversible = v.kind == Kind::dict || (v.kind == Kind::list && v.seq != Seq::iterator);
    return Value::list(std::move(items), reversible ? Seq::iterator : Seq::list, v.data);
  }
  if (name == "unique") {
    Bind b(a, name, {"case_sensitive", "attribute"});
    const bool cs = truthy(b("case_sensitive", Value::boolean(false)));
    const Value attribute = b("attribute", Value::none());
    std::vector<Value> out, seen;
    for (const Value& item : iterate(v)) {
      const Value key =
          lowered(attribute.kind == Kind::none ? item : attr_path(item, to_text(attribute).str()), cs);
      if (key.kind == Kind::list || key.kind == Kind::dict) throw Failure(str("unhashable type: '", type_name(key), "'"));
      if (std::none_of(seen.begin(), seen.end(), [&](const Value& s) { return equal(s, key); })) {
        seen.push_back(key);
        out.push_back(item);
      }
    }
    return Value::list(std::move(out), Seq::iterator, v.data);
  }
  if (name == "sort") {
    Bind b(a, name, {"reverse", "case_sensitive", "attribute"});
    const bool rev = truthy(b("reverse", Value::boolean(false)));
    const bool cs = truthy(b("case_sensitive", Value::boolean(false)));
    const Value attribute = b("attribute", Value::none());
    std::vector<Value> items = iterate(v);
    std::vector<std::pair<Value, size_t>> keyed;
    for (size_t k = 0; k < items.size(); ++k)
      keyed.push_back({lowered(attribute.kind == Kind::none ? items[k] : attr_path(items[k], to_text(attribute).str()), cs), k});
    std::stable_sort(keyed.begin(), keyed.end(), [rev](const auto& x, const auto& y) {
      return rev ? less(y.first, x.first) : less(x.first, y.first);
    });
    std::vector<Value> out;
    for (const auto& [key, k] : keyed) out.push_back(items[k]);
    return Value::list(std::move(out), Seq::list, v.data);
  }
  if (name == "map") {
    std::vector<Value> out;
    if (!truthy(v)) return Value::list({}, Seq::iterator);
    const Value* attribute = nullptr;
    for (const auto& [k, e] : a.kw)
      if (k == "attribute") attribute = &e;
    if (attribute) {
      Value fallback = Value::undefined();
      bool has_default = false;
      for (const auto& [k, e] : a.kw) {
        if (k == "default") fallback = e, has_default = e.kind != Kind::none;
        else if (k != "attribute") throw Failure(str("map got an unexpected keyword argument '", k, "'"));
      }
      if (!a.pos.empty()) throw Failure("map(attribute=...) takes no positional argument");
      for (const Value& item : iterate(v)) {
        out.push_back(attr_path(item, to_text(*attribute).str(), has_default ? &fallback : nullptr));
      }
    } else {
      if (a.pos.empty()) throw Failure("map needs a filter name or attribute=");
      const std::string f = as_text(a.pos[0], "the filter name").str();
      if (!has_filter(f)) throw Failure(str("the filter '", f, "' is not implemented"));
      Args extra;
      extra.pos.assign(a.pos.begin() + 1, a.pos.end());
      extra.kw = a.kw;
      for (const Value& item : iterate(v)) out.push_back(filter_arg_call(false, f, item, extra));
    }
    return Value::list(std::move(out), Seq::iterator, v.data);
  }
  if (name == "select") return select_like(v, a, false, true);
  if (name == "reject") return select_like(v, a, false, false);
  if (name == "selectattr") return select_like(v, a, true, true);
  if (name == "rejectattr") return select_like(v, a, true, false);
  if (name == "int") {
    Bind b(a, name, {"default", "base"});
    need_defined();
    return to_int_value(v, b("default", Value::integer(0)), as_int(b("base", Value::integer(10)), "base"));
  }
  if (name == "float") {
    Bind b(a, name, {"default"});
    need_defined();
    if (v.kind == Kind::floating) return v;
    if (v.kind == Kind::integer || v.kind == Kind::boolean) return Value::floating(as_double(v), v.data);
    if (v.is_string()) {
      std::string s = v.text().str();
      size_t i = 0, e = s.size();
      while (i < e && py_isspace(static_cast<unsigned char>(s[i]))) ++i;
      while (e > i && py_isspace(static_cast<unsigned char>(s[e - 1]))) --e;
      s = s.substr(i, e - i);
      std::string plain;
      for (size_t k = 0; k < s.size(); ++k) {
        if (s[k] == '_' && k > 0 && k + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[k - 1])) &&
            std::isdigit(static_cast<unsigned char>(s[k + 1])))
          continue;
        plain += s[k];
      }
      char* end = nullptr;
      const double d = std::strtod(plain.c_str(), &end);
      if (!plain.empty() && *end == 0 && plain.find_first_of("xXpP") == std::string::npos)
        return Value::floating(d, v.text().any_data());
    }
    return b("default", Value::floating(0.0));
  }
  if (name == "abs") {
    Bind b(a, name, {});
    if (v.kind == Kind::floating) return Value::floating(std::fabs(v.f), v.data);
    if (v.kind == Kind::integer || v.kind == Kind::boolean) return Value::integer(std::llabs(as_int(v, "abs")), v.data);
    need_defined();
    throw Failure(str("bad operand type for abs(): '", type_name(v), "'"));
  }
  if (name == "round") {
    Bind b(a, name, {"precision", "method"});
    const int64_t precision = as_int(b("precision", Value::integer(0)), "precision");
    const std::string m = to_text(b("method", Value::string("common", 0))).str();
    need_defined();
    if (!v.is_number()) throw Failure(str("type ", type_name(v), " doesn't define __round__ method"));
    if (m == "common") {
      if (v.kind != Kind::floating) {
        if (precision < 0) throw Failure("round() of an int to negative digits is not implemented");
        return Value::integer(as_int(v, "round"), v.data);
      }
      return Value::floating(py_round(v.f, precision), v.data);
    }
    if (m != "ceil" && m != "floor") throw Failure("method must be common, ceil or floor");
    if (precision < 0 || precision > 15) throw Failure("round() with that precision is not implemented");
    const double scale = std::pow(10.0, static_cast<double>(precision));
    const double x = as_double(v) * scale;
    return Value::floating((m == "ceil" ? std::ceil(x) : std::floor(x)) / scale, v.data);
  }
  if (name == "indent") {
    Bind b(a, name, {"width", "first", "blank"});
    const Value width = b("width", Value::integer(4));
    const std::string ind = width.is_string() ? width.text().str()
                                              : std::string(static_cast<size_t>(std::max<int64_t>(0, as_int(width, "width"))), ' ');
    const bool first = truthy(b("first", Value::boolean(false)));
    const bool blank = truthy(b("blank", Value::boolean(false)));
    if (v.markup) throw Failure("indent of a `safe` (Markup) string is not implemented");
    // jinja2 appends "\n" to the value itself, which only a string takes.
    if (!v.is_string()) throw Failure(str("indent of a ", type_name(v), " (jinja2 fails on it)"));
    Text s = v.text();
    s.append("\n", 0);
    const std::vector<Text> lines = py_splitlines(s);
    Text out;
    for (size_t k = 0; k < lines.size(); ++k) {
      if (k) out.append("\n", 0);
      if (k && (blank || !lines[k].empty())) out.append(ind, 0);
      out.append(lines[k]);
    }
    if (first) {
      Text t(ind, 0);
      t.append(out);
      return Value::string(std::move(t));
    }
    return Value::string(std::move(out));
  }
  if (name == "wordcount") {
    Bind b(a, name, {});
    const std::string s = to_text(v).str();
    int64_t n = 0;
    bool in_word = false;
    for (size_t i = 0; i < s.size();) {
      int len;
      const uint32_t c = decode_at(s, i, len);
      const auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
      const bool w = c == '_' || (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
                     (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
      if (w && !in_word) ++n;
      in_word = w;
      i += len;
    }
    return Value::integer(n);
  }
  if (name == "sum") {
    Bind b(a, name, {"attribute", "start"});
    const Value attribute = b("attribute", Value::none());
    Value acc = b("start", Value::integer(0));
    for (const Value& item : iterate(v)) {
      const Value x = attribute.kind == Kind::none ? item : attr_path(item, to_text(attribute).str());
      if (!acc.is_number() || !x.is_number()) throw Failure(str("sum of ", type_name(x), " values is not implemented"));
      if (acc.kind == Kind::floating || x.kind == Kind::floating)
        acc = Value::floating(as_double(acc) + as_double(x));
      else
        acc = Value::integer(as_int(acc, "sum") + as_int(x, "sum"));
    }
    return acc;
  }
  if (name == "min" || name == "max") {
    Bind b(a, name, {"case_sensitive", "attribute"});
    const bool cs = truthy(b("case_sensitive", Value::boolean(false)));
    const Value attribute = b("attribute", Value::none());
    const std::vector<Value> items = iterate(v);
    if (items.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    size_t best = 0;
    auto key = [&](size_t k) {
      return lowered(attribute.kind == Kind::none ? items[k] : attr_path(items[k], to_text(attribute).str()), cs);
    };
    for (size_t k = 1; k < items.size(); ++k)
      if (name == "min" ? less(key(k), key(best)) : less(key(best), key(k))) best = k;
    return items[best];
  }
  throw Failure(str("the filter '", name, "' is not implemented"));
}

bool test_impl(const std::string& name, const Value& v, Args& a) {
  auto other = [&]() -> const Value& {
    if (a.pos.size() != 1 || !a.kw.empty()) throw Failure(str("the test '", name, "' takes one argument"));
    return a.pos[0];
  };
  auto none_args = [&] {
    if (!a.pos.empty() || !a.kw.empty()) throw Failure(str("the test '", name, "' takes no argument"));
  };
  if (name == "defined") return none_args(), !v.is_undefined();
  if (name == "undefined") return none_args(), v.is_undefined();
  if (name == "none") return none_args(), v.kind == Kind::none;
  if (name == "boolean") return none_args(), v.kind == Kind::boolean;
  if (name == "true") return none_args(), v.kind == Kind::boolean && v.b;
  if (name == "false") return none_args(), v.kind == Kind::boolean && !v.b;
  if (name == "integer") return none_args(), v.kind == Kind::integer;
  if (name == "float") return none_args(), v.kind == Kind::floating;
  if (name == "number") return none_args(), v.is_number();
  if (name == "string") return none_args(), v.is_string();
  if (name == "mapping") return none_args(), v.kind == Kind::dict;
  if (name == "iterable")
    return none_args(), v.is_string() || v.kind == Kind::list || v.kind == Kind::dict || v.is_undefined();
  if (name == "sequence")
    return none_args(), v.is_string() || v.kind == Kind::dict || (v.kind == Kind::list && v.seq != Seq::iterator) ||
                            v.is_undefined();
  if (name == "callable") return none_args(), v.kind == Kind::callable;
  if (name == "odd" || name == "even") {
    none_args();
    if (v.is_undefined()) fail_undefined(v);
    if (!v.is_number()) throw Failure(str("the test '", name, "' of a ", type_name(v), " (jinja2 fails on it)"));
    // value % 2 == 1 (or == 0), floats included.
    if (v.kind == Kind::floating) {
      double m = std::fmod(v.f, 2.0);
      if (m < 0) m += 2.0;
      return name == "odd" ? m == 1.0 : m == 0.0;
    }
    const int64_t m = ((as_int(v, "the value") % 2) + 2) % 2;
    return name == "odd" ? m == 1 : m == 0;
  }
  if (name == "divisibleby") {
    const int64_t d = as_int(other(), "the divisor");
    if (d == 0) throw Failure("integer modulo by zero");
    return as_int(v, "the value") % d == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, other());
  if (name == "ne" || name == "!=") return !equal(v, other());
  if (name == "lt" || name == "lessthan" || name == "<") return less(v, other());
  if (name == "gt" || name == "greaterthan" || name == ">") return less(other(), v);
  if (name == "le" || name == "<=") return !less(other(), v);
  if (name == "ge" || name == ">=") return !less(v, other());
  if (name == "in") {
    const Value& seq = other();
    if (seq.is_string()) return v.is_string() && seq.text().str().find(as_text(v, "the value").str()) != std::string::npos;
    for (const Value& x : iterate(seq))
      if (equal(x, v)) return true;
    return false;
  }
  if (name == "lower" || name == "upper") {
    none_args();
    Args none;
    return truthy(str_predicate(to_text(v), name == "lower" ? "islower" : "isupper"));
  }
  if (name == "sameas") {
    const Value& o = other();
    if ((v.kind == Kind::none || v.kind == Kind::boolean) && (o.kind == Kind::none || o.kind == Kind::boolean))
      return v.kind == o.kind && (v.kind == Kind::none || v.b == o.b);
    throw Failure("the test 'sameas' is implemented for none, true and false only");
  }
  throw Failure(str("the test '", name, "' is not implemented"));
}

}  // namespace

[[noreturn]] void fail_undefined(const Value& v) {
  throw Failure(v.hint().empty() ? std::string("an undefined value is used") : v.hint());
}

bool has_filter(const std::string& n) {
  static const std::set<std::string> f = {
      "abs", "capitalize", "count", "d", "default", "first", "float", "indent", "int", "items", "join",
      "last", "length", "list", "lower", "map", "max", "min", "reject", "rejectattr", "replace", "reverse",
      "round", "safe", "select", "selectattr", "sort", "string", "sum", "title", "tojson", "trim", "unique",
      "upper", "wordcount"};
  return f.count(n) > 0;
}

bool has_test(const std::string& n) {
  static const std::set<std::string> t = {
      "boolean", "callable", "defined", "divisibleby", "eq", "equalto", "==", "even", "false", "float", "ge",
      ">=", "gt", ">", "greaterthan", "in", "integer", "iterable", "le", "<=", "lower", "lt", "<", "lessthan",
      "mapping", "ne", "!=", "none", "number", "odd", "sameas", "sequence", "string", "true", "undefined", "upper"};
  return t.count(n) > 0;
}

bool is_refused_global(const std::string& n) { return n == "cycler" || n == "joiner" || n == "lipsum"; }

Value call_filter(const std::string& name, const Value& subject, Args& args) { return filter_impl(name, subject, args); }
bool call_test(const std::string& name, const Value& subject, Args& args) { return test_impl(name, subject, args); }

std::vector<Value> iterate(const Value& v) {
  switch (v.kind) {
    case Kind::undefined: return {};
    case Kind::string: return chars_of(v.text());
    case Kind::list: return v.items();
    case Kind::dict: {
      std::vector<Value> keys;
      for (const auto& [k, e] : v.dict().items) keys.push_back(k);
      return keys;
    }
    default: throw Failure(str("'", type_name(v), "' object is not iterable"));
  }
}

int64_t py_len(const Value& v) {
  switch (v.kind) {
    case Kind::string: return static_cast<int64_t>(count_code_points(v.text().str()));
    case Kind::list:
      if (v.seq == Seq::iterator) throw Failure("object of type 'generator' has no len()");
      return static_cast<int64_t>(v.items().size());
    case Kind::dict: return static_cast<int64_t>(v.dict().items.size());
    case Kind::undefined: return 0;
    default: throw Failure(str("object of type '", type_name(v), "' has no len()"));
  }
}

Value get_attr(const Value& obj, const std::string& name) {
  switch (obj.kind) {
    case Kind::undefined: fail_undefined(obj);
    case Kind::dict: {
      if (is_dict_method(name)) return dict_method(obj, name);
      if (const Value* v = obj.dict().find(std::string_view(name))) return *v;
      return Value::undefined(str("'dict object' has no attribute '", name, "'"));
    }
    case Kind::string:
      if (str_methods().count(name)) return str_method(obj, name);
      break;
    case Kind::list:
      if (obj.seq == Seq::list && is_list_method(name)) {
        if (name == "copy" || name == "count" || name == "index")
          return method(name, [name](Args&) -> Value { throw Failure(str("list.", name, "() is not implemented")); });
        return unsafe(obj, name);
      }
      break;
    case Kind::ns: {
      if (const Value* v = obj.ns().find(name)) return *v;
      return Value::undefined(str("'Namespace' object has no attribute '", name, "'"));
    }
    case Kind::loop: return loop_attr(obj.loop(), name);
    default: break;
  }
  return Value::undefined(str("'", type_name(obj), " object' has no attribute '", name, "'"));
}

Value get_item(const Value& obj, const Value& key) {
  switch (obj.kind) {
    case Kind::undefined: fail_undefined(obj);
    case Kind::dict:
      if (const Value* v = obj.dict().find(key)) return *v;
      break;
    case Kind::string:
    case Kind::list: {
      if (obj.kind == Kind::list && (obj.seq == Seq::iterator || obj.seq == Seq::view)) break;
      if (key.kind == Kind::integer || key.kind == Kind::boolean) {
        int64_t i = as_int(key, "the index");
        if (obj.kind == Kind::list) {
          const auto& items = obj.items();
          const int64_t n = static_cast<int64_t>(items.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) return items[static_cast<size_t>(i)];
        } else {
          const std::vector<size_t> off = code_point_offsets(obj.text().str());
          const int64_t n = static_cast<int64_t>(off.size()) - 1;
          if (i < 0) i += n;
          if (i >= 0 && i < n) return Value::string(obj.text().sub(off[i], off[i + 1]));
        }
        return Value::undefined(str("index ", key.i, " is out of range"));
      }
      break;
    }
    default: break;
  }
  if (key.is_string()) return get_attr(obj, key.text().str());
  return Value::undefined(str("'", type_name(obj), " object' has no element ", to_text(key).str()));
}

Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) fail_undefined(obj);
  const bool is_str = obj.is_string();
  if (!is_str && !(obj.kind == Kind::list && (obj.seq == Seq::list || obj.seq == Seq::tuple)))
    throw Failure(str("'", type_name(obj), "' object is not subscriptable"));
  std::vector<size_t> off;
  int64_t n;
  if (is_str) {
    off = code_point_offsets(obj.text().str());
    n = static_cast<int64_t>(off.size()) - 1;
  } else {
    n = static_cast<int64_t>(obj.items().size());
  }
  auto absent = [](const Value& v) { return v.kind == Kind::none || v.is_undefined(); };
  const int64_t st = absent(step) ? 1 : as_int(step, "the slice step");
  if (st == 0) throw Failure("slice step cannot be zero");
  // PySlice_AdjustIndices.
  int64_t lo, hi;
  if (absent(start)) {
    lo = st < 0 ? n - 1 : 0;
  } else {
    lo = as_int(start, "a slice index");
    if (lo < 0) lo = std::max<int64_t>(lo + n, st < 0 ? -1 : 0);
    else if (lo >= n) lo = st < 0 ? n - 1 : n;
  }
  if (absent(stop)) {
    hi = st < 0 ? -1 : n;
  } else {
    hi = as_int(stop, "a slice index");
    if (hi < 0) hi = std::max<int64_t>(hi + n, st < 0 ? -1 : 0);
    else if (hi >= n) hi = st < 0 ? n - 1 : n;
  }
  std::vector<int64_t> idx;
  if (st > 0)
    for (int64_t k = lo; k < hi; k += st) idx.push_back(k);
  else
    for (int64_t k = lo; k > hi; k += st) idx.push_back(k);
  if (is_str) {
    Text out;
    if (st == 1 && !idx.empty()) {
      out.append(obj.text(), off[idx.front()], off[idx.back() + 1]);
    } else {
      for (int64_t k : idx) out.append(obj.text(), off[k], off[k + 1]);
    }
    return Value::string(std::move(out));
  }
  std::vector<Value> out;
  for (int64_t k : idx) out.push_back(obj.items()[static_cast<size_t>(k)]);
  return Value::list(std::move(out), obj.seq, obj.data);
}

Value global_function(const std::string& name, const std::tm* now) {
  if (name == "range") {
    return method(name, [](Args& a) {
      if (!a.kw.empty() || a.pos.empty() || a.pos.size() > 3) throw Failure("range() takes 1 to 3 integers");
      int64_t lo = 0, hi, st = 1;
      if (a.pos.size() == 1) {
        hi = as_int(a.pos[0], "range's argument");
      } else {
        lo = as_int(a.pos[0], "range's argument");
        hi = as_int(a.pos[1], "range's argument");
        if (a.pos.size() == 3) st = as_int(a.pos[2], "range's argument");
      }
      if (st == 0) throw Failure("range() arg 3 must not be zero");
      std::vector<Value> out;
      for (int64_t k = lo; st > 0 ? k < hi : k > hi; k += st) {
        // The sandbox's MAX_RANGE.
        if (out.size() >= 100000) throw Failure("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        out.push_back(Value::integer(k));
      }
      return Value::list(std::move(out), Seq::view);
    });
  }
  if (name == "namespace") {
    return method(name, [](Args& a) {
      auto ns = std::make_shared<Namespace>();
      if (a.pos.size() > 1) throw Failure("namespace() takes at most one positional argument");
      if (!a.pos.empty()) {
        if (a.pos[0].kind != Kind::dict) throw Failure("namespace()'s positional argument must be a dict");
        for (const auto& [k, v] : a.pos[0].dict().items) ns->set(as_text(k, "a namespace key").str(), v);
      }
      for (auto& [k, v] : a.kw) ns->set(k, v);
      Value v;
      v.kind = Kind::ns;
      v.p = ns;
      return v;
    });
  }
  if (name == "dict") {
    return method(name, [](Args& a) {
      if (!a.pos.empty()) throw Failure("dict() with positional arguments is not implemented");
      auto d = std::make_shared<Dict>();
      for (auto& [k, v] : a.kw) d->items.emplace_back(Value::string(k, 0), v);
      return Value::dict(d);
    });
  }
  if (name == "raise_exception") {
    return method(name, [](Args& a) -> Value {
      if (a.pos.size() != 1 || !a.kw.empty()) throw Failure("raise_exception() takes one argument");
      throw TemplateRaised(to_text(a.pos[0]).str());
    });
  }
  if (name == "strftime_now") {
    return method(name, [now](Args& a) {
      if (a.pos.size() != 1 || !a.kw.empty()) throw Failure("strftime_now() takes one argument");
      const std::string fmt = as_text(a.pos[0], "the format").str();
      std::tm tm{};
      if (now) {
        tm = *now;
      } else {
        const std::time_t clock = std::time(nullptr);
        localtime_r(&clock, &tm);
      }
      char buf[512];
      const size_t n = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
      if (n == 0 && !fmt.empty()) throw Failure("strftime_now's format gives nothing or is too long");
      return Value::string(std::string(buf, n), 0);
    });
  }
  return Value::undefined(str("'", name, "' is undefined"));
}

}  // namespace lcx::jinja
