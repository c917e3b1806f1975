// jinja2's filters, tests and global functions, and the Python methods of str, dict and the
// loop object that chat templates call, each with the semantics of jinja2 3.1 under
// ImmutableSandboxedEnvironment and transformers' overrides (tojson, raise_exception,
// strftime_now). Only those listed here exist; the parser refuses any other filter or test.
#pragma once
#include <ctime>
#include <string>

#include "data/jinja/value.h"

namespace lcx::jinja {

bool has_filter(const std::string& name);
bool has_test(const std::string& name);
// Global functions jinja2 defines that are not implemented (refused when called).
bool is_refused_global(const std::string& name);

// A filter or test applied; the interpreter passes filters and tests used through `map`,
// `select` and friends back in through `call_filter` and `call_test`.
Value call_filter(const std::string& name, const Value& subject, Args& args);
bool call_test(const std::string& name, const Value& subject, Args& args);

// `obj.name` and `obj[key]` as jinja2's sandbox resolves them: a method, a key, an attribute,
// or undefined. Throws Failure where jinja2 raises (an attribute of undefined).
Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);

// The values a for loop (or `in`, or a filter) goes through: a string's characters, a dict's
// keys; undefined gives none. Throws Failure for what Python cannot iterate.
std::vector<Value> iterate(const Value& v);
// Raises the undefined's error (jinja2's UndefinedError) where Python would use it.
[[noreturn]] void fail_undefined(const Value& v);
// Python's len(); throws Failure for what has none.
int64_t py_len(const Value& v);
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// The globals: range, namespace, dict, raise_exception, strftime_now (reading `now`, the local
// time, or the clock where it is null).
Value global_function(const std::string& name, const std::tm* now);

// Raised by raise_exception(msg): the message is the template's own.
class TemplateRaised : public Failure {
 public:
  using Failure::Failure;
};

}  // namespace lcx::jinja
