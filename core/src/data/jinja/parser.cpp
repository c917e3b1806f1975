// A recursive-descent parser with jinja2's grammar and precedence (jinja2/parser.py):
// condexpr < or < and < not < compare < + - < ~ < * / // % < ** < unary, then postfix
// (attribute, subscript, call) and the filter chain (| filter, is test, call).
#include <cerrno>
#include <cstdlib>
#include <set>

#include "data/jinja/ast.h"
#include "data/jinja/builtins.h"
#include "data/jinja/lexer.h"
#include "lcx/error.h"

namespace lcx::jinja {

namespace {

class Parser {
 public:
  Parser(std::vector<Token> toks, int* error_line) : t_(std::move(toks)), error_line_(error_line) {}

  Program program() {
    Program p;
    p.body = subparse({});
    if (cur().type != Tok::eof) throw fail(str("unexpected '", cur().value, "'"));
    p.has_generation = has_generation_;
    return p;
  }

 private:
  const Token& cur() const { return t_[pos_]; }
  const Token& peek(int n = 1) const { return t_[std::min(pos_ + n, t_.size() - 1)]; }
  Failure fail(const std::string& msg) const {
    *error_line_ = cur().line;
    return Failure(msg);
  }
  Failure fail_at(int line, const std::string& msg) const {
    *error_line_ = line;
    return Failure(msg);
  }
  bool is_op(const char* op) const { return cur().type == Tok::op && cur().value == op; }
  bool is_name(const char* n) const { return cur().type == Tok::name && cur().value == n; }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    ++pos_;
    return true;
  }
  bool skip_name(const char* n) {
    if (!is_name(n)) return false;
    ++pos_;
    return true;
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) throw fail(str("expected '", op, "', found ", describe(cur())));
  }
  std::string expect_name() {
    if (cur().type != Tok::name) throw fail(str("expected a name, found ", describe(cur())));
    return t_[pos_++].value;
  }
  void expect_block_end() {
    if (cur().type != Tok::block_end) throw fail(str("expected the end of the tag, found ", describe(cur())));
    ++pos_;
  }
  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::eof: return "the end of the template";
      case Tok::block_end: return "'%}'";
      case Tok::var_end: return "'}}'";
      case Tok::string: return "a string";
      default: return "'" + t.value + "'";
    }
  }

  ExprPtr make(Expr::K k, int line) {
    auto e = std::make_unique<Expr>();
    e->k = k;
    e->line = line;
    return e;
  }

  // Statements up to a {% tag %} whose name is in `ends`; leaves the stream at that name.
  Body subparse(const std::set<std::string>& ends) {
    Body body;
    while (true) {
      const Token& tk = cur();
      if (tk.type == Tok::eof) {
        if (!ends.empty()) {
          std::string closer = *ends.begin();
          for (const auto& e : ends)
            if (e.rfind("end", 0) == 0) closer = e;
          throw fail(str("the template ends inside a block (missing {% ", closer, " %})"));
        }
        return body;
      }
      if (tk.type == Tok::text) {
        auto n = std::make_unique<Node>();
        n->k = Node::K::text;
        n->line = tk.line;
        n->text = tk.value;
        body.push_back(std::move(n));
        ++pos_;
        continue;
      }
      if (tk.type == Tok::var_begin) {
        ++pos_;
        auto n = std::make_unique<Node>();
        n->k = Node::K::print;
        n->line = tk.line;
        n->expr = parse_tuple(true);
        if (cur().type != Tok::var_end) throw fail(str("expected '}}', found ", describe(cur())));
        ++pos_;
        body.push_back(std::move(n));
        continue;
      }
      if (tk.type == Tok::block_begin) {
        ++pos_;
        if (cur().type != Tok::name) throw fail("expected a tag name");
        if (ends.count(cur().value)) return body;
        body.push_back(statement());
        continue;
      }
      throw fail(str("unexpected ", describe(tk)));
    }
  }

  NodePtr statement() {
    const Token& tk = cur();
    const std::string& tag = tk.value;
    auto n = std::make_unique<Node>();
    n->line = tk.line;
    if (tag == "if") {
      ++pos_;
      n->k = Node::K::if_;
      ExprPtr c = parse_tuple(false);
      expect_block_end();
      while (true) {
        Body b = subparse({"elif", "else", "endif"});
        n->branches.emplace_back(std::move(c), std::move(b));
        const std::string end = expect_name();
        if (end == "elif") {
          c = parse_tuple(false);
          expect_block_end();
          continue;
        }
        if (end == "else") {
          expect_block_end();
          Body e = subparse({"endif"});
          ++pos_;
          n->branches.emplace_back(nullptr, std::move(e));
        }
        expect_block_end();
        return n;
      }
    }
    if (tag == "for") {
      ++pos_;
      n->k = Node::K::for_;
      n->targets.push_back(expect_name());
      while (skip_op(",")) {
        n->target_tuple = true;
        if (is_name("in")) break;
        n->targets.push_back(expect_name());
      }
      if (!skip_name("in")) throw fail(str("expected 'in' in the for tag, found ", describe(cur())));
      n->expr = parse_tuple(false);
      if (skip_name("if")) n->cond = parse_expression();
      if (is_name("recursive")) throw fail("recursive loops ({% for ... recursive %}) are not supported");
      expect_block_end();
      ++loop_depth_;
      n->body = subparse({"else", "endfor"});
      --loop_depth_;
      if (expect_name() == "else") {
        expect_block_end();
        n->else_body = subparse({"endfor"});
        ++pos_;
      }
      expect_block_end();
      return n;
    }
    if (tag == "set") {
      ++pos_;
      std::string first = expect_name();
      if (skip_op(".")) {
        n->attr = expect_name();
      }
      n->targets.push_back(first);
      while (n->attr.empty() && skip_op(",")) {
        n->target_tuple = true;
        if (is_op("=")) break;
        n->targets.push_back(expect_name());
      }
      if (skip_op("=")) {
        n->k = Node::K::set;
        n->expr = parse_tuple(true);
        expect_block_end();
        return n;
      }
      if (n->target_tuple || !n->attr.empty())
        throw fail("a block {% set %} assigns one plain name only");
      n->k = Node::K::set_block;
      while (skip_op("|")) n->filters.push_back(parse_filter(nullptr));
      expect_block_end();
      ++buffered_depth_;
      n->body = subparse({"endset"});
      --buffered_depth_;
      ++pos_;
      expect_block_end();
      return n;
    }
    if (tag == "macro") {
      ++pos_;
      n->k = Node::K::macro;
      n->targets.push_back(expect_name());
      expect_op("(");
      while (!is_op(")")) {
        n->params.push_back(expect_name());
        n->defaults.push_back(skip_op("=") ? parse_expression() : nullptr);
        if (!skip_op(",")) break;
      }
      expect_op(")");
      expect_block_end();
      ++buffered_depth_;
      const int saved_loops = loop_depth_;
      loop_depth_ = 0;
      in_macro_.push_back(std::set<std::string>(n->params.begin(), n->params.end()));
      n->body = subparse({"endmacro"});
      in_macro_.pop_back();
      loop_depth_ = saved_loops;
      --buffered_depth_;
      ++pos_;
      if (cur().type == Tok::name) ++pos_;  // {% endmacro name %}
      expect_block_end();
      return n;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) throw fail(str("{% ", tag, " %} outside a loop"));
      ++pos_;
      n->k = tag == "break" ? Node::K::break_ : Node::K::continue_;
      expect_block_end();
      return n;
    }
    if (tag == "generation") {
      // transformers counts the span's start in the text already yielded at the top level, so
      // inside a macro or a block set its offsets would not be the text's; refused there.
      if (buffered_depth_ > 0) throw fail("{% generation %} inside a macro or a block {% set %} is not supported");
      if (in_generation_) throw fail("{% generation %} inside another {% generation %} is not supported");
      ++pos_;
      n->k = Node::K::generation;
      has_generation_ = true;
      expect_block_end();
      in_generation_ = true;
      n->body = subparse({"endgeneration"});
      in_generation_ = false;
      ++pos_;
      expect_block_end();
      return n;
    }
    static const std::set<std::string> known_ends = {"endif", "endfor", "endset", "endmacro", "endgeneration",
                                                      "else", "elif", "endraw"};
    if (known_ends.count(tag)) throw fail(str("{% ", tag, " %} without its opening tag"));
    throw fail(str("the {% ", tag, " %} tag is not supported"));
  }

  // parse_tuple: comma-separated expressions; a tuple when there is a comma (or `()`).
  ExprPtr parse_tuple(bool with_condexpr) {
    const int line = cur().line;
    std::vector<ExprPtr> items;
    bool comma = false;
    while (true) {
      if (!items.empty()) {
        if (!skip_op(",")) break;
        comma = true;
        if (ends_tuple()) break;
      }
      items.push_back(with_condexpr ? parse_expression() : parse_or());
      if (!is_op(",")) break;
    }
    if (!comma && items.size() == 1) return std::move(items[0]);
    auto t = make(Expr::K::tuple, line);
    t->a = std::move(items);
    return t;
  }
  bool ends_tuple() const {
    return cur().type == Tok::var_end || cur().type == Tok::block_end || cur().type == Tok::eof || is_op(")") ||
           is_op("]") || is_op("}") || is_name("if") || is_name("in");
  }

  ExprPtr parse_expression() {
    ExprPtr e = parse_or();
    while (is_name("if")) {
      const int line = cur().line;
      ++pos_;
      auto c = make(Expr::K::cond, line);
      ExprPtr test = parse_or();
      ExprPtr other = skip_name("else") ? parse_expression() : nullptr;
      c->a.push_back(std::move(test));
      c->a.push_back(std::move(e));
      c->a.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }
  ExprPtr parse_or() {
    ExprPtr l = parse_and();
    while (is_name("or")) {
      auto n = make(Expr::K::or_, cur().line);
      ++pos_;
      n->a.push_back(std::move(l));
      n->a.push_back(parse_and());
      l = std::move(n);
    }
    return l;
  }
  ExprPtr parse_and() {
    ExprPtr l = parse_not();
    while (is_name("and")) {
      auto n = make(Expr::K::and_, cur().line);
      ++pos_;
      n->a.push_back(std::move(l));
      n->a.push_back(parse_not());
      l = std::move(n);
    }
    return l;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      auto n = make(Expr::K::not_, cur().line);
      ++pos_;
      n->a.push_back(parse_not());
      return n;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    const int line = cur().line;
    ExprPtr first = parse_math1();
    std::vector<std::string> ops;
    std::vector<ExprPtr> rest;
    while (true) {
      if (cur().type == Tok::op && (cur().value == "==" || cur().value == "!=" || cur().value == "<" ||
                                    cur().value == "<=" || cur().value == ">" || cur().value == ">=")) {
        ops.push_back(t_[pos_++].value);
      } else if (is_name("in")) {
        ++pos_;
        ops.push_back("in");
      } else if (is_name("not") && peek().type == Tok::name && peek().value == "in") {
        pos_ += 2;
        ops.push_back("notin");
      } else {
        break;
      }
      rest.push_back(parse_math1());
    }
    if (ops.empty()) return first;
    auto c = make(Expr::K::compare, line);
    c->a.push_back(std::move(first));
    for (auto& r : rest) c->a.push_back(std::move(r));
    c->ops = std::move(ops);
    return c;
  }
  ExprPtr binop(const std::string& op, ExprPtr l, ExprPtr r, int line) {
    auto n = make(Expr::K::binop, line);
    n->name = op;
    n->a.push_back(std::move(l));
    n->a.push_back(std::move(r));
    return n;
  }
  ExprPtr parse_math1() {
    ExprPtr l = parse_concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = cur().value;
      const int line = cur().line;
      ++pos_;
      l = binop(op, std::move(l), parse_concat(), line);
    }
    return l;
  }
  ExprPtr parse_concat() {
    const int line = cur().line;
    std::vector<ExprPtr> parts;
    parts.push_back(parse_math2());
    while (skip_op("~")) parts.push_back(parse_math2());
    if (parts.size() == 1) return std::move(parts[0]);
    auto n = make(Expr::K::concat, line);
    n->a = std::move(parts);
    return n;
  }
  ExprPtr parse_math2() {
    ExprPtr l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = cur().value;
      const int line = cur().line;
      if (op == "%" && l->k == Expr::K::literal && l->lit.is_string())
        throw fail("string formatting with % is not supported");
      ++pos_;
      l = binop(op, std::move(l), parse_pow(), line);
    }
    return l;
  }
  ExprPtr parse_pow() {
    ExprPtr l = parse_unary(true);
    while (is_op("**")) {
      const int line = cur().line;
      ++pos_;
      l = binop("**", std::move(l), parse_unary(true), line);
    }
    return l;
  }
  ExprPtr parse_unary(bool with_filter) {
    const int line = cur().line;
    ExprPtr n;
    if (skip_op("-")) {
      n = make(Expr::K::neg, line);
      n->a.push_back(parse_unary(false));
    } else if (skip_op("+")) {
      n = make(Expr::K::pos, line);
      n->a.push_back(parse_unary(false));
    } else {
      n = parse_primary();
    }
    n = parse_postfix(std::move(n));
    if (with_filter) n = parse_filter_expr(std::move(n));
    return n;
  }
  ExprPtr literal(Value v, int line) {
    auto n = make(Expr::K::literal, line);
    n->lit = std::move(v);
    return n;
  }
  ExprPtr parse_primary() {
    const Token& tk = cur();
    const int line = tk.line;
    switch (tk.type) {
      case Tok::name: {
        ++pos_;
        const std::string& v = tk.value;
        if (v == "true" || v == "True") return literal(Value::boolean(true), line);
        if (v == "false" || v == "False") return literal(Value::boolean(false), line);
        if (v == "none" || v == "None") return literal(Value::none(), line);
        if (!in_macro_.empty() && (v == "caller" || v == "varargs" || v == "kwargs") && !in_macro_.back().count(v))
          throw fail_at(line, str("a macro's `", v, "` is not supported"));
        auto n = make(Expr::K::name, line);
        n->name = v;
        return n;
      }
      case Tok::string: {
        std::string s;
        while (cur().type == Tok::string) s += t_[pos_++].value;
        return literal(Value::string(s, 0), line);
      }
      case Tok::integer: {
        ++pos_;
        const std::string& d = tk.value;
        int base = 10;
        size_t off = 0;
        if (d.size() > 1 && d[0] == '0' && (d[1] | 0x20) != '0' && std::isalpha(static_cast<unsigned char>(d[1]))) {
          const char b = static_cast<char>(d[1] | 0x20);
          base = b == 'x' ? 16 : b == 'o' ? 8 : 2;
          off = 2;
        }
        errno = 0;
        const long long v = std::strtoll(d.c_str() + off, nullptr, base);
        if (errno == ERANGE) throw fail_at(line, "an integer literal beyond 64 bits");
        return literal(Value::integer(v), line);
      }
      case Tok::floating: {
        ++pos_;
        return literal(Value::floating(std::strtod(tk.value.c_str(), nullptr)), line);
      }
      case Tok::op: {
        if (skip_op("(")) {
          if (skip_op(")")) {
            auto t = make(Expr::K::tuple, line);
            return t;
          }
          ExprPtr e = parse_tuple(true);
          expect_op(")");
          return e;
        }
        if (skip_op("[")) {
          auto l = make(Expr::K::list, line);
          while (!is_op("]")) {
            l->a.push_back(parse_expression());
            if (!skip_op(",")) break;
          }
          expect_op("]");
          return l;
        }
        if (skip_op("{")) {
          auto d = make(Expr::K::dict, line);
          while (!is_op("}")) {
            d->a.push_back(parse_expression());
            expect_op(":");
            d->a.push_back(parse_expression());
            if (!skip_op(",")) break;
          }
          expect_op("}");
          return d;
        }
        break;
      }
      default: break;
    }
    throw fail(str("unexpected ", describe(tk)));
  }
  ExprPtr parse_postfix(ExprPtr n) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        n = parse_subscript(std::move(n));
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }
  ExprPtr parse_subscript(ExprPtr obj) {
    const int line = cur().line;
    if (skip_op(".")) {
      if (cur().type == Tok::name) {
        auto g = make(Expr::K::getattr, line);
        g->name = t_[pos_++].value;
        g->a.push_back(std::move(obj));
        return g;
      }
      if (cur().type == Tok::integer) {
        auto g = make(Expr::K::getitem, line);
        g->a.push_back(std::move(obj));
        g->a.push_back(parse_primary());
        return g;
      }
      throw fail("expected a name after '.'");
    }
    expect_op("[");
    ExprPtr start, stop, step;
    bool is_slice = false;
    if (!is_op(":")) start = parse_expression();
    if (skip_op(":")) {
      is_slice = true;
      if (!is_op("]") && !is_op(":")) stop = parse_expression();
      if (skip_op(":") && !is_op("]")) step = parse_expression();
    }
    if (is_op(",")) throw fail("subscripts with several indices are not supported");
    expect_op("]");
    if (!is_slice) {
      auto g = make(Expr::K::getitem, line);
      g->a.push_back(std::move(obj));
      g->a.push_back(std::move(start));
      return g;
    }
    auto s = make(Expr::K::slice, line);
    s->a.push_back(std::move(obj));
    s->a.push_back(std::move(start));
    s->a.push_back(std::move(stop));
    s->a.push_back(std::move(step));
    return s;
  }
  void parse_args(Expr& n) {
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) throw fail("*args and **kwargs in calls are not supported");
      if (cur().type == Tok::name && peek().type == Tok::op && peek().value == "=") {
        std::string k = t_[pos_].value;
        pos_ += 2;
        n.kw.emplace_back(std::move(k), parse_expression());
      } else {
        if (!n.kw.empty()) throw fail("a positional argument after a keyword argument");
        n.a.push_back(parse_expression());
      }
      if (!skip_op(",")) break;
    }
    expect_op(")");
  }
  ExprPtr parse_call(ExprPtr callee) {
    auto c = make(Expr::K::call, cur().line);
    if (callee->k == Expr::K::name && is_refused_global(callee->name))
      throw fail(str("the global `", callee->name, "` is not supported"));
    c->a.push_back(std::move(callee));
    parse_args(*c);
    return c;
  }
  ExprPtr parse_filter(ExprPtr subject) {
    const int line = cur().line;
    std::string name = expect_name();
    while (skip_op(".")) name += "." + expect_name();
    if (!has_filter(name)) throw fail_at(line, str("the filter '", name, "' is not implemented"));
    auto f = make(Expr::K::filter, line);
    f->name = name;
    f->a.push_back(std::move(subject));
    if (is_op("(")) parse_args(*f);
    return f;
  }
  ExprPtr parse_filter_expr(ExprPtr n) {
    while (true) {
      if (skip_op("|")) {
        n = parse_filter(std::move(n));
      } else if (is_name("is")) {
        const int line = cur().line;
        ++pos_;
        const bool negated = skip_name("not");
        std::string name = expect_name();
        while (skip_op(".")) name += "." + expect_name();
        if (!has_test(name)) throw fail_at(line, str("the test '", name, "' is not implemented"));
        auto t = make(Expr::K::test, line);
        t->name = name;
        t->a.push_back(std::move(n));
        if (is_op("(")) {
          parse_args(*t);
        } else if ((cur().type == Tok::name || cur().type == Tok::string || cur().type == Tok::integer ||
                    cur().type == Tok::floating || is_op("(") || is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          if (is_name("is")) throw fail("tests cannot be chained with `is`");
          t->a.push_back(parse_postfix(parse_primary()));
        }
        if (negated) {
          auto no = make(Expr::K::not_, line);
          no->a.push_back(std::move(t));
          n = std::move(no);
        } else {
          n = std::move(t);
        }
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  std::vector<Token> t_;
  size_t pos_ = 0;
  int* error_line_;
  int loop_depth_ = 0;
  int buffered_depth_ = 0;
  bool in_generation_ = false;
  bool has_generation_ = false;
  std::vector<std::set<std::string>> in_macro_;
};

}  // namespace

Program parse_program(const std::string& source, int* error_line) {
  Parser p(lex(source, error_line), error_line);
  return p.program();
}

}  // namespace lcx::jinja
