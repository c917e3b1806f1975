// The files a dataset is read from: what a file's name says it holds, its bytes decompressed as
// they stream (gzip, zstd), its lines, and the checks that refuse a file that is not what its name
// says before any of it is trained on.
//
//   lcx::DataFileName n = lcx::data_file_name(path);     // {"jsonl", Compression::gzip} for x.jsonl.gz
//   lcx::ByteStream in(path, n.compression);              // throws when a .gz has no gzip header
//   lcx::for_each_line(in, [&](std::string_view line, int64_t line_no) { ... });
//
// Names: .txt (one document), .jsonl (one record a line), .json (an array of records, or an object
// holding one), .tokens (uint32 ids), each of the first three optionally .gz or .zst. Parquet, Arrow
// and the rest are refused by name with the conversion that makes them readable.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

namespace lcx {

enum class Compression { none, gzip, zstd };

struct DataFileName {
  std::string kind;  // "txt" | "jsonl" | "json" | "tokens"; "" when the name is no data lcx reads
  Compression compression = Compression::none;
};

// What `path`'s name says. Throws lcx::Error (key data.source) for a format lcx cannot read but a
// user might well give it (.parquet, .arrow, .csv, ...), naming the file and the conversion.
DataFileName data_file_name(const std::string& path);
// A file's name is no data lcx reads: the error for it (key data.source), naming the file.
[[noreturn]] void refuse_data_file_name(const std::string& path);

// The decompressed bytes of a file, read as they are needed.
class ByteStream {
 public:
  // Throws lcx::Error naming the file when it cannot be opened or does not start as its
  // compression says (a .gz without the gzip header, a .zst without zstd's magic).
  ByteStream(const std::string& path, Compression c);
  ~ByteStream();
  ByteStream(const ByteStream&) = delete;
  ByteStream& operator=(const ByteStream&) = delete;
  // Up to `cap` bytes into `buf`; 0 at the end. Throws naming the file on corrupt or cut data.
  size_t read(char* buf, size_t cap);
  const std::string& path() const;

  struct State;

 private:
  std::unique_ptr<State> s_;
};

// Every line of the stream without its '\n' (and a '\r' before it), numbered from 1.
void for_each_line(ByteStream& in, const std::function<void(std::string_view line, int64_t line_no)>& fn);
// The whole stream.
std::string read_all(ByteStream& in);

// Refuses (lcx::Error, key data.source, naming `path`) text that is plainly not text: a NUL byte,
// compressed data under a plain name, or invalid UTF-8 in more than 1% of the first 64 KiB. A few
// bad sequences in real text are counted and replaced later, as they always were.
void check_looks_like_text(std::string_view head, const std::string& path);

}  // namespace lcx
