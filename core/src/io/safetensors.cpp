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
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "kernels/convert_check.h"
#include "lcx/pinned.h"
#ifdef LCX_HAVE_CUDA
#include "cuda/check.h"
#include "cuda/stream.h"
#endif

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
  } catch (const json::parse_error& e) {
    fail(file, "", str("the header is not valid JSON (from byte ", e.byte, " of its ", n, "): the file is damaged"),
         "copy the file again from where it came from (a checkpoint's: resume from the one before it)");
  } catch (const json::exception& e) {
    fail(file, "", str("the header is not valid JSON (", e.what(), "): the file is damaged"),
         "copy the file again from where it came from (a checkpoint's: resume from the one before it)");
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

namespace {

// What one target asks for, checked before any byte is read.
struct Job {
  const File* file = nullptr;
  const TensorInfo* info = nullptr;
  Tensor dst;
  size_t esize = 0;        // stored bytes per element
  ops::StoredFloat from{};  // float targets
};

// A piece of one job's stored bytes, [begin, end) within the tensor: the unit a reader reads,
// copies and checks. Pieces are multiples of 16 bytes (whole elements of every dtype) but the last.
struct Piece {
  size_t job;
  uint64_t begin, end;
};

ops::StoredFloat stored_float(const std::string& d) {
  if (d == "F64") return ops::StoredFloat::f64;
  if (d == "F32") return ops::StoredFloat::f32;
  if (d == "F16") return ops::StoredFloat::f16;
  return ops::StoredFloat::bf16;
}

// Refuses a target whose dtypes cannot meet, with the reasons load() always gave.
void check_kinds(const File& f, const std::string& name, const std::string& stored, DType dtype) {
  if (stored == safetensors_name(dtype)) return;
  if (is_floating(dtype)) {
    if (stored.rfind("F8", 0) == 0) fail(f.path(), name, str("cannot convert ", stored, " (fp8 is not supported)"));
    // Integers in a floating-point tensor are a relabelled or foreign file, never weights.
    if (!is_float_name(stored))
      fail(f.path(), name, str("holds ", stored, " but a floating-point tensor (", dtype_name(dtype), ") was asked for"),
           "the file is damaged or not this model's: a weight is stored as F32, F16 or BF16");
  } else if (is_float_name(stored) || stored.rfind("F8", 0) == 0) {
    fail(f.path(), name, str("holds ", stored, " but an integer tensor (", dtype_name(dtype), ") was asked for"));
  }
}

// Integer tensors are few and small (none in a model's weights): converted on the host, one by one.
void load_integer(const Job& j) {
  const std::string& d = j.info->dtype;
  Tensor host = j.dst.device().is_cuda() ? Tensor::empty(j.dst.shape(), j.dst.dtype()) : j.dst;
  const uint8_t* src = j.file->bytes(*j.info);
  const int64_t n = host.numel();
  if (d == safetensors_name(host.dtype())) {
    std::memcpy(host.data(), src, host.nbytes());
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t v = load_int(d, src + static_cast<size_t>(i) * j.esize);
      if (host.dtype() == DType::i32) {
        if (v < INT32_MIN || v > INT32_MAX)
          fail(j.file->path(), j.info->name, str("element ", i, " = ", v, " does not fit int32"));
        host.data_as<int32_t>()[i] = static_cast<int32_t>(v);
      } else {
        host.data_as<int64_t>()[i] = v;
      }
    }
  }
  if (j.dst.device().is_cuda()) {
    Tensor dst = j.dst;
    dst.copy_from(host);
  }
}

// pread until `n` bytes are in, or fail naming the file and tensor.
void read_exact(int fd, void* buf, uint64_t n, uint64_t offset, const Job& j) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0)
      fail(j.file->path(), j.info->name,
           got < 0 ? str("read failed: ", std::strerror(errno)) : std::string("file ended early: changed since it was opened?"),
           "check the disk and the file; a file being written cannot be loaded");
    p += got;
    n -= static_cast<uint64_t>(got);
    offset += static_cast<uint64_t>(got);
  }
}

// The line a load prints as it goes: "loading weights  47% 7.7/16.4 GB, 3.52 GB/s, ETA 2s".
class LoadProgress {
 public:
  LoadProgress(bool show, uint64_t total) : show_(show), tty_(isatty(STDERR_FILENO) != 0), total_(total) {}
  void update(uint64_t done, double elapsed, bool final) {
    if (!show_) return;
    // Nothing to say before the first bytes arrive (no rate, no ETA yet).
    if (!final && (done == 0 || elapsed - last_ < (tty_ ? 0.25 : 5.0))) return;
    last_ = elapsed;
    const double rate = elapsed > 0 ? static_cast<double>(done) / elapsed : 0;
    char line[160];
    if (final)
      std::snprintf(line, sizeof line, "loaded weights: %.1f GB in %.1f s, %.2f GB/s", static_cast<double>(done) / 1e9,
                    elapsed, rate / 1e9);
    else
      std::snprintf(line, sizeof line, "loading weights %3d%% %.1f/%.1f GB, %.2f GB/s, ETA %.0fs",
                    total_ ? static_cast<int>(100 * done / total_) : 100, static_cast<double>(done) / 1e9,
                    static_cast<double>(total_) / 1e9, rate / 1e9,
                    rate > 0 ? static_cast<double>(total_ - done) / rate : 0.0);
    if (tty_)
      std::fprintf(stderr, "\r%s\033[K%s", line, final ? "\n" : "");
    else
      std::fprintf(stderr, "%s\n", line);
    std::fflush(stderr);
  }

 private:
  bool show_, tty_;
  uint64_t total_;
  double last_ = -1e9;
};

// Workers a launcher started, other than rank 0, keep quiet: one progress line per job, as one log.
bool lead_process() {
  const char* rank = std::getenv("LCX_WORKER") ? std::getenv("RANK") : nullptr;
  return !rank || std::string(rank) == "0";
}

}  // namespace

Tensor Checkpoint::load(const std::string& name, DType dtype, Device device, bool check_finite) const {
  Tensor out = Tensor::empty(info(name).shape, dtype, device, MemoryCategory::weights);
  LoadOptions o;
  o.check_finite = check_finite;
  load_into({{name, out}}, o);
  return out;
}

void Checkpoint::load_into(const std::vector<LoadTarget>& targets, const LoadOptions& options) const {
  std::vector<Job> jobs;
  std::vector<size_t> floats;  // indices of the float jobs, the parallel part
  bool cuda = false, convert = false;
  for (const auto& t : targets) {
    const TensorInfo& ti = info(t.name);
    const File& f = *files_[where_.at(t.name).first];
    if (!t.dst.defined()) fail(f.path(), t.name, "has no destination tensor to load into");
    if (t.dst.shape() != ti.shape)
      fail(f.path(), t.name, str("has shape ", shape_str(ti.shape), " but its destination has ", shape_str(t.dst.shape())));
    check_kinds(f, t.name, ti.dtype, t.dst.dtype());
    Job j{&f, &ti, t.dst, dtype_bytes(ti.dtype), {}};
    if (is_floating(t.dst.dtype())) {
      j.from = stored_float(ti.dtype);
      floats.push_back(jobs.size());
      cuda = cuda || t.dst.device().is_cuda();
      convert = convert || ti.dtype != safetensors_name(t.dst.dtype());
    }
    jobs.push_back(std::move(j));
  }
  for (const Job& j : jobs)
    if (!is_floating(j.dst.dtype())) load_integer(j);

  // Pieces in file order, each file front to back, so the readers stream every file.
  std::sort(floats.begin(), floats.end(), [&](size_t a, size_t b) {
    return jobs[a].file != jobs[b].file ? jobs[a].file->path() < jobs[b].file->path()
                                        : jobs[a].info->begin < jobs[b].info->begin;
  });
  const uint64_t piece_bytes = options.piece_bytes;
  if (piece_bytes == 0 || piece_bytes % 16 != 0)
    throw Error(str("safetensors load: piece_bytes = ", piece_bytes, " is not a positive multiple of 16"), {},
                "leave LoadOptions::piece_bytes at its default");
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (size_t k : floats) {
    const uint64_t bytes = jobs[k].info->end - jobs[k].info->begin;
    for (uint64_t b = 0; b < bytes; b += piece_bytes) pieces.push_back({k, b, std::min(bytes, b + piece_bytes)});
    total += bytes;
  }
  if (pieces.empty()) return;

  // Read with pread rather than through the mapping: no page faults, and the kernel copies
  // straight into the staging (or destination) memory.
  struct Fds : std::map<const File*, int> {
    ~Fds() {
      for (auto& [f, fd] : *this) ::close(fd);
    }
  } fds;
  for (size_t k : floats) {
    const File* f = jobs[k].file;
    if (fds.count(f)) continue;
    const int fd = ::open(f->path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(f->path(), "", str("cannot open: ", std::strerror(errno)));
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    fds[f] = fd;
  }

  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = static_cast<int>(std::min<size_t>(pieces.size(), options.threads > 0 ? options.threads : std::min(hw, 16)));
  // Per job, the first element found not finite; INT64_MAX while none (the GPU's counters: below).
  std::vector<std::atomic<int64_t>> first_bad(jobs.size());
  for (auto& b : first_bad) b = INT64_MAX;
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> done{0};
  int finished = 0;  // readers done, under finish_mu
  std::mutex finish_mu;
  std::condition_variable finish_cv;
  std::atomic<bool> stop{false};
  std::mutex error_mu;
  std::exception_ptr error;
  auto record_error = [&] {
    std::lock_guard lock(error_mu);
    if (!error) error = std::current_exception();
    stop = true;
  };
  auto note_bad = [&](const Piece& p, int64_t bad) {
    if (bad < 0) return;
    const int64_t at = static_cast<int64_t>(p.begin / jobs[p.job].esize) + bad;
    for (int64_t cur = first_bad[p.job]; at < cur && !first_bad[p.job].compare_exchange_weak(cur, at);) {
    }
  };
  auto piece_ptr = [&](const Piece& p) {  // where a piece's converted elements go
    const Job& j = jobs[p.job];
    return static_cast<char*>(j.dst.data()) + p.begin / j.esize * dtype_size(j.dst.dtype());
  };

  auto host_reader = [&] {
    std::vector<uint8_t> buf;
    for (size_t i; !stop && (i = next++) < pieces.size();) {
      const Piece& p = pieces[i];
      const Job& j = jobs[p.job];
      const uint64_t n = p.end - p.begin;
      const bool same = j.info->dtype == safetensors_name(j.dst.dtype());
      void* dst = piece_ptr(p);
      if (!same) buf.resize(n);
      read_exact(fds.at(j.file), same ? dst : buf.data(), n, j.file->header().data_offset + j.info->begin + p.begin, j);
      note_bad(p, ops::cpu::convert_check(same ? dst : buf.data(), j.from, dst, j.dst.dtype(),
                                          static_cast<int64_t>(n / j.esize), options.check_finite));
      done += n;
    }
  };

#ifdef LCX_HAVE_CUDA
  // On a GPU each reader owns a stream, two pinned buffers and (when a dtype changes) two device
  // buffers: while one piece is copied and converted, the next is read.
  Tensor gpu_bad;
  int device_index = 0;
  if (cuda) {
    for (size_t k : floats)
      if (jobs[k].dst.device().is_cuda()) device_index = jobs[k].dst.device().index;
    gpu_bad = Tensor::empty({static_cast<int64_t>(jobs.size())}, DType::i64, Device::cuda(device_index));
    LCX_CUDA_CHECK(cudaMemset(gpu_bad.data(), 0xff, gpu_bad.nbytes()));
    // The readers' streams do not wait for the legacy stream: whatever last used these
    // destinations is finished first.
    LCX_CUDA_CHECK(cudaDeviceSynchronize());
  }
  auto gpu_reader = [&] {
    LCX_CUDA_CHECK(cudaSetDevice(device_index));
    cudaStream_t stream = nullptr;
    cudaEvent_t free_again[2] = {nullptr, nullptr};
    LCX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    struct Cleanup {
      cudaStream_t& s;
      cudaEvent_t* e;
      ~Cleanup() {
        if (s) cudaStreamDestroy(s);
        for (int k = 0; k < 2; ++k)
          if (e[k]) cudaEventDestroy(e[k]);
      }
    } cleanup{stream, free_again};
    for (auto& e : free_again) LCX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    PinnedBuffer staging[2] = {pinned_alloc(piece_bytes, MemoryCategory::weights),
                               pinned_alloc(piece_bytes, MemoryCategory::weights)};
    Tensor scratch[2];
    if (convert)
      for (auto& s : scratch)
        s = Tensor::empty({static_cast<int64_t>(piece_bytes / 4)}, DType::f32, Device::cuda(device_index));
    // Declared after the buffers, so even a failing reader drains its copies before they go.
    struct Drain {
      cudaStream_t s;
      ~Drain() { cudaStreamSynchronize(s); }
    } drain{stream};
    lcx::cuda::StreamGuard on(stream);
    unsigned k = 0;
    for (size_t i; !stop && (i = next++) < pieces.size(); ++k) {
      const Piece& p = pieces[i];
      const Job& j = jobs[p.job];
      const uint64_t n = p.end - p.begin;
      const int slot = static_cast<int>(k % 2);
      LCX_CUDA_CHECK(cudaEventSynchronize(free_again[slot]));
      void* host = staging[slot].data();
      read_exact(fds.at(j.file), host, n, j.file->header().data_offset + j.info->begin + p.begin, j);
      void* dst = piece_ptr(p);
      const int64_t count = static_cast<int64_t>(n / j.esize);
      if (!j.dst.device().is_cuda()) {  // a host target in a mixed batch
        note_bad(p, ops::cpu::convert_check(host, j.from, dst, j.dst.dtype(), count, options.check_finite));
      } else {
        const bool same = j.info->dtype == safetensors_name(j.dst.dtype());
        void* src = same ? dst : scratch[slot].data();
        LCX_CUDA_CHECK(cudaMemcpyAsync(src, host, n, cudaMemcpyHostToDevice, stream));
        auto* bad = options.check_finite ? gpu_bad.data_as<unsigned long long>() + p.job : nullptr;
        if (!same || bad) ops::cuda::convert_check(src, j.from, dst, j.dst.dtype(), count, p.begin / j.esize, bad);
      }
      LCX_CUDA_CHECK(cudaEventRecord(free_again[slot], stream));
      done += n;
    }
    LCX_CUDA_CHECK(cudaStreamSynchronize(stream));
  };
#endif

  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&start] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  LoadProgress progress(options.progress && lead_process(), total);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t)
    pool.emplace_back([&] {
      try {
#ifdef LCX_HAVE_CUDA
        if (cuda)
          gpu_reader();
        else
#endif
          host_reader();
      } catch (...) {
        record_error();
      }
      {
        std::lock_guard lock(finish_mu);
        ++finished;
      }
      finish_cv.notify_one();
    });
  {
    std::unique_lock lock(finish_mu);
    while (!finish_cv.wait_for(lock, std::chrono::milliseconds(50), [&] { return finished == threads; }))
      progress.update(done, elapsed(), false);
  }
  for (auto& t : pool) t.join();
#ifdef LCX_HAVE_CUDA
  // The staging buffers go back to the host: the plan counts pinned memory for other uses.
  if (cuda) release_cached_pinned();
#endif
  if (error) std::rethrow_exception(error);

  if (options.check_finite) {
#ifdef LCX_HAVE_CUDA
    if (cuda) {
      std::vector<int64_t> dev(jobs.size());
      LCX_CUDA_CHECK(cudaMemcpy(dev.data(), gpu_bad.data(), gpu_bad.nbytes(), cudaMemcpyDeviceToHost));
      for (size_t k = 0; k < jobs.size(); ++k)
        if (dev[k] >= 0 && dev[k] < first_bad[k]) first_bad[k] = dev[k];  // all ones, read signed: -1
    }
#endif
    for (size_t k = 0; k < jobs.size(); ++k) {
      const int64_t at = first_bad[k];
      if (at == INT64_MAX) continue;
      const Job& j = jobs[k];
      // The element as converted, for the message: re-read from the mapping.
      float wide = 0;
      uint32_t as_dst = 0;
      ops::cpu::convert_check(j.file->bytes(*j.info) + static_cast<size_t>(at) * j.esize, j.from, &as_dst, j.dst.dtype(), 1,
                              false);
      ops::cpu::convert_check(&as_dst, j.dst.dtype() == DType::f32   ? ops::StoredFloat::f32
                                       : j.dst.dtype() == DType::bf16 ? ops::StoredFloat::bf16
                                                                      : ops::StoredFloat::f16,
                              &wide, DType::f32, 1, false);
      fail(j.file->path(), j.info->name, str("element ", at, " is ", wide), "the checkpoint is corrupt or diverged; use another");
    }
  }
  progress.update(total, elapsed(), true);
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
