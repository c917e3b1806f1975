// The token cache: a whole tokenized corpus in one memory-mapped file, so a run after the first
// starts at once. Layout (little endian):
//   header (128 bytes): magic "LCXTOK1", version, the key (sha256 hex of tokenizer hash, options
//     and every source file's path, size, mtime, ctime and inode), token and document counts, eos id,
//     flags (whether a mask follows), checksum
//   uint32 tokens[num_tokens]   documents end to end, eos between them
//   (zero padding to 8 bytes)
//   uint64 doc_starts[num_docs] index of each document's first token
//   uint8 mask[num_tokens]      only with the mask flag: 1 where the token trains (is a target)
//   a JSON blob: what was read and skipped, so later runs report the same summary
// A file whose magic, version, key, sizes or checksum do not match is never used: open() says why
// and the caller rebuilds it. Writers write a temporary file and rename it into place.
#pragma once
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

namespace lcx {

// A read-only memory map of a whole file.
class MappedFile {
 public:
  static std::shared_ptr<MappedFile> open(const std::string& path, std::string* why);
  ~MappedFile();
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

struct TokenCacheView {
  std::shared_ptr<MappedFile> file;
  const uint32_t* tokens = nullptr;
  uint64_t num_tokens = 0;
  const uint64_t* doc_starts = nullptr;
  uint64_t num_docs = 0;
  int32_t eos = -1;
  const uint8_t* mask = nullptr;  // num_tokens entries, or null: every token trains
  std::string meta;  // the JSON blob
};

// The cache at `path` if it exists and is intact and its key is `key`; otherwise nullopt-like
// (file == nullptr) with `why` saying what was wrong ("missing", "stale", "truncated", ...).
TokenCacheView open_token_cache(const std::string& path, const std::string& key, std::string* why);

// Streams tokens to `path`.tmp.<host>.<pid> (and, with a mask, the mask to a second temporary
// file beside it), then finish() appends the mask, writes the header and renames it into place.
class TokenCacheWriter {
 public:
  TokenCacheWriter(std::string path, std::string key, int32_t eos, bool with_mask = false);
  ~TokenCacheWriter();
  // One document's tokens (non-empty); eos goes between documents. With a mask, `mask` holds one
  // entry per id and `eos_mask` is the entry of the eos written before this document.
  void add_document(const std::vector<int32_t>& ids, const std::vector<uint8_t>* mask = nullptr, uint8_t eos_mask = 0);
  uint64_t num_tokens() const { return num_tokens_; }
  uint64_t num_docs() const { return doc_starts_.size(); }
  void finish(const std::string& meta);

 private:
  void write(const void* p, size_t n);
  void write_mask(const void* p, size_t n);
  std::string path_, tmp_, mask_tmp_, key_;
  int32_t eos_;
  std::FILE* f_ = nullptr;
  std::FILE* mask_f_ = nullptr;  // null without a mask
  uint64_t num_tokens_ = 0;
  std::vector<uint64_t> doc_starts_;
  bool finished_ = false;
};

// The folder of the token cache `file_name` when data.cache_dir is not set: .lcx-cache in
// `source_folder` where it can be written there or already holds the cache; otherwise, as for a
// read-only mount, the user's cache folder ($XDG_CACHE_HOME/lcx/tokens, or ~/.cache/lcx/tokens),
// saying so once.
std::string default_token_cache_dir(const std::string& source_folder, const std::string& file_name);

// Deletes, saying so, the temporary files in `dir` that writers killed mid-way left behind.
void remove_abandoned_cache_files(const std::string& dir);

// Order-sensitive 64-bit checksum over bytes, memory-bandwidth fast (4 independent lanes).
uint64_t cache_checksum(const uint8_t* p, size_t n);

}  // namespace lcx
