// A Hugging Face tokenizer.json giving the same ids as the `tokenizers` library for the BPE files
// of Qwen2/3, Llama 3, GPT-OSS (byte-level) and Llama 2, Gemma, Mistral v0.1 (SentencePiece
// conversions with byte fallback): added tokens matched first (leftmost longest), the normalizers
// (NFC, Replace, Prepend), the pre-tokenizers (Split by any regex through PCRE2, ByteLevel), BPE,
// the decoders (ByteLevel; Replace, ByteFallback, Fuse, Strip). What it does not implement
// (WordPiece, Unigram, WordLevel models; Metaspace, Whitespace, Digits, ... pre-tokenizers; other
// normalizers) is refused when loading, naming the key (its JSON path) and its value.
//
//   lcx::Tokenizer tok = lcx::Tokenizer::load("data/qwen3/tokenizer.json");
//   std::vector<int32_t> ids = tok.encode("Hello world");   // all cores for a long text
//   std::string text = tok.decode(ids);                     // the normalized input
//   int32_t eos = tok.eos_id();                             // <|endoftext|>
//   tok.prefix_ids();                                       // Llama 3: {<|begin_of_text|>}
//   std::string key = tok.hash();                           // sha256 of the file, for caches
//
// encode() adds no special token of its own: it is tokenizers' encode(add_special_tokens=False),
// what transformers uses on a rendered chat template. prefix_ids() and suffix_ids() are what
// add_special_tokens=True puts around one text.
//
// Input that is not valid UTF-8 is repaired first as Python's bytes.decode(errors='replace')
// would (the only way such bytes reach `tokenizers`); EncodeStats counts the replacements.
// A Tokenizer is cheap to copy (shared state) and safe to use from several threads at once.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace lcx {

struct EncodeStats {
  int64_t invalid_utf8 = 0;  // ill-formed sequences replaced by U+FFFD
};

// The bytes [begin, end) of the text one token stands for. The spans of a text's tokens tile it in
// order; where NFC changed the text, the tokens of a changed stretch (one ASCII character and the
// non-ASCII run after it) each get the whole stretch.
struct TokenSpan {
  uint32_t begin = 0, end = 0;
};
struct Encoding {
  std::vector<int32_t> ids;
  std::vector<TokenSpan> spans;  // one per id
};

class Tokenizer {
 public:
  static Tokenizer load(const std::string& path);

  // threads: 0 = all hardware threads; texts below a few hundred KB use one.
  std::vector<int32_t> encode(std::string_view text, int threads = 0, EncodeStats* stats = nullptr) const;
  // Encodes each text on its own (as tokenizers' encode_batch does), all in parallel; stats, when
  // given, gets one entry per text.
  std::vector<std::vector<int32_t>> encode_batch(const std::vector<std::string_view>& texts, int threads = 0,
                                                 std::vector<EncodeStats>* stats = nullptr) const;
  // encode_batch with each token's byte span in its text (the text as repaired where it was not
  // valid UTF-8), as `tokenizers`' offsets give them in characters. Texts are below 4 GiB each.
  std::vector<Encoding> encode_batch_with_offsets(const std::vector<std::string_view>& texts, int threads = 0,
                                                  std::vector<EncodeStats>* stats = nullptr) const;
  // A text too large to hold whole, read in blocks: read(buf, n) gives up to n bytes (0 at its
  // end), and emit(ids) gets the ids in order, together those encode() gives the whole text. Each
  // block ends where the text may be cut (a piece boundary of the whole text, no added token
  // across it), so memory stays near `block` bytes and their ids; a tokenizer whose text cannot
  // be cut (a prefix-adding normalizer or pre-tokenizer), or a text with no such place, is held
  // longer.
  void encode_stream(const std::function<size_t(char*, size_t)>& read,
                     const std::function<void(std::vector<int32_t>&&)>& emit, int threads = 0,
                     EncodeStats* stats = nullptr, size_t block = size_t{64} << 20) const;
  // Ids back to text (ByteLevel decoder; ill-formed bytes become U+FFFD); special tokens kept
  // unless skip_special.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  int32_t eos_id() const;  // <|endoftext|>, or the model's eos as the file names it
  // The post-processor's TemplateProcessing around one text (tokenizers' add_special_tokens=True),
  // as tokenizer_config.json beside the file overrides it where it sets add_bos_token or
  // add_eos_token (as transformers' Llama and Gemma tokenizers do).
  const std::vector<int32_t>& prefix_ids() const;
  const std::vector<int32_t>& suffix_ids() const;
  int64_t vocab_size() const;  // one past the largest id
  int32_t token_to_id(std::string_view token) const;  // -1 when unknown; added tokens by content
  const std::string& hash() const;  // sha256 of tokenizer.json
  const std::string& path() const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace lcx
