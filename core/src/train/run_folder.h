// The run folder (run.output_dir) holds one run's history: its checkpoints, metrics.jsonl (one row
// a step, and one more after each evaluation: {step, eval_loss, eval_tokens, eval_sequences,
// eval_s}), the TensorBoard events file beside it, and log.jsonl (appended by every start).
//   - a fresh run refuses a folder that holds checkpoints, unless --overwrite clears them first;
//   - a resume must keep the checkpoint's [model] and [data]; the rows of metrics.jsonl after the
//     resumed step are dropped, so the file stays one history;
//   - leftovers of interrupted saves and deletions (.checkpoint-N.tmp, .deleting-*) are removed.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "config/core_config.h"
#include "config/manifest.h"

namespace lcx {

namespace tfevents {
class Writer;
}

// Refuses the root folder and the home folder (a symlink to them too) as the folder `key` names.
void refuse_shared_folder(const std::string& dir, const std::string& key);

// Creates `dir`; refuses one that is a file, that cannot be created or is not writable (a
// read-only mount), naming it and `key` (the option or config key that gave it).
void create_output_dir(const std::string& dir, const std::string& key = "run.output_dir");

// Once per job, before anything is written into run.output_dir (log.jsonl included): refuses the
// root folder and the home folder (a symlink to them too); for a new run, refuses a folder holding
// anything lcx does not write but the run's own manifest (`manifest`, the --config file) unless
// `overwrite` (which still deletes only lcx's own files); then
// creates it and holds its lock, an flock on <output_dir>/.lcx.lock, until the process ends,
// refusing a folder another lcx-train holds, naming its pid and host.
void claim_output_dir(const CoreConfig& cfg, const std::string& manifest, const std::string& resume, bool overwrite);

// The refusals above that need no write, for --dry-run and for a run before it claims the folder
// or writes a line into its log; returns the checkpoint a resume starts from ("" for a new run).
std::string check_run_folder(const CoreConfig& cfg, const std::string& resume, bool overwrite);

// Once per job, before any rank loads anything. Throws lcx::Error for the refusals above.
void open_run_folder(const CoreConfig& cfg, const std::string& resume, bool overwrite);

// metrics.jsonl and the TensorBoard events file, written by the lead rank. Opening it writes the
// events file anew from the rows metrics.jsonl already holds (so a resumed run's events match
// its metrics); each row is flushed as it is added.
class MetricsLog {
 public:
  MetricsLog();  // writes nothing: the ranks other than the lead
  MetricsLog(const std::string& output_dir, int64_t first_step);
  MetricsLog(MetricsLog&&) noexcept;
  ~MetricsLog();
  // `row` has "step" and numbers; the wall time is added as "time". Its keys become TensorBoard
  // tags train/<key>, or eval/<name> for eval_<name>.
  void append(nlohmann::json row);

 private:
  std::string path_;
  std::unique_ptr<tfevents::Writer> events_;
};

}  // namespace lcx
