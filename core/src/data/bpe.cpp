#include "data/bpe.h"

#include <cstdio>
#include <cstring>
#include <queue>

#include "lcx/error.h"

namespace lcx {

uint64_t hash_bytes(std::string_view s) {
  // FNV-1a over 8-byte words, then a final mix: fast for the short words BPE sees.
  uint64_t h = 0xcbf29ce484222325ull ^ s.size();
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  for (; i < s.size(); ++i) h = (h ^ static_cast<unsigned char>(s[i])) * 0x100000001b3ull;
  h ^= h >> 32;
  h *= 0xd6e8feb86659fd93ull;
  h ^= h >> 32;
  return h;
}

namespace {
uint64_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}
uint64_t table_size(size_t n) {
  uint64_t s = 16;
  while (s < 2 * n) s <<= 1;
  return s;
}
}  // namespace

BpeModel::BpeModel(std::vector<std::string> vocab, BpeOptions options)
    : vocab_(std::move(vocab)), options_(options) {
  word_table_.assign(table_size(vocab_.size()), 0);
  word_mask_ = word_table_.size() - 1;
  for (size_t id = 0; id < vocab_.size(); ++id) {
    if (vocab_[id].empty()) continue;
    for (uint64_t h = hash_bytes(vocab_[id]);; ++h) {
      uint32_t& s = word_table_[h & word_mask_];
      if (s == 0) {
        s = static_cast<uint32_t>(id + 1);
        break;
      }
    }
  }
  byte_id_.assign(256, -1);
  for (int b = 0; b < 256; ++b) byte_id_[b] = id_of(std::string(1, static_cast<char>(b)));
  if (options_.byte_fallback) {
    fallback_id_.assign(256, -1);
    char name[8];
    for (int b = 0; b < 256; ++b) {
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      fallback_id_[b] = id_of(name);
    }
  }
  merges_.assign(16, MergeEntry{kEmpty, 0, 0});
  merge_mask_ = merges_.size() - 1;
}

void BpeModel::set_merges(const std::vector<std::pair<int32_t, int32_t>>& merges) {
  merges_.assign(table_size(merges.size()), MergeEntry{kEmpty, 0, 0});
  merge_mask_ = merges_.size() - 1;
  in_merge_.assign(vocab_.size(), 0);
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    auto [a, b] = merges[rank];
    in_merge_[static_cast<size_t>(a)] = in_merge_[static_cast<size_t>(b)] = 1;
    int32_t id = id_of(vocab_[a] + vocab_[b]);
    LCX_CHECK(id >= 0, "merge result missing from vocab");
    uint64_t key = static_cast<uint64_t>(a) << 32 | static_cast<uint32_t>(b);
    for (uint64_t h = mix(key);; ++h) {
      MergeEntry& s = merges_[h & merge_mask_];
      // A repeated pair keeps its last rank, as the Rust HashMap built from the list does.
      if (s.pair == kEmpty || s.pair == key) {
        s = MergeEntry{key, static_cast<uint32_t>(rank), id};
        break;
      }
    }
  }
}

int32_t BpeModel::id_of(std::string_view bytes) const {
  for (uint64_t h = hash_bytes(bytes);; ++h) {
    uint32_t s = word_table_[h & word_mask_];
    if (s == 0) return -1;
    if (vocab_[s - 1] == bytes) return static_cast<int32_t>(s - 1);
  }
}

const BpeModel::MergeEntry* BpeModel::find_merge(int32_t left, int32_t right) const {
  uint64_t key = static_cast<uint64_t>(left) << 32 | static_cast<uint32_t>(right);
  for (uint64_t h = mix(key);; ++h) {
    const MergeEntry& s = merges_[h & merge_mask_];
    if (s.pair == key) return &s;
    if (s.pair == kEmpty) return nullptr;
  }
}

void BpeModel::merge_short(std::vector<int32_t>& syms) const {
  constexpr uint32_t kNone = ~0u;
  size_t n = syms.size();
  uint32_t rank[64];
  int32_t merged[64];
  for (size_t i = 0; i + 1 < n; ++i) {
    const MergeEntry* m = find_merge(syms[i], syms[i + 1]);
    rank[i] = m ? m->rank : kNone;
    merged[i] = m ? m->id : -1;
  }
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i)
      if (rank[i] < rank[best]) best = i;
    if (rank[best] == kNone) break;
    syms[best] = merged[best];
    for (size_t i = best + 1; i + 1 < n; ++i) {
      syms[i] = syms[i + 1];
      rank[i] = rank[i + 1];
      merged[i] = merged[i + 1];
    }
    --n;
    auto refresh = [&](size_t i) {
      const MergeEntry* m = find_merge(syms[i], syms[i + 1]);
      rank[i] = m ? m->rank : kNone;
      merged[i] = m ? m->id : -1;
    };
    if (best > 0) refresh(best - 1);
    if (best + 1 < n) refresh(best);
  }
  syms.resize(n);
}

void BpeModel::merge_long(std::vector<int32_t>& syms) const {
  // Symbols in a linked list; the heap holds (rank, position of the left symbol) and entries
  // that no longer match the list are skipped when popped.
  const int n = static_cast<int>(syms.size());
  std::vector<int> prev(n), next(n);
  for (int i = 0; i < n; ++i) prev[i] = i - 1, next[i] = i + 1 < n ? i + 1 : -1;
  struct Entry {
    uint32_t rank;
    int pos;
    int32_t left, right;
    bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  auto push = [&](int i) {
    if (i < 0 || next[i] < 0) return;
    if (const MergeEntry* m = find_merge(syms[i], syms[next[i]])) heap.push({m->rank, i, syms[i], syms[next[i]]});
  };
  for (int i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    Entry e = heap.top();
    heap.pop();
    int j = next[e.pos];
    if (syms[e.pos] != e.left || j < 0 || syms[j] != e.right) continue;
    syms[e.pos] = find_merge(e.left, e.right)->id;
    next[e.pos] = next[j];
    if (next[j] >= 0) prev[next[j]] = e.pos;
    syms[j] = -1;
    push(prev[e.pos]);
    push(e.pos);
  }
  size_t k = 0;
  for (int i = 0; i >= 0 && i < n; i = next[i]) syms[k++] = syms[i];
  syms.resize(k);
}

void BpeModel::initial_symbols(std::string_view word, std::vector<int32_t>& syms) const {
  if (options_.byte_level) {
    syms.resize(word.size());
    for (size_t i = 0; i < word.size(); ++i) syms[i] = byte_id_[static_cast<unsigned char>(word[i])];
    return;
  }
  syms.clear();
  bool previous_unk = false;
  for (size_t i = 0; i < word.size();) {
    size_t j = i + 1;
    while (j < word.size() && (static_cast<unsigned char>(word[j]) & 0xC0) == 0x80) ++j;
    const std::string_view ch = word.substr(i, j - i);
    i = j;
    if (int32_t id = id_of(ch); id >= 0) {
      syms.push_back(id);
      previous_unk = false;
      continue;
    }
    if (options_.byte_fallback) {
      bool all = true;
      for (char b : ch) all = all && fallback_id_[static_cast<unsigned char>(b)] >= 0;
      if (all) {
        for (char b : ch) syms.push_back(fallback_id_[static_cast<unsigned char>(b)]);
        previous_unk = false;
        continue;
      }
    }
    if (options_.unk < 0)
      throw Error(str("the character ", std::string(ch), " is not in the vocabulary and the tokenizer has no unk_token"),
                  "data.tokenizer", "use the model's own tokenizer.json (its vocabulary covers its training text)");
    if (!(options_.fuse_unk && previous_unk)) syms.push_back(options_.unk);
    previous_unk = true;
  }
}

void BpeModel::encode_word(std::string_view word, std::vector<int32_t>& out) const {
  if (options_.ignore_merges) {
    int32_t id = id_of(word);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  std::vector<int32_t> syms;
  initial_symbols(word, syms);
  if (syms.size() <= 64) {
    merge_short(syms);
    out.insert(out.end(), syms.begin(), syms.end());
    return;
  }
  // A symbol that is part of no merge stays alone whatever surrounds it, and the runs on either
  // side of it merge independently (each in the global rank order): long words, such as a whole
  // Llama 2 text cut only by its newlines' <0x0A>, become many short ones.
  std::vector<int32_t> run;
  auto flush = [&] {
    if (run.size() <= 64) merge_short(run);
    else merge_long(run);
    out.insert(out.end(), run.begin(), run.end());
    run.clear();
  };
  for (int32_t sym : syms) {
    if (sym >= 0 && static_cast<size_t>(sym) < in_merge_.size() && !in_merge_[static_cast<size_t>(sym)]) {
      flush();
      out.push_back(sym);
    } else {
      run.push_back(sym);
    }
  }
  flush();
}

void WordCache::lookup(const BpeModel& bpe, std::string_view word, std::vector<int32_t>& out) {
  // tokenizers caches words below 256 characters too; longer ones are rare and one-off.
  if (word.size() >= 256) {
    bpe.encode_word(word, out);
    return;
  }
  uint64_t h = hash_bytes(word);
  size_t mask = table_.size() - 1;
  for (size_t i = h & mask;; i = (i + 1) & mask) {
    CachedWord& s = table_[i];
    if (s.key_len == 0) break;
    if (s.hash == h && s.key_len == word.size() && std::memcmp(keys_.data() + s.key_off, word.data(), word.size()) == 0) {
      out.insert(out.end(), ids_.begin() + s.ids_off, ids_.begin() + s.ids_off + s.ids_len);
      return;
    }
  }
  scratch_.clear();
  bpe.encode_word(word, scratch_);
  out.insert(out.end(), scratch_.begin(), scratch_.end());
  // Bounded memory: start over rather than evict (a corpus' vocabulary of words refills fast).
  if (keys_.size() > (64u << 20) || ids_.size() > (16u << 20)) {
    table_.assign(1 << 12, CachedWord{});
    used_ = 0;
    keys_.clear();
    ids_.clear();
  }
  if (2 * (used_ + 1) > table_.size()) grow();
  mask = table_.size() - 1;
  size_t i = h & mask;
  while (table_[i].key_len != 0) i = (i + 1) & mask;
  table_[i] = CachedWord{h, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(word.size()),
                   static_cast<uint32_t>(ids_.size()), static_cast<uint32_t>(scratch_.size())};
  keys_.append(word);
  ids_.insert(ids_.end(), scratch_.begin(), scratch_.end());
  ++used_;
}

void WordCache::grow() {
  std::vector<CachedWord> old(table_.size() * 2);
  old.swap(table_);
  size_t mask = table_.size() - 1;
  for (const CachedWord& s : old) {
    if (s.key_len == 0) continue;
    size_t i = s.hash & mask;
    while (table_[i].key_len != 0) i = (i + 1) & mask;
    table_[i] = s;
  }
}

}  // namespace lcx
