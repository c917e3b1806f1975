// Safetensors reader and writer. The header is untrusted input: every length and offset is checked
// against the file's size with overflow-safe arithmetic before anything is dereferenced, and the
// parser is fuzzed (tests/io/test_safetensors_fuzz.cpp). Files are mapped read-only, so opening a
// 16 GB checkpoint costs nothing until a tensor is converted.
#include "lcx/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

namespace lcx::safetensors {
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// Headers above this are refused, as the reference implementation does: no real checkpoint comes
// close, and it bounds what a hostile length can make us allocate.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

[[noreturn]] void fail(const std::string& file, const std::string& tensor, const std::string& what,
                       const std::string& fix = {}) {
  throw Error(tensor.empty() ? str(file, ": ", what) : str(file, ": tensor '", tensor, "': ", what), {}, fix);
}

bool is_float_name(const std::string& d) { return d == "F64" || d == "F32" || d == "F16" || d == "BF16"; }

const char* safetensors_name(DType t) {
  switch (t) {
    case DType::bf16: return "BF16";
    case DType::f16: return "F16";
    case DType::f32: return "F32";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
  }
  return "?";
}

double load_float(const std::string& d, const uint8_t* p) {
  if (d == "F32") {
    float v;
    std::memcpy(&v, p, 4);
    return v;
  }
  if (d == "BF16") {
    bf16 v;
    std::memcpy(&v, p, 2);
    return bf16_to_float(v);
  }
  if (d == "F16") {
    f16 v;
    std::memcpy(&v, p, 2);
    return f16_to_float(v);
  }
  double v;
  std::memcpy(&v, p, 8);
  return v;
}

int64_t load_int(const std::string& d, const uint8_t* p) {
  auto get = [p]<typename T>(T) {
    T v;
    std::memcpy(&v, p, sizeof(T));
    return static_cast<int64_t>(v);
  };
  if (d == "I64") return get(int64_t{});
  if (d == "I32") return get(int32_t{});
  if (d == "I16") return get(int16_t{});
  if (d == "I8") return get(int8_t{});
  if (d == "U32") return get(uint32_t{});
  if (d == "U16") return get(uint16_t{});
  if (d == "U8" || d == "BOOL") return get(uint8_t{});
  uint64_t v;  // U64
  std::memcpy(&v, p, 8);
  return static_cast<int64_t>(v);
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace

size_t dtype_bytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL" || d == "F8_E4M3" || d == "F8_E5M2") return 1;
  return 0;
}

Header parse_header(const uint8_t* data, size_t size, const std::string& file) {
  if (size < 8) fail(file, "", str("truncated: ", size, " bytes cannot hold the 8-byte header length"));
  const uint64_t n = read_u64_le(data);
  if (n > size - 8)
    fail(file, "", str("header length ", n, " is larger than the file (", size, " bytes): truncated or not safetensors"));
  if (n > kMaxHeaderBytes) fail(file, "", str("header length ", n, " exceeds the 100 MiB limit"));
  if (n < 2) fail(file, "", str("header length ", n, " is too short for a JSON object"));

  // Duplicate top-level keys would silently shadow a tensor; the callback sees every key.
  std::set<std::string> keys;
  std::string duplicate;
  auto callback = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::key && depth == 1 && !keys.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  const char* text = reinterpret_cast<const char*>(data + 8);
  json j;
  try {
    j = json::parse(text, text + n, callback);
  } catch (const json::exception& e) {
    fail(file, "", str("header is not valid JSON: ", e.what()));
  }
  if (!duplicate.empty()) fail(file, duplicate, "listed twice in the header");
  if (!j.is_object()) fail(file, "", "header is not a JSON object");

  Header h;
  h.data_offset = 8 + n;
  const uint64_t data_size = size - 8 - n;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(file, "", "__metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) fail(file, "", str("__metadata__ value of '", m.key(), "' is not a string"));
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (name.empty()) fail(file, "", "a tensor has an empty name");
    if (!v.is_object()) fail(file, name, "entry is not an object");
    for (auto k = v.begin(); k != v.end(); ++k)
      if (k.key() != "dtype" && k.key() != "shape" && k.key() != "data_offsets")
        fail(file, name, str("unexpected key '", k.key(), "' (only dtype, shape, data_offsets)"));
    if (!v.contains("dtype") || !v["dtype"].is_string()) fail(file, name, "dtype missing or not a string");
    if (!v.contains("shape") || !v["shape"].is_array()) fail(file, name, "shape missing or not an array");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() || v["data_offsets"].size() != 2)
      fail(file, name, "data_offsets missing or not a pair");
    TensorInfo t;
    t.name = name;
    t.dtype = v["dtype"].get<std::string>();
    const size_t esize = dtype_bytes(t.dtype);
    if (esize == 0) fail(file, name, str("unknown dtype '", t.dtype, "'"));
    uint64_t numel = 1;
    for (const json& d : v["shape"]) {
      if (!d.is_number_unsigned()) fail(file, name, str("shape entry ", d.dump(), " is not a non-negative integer"));
      const uint64_t dim = d.get<uint64_t>();
      if (dim > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(numel, dim, &numel))
        fail(file, name, str("shape ", v["shape"].dump(), " overflows"));
      t.shape.push_back(static_cast<int64_t>(dim));
    }
    for (const json& o : v["data_offsets"])
      if (!o.is_number_unsigned()) fail(file, name, str("data offset ", o.dump(), " is not a non-negative integer"));
    t.begin = v["data_offsets"][0].get<uint64_t>();
    t.end = v["data_offsets"][1].get<uint64_t>();
    if (t.end < t.begin) fail(file, name, str("data_offsets [", t.begin, ", ", t.end, "] end before they begin"));
    if (t.end > data_size)
      fail(file, name, str("data_offsets [", t.begin, ", ", t.end, "] run past the data section (", data_size,
                           " bytes): truncated file or bad offsets"));
    uint64_t bytes = 0;
    if (__builtin_mul_overflow(numel, esize, &bytes) || bytes != t.end - t.begin)
      fail(file, name, str(t.dtype, " ", shape_str(t.shape), " needs ", numel, " x ", esize, " bytes but data_offsets [",
                           t.begin, ", ", t.end, "] hold ", t.end - t.begin));
    h.tensors.push_back(std::move(t));
  }
  // The ranges must tile the data section: no overlap (two tensors sharing bytes) and no holes.
  std::sort(h.tensors.begin(), h.tensors.end(),
            [](const TensorInfo& a, const TensorInfo& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  uint64_t at = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& t : h.tensors) {
    if (t.begin < at)
      fail(file, t.name, str("bytes [", t.begin, ", ", t.end, ") overlap tensor '", prev->name, "' [", prev->begin, ", ",
                             prev->end, ")"));
    if (t.begin > at) fail(file, t.name, str("a gap of ", t.begin - at, " bytes precedes it in the data section"));
    at = t.end;
    prev = &t;
  }
  if (at != data_size) fail(file, "", str("data section has ", data_size, " bytes but the tensors cover ", at));
  return h;
}

File::File(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, "", str("cannot open: ", std::strerror(errno)));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, "", "not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail(path, "", str("mmap failed: ", std::strerror(e)));
    }
    base_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  try {
    header_ = parse_header(base_, size_, path);
  } catch (...) {
    if (base_) ::munmap(const_cast<uint8_t*>(base_), size_);
    throw;
  }
  for (size_t i = 0; i < header_.tensors.size(); ++i) index_[header_.tensors[i].name] = i;
}

File::~File() {
  if (base_) ::munmap(const_cast<uint8_t*>(base_), size_);
}

const TensorInfo* File::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &header_.tensors[it->second];
}

Checkpoint Checkpoint::open(const std::string& path) {
  Checkpoint c;
  c.path_ = path;
  std::error_code ec;
  if (!fs::exists(path, ec)) fail(path, "", "does not exist", "give an HF model folder or a .safetensors file");
  auto add_file = [&c](const std::string& p) {
    c.files_.push_back(std::make_shared<File>(p));
    return c.files_.size() - 1;
  };
  if (!fs::is_directory(path)) {
    size_t k = add_file(path);
    for (const auto& t : c.files_[k]->header().tensors) c.where_[t.name] = {k, &t};
    return c;
  }
  // transformers looks for the single file first, then the index; so do we.
  const fs::path single = fs::path(path) / "model.safetensors";
  const fs::path index = fs::path(path) / "model.safetensors.index.json";
  if (fs::exists(single)) {
    size_t k = add_file(single.string());
    for (const auto& t : c.files_[k]->header().tensors) c.where_[t.name] = {k, &t};
    return c;
  }
  if (!fs::exists(index))
    fail(path, "", "holds neither model.safetensors nor model.safetensors.index.json",
         "point at a folder written by save_pretrained (or by lcx)");
  json j;
  try {
    std::ifstream in(index);
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail(index.string(), "", str("not valid JSON: ", e.what()));
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    fail(index.string(), "", "has no weight_map object");
  std::map<std::string, size_t> by_file;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string()) fail(index.string(), it.key(), "weight_map value is not a file name");
    const std::string shard = it.value().get<std::string>();
    // Shards must sit in the folder itself; a path in the index must not reach elsewhere.
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
      fail(index.string(), it.key(), str("shard name '", shard, "' is not a plain file name"));
    auto f = by_file.find(shard);
    size_t k = f != by_file.end() ? f->second : (by_file[shard] = add_file((fs::path(path) / shard).string()));
    const TensorInfo* t = c.files_[k]->find(it.key());
    if (!t) fail(c.files_[k]->path(), it.key(), "listed in model.safetensors.index.json but missing from this shard");
    c.where_[it.key()] = {k, t};
  }
  for (const auto& f : c.files_)
    for (const auto& t : f->header().tensors) {
      auto w = c.where_.find(t.name);
      if (w == c.where_.end() || c.files_[w->second.first].get() != f.get())
        fail(f->path(), t.name, "present in this shard but model.safetensors.index.json does not map it here");
    }
  return c;
}

std::vector<std::string> Checkpoint::names() const {
  std::vector<std::string> out;
  for (const auto& [n, w] : where_) out.push_back(n);
  return out;
}

const TensorInfo& Checkpoint::info(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) fail(path_, name, "missing from the checkpoint");
  return *it->second.second;
}

const std::string& Checkpoint::file_of(const std::string& name) const {
  auto it = where_.find(name);
  if (it == where_.end()) fail(path_, name, "missing from the checkpoint");
  return files_[it->second.first]->path();
}

Tensor Checkpoint::load(const std::string& name, DType dtype, Device device, bool check_finite) const {
  const TensorInfo& t = info(name);
  const File& f = *files_[where_.at(name).first];
  const uint8_t* src = f.bytes(t);
  const size_t esize = dtype_bytes(t.dtype);
  Tensor out = Tensor::empty(t.shape, dtype, Device::cpu(), MemoryCategory::weights);
  const int64_t n = out.numel();
  if (t.dtype == safetensors_name(dtype)) {
    std::memcpy(out.data(), src, out.nbytes());
  } else if (is_floating(dtype)) {
    if (t.dtype.rfind("F8", 0) == 0)
      fail(f.path(), name, str("cannot convert ", t.dtype, " (fp8 is not supported)"));
    // Integers in a floating-point tensor are a relabelled or foreign file, never weights.
    if (!is_float_name(t.dtype))
      fail(f.path(), name, str("holds ", t.dtype, " but a floating-point tensor (", dtype_name(dtype), ") was asked for"),
           "the file is damaged or not this model's: a weight is stored as F32, F16 or BF16");
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t* p = src + static_cast<size_t>(i) * esize;
      const float v = static_cast<float>(load_float(t.dtype, p));
      switch (dtype) {
        case DType::f32: out.data_as<float>()[i] = v; break;
        case DType::bf16: out.data_as<bf16>()[i] = float_to_bf16(v); break;
        default: out.data_as<f16>()[i] = float_to_f16(v); break;
      }
    }
  } else {
    if (is_float_name(t.dtype) || t.dtype.rfind("F8", 0) == 0)
      fail(f.path(), name, str("holds ", t.dtype, " but an integer tensor (", dtype_name(dtype), ") was asked for"));
    for (int64_t i = 0; i < n; ++i) {
      int64_t v = load_int(t.dtype, src + static_cast<size_t>(i) * esize);
      if (dtype == DType::i32) {
        if (v < INT32_MIN || v > INT32_MAX) fail(f.path(), name, str("element ", i, " = ", v, " does not fit int32"));
        out.data_as<int32_t>()[i] = static_cast<int32_t>(v);
      } else {
        out.data_as<int64_t>()[i] = v;
      }
    }
  }
  if (check_finite && is_floating(dtype)) {
    std::vector<float> v = dtype == DType::f32 ? std::vector<float>() : out.to_floats();
    const float* p = dtype == DType::f32 ? out.data_as<float>() : v.data();
    for (int64_t i = 0; i < n; ++i)
      if (!std::isfinite(p[i]))
        fail(f.path(), name, str("element ", i, " is ", p[i]), "the checkpoint is corrupt or diverged; use another");
  }
  return device.is_cuda() ? out.to(device) : out;
}

void write_file(const std::string& path, const std::vector<NamedTensor>& tensors, DType dtype,
                const std::map<std::string, std::string>& metadata) {
  std::vector<Tensor> host;
  nlohmann::ordered_json h;
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t at = 0;
  for (const auto& nt : tensors) {
    Tensor t = nt.value.device().is_cuda() ? nt.value.to(Device::cpu()) : nt.value;
    if (is_floating(t.dtype()) && t.dtype() != dtype) t = t.to(dtype);
    const uint64_t bytes = t.nbytes();
    h[nt.name] = {{"dtype", safetensors_name(t.dtype())}, {"shape", t.shape()}, {"data_offsets", {at, at + bytes}}};
    at += bytes;
    host.push_back(std::move(t));
  }
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keeps the data section 8-byte aligned
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail(path, "", str("cannot open for writing: ", std::strerror(errno)));
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const auto& t : host) out.write(static_cast<const char*>(t.data()), static_cast<std::streamsize>(t.nbytes()));
  out.close();
  if (!out) fail(path, "", "write failed (disk full?)");
}

std::vector<std::string> write_checkpoint(const std::string& dir, const std::vector<NamedTensor>& tensors,
                                          DType dtype, uint64_t max_shard_bytes) {
  fs::create_directories(dir);
  // Stale files of an earlier save would shadow or contradict this one.
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n == "model.safetensors" || n == "model.safetensors.index.json" ||
        (n.rfind("model-", 0) == 0 && n.size() > 12 && n.substr(n.size() - 12) == ".safetensors"))
      fs::remove(e.path());
  }
  auto stored_bytes = [dtype](const Tensor& t) {
    return static_cast<uint64_t>(t.numel()) * dtype_size(is_floating(t.dtype()) ? dtype : t.dtype());
  };
  std::vector<std::vector<NamedTensor>> shards(1);
  uint64_t total = 0, in_shard = 0;
  for (const auto& nt : tensors) {
    const uint64_t b = stored_bytes(nt.value);
    if (in_shard > 0 && in_shard + b > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(nt);
    in_shard += b;
    total += b;
  }
  if (shards.size() == 1) {
    write_file((fs::path(dir) / "model.safetensors").string(), tensors, dtype);
    return {"model.safetensors"};
  }
  std::vector<std::string> names;
  nlohmann::ordered_json index;
  index["metadata"] = {{"total_size", total}};
  index["weight_map"] = nlohmann::ordered_json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    write_file((fs::path(dir) / name).string(), shards[s], dtype);
    for (const auto& nt : shards[s]) index["weight_map"][nt.name] = name;
    names.push_back(name);
  }
  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  std::ofstream out(index_path);
  out << index.dump(2) << "\n";
  if (!out) fail(index_path, "", "write failed");
  names.push_back("model.safetensors.index.json");
  return names;
}

}  // namespace lcx::safetensors
