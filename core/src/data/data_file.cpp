#include "data/data_file.h"

#include <zlib.h>
#include <zstd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "data/utf8.h"
#include "lcx/error.h"

namespace fs = std::filesystem;

namespace lcx {

namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

bool starts_gzip(std::string_view b) { return b.size() >= 2 && static_cast<unsigned char>(b[0]) == 0x1f && static_cast<unsigned char>(b[1]) == 0x8b; }
bool starts_zstd(std::string_view b) {
  return b.size() >= 4 && static_cast<unsigned char>(b[0]) == 0x28 && static_cast<unsigned char>(b[1]) == 0xb5 &&
         static_cast<unsigned char>(b[2]) == 0x2f && static_cast<unsigned char>(b[3]) == 0xfd;
}

const char* kConvert = "python -c \"import pandas as pd; pd.read_parquet('x.parquet').to_json('x.jsonl', orient='records', lines=True)\"";

}  // namespace

DataFileName data_file_name(const std::string& path) {
  std::string name = lower(fs::path(path).filename().string());
  DataFileName n;
  auto strip = [&](const char* ext) {
    const size_t k = std::strlen(ext);
    if (name.size() > k && name.compare(name.size() - k, k, ext) == 0) {
      name.resize(name.size() - k);
      return true;
    }
    return false;
  };
  if (strip(".gz")) n.compression = Compression::gzip;
  else if (strip(".zst")) n.compression = Compression::zstd;
  const std::string ext = fs::path(name).extension().string();
  if (ext == ".txt" || ext == ".jsonl" || ext == ".json") n.kind = ext.substr(1);
  else if (ext == ".tokens" && n.compression == Compression::none) n.kind = "tokens";
  if (ext == ".parquet" || ext == ".arrow" || ext == ".feather")
    throw Error(str("data.source: ", path, " is ", ext.substr(1), ", which lcx does not read (Debian packages no "
                    "Arrow/Parquet C++ library)"),
                "data.source", str("convert it to JSON lines once: ", ext == ".parquet" ? std::string(kConvert) :
                                   "python -c \"import pandas as pd; pd.read_feather('x.arrow').to_json('x.jsonl', "
                                   "orient='records', lines=True)\"",
                                   " and point data.source at x.jsonl"));
  if (ext == ".csv" || ext == ".tsv")
    throw Error(str("data.source: ", path, " is ", ext.substr(1), ", which lcx does not read"), "data.source",
                str("convert it to JSON lines once: python -c \"import pandas as pd; pd.read_csv('x", ext,
                    "'", ext == ".tsv" ? ", sep='\\t'" : "", ").to_json('x.jsonl', orient='records', lines=True)\""));
  return n;
}

void refuse_data_file_name(const std::string& path) {
  throw Error(str("data.source: ", path, " is not a kind of file lcx reads, so it is not read as text"), "data.source",
              "give .txt, .jsonl or .json files (each may be .gz or .zst compressed), or uint32 token ids named "
              ".tokens; rename a file whose name hides what it holds");
}

struct ByteStream::State {
  std::string path;
  Compression c = Compression::none;
  FILE* f = nullptr;
  std::vector<char> in;  // compressed input not yet consumed
  size_t in_at = 0, in_end = 0;
  bool eof = false;
  z_stream z{};
  bool z_open = false, z_member_done = false;
  ZSTD_DStream* zs = nullptr;
  bool zs_frame_done = true;

  // Refills `in` from the file; false at the end.
  bool fill() {
    if (in_at < in_end) return true;
    if (eof) return false;
    in_at = 0;
    in_end = std::fread(in.data(), 1, in.size(), f);
    if (in_end == 0) {
      if (std::ferror(f)) throw Error(str("data.source: reading ", path, " failed"), "data.source", "check the file and its disk");
      eof = true;
      return false;
    }
    return true;
  }
  [[noreturn]] void corrupt(const std::string& what) const {
    throw Error(str("data.source: ", path, " is not valid ", c == Compression::gzip ? "gzip" : "zstd", " data: ", what),
                "data.source", "check the file (gzip -t or zstd -t), or name it by what it holds");
  }
};

ByteStream::ByteStream(const std::string& path, Compression c) : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.path = path;
  s.c = c;
  s.f = std::fopen(path.c_str(), "rb");
  if (!s.f) throw Error(str("data.source: ", path, " cannot be read: ", std::strerror(errno)), "data.source", "check the path and its permissions");
  s.in.resize(1 << 20);
  s.fill();
  const std::string_view head(s.in.data(), s.in_end);
  if (c == Compression::gzip) {
    if (!starts_gzip(head))
      throw Error(str("data.source: ", path, " is named .gz but does not start with gzip's header", starts_zstd(head) ? " (it is zstd data)" : ""),
                  "data.source", "compress it with gzip, or name it by what it holds");
    if (inflateInit2(&s.z, 16 + MAX_WBITS) != Z_OK) throw Error(str("zlib could not start reading ", path));
    s.z_open = true;
  } else if (c == Compression::zstd) {
    if (!starts_zstd(head))
      throw Error(str("data.source: ", path, " is named .zst but does not start with zstd's magic number", starts_gzip(head) ? " (it is gzip data)" : ""),
                  "data.source", "compress it with zstd, or name it by what it holds");
    s.zs = ZSTD_createDStream();
    if (!s.zs || ZSTD_isError(ZSTD_initDStream(s.zs))) throw Error(str("zstd could not start reading ", path));
  }
}

ByteStream::~ByteStream() {
  if (s_->z_open) inflateEnd(&s_->z);
  if (s_->zs) ZSTD_freeDStream(s_->zs);
  if (s_->f) std::fclose(s_->f);
}

const std::string& ByteStream::path() const { return s_->path; }

size_t ByteStream::read(char* buf, size_t cap) {
  State& s = *s_;
  if (s.c == Compression::none) {
    if (!s.fill()) return 0;
    const size_t n = std::min(cap, s.in_end - s.in_at);
    std::memcpy(buf, s.in.data() + s.in_at, n);
    s.in_at += n;
    return n;
  }
  if (s.c == Compression::gzip) {
    // Members one after another (cat a.gz b.gz) read as one stream, as gzip -d does.
    size_t out = 0;
    while (out < cap) {
      if (s.z_member_done) {
        if (!s.fill()) return out;
        inflateReset(&s.z);
        s.z_member_done = false;
      }
      if (!s.fill()) s.corrupt("it ends inside a compressed member");
      s.z.next_in = reinterpret_cast<Bytef*>(s.in.data() + s.in_at);
      s.z.avail_in = static_cast<uInt>(s.in_end - s.in_at);
      s.z.next_out = reinterpret_cast<Bytef*>(buf + out);
      s.z.avail_out = static_cast<uInt>(std::min<size_t>(cap - out, 1u << 30));
      const int rc = inflate(&s.z, Z_NO_FLUSH);
      out = static_cast<size_t>(reinterpret_cast<char*>(s.z.next_out) - buf);
      s.in_at = s.in_end - s.z.avail_in;
      if (rc == Z_STREAM_END) s.z_member_done = true;
      else if (rc != Z_OK && rc != Z_BUF_ERROR) s.corrupt(s.z.msg ? s.z.msg : "inflate failed");
      if (out > 0 && rc != Z_STREAM_END) return out;
    }
    return out;
  }
  size_t out = 0;
  while (out == 0) {
    if (!s.fill()) {
      if (!s.zs_frame_done) s.corrupt("it ends inside a frame");
      return 0;
    }
    ZSTD_inBuffer ib{s.in.data(), s.in_end, s.in_at};
    ZSTD_outBuffer ob{buf, cap, 0};
    const size_t rc = ZSTD_decompressStream(s.zs, &ob, &ib);
    if (ZSTD_isError(rc)) s.corrupt(ZSTD_getErrorName(rc));
    s.zs_frame_done = rc == 0;
    s.in_at = ib.pos;
    out = ob.pos;
  }
  return out;
}

void for_each_line(ByteStream& in, const std::function<void(std::string_view, int64_t)>& fn) {
  std::vector<char> buf(1 << 20);
  std::string carry;
  int64_t line_no = 0;
  auto emit = [&](std::string_view line) {
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    fn(line, ++line_no);
  };
  for (size_t n; (n = in.read(buf.data(), buf.size())) > 0;) {
    std::string_view chunk(buf.data(), n);
    for (size_t nl; (nl = chunk.find('\n')) != std::string_view::npos; chunk.remove_prefix(nl + 1)) {
      if (carry.empty()) {
        emit(chunk.substr(0, nl));
      } else {
        carry.append(chunk.substr(0, nl));
        emit(carry);
        carry.clear();
      }
    }
    carry.append(chunk);
  }
  if (!carry.empty()) emit(carry);
}

std::string read_all(ByteStream& in) {
  std::string out;
  std::vector<char> buf(1 << 20);
  for (size_t n; (n = in.read(buf.data(), buf.size())) > 0;) out.append(buf.data(), n);
  return out;
}

void check_looks_like_text(std::string_view head, const std::string& path) {
  head = head.substr(0, 64 << 10);
  auto refuse = [&](const std::string& what, const std::string& fix) {
    throw Error(str("data.source: ", path, " ", what, ", so it is not read as text"), "data.source", fix);
  };
  if (starts_gzip(head)) refuse("holds gzip data under a name without .gz", "name it by what it holds, e.g. x.jsonl.gz");
  if (starts_zstd(head)) refuse("holds zstd data under a name without .zst", "name it by what it holds, e.g. x.jsonl.zst");
  if (const size_t z = head.find('\0'); z != std::string_view::npos)
    refuse(str("holds binary data (a NUL byte at offset ", z, ")"), "give text files; token ids go in a .tokens file");
  // Invalid UTF-8: a few sequences in real text are repaired and counted; a file made of them is not text.
  int64_t bad = 0;
  for (size_t at = 0; at < head.size();) {
    const size_t i = utf8::first_invalid(head.substr(at));
    if (i == std::string_view::npos) break;
    // A multi-byte character cut by the end of the sample is not an error.
    if (head.size() - (at + i) < 4 && head.size() == (64u << 10)) break;
    ++bad;
    at += i + 1;
  }
  if (bad > 0 && bad * 100 > static_cast<int64_t>(head.size()))
    refuse(str("is not UTF-8 text (", bad, " invalid sequences in its first ", head.size(), " bytes)"),
           "convert it to UTF-8 (iconv -f LATIN1 -t UTF-8), or name it by what it holds");
}

}  // namespace lcx
