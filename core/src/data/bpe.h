// BPE as `tokenizers` runs it: merges applied lowest rank first, leftmost first among equal ranks,
// which is the order it pops its merge heap in. Two alphabets:
//   byte-level  words are raw bytes, one symbol per byte (the ByteLevel alphabet is undone when
//               the vocabulary is loaded);
//   characters  one symbol per UTF-8 character (SentencePiece conversions: Llama 2, Gemma); a
//               character outside the vocabulary becomes its bytes' <0xNN> tokens (byte_fallback)
//               or the unknown token (consecutive ones fused into one with fuse_unk).
// Short words use a linear scan over pair ranks, long ones a heap; a per-thread WordCache
// remembers the ids of words already seen.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace lcx {

struct BpeOptions {
  bool byte_level = true;
  bool ignore_merges = false;  // a word that is a vocabulary entry is that one token
  bool byte_fallback = false;  // characters only
  int32_t unk = -1;            // characters only; -1: none (an unknown character is an error)
  bool fuse_unk = false;
};

class BpeModel {
 public:
  // `vocab[i]` are the bytes of id i (ids without an entry stay empty).
  BpeModel(std::vector<std::string> vocab, BpeOptions options);
  // Merges as id pairs, rank = position; both parts and their concatenation must be in vocab.
  void set_merges(const std::vector<std::pair<int32_t, int32_t>>& merges);
  // Appends the ids of `word` (non-empty) to `out`.
  void encode_word(std::string_view word, std::vector<int32_t>& out) const;
  int32_t id_of(std::string_view bytes) const;  // -1 when absent
  const std::string& bytes_of(int32_t id) const { return vocab_[id]; }
  size_t size() const { return vocab_.size(); }
  const BpeOptions& options() const { return options_; }
  // The <0xNN> token of byte b (byte_fallback), or -1.
  int32_t fallback_id(uint8_t b) const { return fallback_id_.empty() ? -1 : fallback_id_[b]; }

 private:
  struct MergeEntry {
    uint64_t pair;  // left << 32 | right; kEmpty when unused
    uint32_t rank;
    int32_t id;
  };
  static constexpr uint64_t kEmpty = ~0ull;
  const MergeEntry* find_merge(int32_t left, int32_t right) const;
  void merge_short(std::vector<int32_t>& syms) const;
  void merge_long(std::vector<int32_t>& syms) const;
  void initial_symbols(std::string_view word, std::vector<int32_t>& syms) const;

  std::vector<std::string> vocab_;
  std::vector<MergeEntry> merges_;
  uint64_t merge_mask_ = 0;
  std::vector<int32_t> byte_id_;  // id of each single byte
  std::vector<uint32_t> word_table_;  // open addressing over vocab_: id + 1, 0 when empty
  uint64_t word_mask_ = 0;
  BpeOptions options_;
  std::vector<int32_t> fallback_id_;  // by byte: its <0xNN> id, when byte_fallback
  std::vector<uint8_t> in_merge_;     // by id: 1 when the id is a part of some merge
};

// Word -> ids memo for one thread; cleared when it grows past a bound.
class WordCache {
 public:
  // Ids of `word`, computing and remembering them on a miss.
  void lookup(const BpeModel& bpe, std::string_view word, std::vector<int32_t>& out);

 private:
  struct CachedWord {
    uint64_t hash = 0;
    uint32_t key_off = 0, key_len = 0;  // into keys_; key_len 0 marks an empty entry
    uint32_t ids_off = 0, ids_len = 0;  // into ids_
  };
  void grow();
  std::vector<CachedWord> table_ = std::vector<CachedWord>(1 << 12);
  size_t used_ = 0;
  std::string keys_;
  std::vector<int32_t> ids_;
  std::vector<int32_t> scratch_;
};

uint64_t hash_bytes(std::string_view s);

}  // namespace lcx
