#!/usr/bin/env python3
"""Writes the golden ids that tests/data/tokenizer_golden_test.cpp holds lcx's tokenizer to.

Runs where the Hugging Face `tokenizers` library is installed (the GPU machine; no network needed):
    python3 tests/data/gen_golden.py --tokenizer data/qwen3/tokenizer.json --kjv data/kjv/kjv.txt \
        --out tests/data/fixtures/qwen3_golden.json [--kjv-ids kjv_ids.u32]
Every id comes from tokenizers' Tokenizer.encode(text, add_special_tokens=True); nothing here
knows what lcx produces. The strings are written out with their ids, so the fixture is
self-contained; the KJV book (4.3 MB) is kept as its count, a sha256 of its ids (uint32 little
endian) and its first and last 2000 ids.
"""
import argparse
import hashlib
import json
import random
import struct

import tokenizers
from tokenizers import Tokenizer

CASES = [
    "", "Hello world", "Hello, world!", "hello", " hello", "  hello", "   hello", "hello ", "hello  ",
    "  leading and trailing  ", "a\tb\t\tc\t", "\t\tindented", "line1\nline2\r\nline3\r\r\n\nline4\n",
    "\n", "\n\n", "\r\n", " \n", "\n ", " \n \n  x", "x\n\n\n  y", "x  \n  y", "end with newline\n",
    "I'm you're we've they'll he'd it's don't", "I'M YOU'RE WE'VE THEY'LL HE'D IT'S DON'T",
    "'s 't 're 've 'm 'll 'd 'S 'T 'Re 'rE 'VE 'Ll 'lL 'D", "'sa 'tx 'rex 'lla", "''s '", "'", "x'", "'ſ 'ſt ſ's",
    "rock'n'roll", "O'Neil's dog's bone", "'hello' \"quoted\"", "it’s curly’s",
    "1234567890", "3.14159 1,000,000 -42 +7 1e-9", "٣٤٥ ۱۲۳ १२३ ⅫⅣ ½ ² ①", "abc123def 123abc abc 123",
    "我爱北京天安门。今天天气很好！", "こんにちは、世界。カタカナとひらがなと漢字。", "안녕하세요 세계! 한국어 문장입니다.",
    "مرحبا بالعالم، كيف حالك؟", "नमस्ते दुनिया, हिन्दी में लिखा।", "Привет, мир! Как дела? Ёжик.", "สวัสดีชาวโลก ภาษาไทย",
    "שלום עולם", "Καλημέρα κόσμε", "Tiếng Việt có dấu rất nhiều", "Ελληνικά и русский and English 混合",
    "ქართული ენა", "Հայերեն", "አማርኛ", "தமிழ் மொழி", "ᠮᠣᠩᠭᠣᠯ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕸𝖆𝖙𝖍", "𐍈𐌰𐌹",
    "👍 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇫🇷🇩🇪 🧑🏿‍🚀", "😀😃😄😁", "a👍b", " 👍", "text 🙂.", "\u200d\u200d", "x\u200dy",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n",
    "text<|endoftext|>more text", "<|endoftext|><|endoftext|>", " <|endoftext|> ", "<think>\nhmm\n</think>\n\nanswer",
    "<tool_call>{\"name\": \"f\"}</tool_call>", "<|im_start", "<|endoftext|", "<<|im_end|>>", "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "e\u0301", "cafe\u0301", "A\u030a", "\u1e9b\u0323", "\u1100\u1161\u11a8", "\u212b", "\u2126", "q\u0307\u0323",
    "\u0340\u0341", "\u0958", "\ufb01 \ufb00", "x\u0301\u0301y",
    " ", "  ", "   ", " " * 100, " " * 1000 + "x", "\n" * 50, "\t" * 20, " \t \t ", "\u00a0x", "\u3000x", "\u3000\u3000",
    "a\u2028b", "a\u2029b", "a\u0085b", "x \u00a0 y", "\x1c\x1d\x1e\x1f", "a\u180eb", "a\u200bb", "a\ufeffb", "\ufeffBOM",
    "\x00\x01 \x7f", "a\x0bb\x0cc", "\r", "\r\r\r", "x\r\ny\r\n\r\n",
    "def f(x):\n    return x**2  # square\n\n\tif a != b:\n\t\tpass\n",
    "{\"key\": [1, 2.5, null], \"nested\": {\"a\": \"b\"}}", "https://example.com/path?q=1&r=2#frag",
    "!!!???...", " !!!", "x!!!\n\n", "a--b==c", "(((nested)))", "$100 €50 £20 ¥1000", "@user #tag", "~`^|\\",
    "a" * 1000, "ab" * 300, "1" * 100, "!" * 200, "😀" * 50, "the " * 200, "Hello世界123abc!!!\n\n",
    "ÀÉÎÕÜ àéîõü ÇçÑñ ß ẞ", "Ǆǅǆ ǈ", "İstanbul ıi", "ﬀ ﬃ", "Ⓐⓑ", "ＡＢＣ１２３", "ｶﾀｶﾅ",
]

# Pieces the random strings are drawn from: each class boundary of the Split regex.
ALPHABET = [" ", " ", " ", "  ", "\n", "\n", "\r", "\r\n", "\t", "\u00a0", "\u3000", "\u2028", "\u0085",
            "a", "b", "Z", "word", "The", "é", "e\u0301", "ß", "ſ", "я", "中", "文", "ア", "한", "ा", "ि", "क", "्",
            "0", "7", "42", "٣", "½", "'", "'", "s", "S", "t", "re", "ve", "ll", "m", "d", "D",
            ".", ",", "!", "?", "-", "_", "(", ")", "\"", "#", "$", "%", "&", "*", "+", "/", ":", ";", "<", ">",
            "=", "@", "[", "]", "\\", "^", "`", "{", "}", "|", "~", "…", "—", "“", "”", "👍", "🏽", "\u200d",
            "\ufe0f", "\x00", "\x1f", "\x7f", "<|endoftext|>", "<|im_start|>", "<think>", "<|im"]

INVALID = [b"abc\xffdef", b"\xc3", b"x\xc3", b"\xe2\x82", b"\xe2\x82x", b"\xf0\x9f\x98", b"\xf0\x9f\x98 ok",
           b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"\x80\x80", b"ok\xe2\x82\xacok\xe2\x28\xa1",
           b"\xf8\x88\x80\x80\x80", b"\xfe\xff", b"a\xe0\x80\x80b", b"\xf0\x80\x80\x80", b"\xed\x9f\xbf",
           b"Hello \xf0\x9f\x91 world\n\xc3\xa9\xc3", b"<|endoftext|>\xff<|endoftext|>"]

# Added tokens appended to the file, to hold each matching flag to the library's behavior.
EXTRA_TOKENS = [
    {"id": 151669, "content": "<x>", "single_word": False, "lstrip": True, "rstrip": False, "normalized": False, "special": False},
    {"id": 151670, "content": "[y]", "single_word": False, "lstrip": False, "rstrip": True, "normalized": False, "special": True},
    {"id": 151671, "content": "magic", "single_word": True, "lstrip": False, "rstrip": False, "normalized": False, "special": False},
    {"id": 151672, "content": "caf\u00e9", "single_word": False, "lstrip": False, "rstrip": False, "normalized": True, "special": False},
    {"id": 151673, "content": "<x>yz", "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": False},
]
EXTRA_CASES = ["a <x> b", "a   <x>b", "\n\t <x>", "<x>yz and <x>y", "[y]   tail", "[y]\n\nnext", "[y]x",
               "magic word", "amagic", "magic!", "the magic's", "magic1", "é magic é", "café", "cafe\u0301 au lait",
               "<x><x>", "  <x>  [y]  ", "magicmagic magic"]


def ids_of(tok, text):
    return tok.encode(text, add_special_tokens=True).ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--kjv", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kjv-ids", help="also write every KJV id as uint32 little endian")
    a = ap.parse_args()

    raw = open(a.tokenizer, "rb").read()
    tok = Tokenizer.from_str(raw.decode("utf-8"))
    out = {"tokenizers_version": tokenizers.__version__, "tokenizer_sha256": hashlib.sha256(raw).hexdigest()}

    rng = random.Random(20261129)
    fuzz = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 24))) for _ in range(600)]
    out["cases"] = [{"text": t, "ids": ids_of(tok, t), "decoded": tok.decode(ids_of(tok, t), skip_special_tokens=False)}
                    for t in CASES + fuzz]
    out["skip_special"] = [{"ids": c["ids"], "decoded": tok.decode(c["ids"], skip_special_tokens=True)}
                           for c in out["cases"][:len(CASES)] if "<|" in c["text"] or "<think>" in c["text"]]

    inv = []
    for b in INVALID:
        text = b.decode("utf-8", errors="replace")
        inv.append({"hex": b.hex(), "ids": ids_of(tok, text), "replaced": text.count("\ufffd")})
    out["invalid_utf8"] = inv

    j = json.loads(raw)
    j["added_tokens"] += EXTRA_TOKENS
    tok2 = Tokenizer.from_str(json.dumps(j))
    out["extra_tokens"] = EXTRA_TOKENS
    out["extra_cases"] = [{"text": t, "ids": ids_of(tok2, t)} for t in EXTRA_CASES]

    kjv_bytes = open(a.kjv, "rb").read()
    ids = ids_of(tok, kjv_bytes.decode("utf-8"))
    packed = struct.pack("<%dI" % len(ids), *ids)
    out["kjv"] = {"bytes": len(kjv_bytes), "text_sha256": hashlib.sha256(kjv_bytes).hexdigest(), "count": len(ids),
                  "ids_sha256": hashlib.sha256(packed).hexdigest(), "first": ids[:2000], "last": ids[-2000:]}
    if a.kjv_ids:
        open(a.kjv_ids, "wb").write(packed)
    with open(a.out, "w") as f:
        json.dump(out, f, ensure_ascii=True, separators=(",", ":"))
    print("golden: %d cases, %d invalid-utf8, %d extra, kjv %d tokens, tokenizers %s" % (
        len(out["cases"]), len(inv), len(out["extra_cases"]), len(ids), tokenizers.__version__))


if __name__ == "__main__":
    main()
