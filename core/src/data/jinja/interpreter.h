// Runs a parsed template: jinja2's scoping (a loop iteration and a macro call are scopes of their
// own, `if` is not), Python's operators, and the {% generation %} spans.
#pragma once
#include <ctime>
#include <utility>
#include <vector>

#include "data/jinja/ast.h"

namespace lcx::jinja {

struct Rendered {
  Text text;
  std::vector<std::pair<int64_t, int64_t>> generation;
};

// Throws Failure with *error_line set to the line being run. strftime_now reads `now` (the local
// time), or the clock where it is null.
Rendered run(const Program& program, std::vector<std::pair<std::string, Value>> context, int* error_line,
             const std::tm* now = nullptr);

}  // namespace lcx::jinja
