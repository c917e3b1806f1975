// The run manifest: a TOML file, then --set overrides, then views of its tables for core and
// plugins. Errors name the file, the line and the key.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <toml++/toml.h>

#include "lcx/config.h"


namespace lcx {

// What the reads of one key recorded: its type and default (the getters), its line (describe),
// and the value the last read resolved. The reference and --dry-run are printed from these.
struct KeyRecord {
  std::string table;  // "train", "qwen3", or a sub-table's dotted name
  std::string key;
  std::string type;           // "" when no getter read it (has() alone)
  std::string default_value;  // TOML, or describe's shown_default
  bool default_is_text = false;  // default_value is describe's words, not a TOML value
  std::string values;         // range or allowed values; "" for any value of the type
  std::string meaning;
  std::string value;  // TOML, as last read; "" when no getter read it
  bool set = false;   // given in the manifest or by --set
};

// Every key the views of one manifest were asked for, in the order first asked; views of several
// ranks' threads share it.
struct KeyRecords {
  std::mutex mutex;
  std::vector<KeyRecord> rows;
  std::map<std::pair<std::string, std::string>, size_t> index;  // (table, key) -> rows
};

class Manifest {
 public:
  static Manifest load(const std::string& path);
  static Manifest parse(const std::string& text, const std::string& source_name);

  // "section.key=value" (deeper paths allowed). The value is TOML (numbers, true/false, arrays,
  // quoted or bare strings). An existing key keeps its type: a mismatch is an error.
  void set(const std::string& assignment);
  // `f` given the whole table to change in place (keys' source lines are kept).
  void edit(const std::function<void(toml::table&)>& f) { f(*root_); }
  ConfigView section(const std::string& name) const;
  std::vector<std::string> table_names() const;
  std::string to_toml() const;
  std::string to_json() const;
  const std::string& source() const { return source_; }
  // The keys the views of this manifest were asked for so far (a copy).
  std::vector<KeyRecord> keys() const;

 private:
  std::shared_ptr<toml::table> root_;
  std::string source_;
  // Each --set key (dotted) and its assignment; copied on write, as views share it.
  std::shared_ptr<const std::map<std::string, std::string>> overrides_;
  std::shared_ptr<KeyRecords> keys_ = std::make_shared<KeyRecords>();
};

}  // namespace lcx
