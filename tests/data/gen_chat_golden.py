#!/usr/bin/env python3
"""Golden renders of the chat fixtures for tests/data/chat_template_test.cpp.

For each conversation of fixtures/chat/conversations.jsonl, renders its template
(fixtures/chat/templates/<template>.jinja) as transformers' apply_chat_template does and writes
fixtures/chat/golden.jsonl, one line per conversation:
  {"name", "engine", "special_tokens", "text", "ids"?, "generation"?, "assistant_masks"?}
or {"name", "engine", "special_tokens", "error"} where the render fails.
`generation` holds the {% generation %} spans as [begin, end) byte offsets of the UTF-8 text.

  python3 tests/data/gen_chat_golden.py --tokenizer data/qwen3 --md golden.md   # transformers
  python3 tests/data/gen_chat_golden.py --local                                  # jinja2 only

--local uses plain jinja2 configured as transformers configures it (ImmutableSandboxedEnvironment,
trim_blocks, lstrip_blocks, loopcontrols, its tojson, raise_exception, strftime_now and the
generation extension) and writes no ids. The transformers mode also renders every conversation
that way and reports, per template, whether the two agree.
"""
import argparse
import json
import os
import sys
from datetime import datetime

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures", "chat")
# What a Qwen3 tokenizer's special_tokens_map holds; the transformers mode records the real one.
LOCAL_SPECIAL_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def local_environment():
    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTracker(jinja2.ext.Extension):
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(activate_tracker=self.activate_tracker)
            self.blocks = None
            self.spans = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_generation"), [], [], body).set_lineno(lineno)

        @jinja2.pass_eval_context
        def _generation(self, context, caller):
            rv = caller()
            if self.blocks or self.spans:  # transformers' is_active()
                start = len("".join(self.blocks))
                self.spans.append((start, start + len(rv)))
            return rv

        def activate_tracker(self, blocks, spans):
            self.blocks, self.spans = blocks, spans

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTracker, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def byte_spans(text, spans):
    return [[len(text[:a].encode("utf-8")), len(text[:b].encode("utf-8"))] for a, b in spans]


def render_local(env, template, conv, special_tokens):
    """(text, generation byte spans) or raises."""
    compiled = env.from_string(template)
    blocks, spans = [], []
    env.activate_tracker(blocks, spans)
    try:
        for block in compiled.generate(messages=conv["messages"], tools=conv.get("tools"), documents=None,
                                       add_generation_prompt=conv["add_generation_prompt"],
                                       **special_tokens, **conv.get("kwargs", {})):
            blocks.append(block)
    finally:
        env.activate_tracker(None, None)
    text = "".join(blocks)
    return text, byte_spans(text, spans)


def load_inputs():
    convs = [json.loads(line) for line in open(os.path.join(FIXTURES, "conversations.jsonl"), encoding="utf-8")]
    templates = {}
    for c in convs:
        if c["template"] not in templates:
            with open(os.path.join(FIXTURES, "templates", c["template"] + ".jinja"), encoding="utf-8") as f:
                templates[c["template"]] = f.read()
    return convs, templates


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local", action="store_true", help="plain jinja2, no transformers, no ids")
    ap.add_argument("--tokenizer", default=os.path.join(HERE, "..", "..", "data", "qwen3"),
                    help="folder with tokenizer.json (and tokenizer_config.json) for the transformers mode")
    ap.add_argument("--out", default=os.path.join(FIXTURES, "golden.jsonl"))
    ap.add_argument("--md", help="write a markdown summary here")
    args = ap.parse_args()

    import jinja2
    convs, templates = load_inputs()
    env = local_environment()
    previous = {}
    if os.path.exists(args.out):
        for line in open(args.out, encoding="utf-8"):
            r = json.loads(line)
            previous[r["name"]] = r

    rows = []
    agree = {}  # template -> [conversations, identical to the local jinja2 render]
    if args.local:
        engine = f"jinja2 {jinja2.__version__} (local, configured as transformers)"
        special = dict(LOCAL_SPECIAL_TOKENS)
        for c in convs:
            row = {"name": c["name"], "engine": engine, "special_tokens": special}
            try:
                text, spans = render_local(env, templates[c["template"]], c, special)
                row["text"] = text
                if "{% generation" in templates[c["template"]] or "{%- generation" in templates[c["template"]]:
                    row["generation"] = spans
            except Exception as e:  # the golden records that the render fails, and how
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
    else:
        import transformers
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
        engine = f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}"
        tok_dir = os.path.abspath(args.tokenizer)
        if os.path.exists(os.path.join(tok_dir, "tokenizer_config.json")):
            tok = AutoTokenizer.from_pretrained(tok_dir)
        else:
            tok = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tok_dir, "tokenizer.json"),
                                          eos_token="<|im_end|>", pad_token="<|endoftext|>")
        special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
        try:
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError:
            render_jinja_template = None
        for c in convs:
            template = templates[c["template"]]
            has_generation = "generation %}" in template
            row = {"name": c["name"], "engine": engine, "special_tokens": special}
            kw = dict(c.get("kwargs", {}))
            common = dict(tools=c.get("tools"), chat_template=template,
                          add_generation_prompt=c["add_generation_prompt"], **kw)
            try:
                text = tok.apply_chat_template(c["messages"], tokenize=False, **common)
                row["text"] = text
                out = tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=has_generation, **common)
                ids = out["input_ids"]
                row["ids"] = list(ids[0] if ids and isinstance(ids[0], list) else ids)
                if has_generation:
                    masks = out["assistant_masks"]
                    row["assistant_masks"] = list(masks[0] if masks and isinstance(masks[0], list) else masks)
            except Exception as e:  # the golden records that transformers refuses, and how
                row.pop("text", None)
                row["error"] = f"{type(e).__name__}: {e}"
            if has_generation and "text" in row and render_jinja_template is not None:
                # The spans transformers computes the mask from (character offsets, made bytes).
                try:
                    _, indices = render_jinja_template(
                        conversations=[c["messages"]], tools=c.get("tools"), documents=None,
                        chat_template=template, return_assistant_tokens_mask=True,
                        add_generation_prompt=c["add_generation_prompt"], **special, **kw)
                    row["generation"] = byte_spans(row["text"], indices[0])
                except Exception as e:
                    print(f"{c['name']}: no generation spans from render_jinja_template ({e})", file=sys.stderr)
            try:
                local_text, _ = render_local(env, template, c, special)
                same = "text" in row and local_text == row["text"]
            except Exception:
                same = "error" in row
            a = agree.setdefault(c["template"], [0, 0])
            a[0] += 1
            a[1] += same
            rows.append(row)

    with open(args.out, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")

    if args.md:
        changed = [r["name"] for r in rows
                   if r["name"] in previous and (r.get("text"), r.get("error") is None) !=
                   (previous[r["name"]].get("text"), previous[r["name"]].get("error") is None)]
        with open(args.md, "w", encoding="utf-8") as f:
            f.write(f"# Chat template golden\n\nEngine: {engine}\n\n")
            f.write(f"{len(rows)} conversations, {sum('error' in r for r in rows)} refused by the engine, "
                    f"{sum('ids' in r for r in rows)} with ids.\n\n")
            f.write("| template | conversations | identical to plain jinja2 |\n|---|---|---|\n")
            per = {}
            for c in convs:
                per[c["template"]] = per.get(c["template"], 0) + 1
            for t, n in per.items():
                same = f"{agree[t][1]}/{agree[t][0]}" if t in agree else "(local run)"
                f.write(f"| {t} | {n} | {same} |\n")
            f.write(f"\nTexts changed against the previous {os.path.basename(args.out)}: "
                    f"{len(changed)}{' (' + ', '.join(changed) + ')' if changed else ''}\n")
    print(f"wrote {len(rows)} rows to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
