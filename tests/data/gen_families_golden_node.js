// The `tokenizers` library through its Node binding (npm `tokenizers`, the same Rust code as the
// Python package), for gen_families_golden.py --node where Python's `tokenizers` is not installed:
//   node gen_families_golden_node.js REQUEST.json > RESULT.json
// REQUEST: {"tokenizer": path, "texts": [...], "special": [false, true], "offsets": bool}; RESULT:
// {"version", "cases": [{"text", "add_special_tokens", "ids", "decoded", "offsets"?}]} in the order of
// texts x special; offsets (with "offsets": true) are each token's [begin, end) in characters.
const fs = require('fs');
const { Tokenizer } = require('tokenizers');

(async () => {
  const req = JSON.parse(fs.readFileSync(process.argv[2], 'utf8'));
  const tok = Tokenizer.fromFile(req.tokenizer);
  const cases = [];
  for (const text of req.texts) {
    for (const special of req.special) {
      const enc = await tok.encode(text, null, { addSpecialTokens: special });
      const ids = enc.getIds();
      const c = { text, add_special_tokens: special, ids: Array.from(ids), decoded: await tok.decode(ids, false) };
      if (req.offsets) c.offsets = enc.getOffsets();
      cases.push(c);
    }
  }
  const version = JSON.parse(fs.readFileSync(require.resolve('tokenizers/package.json'), 'utf8')).version;
  process.stdout.write(JSON.stringify({ version, cases }));
})();
