#!/usr/bin/env python3
"""Reference ids for the tokenizers of the families lcx reads (Llama 3.1, Gemma 3, GPT-OSS, Llama 2,
Qwen3) and for their chat templates, for tests/data/tokenizer_families_test.cpp.

Runs where `tokenizers` and `transformers` are installed (the GPU machine, CPU only, no network):
    python3 tests/data/gen_families_golden.py --tokenizers DIR --out tests/data/fixtures/families
DIR holds one folder per family (llama3_1, gemma3, gptoss, llama2, qwen3) with tokenizer.json (or
tokenizer.json.gz) and tokenizer_config.json, as scripts/fetch_data.sh puts them in data/. Writes
  <family>_golden.json  {"tokenizers_version", "tokenizer_sha256", "cases": [{"text",
                         "add_special_tokens", "ids", "decoded"}], "transformers": [{"text", "ids"}]}
                        ids from Tokenizer.from_file(...).encode(text, add_special_tokens=...),
                        decoded from its decode(ids, skip_special_tokens=False); "transformers" holds
                        AutoTokenizer(folder)(text)["input_ids"] (the BOS transformers adds).
  chat_golden.jsonl     per conversation of chat_conversations.jsonl: the text and ids of
                        AutoTokenizer(folder).apply_chat_template(..., tokenize=True) with the
                        template of fixtures/chat/templates/<template>.jinja, or the error it raised.
                        A conversation with "date" renders with strftime_now reading that day (noon);
                        one with "mask_template" gets "assistant_masks": return_assistant_tokens_mask
                        of the same conversation under that template (the same text with
                        {% generation %} blocks, checked equal), the tokens lcx's loss_on = "assistant"
                        trains.
Nothing here knows what lcx produces.

  python3 tests/data/gen_families_golden.py --tokenizers data --out DIR --chat-only
writes only chat_golden.jsonl (what scripts/check_chat_tokens_55.py compares).

Without Python's `tokenizers` and `transformers` (a machine with npm and jinja2 only):
    python3 tests/data/gen_families_golden.py --node NODE_MODULES --tokenizers data --out ...
encodes through the Node binding of the same library (npm install tokenizers@<version>; see
gen_families_golden_node.js) and renders the chat templates with jinja2 configured as transformers
configures it (gen_chat_golden.local_environment), then encodes the text without special tokens,
as apply_chat_template(tokenize=True) does; the fixtures say which engine wrote them. With
--keep-existing it writes only the conversations chat_golden.jsonl has no row for yet, keeping the
rows there (those transformers wrote) as they are.
"""
import argparse
import gzip
import hashlib
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# The Qwen3 fixture's strings (every class boundary of the regexes), read without importing
# gen_golden.py, which needs Python's `tokenizers`.
def qwen3_cases():
    import ast
    with open(os.path.join(HERE, "gen_golden.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CASES" for t in node.targets):
            # String literals and repetitions ("x" * 100): evaluated with no names in scope.
            return eval(compile(ast.Expression(node.value), "gen_golden.py", "eval"), {"__builtins__": {}})
    raise RuntimeError("gen_golden.py has no CASES")


CASES = qwen3_cases()

FAMILIES = ["llama3_1", "gemma3", "gptoss", "llama2", "qwen3"]
EXTRA = [
    "<s>", " <s> x", "Hello <s> world</s>", "<bos>hi", "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", "<|startoftext|>x<|return|>",
    "▁already▁metaspace", "a  b   c    d", " x", "x ", "\u2581", "<0x41>", "<unk>", "1234567 3.14159 12345678901",
    "don't DON'T Don't", "\t\tindented\n    four\n", "ﬁ", "\ufffd", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def materialize(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
        elif os.path.exists(os.path.join(src, name + ".gz")):
            with gzip.open(os.path.join(src, name + ".gz"), "rb") as f, open(os.path.join(dst, name), "wb") as g:
                shutil.copyfileobj(f, g)
    return dst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizers", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--node", help="a node_modules folder holding npm's tokenizers: use it, and jinja2 for the chat")
    ap.add_argument("--chat-only", action="store_true", help="write chat_golden.jsonl only")
    ap.add_argument("--keep-existing", action="store_true",
                    help="--node: keep the rows --out's chat_golden.jsonl has, render only the new conversations")
    args = ap.parse_args()
    if args.node:
        return main_node(args)
    os.makedirs(args.out, exist_ok=True)
    fixtures = os.path.join(HERE, "fixtures")
    with open(os.path.join(fixtures, "families", "multilingual.txt"), encoding="utf-8") as f:
        multilingual = f.read()
    texts = [multilingual] + EXTRA + CASES
    tmp = tempfile.mkdtemp()
    folders = {}
    import tokenizers
    from tokenizers import Tokenizer
    import transformers
    from transformers import AutoTokenizer
    for fam in FAMILIES:
        folder = materialize(os.path.join(args.tokenizers, fam), os.path.join(tmp, fam))
        folders[fam] = folder
        if args.chat_only:
            continue
        path = os.path.join(folder, "tokenizer.json")
        tok = Tokenizer.from_file(path)
        cases = []
        for t in texts:
            for special in (False, True):
                ids = tok.encode(t, add_special_tokens=special).ids
                cases.append({"text": t, "add_special_tokens": special, "ids": ids,
                              "decoded": tok.decode(ids, skip_special_tokens=False)})
        hf = []
        try:
            auto = AutoTokenizer.from_pretrained(folder)
            for t in [multilingual, "Hello world", " leading", "<s>x"]:
                hf.append({"text": t, "ids": list(auto(t)["input_ids"])})
        except Exception as e:
            hf.append({"error": f"{type(e).__name__}: {e}"})
        with open(path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        out = {"tokenizers_version": tokenizers.__version__, "transformers_version": transformers.__version__,
               "tokenizer_sha256": sha, "cases": cases, "transformers": hf}
        with open(os.path.join(args.out, f"{fam}_golden.json"), "w", encoding="utf-8") as f:
            json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        print(fam, len(cases), "cases", file=sys.stderr)

    rows = []
    autos = {}
    for c in read_conversations(fixtures):
        if c["tokenizer"] not in autos:
            autos[c["tokenizer"]] = AutoTokenizer.from_pretrained(folders[c["tokenizer"]])
        rows.append(chat_row_transformers(autos[c["tokenizer"]], c, fixtures))
    write_rows(os.path.join(args.out, "chat_golden.jsonl"), rows)
    print(len(rows), "conversations", file=sys.stderr)


def read_conversations(fixtures):
    with open(os.path.join(fixtures, "families", "chat_conversations.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_template(fixtures, name):
    with open(os.path.join(fixtures, "chat", "templates", name + ".jinja"), encoding="utf-8") as f:
        return f.read()


def write_rows(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


class frozen_clock:
    """strftime_now reads `date` at noon (transformers' and gen_chat_golden's call datetime.now())."""

    def __init__(self, date, modules):
        self.date, self.modules, self.saved = date, modules, []

    def __enter__(self):
        import types
        from datetime import datetime
        if self.date:
            fixed = datetime.fromisoformat(self.date + "T12:00:00")

            class Frozen(datetime):
                @classmethod
                def now(cls, tz=None):
                    return fixed

            for m in self.modules:
                old = getattr(m, "datetime", None)
                if isinstance(old, type):  # from datetime import datetime
                    new = Frozen
                elif isinstance(old, types.ModuleType):  # import datetime
                    new = types.ModuleType("datetime")
                    new.__dict__.update(old.__dict__)
                    new.datetime = Frozen
                else:
                    raise SystemExit(f"{m.__name__} has no datetime to freeze strftime_now with")
                self.saved.append((m, old))
                m.datetime = new
        return self

    def __exit__(self, *exc):
        for m, d in self.saved:
            m.datetime = d


def chat_row_transformers(tok, c, fixtures):
    import transformers
    from transformers.utils import chat_template_utils
    row = {"name": c["name"], "engine": f"transformers {transformers.__version__}",
           "special_tokens": {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}}
    if "date" in c:
        row["date"] = c["date"]
    common = dict(tools=c.get("tools"), add_generation_prompt=c["add_generation_prompt"], **c.get("kwargs", {}))
    with frozen_clock(c.get("date"), [chat_template_utils]):
        try:
            template = read_template(fixtures, c["template"])
            row["text"] = tok.apply_chat_template(c["messages"], tokenize=False, chat_template=template, **common)
            out = tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True, chat_template=template, **common)
            ids = out["input_ids"]
            row["ids"] = list(ids[0] if ids and isinstance(ids[0], list) else ids)
        except Exception as e:
            row.pop("text", None)
            row["error"] = f"{type(e).__name__}: {e}"
            return row
        if "date" in c and "strftime_now" in template and c["date"] not in row["text"]:
            raise SystemExit(f"{c['name']}: strftime_now did not read {c['date']}: transformers' clock was not frozen")
        if "mask_template" in c:
            masked = read_template(fixtures, c["mask_template"])
            text = tok.apply_chat_template(c["messages"], tokenize=False, chat_template=masked, **common)
            if text != row["text"]:
                raise SystemExit(f"{c['name']}: {c['mask_template']} renders another text than {c['template']}")
            out = tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True, chat_template=masked,
                                          return_assistant_tokens_mask=True, **common)
            m = out["assistant_masks"]
            row["assistant_masks"] = list(m[0] if m and isinstance(m[0], list) else m)
    return row


def main_node(args):
    import subprocess
    import jinja2
    from gen_chat_golden import render_local
    fixtures = os.path.join(HERE, "fixtures")
    with open(os.path.join(fixtures, "families", "multilingual.txt"), encoding="utf-8") as f:
        multilingual = f.read()
    texts = [multilingual] + EXTRA + CASES
    tmp = tempfile.mkdtemp()
    env = dict(os.environ, NODE_PATH=os.path.abspath(args.node))
    script = os.path.join(HERE, "gen_families_golden_node.js")

    def encode(path, texts, special, offsets=False):
        req = os.path.join(tmp, "request.json")
        with open(req, "w", encoding="utf-8") as f:
            json.dump({"tokenizer": path, "texts": texts, "special": special, "offsets": offsets}, f)
        return json.loads(subprocess.run(["node", script, req], env=env, check=True, capture_output=True).stdout)

    folders = {}
    for fam in FAMILIES:
        folder = materialize(os.path.join(args.tokenizers, fam), os.path.join(tmp, fam))
        folders[fam] = folder
        if args.chat_only or args.keep_existing:
            continue
        path = os.path.join(folder, "tokenizer.json")
        res = encode(path, texts, [False, True])
        with open(path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        out = {"tokenizers_version": res["version"] + " (node binding)", "tokenizer_sha256": sha, "cases": res["cases"]}
        with open(os.path.join(args.out, f"{fam}_golden.json"), "w", encoding="utf-8") as f:
            json.dump(out, f, ensure_ascii=False, separators=(",", ":"))
        print(fam, len(res["cases"]), "cases", file=sys.stderr)

    import gen_chat_golden
    jenv = gen_chat_golden.local_environment()
    out_path = os.path.join(args.out, "chat_golden.jsonl")
    kept = {}
    if args.keep_existing and os.path.exists(out_path):
        with open(out_path, encoding="utf-8") as f:
            kept = {r["name"]: r for r in map(json.loads, f) if r}
    rows = []
    for c in read_conversations(fixtures):
        if c["name"] in kept:
            rows.append(kept[c["name"]])
            continue
        with open(os.path.join(folders[c["tokenizer"]], "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
        special = {}
        for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
            v = config.get(k)
            v = v.get("content") if isinstance(v, dict) else v
            if isinstance(v, str):
                special[k] = v
        row = {"name": c["name"], "engine": f"jinja2 {jinja2.__version__} (configured as transformers) + tokenizers "
                                            f"node binding", "special_tokens": special}
        if "date" in c:
            row["date"] = c["date"]
        conv = dict(c, kwargs=c.get("kwargs", {}))
        tokenizer_json = os.path.join(folders[c["tokenizer"]], "tokenizer.json")
        with frozen_clock(c.get("date"), [gen_chat_golden]):
            try:
                row["text"], _ = render_local(jenv, read_template(fixtures, c["template"]), conv, special)
            except jinja2.TemplateError as e:
                row.pop("text", None)
                row["error"] = f"{type(e).__name__}: {e}"
            if "text" in row:
                enc = encode(tokenizer_json, [row["text"]], [False], offsets=True)["cases"][0]
                row["ids"] = enc["ids"]
                if "mask_template" in c:
                    text, spans = render_local(jenv, read_template(fixtures, c["mask_template"]), conv, special)
                    if text != row["text"]:
                        raise SystemExit(f"{c['name']}: {c['mask_template']} renders another text than {c['template']}")
                    row["assistant_masks"] = mask_from_spans(text, spans, enc["offsets"])
        rows.append(row)
    write_rows(out_path, rows)
    print(len(rows), "conversations", file=sys.stderr)


def mask_from_spans(text, byte_spans, offsets):
    """transformers' assistant mask: per generation span, the tokens from the one holding its first
    character through the one holding its last (char_to_token), from character offsets."""
    mask = [0] * len(offsets)
    data = text.encode("utf-8")

    def char_at(byte):
        return len(data[:byte].decode("utf-8"))

    def token_of(ch):
        for k, (b, e) in enumerate(offsets):
            if b <= ch < e:
                return k
        return None

    for b, e in byte_spans:
        if e <= b:
            continue
        first, last = token_of(char_at(b)), token_of(char_at(e) - 1)
        if first is None:
            break
        for k in range(first, last + 1 if last is not None else len(offsets)):
            mask[k] = 1
    return mask

if __name__ == "__main__":
    main()
