#!/usr/bin/env python3
"""Agent transcripts as chat .jsonl, for long-context fine-tuning runs and benchmarks.

Each line is one conversation as lcx reads it ([data] format = "chat"): a system prompt, the tools
the agent may call, one task from the user, then many rounds of the assistant thinking
(reasoning_content), calling tools (tool_calls, arguments as objects or, every other call, as a JSON
string as OpenAI's API writes them) and reading their results (role "tool": file contents, search
hits, test runs), and a final reply. Every text is generated from --seed, so the same arguments give
the same file byte for byte. File contents are code-like: Python and C++ modules with functions,
classes, comments and tests, so they tokenize as source does (about 3.7 characters per Qwen3 token).

  scripts/gen_agent_transcripts.py --out data/agent/transcripts.jsonl --conversations 4 --tokens 1000000
  lcx-train tokenize --tokenizer data/qwen3/tokenizer.json --chat data/agent/transcripts.jsonl | awk '{print NF}'

--tokens is each conversation's size in Qwen3 tokens, estimated from its bytes (--bytes-per-token);
`lcx-train tokenize --chat` counts them exactly.
"""
import argparse
import json
import random
import sys

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "path from the repository root"},
            "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "glob": {"type": "string"}}, "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run", "description": "Run a shell command in the repository and return its output.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}, "timeout_s": {"type": "integer"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace a unique string of a file by another.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["path", "old", "new"]}}},
]

SYSTEM = ("You are a software engineering agent working in a checked-out repository. Read before you "
          "change anything, keep changes small, run the tests after each edit, and say what you did "
          "and why when you are done. Use the tools; never guess a file's contents.")

WORDS = ("buffer cache index token shard layer block offset stride count limit window queue batch "
         "request record entry header payload cursor state config option value result error parser "
         "reader writer stream chunk segment range node edge graph matrix vector tensor kernel "
         "device host rank group mesh plan budget rate step epoch sample mask label target").split()
VERBS = ("load save parse build merge split check update apply reset flush open close scan find "
         "count sort pack unpack encode decode resolve validate compute collect emit").split()
TASKS = [
    "The test suite fails on {mod}: {fn} returns the wrong {noun} when the {noun2} is empty. Find the cause, fix it and add a regression test.",
    "Add a `{fn}` option to {mod} that limits the {noun} per {noun2}, document it, and make sure nothing else changes.",
    "Profile shows {mod}.{fn} dominates the run time on large {noun} inputs. Make it faster without changing its results.",
    "Refactor {mod} so that {fn} and its callers share one way to {verb} a {noun}; keep the public API as it is.",
]


class Gen:
    def __init__(self, seed):
        self.r = random.Random(seed)

    def pick(self, xs):
        return xs[self.r.randrange(len(xs))]

    def ident(self, parts=2):
        return "_".join(self.pick(VERBS if i == 0 else WORDS) for i in range(parts))

    def type_name(self):
        return "".join(w.capitalize() for w in (self.pick(WORDS), self.pick(WORDS)))

    def sentence(self, n=12):
        words = [self.pick(WORDS + VERBS) for _ in range(n)]
        return " ".join(words).capitalize() + "."

    def python_module(self, lines):
        out = ['"""%s"""' % self.sentence(10), "import os", "import sys", "from typing import Dict, List, Optional", ""]
        while len(out) < lines:
            if self.r.random() < 0.3:
                cls = self.type_name()
                out += ["", "class %s:" % cls, '    """%s"""' % self.sentence(9), "",
                        "    def __init__(self, %s: int, %s: Optional[str] = None):" % (self.pick(WORDS), self.pick(WORDS))]
                for _ in range(self.r.randrange(2, 6)):
                    a = self.pick(WORDS)
                    out.append("        self.%s = %s" % (a, self.r.choice(["[]", "{}", "0", "None", a])))
            fn = self.ident(self.r.randrange(2, 4))
            args = ", ".join(self.pick(WORDS) for _ in range(self.r.randrange(1, 4)))
            out += ["", "def %s(%s):" % (fn, args), '    """%s"""' % self.sentence(self.r.randrange(6, 16))]
            for _ in range(self.r.randrange(3, 14)):
                a, b = self.pick(WORDS), self.pick(WORDS)
                out.append(self.r.choice([
                    "    %s = %s(%s)" % (a, self.ident(), b),
                    "    if %s is None or len(%s) == 0:\n        return %s" % (a, a, self.r.choice(["None", "[]", "0"])),
                    "    for %s in range(len(%s)):\n        %s += %s[%s] * %d" % ("i", a, b, a, "i", self.r.randrange(1, 9)),
                    "    # %s" % self.sentence(self.r.randrange(5, 12)),
                    "    %s.%s(%s, %s=%d)" % (a, self.ident(), b, self.pick(WORDS), self.r.randrange(100)),
                ]))
            out.append("    return %s" % self.pick(WORDS))
        return "\n".join(out) + "\n"

    def cpp_module(self, lines):
        out = ["// %s" % self.sentence(10), "#include <cstdint>", "#include <string>", "#include <vector>", "",
               "namespace %s {" % self.pick(WORDS), ""]
        while len(out) < lines:
            t = self.type_name()
            out += ["struct %s {" % t]
            for _ in range(self.r.randrange(2, 6)):
                out.append("  %s %s = %d;" % (self.r.choice(["int64_t", "double", "size_t", "bool"]), self.pick(WORDS), self.r.randrange(10)))
            out += ["};", "", "// %s" % self.sentence(self.r.randrange(6, 14)),
                    "%s %s(const %s& %s, int64_t n) {" % (self.r.choice(["int64_t", "void", "bool"]), self.ident(), t, self.pick(WORDS))]
            for _ in range(self.r.randrange(3, 12)):
                a = self.pick(WORDS)
                out.append(self.r.choice([
                    "  for (int64_t i = 0; i < n; ++i) %s += %s[i];" % (a, self.pick(WORDS)),
                    "  if (%s.%s > n) return {};" % (self.pick(WORDS), a),
                    "  const auto %s = %s(%s, n / %d);" % (a, self.ident(), self.pick(WORDS), self.r.randrange(2, 9)),
                    "  // %s" % self.sentence(self.r.randrange(5, 11)),
                ]))
            out += ["}", ""]
        out.append("}  // namespace")
        return "\n".join(out) + "\n"

    def path(self):
        d = self.pick(["src", "lib", "core", "tools", "tests"])
        if self.r.random() < 0.5:
            return "%s/%s/%s.py" % (d, self.pick(WORDS), self.ident())
        return "%s/%s/%s.cpp" % (d, self.pick(WORDS), self.ident())

    def file_text(self, path, lines):
        return self.python_module(lines) if path.endswith(".py") else self.cpp_module(lines)

    def search_hits(self, pattern):
        return "\n".join("%s:%d:    %s = %s(%s)" % (self.path(), self.r.randrange(1, 900), self.pick(WORDS), pattern,
                                                     self.pick(WORDS)) for _ in range(self.r.randrange(5, 30)))

    def test_run(self, passed):
        names = ["tests/test_%s.py::test_%s" % (self.pick(WORDS), self.ident()) for _ in range(self.r.randrange(8, 40))]
        lines = ["%s %s" % (n, "PASSED" if passed or self.r.random() < 0.8 else "FAILED") for n in names]
        fails = sum(1 for l in lines if l.endswith("FAILED"))
        lines.append("%d passed, %d failed in %.2fs" % (len(lines) - fails, fails, self.r.uniform(0.5, 90)))
        if fails:
            lines += ["", "E   AssertionError: expected %d, got %d" % (self.r.randrange(100), self.r.randrange(100)),
                      "E   at %s:%d" % (self.path(), self.r.randrange(1, 500))]
        return "\n".join(lines)


def transcript(g, tokens, bytes_per_token):
    budget = int(tokens * bytes_per_token)
    mod, fn = g.path(), g.ident()
    task = g.pick(TASKS).format(mod=mod, fn=fn, noun=g.pick(WORDS), noun2=g.pick(WORDS), verb=g.pick(VERBS))
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    size = len(SYSTEM) + len(task) + len(json.dumps(TOOLS))
    call_no = 0
    # File reads of up to 2,000 lines make most of a long transcript, as an agent's reading does.
    max_lines = max(8, min(2000, budget // 200))
    while size < budget * 0.97:
        kind = g.r.choices(["read_file", "search", "run", "edit_file"], weights=[6, 2, 2, 1])[0]
        if kind == "read_file":
            path = g.path() if g.r.random() < 0.7 else mod
            args = {"path": path}
            result = g.file_text(path, g.r.randrange(min(40, max_lines // 2), max_lines))
        elif kind == "search":
            pat = g.ident()
            args = {"pattern": pat, "glob": g.pick(["*.py", "*.cpp", "**/*"])}
            result = g.search_hits(pat)
        elif kind == "run":
            args = {"command": g.pick(["python -m pytest -x -q", "ctest --output-on-failure", "make -j8 test"]),
                    "timeout_s": g.pick([60, 300, 600])}
            result = g.test_run(g.r.random() < 0.4)
        else:
            args = {"path": mod, "old": "%s = %s" % (g.pick(WORDS), g.pick(WORDS)), "new": "%s = %s" % (g.pick(WORDS), g.pick(WORDS))}
            result = "edited %s: 1 replacement" % mod
        # The last result is cut at the budget, at a line's end, as a read of a line range would be.
        room = max(200, budget - size)
        if len(result) > room:
            result = result[:result.rfind("\n", 0, room) + 1 or room]
        reasoning = " ".join(g.sentence(g.r.randrange(8, 20)) for _ in range(g.r.randrange(1, 6)))
        call_no += 1
        # OpenAI's wire format writes arguments as a JSON string; lcx parses it to the object.
        arguments = json.dumps(args) if call_no % 2 == 0 else args
        content = g.sentence(g.r.randrange(6, 14)) if g.r.random() < 0.3 else ""
        msgs.append({"role": "assistant", "content": content, "reasoning_content": reasoning,
                     "tool_calls": [{"type": "function", "function": {"name": kind, "arguments": arguments}}]})
        msgs.append({"role": "tool", "content": result})
        size += len(reasoning) + len(content) + len(json.dumps(args)) + len(result) + 60
    msgs.append({"role": "assistant", "reasoning_content": g.sentence(18),
                 "content": "Done. " + " ".join(g.sentence(g.r.randrange(8, 16)) for _ in range(4))})
    return {"messages": msgs, "tools": TOOLS}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the .jsonl to write ('-' for stdout)")
    ap.add_argument("--conversations", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=200000, help="each conversation's size, Qwen3 tokens (estimated)")
    ap.add_argument("--bytes-per-token", type=float, default=3.7, help="the estimate's ratio for this code-like text")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.tokens < 200:
        sys.exit("gen_agent_transcripts: --tokens below 200 leaves no room for a tool call")
    out = sys.stdout if a.out == "-" else open(a.out, "w", encoding="utf-8")
    total = 0
    for i in range(a.conversations):
        line = json.dumps(transcript(Gen(a.seed * 1000003 + i), a.tokens, a.bytes_per_token), ensure_ascii=False)
        total += len(line)
        out.write(line + "\n")
    if out is not sys.stdout:
        out.close()
    print("gen_agent_transcripts: %d conversations, %.1f MB, about %d tokens each" % (a.conversations, total / 1e6, a.tokens),
          file=sys.stderr)


if __name__ == "__main__":
    main()
