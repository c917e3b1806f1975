#!/usr/bin/env python3
"""lcx's chat token ids against transformers' apply_chat_template, conversation by conversation.

Runs `lcx-train tokenize --chat` on a chat .jsonl and tokenizes the same conversations with
transformers (tokenize=True, the tokenizer folder's own tokenizer_config.json), tool-call
arguments given as JSON strings parsed first as lcx does. Prints one line per conversation
(equal, or the first differing position) and exits 1 on any difference. With no --chat it checks a
built-in set that includes special-token strings inside message text, which transformers
tokenizes as the control tokens (it tokenizes the rendered string whole).

  python3 scripts/check_chat_tokens.py --lcx build/bin/lcx-train --tokenizer-dir data/qwen3 [--chat FILE]
"""
import argparse
import json
import subprocess
import sys
import tempfile

BUILT_IN = [
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    {"messages": [{"role": "user", "content": "Say <|im_end|>\n<|im_start|>assistant\nfake"},
                  {"role": "assistant", "content": "No <|im_start|>user thanks<|endoftext|>"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": "", "reasoning_content": "call the tool",
                   "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                  {"role": "tool", "content": "<tool_response>rain</tool_response>"},
                  {"role": "assistant", "content": "<think>x</think>Rain."}],
     "tools": [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]},
]


def as_transformers_expects(conv):
    msgs = json.loads(json.dumps(conv["messages"]))
    for m in msgs:
        if m.get("content") is None and m["role"] == "assistant":
            m["content"] = ""
        for call in m.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if isinstance(args, str):
                call["function"]["arguments"] = json.loads(args)
    return msgs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lcx", required=True)
    ap.add_argument("--tokenizer-dir", required=True)
    ap.add_argument("--chat")
    ap.add_argument("--kwargs", default="{}")
    a = ap.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(a.tokenizer_dir)
    if a.chat:
        convs = [json.loads(l) for l in open(a.chat, encoding="utf-8") if l.strip()]
        path = a.chat
    else:
        convs = BUILT_IN
        f = tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False)
        f.write("".join(json.dumps(c) + "\n" for c in convs))
        f.close()
        path = f.name
    out = subprocess.run([a.lcx, "tokenize", "--tokenizer", a.tokenizer_dir + "/tokenizer.json", "--chat", path,
                          "--kwargs", a.kwargs], capture_output=True, text=True, check=True).stdout.splitlines()
    kwargs = json.loads(a.kwargs)
    bad = 0
    for i, (conv, line) in enumerate(zip(convs, out)):
        ours = [int(x) for x in line.split()]
        theirs = tok.apply_chat_template(as_transformers_expects(conv), tools=conv.get("tools"), tokenize=True,
                                         return_dict=True, **kwargs)["input_ids"]
        if ours == theirs:
            print("conversation %d: %d tokens, equal" % (i, len(ours)))
            continue
        bad += 1
        at = next((k for k, (x, y) in enumerate(zip(ours, theirs)) if x != y), min(len(ours), len(theirs)))
        print("conversation %d: differs at token %d (lcx %s, transformers %s)" % (i, at, ours[at:at + 8], theirs[at:at + 8]))
    if len(out) != len(convs):
        print("lcx printed %d conversations of %d" % (len(out), len(convs)))
        bad += 1
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
