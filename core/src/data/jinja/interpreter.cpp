#include "data/jinja/interpreter.h"

#include <cmath>
#include <limits>

#include "data/jinja/builtins.h"
#include "lcx/error.h"

namespace lcx::jinja {

namespace {

struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get())
      for (const auto& [k, v] : s->vars)
        if (k == name) return &v;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [k, old] : vars)
      if (k == name) {
        old = std::move(v);
        return;
      }
    vars.emplace_back(name, std::move(v));
  }
};
using ScopePtr = std::shared_ptr<Scope>;

enum class Flow { normal, break_, continue_ };

// A list a template builds by + or * holds at most this many items, the bound kMaxTextBytes puts
// on its strings (and jinja2's sandbox on range()) applied to lists.
constexpr size_t kMaxListItems = size_t{1} << 22;
void check_list_size(size_t items) {
  if (items > kMaxListItems)
    throw Failure(str("a list longer than the ", kMaxListItems, " items a template may build (it grows a list without bound)"));
}

int64_t num_int(const Value& v) { return v.kind == Kind::boolean ? v.b : v.i; }
double num_double(const Value& v) {
  return v.kind == Kind::floating ? v.f : v.kind == Kind::boolean ? (v.b ? 1.0 : 0.0) : static_cast<double>(v.i);
}

[[noreturn]] void type_error(const std::string& op, const Value& a, const Value& b) {
  throw Failure(str("unsupported operand type(s) for ", op, ": '", type_name(a), "' and '", type_name(b), "'"));
}

Value arith(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  const uint8_t d = a.data | b.data;
  if (a.is_number() && b.is_number()) {
    const bool fl = a.kind == Kind::floating || b.kind == Kind::floating;
    if (op == "/") {
      if (num_double(b) == 0) throw Failure("division by zero");
      return Value::floating(num_double(a) / num_double(b), d);
    }
    if (fl) {
      const double x = num_double(a), y = num_double(b);
      if (op == "+") return Value::floating(x + y, d);
      if (op == "-") return Value::floating(x - y, d);
      if (op == "*") return Value::floating(x * y, d);
      if (op == "**") return Value::floating(std::pow(x, y), d);
      if (y == 0) throw Failure("float modulo or floor division by zero");
      // CPython's float_divmod.
      double mod = std::fmod(x, y);
      double div = (x - mod) / y;
      if (mod != 0) {
        if ((y < 0) != (mod < 0)) {
          mod += y;
          div -= 1.0;
        }
      } else {
        mod = std::copysign(0.0, y);
      }
      double floordiv;
      if (div != 0) {
        floordiv = std::floor(div);
        if (div - floordiv > 0.5) floordiv += 1.0;
      } else {
        floordiv = std::copysign(0.0, x / y);
      }
      return Value::floating(op == "%" ? mod : floordiv, d);
    }
    const int64_t x = num_int(a), y = num_int(b);
    int64_t r;
    if (op == "+") {
      if (__builtin_add_overflow(x, y, &r)) throw Failure("an integer beyond 64 bits");
      return Value::integer(r, d);
    }
    if (op == "-") {
      if (__builtin_sub_overflow(x, y, &r)) throw Failure("an integer beyond 64 bits");
      return Value::integer(r, d);
    }
    if (op == "*") {
      if (__builtin_mul_overflow(x, y, &r)) throw Failure("an integer beyond 64 bits");
      return Value::integer(r, d);
    }
    if (op == "**") {
      if (y < 0) return Value::floating(std::pow(static_cast<double>(x), static_cast<double>(y)), d);
      int64_t acc = 1;
      for (int64_t k = 0; k < y; ++k)
        if (__builtin_mul_overflow(acc, x, &acc)) throw Failure("an integer beyond 64 bits");
      return Value::integer(acc, d);
    }
    if (y == 0) throw Failure("integer division or modulo by zero");
    int64_t q = x / y, m = x % y;
    if (m != 0 && ((m < 0) != (y < 0))) {
      m += y;
      q -= 1;
    }
    return Value::integer(op == "%" ? m : q, d);
  }
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      if (a.markup || b.markup) throw Failure("+ with a `safe` (Markup) string is not implemented");
      Text t = a.text();
      t.append(b.text());
      return Value::string(std::move(t));
    }
    if (a.kind == Kind::list && b.kind == Kind::list && a.seq == b.seq && (a.seq == Seq::list || a.seq == Seq::tuple)) {
      check_list_size(a.items().size() + b.items().size());
      std::vector<Value> items = a.items();
      items.insert(items.end(), b.items().begin(), b.items().end());
      return Value::list(std::move(items), a.seq, d);
    }
    if (a.is_string() || b.is_string())
      throw Failure(str("can only concatenate str (not \"", type_name(a.is_string() ? b : a), "\") to str"));
  }
  if (op == "*") {
    const Value* seq = a.is_number() ? &b : &a;
    const Value* n = a.is_number() ? &a : &b;
    if (n->is_number() && n->kind != Kind::floating &&
        (seq->is_string() || (seq->kind == Kind::list && (seq->seq == Seq::list || seq->seq == Seq::tuple)))) {
      const int64_t times = num_int(*n);
      // The result's size checked before it is built: 'x' * 10**12 fails at once.
      const size_t each = seq->is_string() ? seq->text().size() : seq->items().size();
      if (times > 0 && each > 0) {
        const size_t most = seq->is_string() ? kMaxTextBytes : kMaxListItems;
        const size_t total = static_cast<uint64_t>(times) > most / each ? most + 1 : each * static_cast<size_t>(times);
        if (seq->is_string()) check_text_size(total);
        else check_list_size(total);
      }
      if (seq->is_string()) {
        Text t;
        for (int64_t k = 0; k < times; ++k) t.append(seq->text());
        return Value::string(std::move(t));
      }
      std::vector<Value> items;
      for (int64_t k = 0; k < times; ++k) items.insert(items.end(), seq->items().begin(), seq->items().end());
      return Value::list(std::move(items), seq->seq, d);
    }
  }
  if (op == "%" && a.is_string()) throw Failure("string formatting with % is not supported");
  type_error(op, a, b);
}

bool contains(const Value& seq, const Value& x) {
  if (seq.is_string()) {
    if (x.is_undefined()) fail_undefined(x);
    if (!x.is_string())
      throw Failure(str("'in <string>' requires string as left operand, not ", type_name(x)));
    return seq.text().str().find(x.text().str()) != std::string::npos;
  }
  if (seq.kind == Kind::dict) {
    if (x.kind == Kind::dict || (x.kind == Kind::list && x.seq != Seq::tuple))
      throw Failure(str("unhashable type: '", type_name(x), "'"));
    return seq.dict().find(x) != nullptr;
  }
  if (seq.kind == Kind::list) {
    for (const Value& v : seq.items())
      if (equal(v, x)) return true;
    return false;
  }
  if (seq.is_undefined()) return false;
  throw Failure(str("argument of type '", type_name(seq), "' is not iterable"));
}

class Interpreter {
 public:
  Interpreter(int* error_line, const std::tm* now) : error_line_(error_line), now_(now) {}

  Rendered render(const Program& p, std::vector<std::pair<std::string, Value>> context) {
    auto root = std::make_shared<Scope>();
    root->vars = std::move(context);
    Rendered r;
    out_ = &r.text;
    generation_ = &r.generation;
    exec(p.body, root);
    return r;
  }

 private:
  Flow exec(const Body& body, const ScopePtr& scope) {
    for (const auto& n : body) {
      const Flow f = exec(*n, scope);
      if (f != Flow::normal) return f;
    }
    return Flow::normal;
  }

  Flow exec(const Node& n, const ScopePtr& scope) {
    *error_line_ = n.line;
    switch (n.k) {
      case Node::K::text:
        out_->append(n.text, 0);
        if (buffered_ == 0) ++yielded_;
        return Flow::normal;
      case Node::K::print: {
        const Value v = eval(*n.expr, *scope);
        out_->append(to_text(v));
        if (buffered_ == 0) ++yielded_;
        return Flow::normal;
      }
      case Node::K::if_:
        for (const auto& [cond, body] : n.branches) {
          if (!cond || truthy(eval(*cond, *scope))) return exec(body, scope);
          *error_line_ = n.line;
        }
        return Flow::normal;
      case Node::K::for_: return exec_for(n, scope);
      case Node::K::set: {
        Value v = eval(*n.expr, *scope);
        *error_line_ = n.line;
        assign(n, std::move(v), *scope);
        return Flow::normal;
      }
      case Node::K::set_block: {
        Value v = Value::string(capture(n.body, scope));
        for (const auto& f : n.filters) v = apply_filter(*f, v, *scope);
        scope->set(n.targets[0], std::move(v));
        return Flow::normal;
      }
      case Node::K::macro: scope->set(n.targets[0], make_macro(n, scope)); return Flow::normal;
      case Node::K::break_: return Flow::break_;
      case Node::K::continue_: return Flow::continue_;
      case Node::K::generation: {
        // transformers records a span only once its tracker is active: once something has been
        // yielded at the top level or a span recorded (AssistantTracker.is_active).
        const bool active = yielded_ > 0 || !generation_->empty();
        const int64_t begin = static_cast<int64_t>(out_->size());
        ++buffered_;
        const Flow f = exec(n.body, scope);
        --buffered_;
        ++yielded_;
        if (active) generation_->push_back({begin, static_cast<int64_t>(out_->size())});
        return f;
      }
    }
    return Flow::normal;
  }

  void assign(const Node& n, Value v, Scope& scope) {
    if (!n.attr.empty()) {
      const Value* ns = scope.find(n.targets[0]);
      if (!ns || ns->kind != Kind::ns) throw Failure("cannot assign attribute on non-namespace object");
      ns->ns().set(n.attr, std::move(v));
      return;
    }
    bind(n.targets, n.target_tuple, v, scope);
  }

  static void bind(const std::vector<std::string>& targets, bool tuple, const Value& v, Scope& scope) {
    if (!tuple) {
      scope.set(targets[0], v);
      return;
    }
    const std::vector<Value> items = iterate(v);
    if (items.size() != targets.size())
      throw Failure(str(items.size() < targets.size() ? "not enough" : "too many", " values to unpack (expected ",
                        targets.size(), ", got ", items.size(), ")"));
    for (size_t k = 0; k < targets.size(); ++k) scope.set(targets[k], items[k]);
  }

  Flow exec_for(const Node& n, const ScopePtr& scope) {
    const Value seq = eval(*n.expr, *scope);
    *error_line_ = n.line;
    if (seq.kind == Kind::none) throw Failure("'NoneType' object is not iterable");
    std::vector<Value> items = iterate(seq);
    if (n.cond) {
      std::vector<Value> kept;
      for (const Value& item : items) {
        auto s = std::make_shared<Scope>();
        s->parent = scope;
        bind(n.targets, n.target_tuple, item, *s);
        if (truthy(eval(*n.cond, *s))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      auto s = std::make_shared<Scope>();
      s->parent = scope;
      exec(n.else_body, s);
      return Flow::normal;
    }
    auto info = std::make_shared<LoopInfo>();
    info->length = static_cast<int64_t>(items.size());
    info->items = &items;
    Value loop;
    loop.kind = Kind::loop;
    loop.p = info;
    for (size_t k = 0; k < items.size(); ++k) {
      info->index0 = static_cast<int64_t>(k);
      auto s = std::make_shared<Scope>();
      s->parent = scope;
      s->vars.emplace_back("loop", loop);
      *error_line_ = n.line;
      bind(n.targets, n.target_tuple, items[k], *s);
      if (exec(n.body, s) == Flow::break_) break;
    }
    return Flow::normal;
  }

  Text capture(const Body& body, const ScopePtr& scope) {
    Text buf;
    Text* saved = out_;
    out_ = &buf;
    ++buffered_;
    exec(body, scope);
    --buffered_;
    out_ = saved;
    return buf;
  }

  Value make_macro(const Node& n, const ScopePtr& defining) {
    const Node* node = &n;
    Value v;
    v.kind = Kind::callable;
    v.p = std::make_shared<const Callable>(Callable{n.targets[0], [this, node, defining](Args& a) -> Value {
      const int saved_line = *error_line_;
      // Python stops runaway recursion near this depth (each macro call is several frames).
      if (macro_depth_ >= 200) throw Failure(str("macro '", node->targets[0], "' recurses deeper than 200 calls"));
      struct Depth {
        int& d;
        explicit Depth(int& x) : d(x) { ++d; }
        ~Depth() { --d; }
      } depth(macro_depth_);
      if (a.pos.size() > node->params.size())
        throw Failure(str("macro '", node->targets[0], "' takes not more than ", node->params.size(),
                          " argument(s)"));
      auto s = std::make_shared<Scope>();
      s->parent = defining;
      std::vector<bool> given(node->params.size(), false);
      for (size_t k = 0; k < a.pos.size(); ++k) {
        s->set(node->params[k], a.pos[k]);
        given[k] = true;
      }
      for (auto& [key, val] : a.kw) {
        size_t k = 0;
        while (k < node->params.size() && node->params[k] != key) ++k;
        if (k == node->params.size())
          throw Failure(str("macro '", node->targets[0], "' takes no keyword argument '", key, "'"));
        s->set(key, val);
        given[k] = true;
      }
      for (size_t k = 0; k < node->params.size(); ++k) {
        if (given[k]) continue;
        if (node->defaults[k])
          s->set(node->params[k], eval(*node->defaults[k], *s));
        else
          s->set(node->params[k], Value::undefined(str("'", node->params[k], "' is undefined")));
      }
      Value r = Value::string(capture(node->body, s));
      *error_line_ = saved_line;
      return r;
    }});
    return v;
  }

  Args eval_args(const Expr& e, size_t first, Scope& scope) {
    Args a;
    for (size_t k = first; k < e.a.size(); ++k) a.pos.push_back(eval(*e.a[k], scope));
    for (const auto& [key, x] : e.kw) a.kw.emplace_back(key, eval(*x, scope));
    return a;
  }

  Value apply_filter(const Expr& f, const Value& subject, Scope& scope) {
    Args a = eval_args(f, 1, scope);
    *error_line_ = f.line;
    return call_filter(f.name, subject, a);
  }

  Value lookup(const std::string& name, Scope& scope) {
    if (const Value* v = scope.find(name)) return *v;
    return global_function(name, now_);
  }

  Value eval(const Expr& e, Scope& scope) {
    switch (e.k) {
      case Expr::K::literal: return e.lit;
      case Expr::K::name: return lookup(e.name, scope);
      case Expr::K::getattr: {
        const Value obj = eval(*e.a[0], scope);
        *error_line_ = e.line;
        return get_attr(obj, e.name);
      }
      case Expr::K::getitem: {
        const Value obj = eval(*e.a[0], scope);
        const Value key = eval(*e.a[1], scope);
        *error_line_ = e.line;
        return get_item(obj, key);
      }
      case Expr::K::slice: {
        const Value obj = eval(*e.a[0], scope);
        Value parts[3];
        for (int k = 0; k < 3; ++k)
          if (e.a[k + 1]) parts[k] = eval(*e.a[k + 1], scope);
          else parts[k] = Value::none();
        *error_line_ = e.line;
        return slice(obj, parts[0], parts[1], parts[2]);
      }
      case Expr::K::call: {
        const Value callee = eval(*e.a[0], scope);
        Args a = eval_args(e, 1, scope);
        *error_line_ = e.line;
        if (callee.is_undefined()) fail_undefined(callee);
        if (callee.kind != Kind::callable) throw Failure(str("'", type_name(callee), "' object is not callable"));
        return callee.callable().fn(a);
      }
      case Expr::K::filter: {
        const Value subject = eval(*e.a[0], scope);
        return apply_filter(e, subject, scope);
      }
      case Expr::K::test: {
        const Value subject = eval(*e.a[0], scope);
        Args a = eval_args(e, 1, scope);
        *error_line_ = e.line;
        return Value::boolean(call_test(e.name, subject, a));
      }
      case Expr::K::not_: return Value::boolean(!truthy(eval(*e.a[0], scope)));
      case Expr::K::neg:
      case Expr::K::pos: {
        const Value v = eval(*e.a[0], scope);
        *error_line_ = e.line;
        if (v.is_undefined()) fail_undefined(v);
        if (!v.is_number()) throw Failure(str("bad operand type for unary ", e.k == Expr::K::neg ? "-" : "+", ": '",
                                              type_name(v), "'"));
        if (e.k == Expr::K::pos) return v.kind == Kind::boolean ? Value::integer(v.b, v.data) : v;
        if (v.kind == Kind::floating) return Value::floating(-v.f, v.data);
        if (num_int(v) == std::numeric_limits<int64_t>::min()) throw Failure("an integer beyond 64 bits");
        return Value::integer(-num_int(v), v.data);
      }
      case Expr::K::binop: {
        const Value a = eval(*e.a[0], scope);
        const Value b = eval(*e.a[1], scope);
        *error_line_ = e.line;
        return arith(e.name, a, b);
      }
      case Expr::K::concat: {
        Text t;
        for (const auto& part : e.a) {
          t.append(to_text(eval(*part, scope)));
        }
        return Value::string(std::move(t));
      }
      case Expr::K::compare: {
        Value left = eval(*e.a[0], scope);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.a[k + 1], scope);
          *error_line_ = e.line;
          const std::string& op = e.ops[k];
          bool r;
          if (op == "==") r = equal(left, right);
          else if (op == "!=") r = !equal(left, right);
          else if (op == "in") r = contains(right, left);
          else if (op == "notin") r = !contains(right, left);
          else {
            if (left.is_undefined()) fail_undefined(left);
            if (right.is_undefined()) fail_undefined(right);
            if (op == "<") r = less(left, right);
            else if (op == ">") r = less(right, left);
            else if (op == "<=") r = less(left, right) || equal(left, right);
            else r = less(right, left) || equal(left, right);
          }
          if (!r) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case Expr::K::and_: {
        Value a = eval(*e.a[0], scope);
        if (!truthy(a)) return a;
        return eval(*e.a[1], scope);
      }
      case Expr::K::or_: {
        Value a = eval(*e.a[0], scope);
        if (truthy(a)) return a;
        return eval(*e.a[1], scope);
      }
      case Expr::K::cond: {
        if (truthy(eval(*e.a[0], scope))) return eval(*e.a[1], scope);
        if (e.a[2]) return eval(*e.a[2], scope);
        return Value::undefined("the conditional expression has no else");
      }
      case Expr::K::list:
      case Expr::K::tuple: {
        std::vector<Value> items;
        for (const auto& x : e.a) items.push_back(eval(*x, scope));
        return Value::list(std::move(items), e.k == Expr::K::list ? Seq::list : Seq::tuple);
      }
      case Expr::K::dict: {
        auto d = std::make_shared<Dict>();
        for (size_t k = 0; k + 1 < e.a.size(); k += 2) {
          Value key = eval(*e.a[k], scope);
          Value val = eval(*e.a[k + 1], scope);
          if (key.kind == Kind::list && key.seq != Seq::tuple) throw Failure("unhashable type: 'list'");
          if (key.kind == Kind::dict) throw Failure("unhashable type: 'dict'");
          bool replaced = false;
          for (auto& [ok, ov] : d->items)
            if (equal(ok, key)) {
              ov = val;
              replaced = true;
            }
          if (!replaced) d->items.emplace_back(std::move(key), std::move(val));
        }
        return Value::dict(std::move(d));
      }
    }
    return Value::undefined();
  }

  int* error_line_;
  const std::tm* now_;
  int macro_depth_ = 0;
  int buffered_ = 0;  // inside a macro, a block set or a generation body: jinja2 buffers, not yields
  int64_t yielded_ = 0;  // outputs jinja2 would have yielded at the top level so far
  Text* out_ = nullptr;
  std::vector<std::pair<int64_t, int64_t>>* generation_ = nullptr;
};

}  // namespace

Rendered run(const Program& program, std::vector<std::pair<std::string, Value>> context, int* error_line,
             const std::tm* now) {
  Interpreter in(error_line, now);
  return in.render(program, std::move(context));
}

}  // namespace lcx::jinja
