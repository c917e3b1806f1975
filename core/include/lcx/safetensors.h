// Safetensors checkpoints: one file, or a folder of shards listed by model.safetensors.index.json.
// Files are memory-mapped and validated before any tensor byte is touched: the header must fit the
// file, every tensor's byte range must match its dtype and shape, lie inside the data section and
// not overlap another, and the ranges must tile the data section exactly (as the reference reader
// demands). Every error names the file and, where there is one, the tensor.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lcx/tensor.h"

namespace lcx::safetensors {

struct TensorInfo {
  std::string name;
  std::string dtype;    // as written in the header: "BF16", "F32", "I64", ...
  Shape shape;
  uint64_t begin = 0;   // byte range inside the data section
  uint64_t end = 0;
};

// A batched load (Checkpoint::load_into). Readers work on chunks of every file at once; for a GPU
// target each chunk goes through a pinned staging buffer to the device as soon as it is read, and is
// converted and checked there, so the disk, the copy and the check overlap.
struct LoadOptions {
  bool check_finite = false;  // refuse a NaN or Inf (after conversion), naming file, tensor, element
  bool progress = false;      // a line with the bytes done, GB/s and the ETA on stderr (rank 0 only)
  int threads = 0;            // readers; 0: from the machine's cores
  uint64_t piece_bytes = 16ull << 20;  // what a reader reads at a time: a multiple of 16
};

// One tensor of a batched load: the checkpoint's tensor `name` into `dst`, which the caller has
// allocated (on the host or a GPU) with that tensor's shape and the dtype wanted.
struct LoadTarget {
  std::string name;
  Tensor dst;
};

struct Header {
  std::vector<TensorInfo> tensors;           // in data order
  std::map<std::string, std::string> metadata;  // "__metadata__"
  uint64_t data_offset = 0;                  // 8 + header length: where the data section starts
};

// Bytes per element of a safetensors dtype name; 0 for a name the format does not define.
size_t dtype_bytes(const std::string& name);

// Parses and validates the header of a safetensors image of `size` bytes (the whole file).
// `file` only names the source in errors. Never reads outside [data, data + size).
Header parse_header(const uint8_t* data, size_t size, const std::string& file);

// One memory-mapped file.
class File {
 public:
  explicit File(const std::string& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  const Header& header() const { return header_; }
  const TensorInfo* find(const std::string& name) const;
  // The tensor's bytes as stored (little-endian, its own dtype).
  const uint8_t* bytes(const TensorInfo& t) const { return base_ + header_.data_offset + t.begin; }

 private:
  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  Header header_;
  std::map<std::string, size_t> index_;
};

// A checkpoint: a .safetensors file, or a folder holding model.safetensors or an index and shards.
class Checkpoint {
 public:
  static Checkpoint open(const std::string& path);

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;  // sorted
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;
  // The file a tensor lives in (for error messages).
  const std::string& file_of(const std::string& name) const;
  // One tensor in `dtype` on `device` (load_into of one target). With check_finite, a NaN or Inf
  // (after conversion) fails naming the file, the tensor and the element.
  Tensor load(const std::string& name, DType dtype, Device device = Device::cpu(),
              bool check_finite = false) const;
  // Fills every target, in parallel, with the values load() gives bit for bit. Every target is
  // checked (name, shape, dtype) before the first byte is read.
  void load_into(const std::vector<LoadTarget>& targets, const LoadOptions& options = {}) const;

 private:
  std::string path_;
  std::vector<std::shared_ptr<File>> files_;
  std::map<std::string, std::pair<size_t, const TensorInfo*>> where_;
};

struct NamedTensor {
  std::string name;
  Tensor value;
};

// Writes one file; each tensor is converted to `dtype` when floating (integer tensors keep theirs).
void write_file(const std::string& path, const std::vector<NamedTensor>& tensors, DType dtype,
                const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

// Writes model.safetensors when the total fits in `max_shard_bytes`, else shards
// model-0000k-of-0000n.safetensors and model.safetensors.index.json, as transformers names them.
// Returns the file names written.
std::vector<std::string> write_checkpoint(const std::string& dir, const std::vector<NamedTensor>& tensors,
                                          DType dtype, uint64_t max_shard_bytes = 5ull << 30);

}  // namespace lcx::safetensors
