// The parsed template: expressions and statements of the Jinja subset chat templates use.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/jinja/value.h"

namespace lcx::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class K {
    literal,    // lit
    name,       // name
    getattr,    // a[0].name
    getitem,    // a[0][a[1]]
    slice,      // a[0][a[1]:a[2]:a[3]] (null parts absent)
    call,       // a[0](a[1..], kw)
    filter,     // a[0] | name(a[1..], kw)
    test,       // a[0] is name(a[1..], kw)
    not_,       // not a[0]
    neg,        // -a[0]
    pos,        // +a[0]
    binop,      // a[0] op a[1]: + - * / // % **
    concat,     // a[0] ~ a[1] ~ ...
    compare,    // a[0] ops[0] a[1] ops[1] a[2] ...
    and_,
    or_,
    cond,       // a[1] if a[0] else a[2] (a[2] null: undefined)
    list,
    tuple,
    dict,       // a[0]: a[1], a[2]: a[3], ...
  };
  K k;
  int line;
  Value lit;
  std::string name;  // name, attribute, filter, test, operator
  std::vector<ExprPtr> a;
  std::vector<std::pair<std::string, ExprPtr>> kw;
  std::vector<std::string> ops;  // compare: == != < <= > >= in notin
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Node {
  enum class K { text, print, if_, for_, set, set_block, macro, break_, continue_, generation };
  K k;
  int line;
  std::string text;                                   // text
  ExprPtr expr;                                       // print, for's iterable, set's value
  std::vector<std::pair<ExprPtr, Body>> branches;     // if / elif (else: a null condition)
  std::vector<std::string> targets;                   // for / set names; macro name
  bool target_tuple = false;                          // `for a, b in` / `set a, b =`
  std::string attr;                                   // set ns.attr: targets[0] is ns
  ExprPtr cond;                                       // for ... if cond
  Body body, else_body;                               // for / macro / set_block / generation
  std::vector<std::string> params;                    // macro
  std::vector<ExprPtr> defaults;                      // macro: one per param, null without
  std::vector<ExprPtr> filters;                       // set_block: filters applied to the body, a[0] null
};

struct Program {
  Body body;
  bool has_generation = false;
};

// Parses `source`; throws Failure with *error_line set for anything outside the subset.
Program parse_program(const std::string& source, int* error_line);

}  // namespace lcx::jinja
