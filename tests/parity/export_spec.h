// The models and tokens of the committed lcx exports (fixtures/lcx_export*), shared by the tool
// that writes them and the test that checks they are still what the tool writes.
#pragma once
#include <cstdint>
#include <ostream>
#include <vector>

namespace lcx::parity {

struct ExportVariant {
  const char* folder;  // under tests/parity/fixtures
  const char* spec;    // init_random spec
  const char* table;   // the qwen3 module's TOML table
};

// Three layers, GQA 2, head_dim 32, theta 1e6 as the real models ship; untied in one file, and
// tied in shards of 40 KB (so transformers reads lcx's index and a checkpoint without lm_head).
inline constexpr ExportVariant kExports[] = {
    {"lcx_export",
     R"({"vocab_size":256,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":3,"num_attention_heads":4,)"
     R"("num_key_value_heads":2,"head_dim":32,"tie_word_embeddings":false,"initializer_range":0.1})",
     ""},
    {"lcx_export_tied_sharded",
     R"({"vocab_size":256,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":3,"num_attention_heads":4,)"
     R"("num_key_value_heads":2,"head_dim":32,"tie_word_embeddings":true,"initializer_range":0.1})",
     R"(max_shard_size = "40KB")"},
};
inline void PrintTo(const ExportVariant& v, std::ostream* os) { *os << v.folder; }

inline constexpr uint64_t kExportSeed = 20261129;

inline std::vector<int64_t> export_ids() {
  std::vector<int64_t> ids;
  for (int64_t t = 0; t < 48; ++t) ids.push_back((t * 97 + 13) % 256);
  return ids;
}

inline std::vector<int64_t> export_labels() {
  std::vector<int64_t> l = export_ids();
  l[7] = -100;
  l[30] = -100;
  return l;
}

}  // namespace lcx::parity
