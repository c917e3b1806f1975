// The tokens of a template as jinja2's lexer cuts them, with trim_blocks and lstrip_blocks:
// text between tags (whitespace control already applied), tag openers and closers, and the
// expression tokens inside tags. Newlines are normalized to "\n" and one trailing newline of the
// source is dropped, as jinja2 does with keep_trailing_newline off.
#pragma once
#include <string>
#include <vector>

namespace lcx::jinja {

enum class Tok { text, var_begin, var_end, block_begin, block_end, name, string, integer, floating, op, eof };

struct Token {
  Tok type;
  std::string value;  // text, the name, the string's decoded value, the number's digits, the operator
  int line;
};

// Throws Failure (with the line in `line`) for what the lexer cannot read.
std::vector<Token> lex(const std::string& source, int* error_line);

}  // namespace lcx::jinja
