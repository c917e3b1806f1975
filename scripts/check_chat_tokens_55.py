#!/usr/bin/env python3
"""Gemma 3's and GPT-OSS's chat goldens and lcx's chat path, against transformers.

Where `transformers` (5.17) and `tokenizers` are installed (the GPU machine's Python; no network,
no GPU needed):

  python3 scripts/check_chat_tokens_55.py [--data data] [--lcx build/bin/lcx-train] [--out DIR]

1. Renders every Gemma 3 and GPT-OSS conversation of tests/data/fixtures/families/
   chat_conversations.jsonl with apply_chat_template (tokenize=False and True) as
   gen_families_golden.py does (strftime_now reading the row's date; assistant_masks from
   return_assistant_tokens_mask under its mask_template) and compares text, ids, masks and
   refusals with the committed chat_golden.jsonl, whose new rows jinja2 and the tokenizers Node
   binding wrote. With --out, writes the transformers rows there (chat_golden_transformers.jsonl)
   to replace them.
2. With --lcx (a built lcx-train), runs `lcx-train tokenize --chat --mask` on the conversations
   transformers renders, with the fixture templates and today's date, and compares its ids with
   apply_chat_template(tokenize=True) and its mask with return_assistant_tokens_mask under the
   mask_template (add_generation_prompt false: lcx renders training conversations).

Prints one line per conversation and exits 1 on any difference.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests", "data")
FIXTURES = os.path.join(TESTS, "fixtures")
sys.path.insert(0, TESTS)

FAMILIES = ("gemma3", "gptoss")


def first_difference(a, b):
    at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"at {at} (lcx/golden {a[at:at + 6]}, transformers {b[at:at + 6]})"


def check_goldens(convs, autos, out_dir):
    from gen_families_golden import chat_row_transformers
    golden = {}
    with open(os.path.join(FIXTURES, "families", "chat_golden.jsonl"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                golden[r["name"]] = r
    bad, rows = 0, []
    for c in convs:
        row = chat_row_transformers(autos[c["tokenizer"]], c, FIXTURES)
        rows.append(row)
        g = golden.get(c["name"])
        if g is None:
            print(f"golden  {c['name']}: no committed row")
            bad += 1
            continue
        problems = []
        if ("error" in row) != ("error" in g):
            problems.append(f"transformers {'refuses' if 'error' in row else 'renders'} it, the golden "
                            f"{'refuses' if 'error' in g else 'renders'} it ({row.get('error', g.get('error'))})")
        else:
            if row.get("text") != g.get("text"):
                problems.append("text differs " + first_difference(g.get("text", ""), row.get("text", "")))
            if row.get("ids") != g.get("ids"):
                problems.append("ids differ " + first_difference(g.get("ids", []), row.get("ids", [])))
            if row.get("assistant_masks") != g.get("assistant_masks"):
                problems.append("assistant_masks differ " +
                                first_difference(g.get("assistant_masks", []), row.get("assistant_masks", [])))
        bad += bool(problems)
        what = "refused as the golden" if "error" in row and not problems else \
            f"{len(row.get('ids', []))} tokens, {sum(row.get('assistant_masks', []))} trained"
        print(f"golden  {c['name']}: " + ("; ".join(problems) if problems else f"equal ({what})"))
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "chat_golden_transformers.jsonl"), "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return bad


def check_lcx(lcx, convs, autos, data):
    from gen_families_golden import read_template
    bad = 0
    groups = {}
    for c in convs:
        key = (c["tokenizer"], c["template"], c.get("mask_template"), json.dumps(c.get("kwargs", {}), sort_keys=True))
        groups.setdefault(key, []).append(c)
    tmp = tempfile.mkdtemp()
    for (family, template, mask_template, kwargs), group in groups.items():
        tok = autos[family]
        kw = json.loads(kwargs)
        expected = []
        for c in group:
            common = dict(tools=c.get("tools"), add_generation_prompt=False, **kw)
            try:
                ids = tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True,
                                              chat_template=read_template(FIXTURES, template), **common)["input_ids"]
            except Exception as e:  # refused by the template: not a conversation lcx trains on either
                expected.append(None)
                continue
            mask = None
            if mask_template:
                out = tok.apply_chat_template(c["messages"], tokenize=True, return_dict=True,
                                              chat_template=read_template(FIXTURES, mask_template),
                                              return_assistant_tokens_mask=True, **common)
                mask = list(out["assistant_masks"])
            expected.append((list(ids), mask))
        kept = [(c, e) for c, e in zip(group, expected) if e is not None]
        if not kept:
            continue
        path = os.path.join(tmp, f"{family}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for c, _ in kept:
                line = {"messages": c["messages"]}
                if c.get("tools"):
                    line["tools"] = c["tools"]
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
        cmd = [lcx, "tokenize", "--tokenizer", os.path.join(data, family, "tokenizer.json"), "--chat", path,
               "--tokenizer-config", os.path.join(FIXTURES, "chat", "templates", template + ".jinja"),
               "--kwargs", kwargs, "--mask", "--threads", "1"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            print(f"lcx     {family}/{template}: lcx-train tokenize failed: {out.stderr.strip()}")
            bad += len(kept)
            continue
        lines = out.stdout.splitlines()
        for k, (c, (ids, mask)) in enumerate(kept):
            ours = [int(x) for x in lines[2 * k].split()] if 2 * k < len(lines) else []
            our_mask = [int(x) for x in lines[2 * k + 1].split()] if 2 * k + 1 < len(lines) else []
            problems = []
            if ours != ids:
                problems.append("ids differ " + first_difference(ours, ids))
            if mask is not None and our_mask != mask:
                problems.append("mask differs " + first_difference(our_mask, mask))
            bad += bool(problems)
            print(f"lcx     {c['name']}: " + ("; ".join(problems) if problems else
                                              f"equal ({len(ids)} tokens, {sum(our_mask)} trained)"))
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.join(ROOT, "data"), help="folder with gemma3/ and gptoss/ tokenizers")
    ap.add_argument("--lcx", help="a built lcx-train: also check its chat ids and masks")
    ap.add_argument("--out", help="write the transformers rows here")
    a = ap.parse_args()
    import transformers
    from transformers import AutoTokenizer
    from gen_families_golden import materialize, read_conversations
    print(f"transformers {transformers.__version__}")
    tmp = tempfile.mkdtemp()
    autos = {fam: AutoTokenizer.from_pretrained(materialize(os.path.join(a.data, fam), os.path.join(tmp, fam)))
             for fam in FAMILIES}
    convs = [c for c in read_conversations(FIXTURES) if c["tokenizer"] in FAMILIES]
    bad = check_goldens(convs, autos, a.out)
    if a.lcx:
        bad += check_lcx(a.lcx, convs, autos, a.data)
    print("all equal" if not bad else f"{bad} differ")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
