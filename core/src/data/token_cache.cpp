#include "data/token_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <signal.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "lcx/error.h"
#include "lcx/log.h"

namespace lcx {
namespace {

constexpr char kMagic[8] = {'L', 'C', 'X', 'T', 'O', 'K', '1', '\0'};
// 2: the optional mask after the document starts.
constexpr uint32_t kVersion = 2;
constexpr uint32_t kHasMask = 1;

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  char key[64];
  uint64_t num_tokens;
  uint64_t num_docs;
  uint64_t meta_bytes;
  uint64_t checksum;  // over everything after the header
  int32_t eos;
  uint32_t flags;
  uint32_t reserved[2];
};
static_assert(sizeof(Header) == 128);

uint64_t offsets_at(uint64_t num_tokens) { return (sizeof(Header) + 4 * num_tokens + 7) / 8 * 8; }

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "localhost";
  return host;
}

// A writer's file (<cache>.tmp.<host>.<pid>) is abandoned when its process is gone: on this host
// that is known; for another host's (a shared folder) an hour without a write is taken as gone.
bool abandoned(const std::filesystem::path& p, const std::string& host, const std::string& pid_text) {
  if (host == host_name()) {
    char* end = nullptr;
    const long pid = std::strtol(pid_text.c_str(), &end, 10);
    return pid <= 0 || *end != '\0' || (::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH);
  }
  std::error_code ec;
  const auto age = std::filesystem::file_time_type::clock::now() - std::filesystem::last_write_time(p, ec);
  return !ec && age > std::chrono::hours(1);
}

}  // namespace

uint64_t cache_checksum(const uint8_t* p, size_t n) {
  uint64_t h[4] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull, 0x27D4EB2F165667C5ull};
  constexpr uint64_t kMul = 0x9FB21C651E98DF25ull;
  size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      h[k] = (h[k] ^ w) * kMul;
      h[k] ^= h[k] >> 31;
    }
  uint64_t r = n;
  for (; i < n; ++i) r = (r ^ p[i]) * kMul;
  for (int k = 0; k < 4; ++k) r = (r ^ h[k]) * kMul, r ^= r >> 29;
  return r;
}

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path, std::string* why) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (why) *why = std::strerror(errno);
    return nullptr;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    if (why) *why = std::strerror(errno);
    ::close(fd);
    return nullptr;
  }
  auto m = std::shared_ptr<MappedFile>(new MappedFile());
  m->size_ = static_cast<size_t>(st.st_size);
  if (m->size_ > 0) {
    void* p = mmap(nullptr, m->size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      if (why) *why = std::strerror(errno);
      ::close(fd);
      return nullptr;
    }
    m->data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return m;
}

MappedFile::~MappedFile() {
  if (data_) munmap(const_cast<uint8_t*>(data_), size_);
}

TokenCacheView open_token_cache(const std::string& path, const std::string& key, std::string* why) {
  TokenCacheView v;
  if (!std::filesystem::exists(path)) {
    *why = "missing";
    return v;
  }
  std::string err;
  auto f = MappedFile::open(path, &err);
  if (!f) {
    *why = "unreadable: " + err;
    return v;
  }
  Header h;
  if (f->size() < sizeof(Header)) {
    *why = "truncated (no header)";
    return v;
  }
  std::memcpy(&h, f->data(), sizeof h);
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) {
    *why = "not a token cache (bad magic)";
    return v;
  }
  if (h.version != kVersion || h.header_bytes != sizeof(Header)) {
    *why = "written by another version of lcx";
    return v;
  }
  if (std::string(h.key, 64) != key) {
    *why = "stale (tokenizer, options or source files changed)";
    return v;
  }
  uint64_t off = offsets_at(h.num_tokens);
  const bool has_mask = (h.flags & kHasMask) != 0;
  uint64_t want = off + 8 * h.num_docs + (has_mask ? h.num_tokens : 0) + h.meta_bytes;
  if (h.num_tokens > (f->size() / 4) || h.num_docs > f->size() / 8 || f->size() != want) {
    *why = "truncated or padded (size does not match its header)";
    return v;
  }
  if (cache_checksum(f->data() + sizeof(Header), f->size() - sizeof(Header)) != h.checksum) {
    *why = "corrupt (checksum mismatch)";
    return v;
  }
  v.tokens = reinterpret_cast<const uint32_t*>(f->data() + sizeof(Header));
  v.num_tokens = h.num_tokens;
  v.doc_starts = reinterpret_cast<const uint64_t*>(f->data() + off);
  v.num_docs = h.num_docs;
  v.eos = h.eos;
  uint64_t at = off + 8 * h.num_docs;
  if (has_mask) {
    v.mask = f->data() + at;
    at += h.num_tokens;
  }
  v.meta.assign(reinterpret_cast<const char*>(f->data() + at), h.meta_bytes);
  v.file = std::move(f);
  return v;
}

TokenCacheWriter::TokenCacheWriter(std::string path, std::string key, int32_t eos, bool with_mask)
    : path_(std::move(path)), key_(std::move(key)), eos_(eos) {
  LCX_CHECK(key_.size() == 64);
  tmp_ = str(path_, ".tmp.", host_name(), ".", getpid());
  f_ = std::fopen(tmp_.c_str(), "wb");
  if (!f_)
    throw Error(str("cannot write the token cache ", tmp_, ": ", std::strerror(errno)), "data.cache_dir",
                "point data.cache_dir at a writable folder");
  if (with_mask) {
    // Named as the writer's own file plus a suffix, so remove_abandoned_cache_files finds it too.
    mask_tmp_ = tmp_ + ".mask";
    mask_f_ = std::fopen(mask_tmp_.c_str(), "w+b");
    if (!mask_f_)
      throw Error(str("cannot write the token cache ", mask_tmp_, ": ", std::strerror(errno)), "data.cache_dir",
                  "point data.cache_dir at a writable folder");
  }
  Header h{};
  write(&h, sizeof h);  // the real header comes last, once the checksum is known
}

TokenCacheWriter::~TokenCacheWriter() {
  if (f_) std::fclose(f_);
  if (mask_f_) std::fclose(mask_f_);
  if (!mask_tmp_.empty()) std::remove(mask_tmp_.c_str());
  if (!finished_) std::remove(tmp_.c_str());
}

void TokenCacheWriter::write(const void* p, size_t n) {
  if (n && std::fwrite(p, 1, n, f_) != n)
    throw Error(str("writing the token cache ", tmp_, " failed: ", std::strerror(errno)), "data.cache_dir",
                "free disk space or point data.cache_dir elsewhere");
}

void TokenCacheWriter::write_mask(const void* p, size_t n) {
  if (n && std::fwrite(p, 1, n, mask_f_) != n)
    throw Error(str("writing the token cache ", mask_tmp_, " failed: ", std::strerror(errno)), "data.cache_dir",
                "free disk space or point data.cache_dir elsewhere");
}

void TokenCacheWriter::add_document(const std::vector<int32_t>& ids, const std::vector<uint8_t>* mask, uint8_t eos_mask) {
  if (ids.empty()) return;
  LCX_CHECK((mask_f_ != nullptr) == (mask != nullptr));
  if (mask) LCX_CHECK(mask->size() == ids.size());
  if (!doc_starts_.empty()) {
    uint32_t e = static_cast<uint32_t>(eos_);
    write(&e, 4);
    if (mask) write_mask(&eos_mask, 1);
    ++num_tokens_;
  }
  doc_starts_.push_back(num_tokens_);
  static_assert(sizeof(int32_t) == sizeof(uint32_t));
  write(ids.data(), ids.size() * 4);
  if (mask) write_mask(mask->data(), mask->size());
  num_tokens_ += ids.size();
}

void TokenCacheWriter::finish(const std::string& meta) {
  uint64_t pad = offsets_at(num_tokens_) - (sizeof(Header) + 4 * num_tokens_);
  const uint64_t zero = 0;
  write(&zero, pad);
  write(doc_starts_.data(), doc_starts_.size() * 8);
  if (mask_f_) {
    if (std::fflush(mask_f_) != 0 || std::fseek(mask_f_, 0, SEEK_SET) != 0)
      throw Error(str("writing ", mask_tmp_, " failed"), "data.cache_dir");
    std::vector<char> buf(1 << 20);
    for (size_t n; (n = std::fread(buf.data(), 1, buf.size(), mask_f_)) > 0;) write(buf.data(), n);
    if (std::ferror(mask_f_)) throw Error(str("reading back ", mask_tmp_, " failed"), "data.cache_dir");
  }
  write(meta.data(), meta.size());
  if (std::fflush(f_) != 0) throw Error(str("writing ", tmp_, " failed"), "data.cache_dir");
  std::fclose(f_);
  f_ = nullptr;
  {
    std::string err;
    auto m = MappedFile::open(tmp_, &err);
    if (!m) throw Error(str("cannot read back ", tmp_, ": ", err), "data.cache_dir");
    Header h{};
    std::memcpy(h.magic, kMagic, sizeof kMagic);
    h.version = kVersion;
    h.header_bytes = sizeof(Header);
    std::memcpy(h.key, key_.data(), 64);
    h.num_tokens = num_tokens_;
    h.num_docs = doc_starts_.size();
    h.meta_bytes = meta.size();
    h.checksum = cache_checksum(m->data() + sizeof(Header), m->size() - sizeof(Header));
    h.eos = eos_;
    h.flags = mask_f_ ? kHasMask : 0;
    std::FILE* f = std::fopen(tmp_.c_str(), "r+b");
    if (!f || std::fwrite(&h, sizeof h, 1, f) != 1 || std::fclose(f) != 0)
      throw Error(str("cannot write the header of ", tmp_), "data.cache_dir");
  }
  std::error_code ec;
  std::filesystem::rename(tmp_, path_, ec);
  if (ec) throw Error(str("cannot move ", tmp_, " to ", path_, ": ", ec.message()), "data.cache_dir");
  finished_ = true;
}

std::string default_token_cache_dir(const std::string& source, const std::string& file_name) {
  namespace fs = std::filesystem;
  const std::string source_folder = source.empty() ? std::string(".") : source;
  const fs::path beside = fs::path(source_folder) / ".lcx-cache";
  std::error_code ec;
  const bool exists = fs::is_directory(beside, ec);
  if ((exists && ::access(beside.c_str(), W_OK) == 0) || (!exists && ::access(source_folder.c_str(), W_OK) == 0) ||
      fs::is_regular_file(beside / file_name, ec))
    return beside.string();
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  fs::path user;
  if (xdg && *xdg) user = fs::path(xdg) / "lcx" / "tokens";
  else if (home && *home) user = fs::path(home) / ".cache" / "lcx" / "tokens";
  else return beside.string();  // nowhere else to go: the write names data.cache_dir as the fix
  log::info(str("data: ", source_folder, " cannot be written (a read-only mount?): the token cache goes to ", user.string(),
                " (data.cache_dir sets another folder)"));
  return user.string();
}

void remove_abandoned_cache_files(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const size_t at = name.find(".lcxtok.tmp.");
    if (!name.starts_with("tokens-") || at == std::string::npos) continue;
    std::string owner = name.substr(at + std::string(".lcxtok.tmp.").size());  // host.pid, or host.pid.mask
    if (owner.ends_with(".mask")) owner.resize(owner.size() - 5);
    const size_t dot = owner.rfind('.');
    if (dot == std::string::npos || !abandoned(e.path(), owner.substr(0, dot), owner.substr(dot + 1))) continue;
    std::error_code rm;
    const uintmax_t bytes = e.file_size(rm);
    if (std::filesystem::remove(e.path(), rm))
      log::info(str("data: removed ", e.path().string(), " (", bytes / (1024 * 1024),
                    " MB), a token cache whose writer was interrupted"));
  }
}

}  // namespace lcx
