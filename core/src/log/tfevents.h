// TensorBoard's event file, written by hand so the run folder shows in `tensorboard --logdir`
// with no TensorFlow or protobuf library. A file is a sequence of records:
//   uint64 length | uint32 masked crc32c(length) | data | uint32 masked crc32c(data)   (little endian)
// where data is a serialized tensorflow.Event: wall_time (1, double), step (2, int64), then one of
// file_version (3, string, "brain.Event:2" in the first record), summary (5) or session_log (6).
// A Summary holds repeated Value{tag (1, string), simple_value (2, float)}.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace lcx::tfevents {

uint32_t crc32c(const void* data, size_t n);
// TFRecord's mask, so a CRC of data that holds CRCs stays well distributed.
uint32_t masked_crc32c(const void* data, size_t n);

using Scalars = std::vector<std::pair<std::string, float>>;
// The serialized Event messages (the record's data).
std::string file_version_event(double wall_time);
std::string scalars_event(double wall_time, int64_t step, const Scalars& scalars);
// SessionLog START at `step`: TensorBoard drops what it holds for this step and later ones, so a
// resumed run replaces the steps it rolled back.
std::string start_event(double wall_time, int64_t step);
// One framed record.
std::string record(const std::string& data);

// Appends records to events.out.tfevents.<unix time>.<hostname> in a folder; each record is
// flushed as it is written.
class Writer {
 public:
  explicit Writer(const std::string& dir);
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;
  void write(const std::string& event);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

// "events.out.tfevents." files of a folder.
bool is_events_file(const std::string& filename);

}  // namespace lcx::tfevents
