#include "train/run_folder.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lcx/error.h"
#include "lcx/log.h"
#include "log/tfevents.h"
#include "slots/resolve.h"
#include "train/checkpoint.h"
#include "util/text.h"

namespace fs = std::filesystem;

namespace lcx {
namespace {

constexpr const char* kMetrics = "metrics.jsonl";

double unix_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string megabytes(const fs::path& p) {
  std::error_code ec;
  uintmax_t bytes = 0;
  if (fs::is_directory(p, ec)) {
    for (const auto& e : fs::recursive_directory_iterator(p, ec))
      if (e.is_regular_file(ec)) bytes += e.file_size(ec);
  } else {
    bytes = fs::file_size(p, ec);
  }
  return str(bytes / (1024 * 1024), " MB");
}

// What an interrupted save (.checkpoint-N.tmp) or deletion (.deleting-*) left behind.
void remove_leftovers(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const bool tmp = name.starts_with(".checkpoint-") && name.ends_with(".tmp");
    if (!tmp && !name.starts_with(".deleting-")) continue;
    const std::string size = megabytes(e.path());
    fs::remove_all(e.path());
    log::info(str("removed ", e.path().string(), " (", size, "), left by an interrupted checkpoint ",
                  tmp ? "save" : "deletion"));
  }
}

std::vector<fs::path> events_files(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (tfevents::is_events_file(e.path().filename().string())) out.push_back(e.path());
  return out;
}

// The rows of metrics.jsonl; a line that is not a row (cut by a kill) is left out and counted.
std::vector<nlohmann::json> read_metrics(const fs::path& p, size_t* bad_lines = nullptr) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer()) rows.push_back(std::move(j));
    else if (bad_lines) ++*bad_lines;
  }
  return rows;
}

void write_metrics(const fs::path& p, const std::vector<nlohmann::json>& rows) {
  const fs::path tmp = p.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    for (const auto& r : rows) out << r.dump() << "\n";
    out.flush();
    if (!out) throw Error(str("cannot write ", tmp.string()), "run.output_dir", "check free disk space and permissions");
  }
  fs::rename(tmp, p);
}

// A resume continues the checkpoint's own run: the same model and the same data stream.
void check_same_run(const CoreConfig& now, const std::string& checkpoint) {
  const fs::path p = fs::path(checkpoint) / "manifest.toml";
  if (!fs::exists(p)) {
    log::warn(str(checkpoint, " has no manifest.toml: whether this run's [model] and [data] match it is not checked"));
    return;
  }
  Manifest saved = Manifest::load(p.string());
  // lcx saves its paths absolute; a relative one (a manifest.toml written by hand) is taken from the
  // working folder, as a --set path is.
  resolve_manifest_paths(saved, fs::current_path().string());
  const CoreConfig was = read_core_config(saved, requested_plugins(saved, {}));
  auto b = [](bool x) { return std::string(x ? "true" : "false"); };
  const std::pair<const char*, std::pair<std::string, std::string>> keys[] = {
      {"model.module", {was.model.module, now.model.module}},
      {"model.path", {was.model.path, now.model.path}},
      {"model.init", {was.model.init, now.model.init}},
      {"model.dtype", {was.model.dtype, now.model.dtype}},
      {"data.seq_len", {str(was.data.seq_len), str(now.data.seq_len)}},
      {"data.source", {was.data.source, now.data.source}},
      {"data.sources", {data_sources_text(was.data), data_sources_text(now.data)}},
      {"data.tokenizer", {was.data.tokenizer, now.data.tokenizer}},
      {"data.format", {was.data.format, now.data.format}},
      {"data.text_field", {was.data.text_field, now.data.text_field}},
      {"data.loss_on", {was.data.loss_on, now.data.loss_on}},
      {"data.chat_template", {was.data.chat_template, now.data.chat_template}},
      {"data.chat_template_kwargs", {was.data.chat_template_kwargs, now.data.chat_template_kwargs}},
      {"data.pad_to_multiple_of", {str(was.data.pad_to_multiple_of), str(now.data.pad_to_multiple_of)}},
      {"data.shuffle", {b(was.data.shuffle), b(now.data.shuffle)}},
      {"data.drop_last", {b(was.data.drop_last), b(now.data.drop_last)}},
      {"data.attend_across_documents", {b(was.data.attend_across_documents), b(now.data.attend_across_documents)}},
      {"data.packing", {was.data.packing, now.data.packing}},
      {"data.overlong", {was.data.overlong, now.data.overlong}},
      {"eval.split", {str(was.eval.split), str(now.eval.split)}},
  };
  for (const auto& [key, v] : keys)
    if (v.first != v.second)
      throw Error(str("--resume ", checkpoint, ": ", key, " is \"", v.second, "\" but the checkpoint was trained with \"",
                      v.first, "\""),
                  key,
                  str("resume with ", key, " = \"", v.first, "\"; to go on with other settings, start a new run in another "
                      "run.output_dir with model.path = \"", checkpoint, "\""));
}

}  // namespace

void refuse_shared_folder(const std::string& dir, const std::string& key) {
  const fs::path path(dir);
  std::error_code ec;
  const fs::path real = fs::weakly_canonical(fs::absolute(path), ec);
  const char* home = std::getenv("HOME");
  const bool is_root = real == real.root_path();
  // The system's own folders: --overwrite would train, write and delete among their files.
  static const char* const kSystem[] = {"/bin", "/boot", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run",
                                        "/sbin", "/sys", "/usr", "/var"};
  for (const char* system : kSystem)
    if (real == fs::path(system))
      throw Error(str(key, " ", dir, " is the system folder ", system, ": lcx writes ",
                      key == "run.output_dir" ? "and deletes checkpoints" : "its files", " there"),
                  key, str("give ", key, " a folder of its own, e.g. runs/my-run"));
  if (is_root || (home && *home && real == fs::weakly_canonical(home, ec)))
    throw Error(str(key, " ", dir, " is ", is_root ? "the root folder" : "the home folder",
                    real != path ? str(" (", real.string(), ")") : std::string(), ": lcx writes ",
                    key == "run.output_dir" ? "and deletes checkpoints" : "its files", " there"),
                key,
                key == "run.output_dir" ? std::string("give the run a folder of its own, e.g. output_dir = \"runs/my-run\"")
                                        : str("give ", key, " a folder of its own, e.g. ", key, " runs/eval"));
}

void create_output_dir(const std::string& dir, const std::string& key) {
  std::error_code ec;
  if (fs::is_symlink(dir, ec) && !fs::exists(dir, ec))
    throw Error(str(key, " ", dir, " is a symbolic link to ", fs::read_symlink(dir, ec).string(), ", which does not exist"),
                key, "create the folder it points to, or remove the link and give the path of a folder");
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    throw Error(str(key, " ", dir, " is a file, not a folder"), key, "give the path of a folder (it is created when missing)");
  fs::create_directories(dir, ec);
  if (ec)
    throw Error(str("cannot create ", key, " ", dir, ": ", ec.message()), key,
                "give a path where this user can create a folder");
  if (::access(dir.c_str(), W_OK) != 0)
    throw Error(str(key, " ", dir, " is not writable: ", std::strerror(errno)), key,
                "give a folder this user can write (not on a read-only mount), or make it writable");
}

namespace {

constexpr const char* kLock = ".lcx.lock";

// What lcx writes into a run folder; metrics.jsonl only when its lines are lcx's rows (the last
// one may be cut by a kill).
bool written_by_lcx(const fs::directory_entry& e) {
  const std::string name = e.path().filename().string();
  std::error_code ec;
  if (name == kMetrics) {
    size_t bad = 0;
    const auto rows = read_metrics(e.path(), &bad);
    return bad == 0 || (bad == 1 && !rows.empty());
  }
  if (name.starts_with("checkpoint-") && e.is_directory(ec))
    return std::all_of(name.begin() + 11, name.end(), ::isdigit) && name.size() > 11 && is_lcx_checkpoint(e.path().string());
  return name == kLock || name == "log.jsonl" || name == "rehearsal.json" || name == "memory_timeline.json" ||
         name == "memory_timeline.svg" || name == str(kMetrics, ".tmp") || tfevents::is_events_file(name) ||
         (name.starts_with("trace-step") && name.ends_with(".json")) || name.starts_with(".deleting-") ||
         (name.starts_with(".checkpoint-") && name.ends_with(".tmp"));
}

void lock_run_folder(const fs::path& dir) {
  const fs::path p = dir / kLock;
  const int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    throw Error(str("cannot open ", p.string(), ": ", std::strerror(errno)), "run.output_dir", "give a folder this user can write");
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char holder[256] = {};
    const ssize_t n = ::pread(fd, holder, sizeof holder - 1, 0);
    ::close(fd);
    std::string who(holder, n > 0 ? static_cast<size_t>(n) : 0);
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    throw Error(str("run.output_dir ", dir.string(), " is in use by another lcx-train (",
                    who.empty() ? std::string("pid unknown") : who, ")"),
                "run.output_dir", "wait for that run to end (or stop it), or give this run another run.output_dir");
  }
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "unknown host");
  const std::string who = str("pid ", ::getpid(), " on host ", host, "\n");
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, who.data(), who.size(), 0) != static_cast<ssize_t>(who.size()))
    log::warn(str("cannot write ", p.string(), ": ", std::strerror(errno)));
  // fd stays open, and the lock held, until the process ends; O_CLOEXEC: launched workers hold none.
}

}  // namespace

void claim_output_dir(const CoreConfig& cfg, const std::string& manifest, const std::string& resume, bool overwrite) {
  const fs::path dir(cfg.run.output_dir);
  std::error_code ec;
  refuse_shared_folder(dir.string(), "run.output_dir");
  // A checkpoint-<step> folder lcx did not write (the Hugging Face Trainer's) is never deleted,
  // and this run's save of that step would have to: refused whatever the run, before anything.
  if (fs::is_directory(dir, ec))
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string name = e.path().filename().string();
      const bool numbered = name.size() > 11 && name.starts_with("checkpoint-") &&
                            std::all_of(name.begin() + 11, name.end(), ::isdigit);
      if (numbered && e.is_directory(ec) && !is_lcx_checkpoint(e.path().string()))
        throw Error(str("run.output_dir ", dir.string(), " holds ", name, ", which lcx did not write (another trainer's "
                        "checkpoint?): lcx neither deletes it nor can save its own ", name, " there"),
                    "run.output_dir", "give the run another folder, or move that checkpoint out of it");
    }
  if (resume.empty() && !overwrite && fs::is_directory(dir, ec)) {
    std::vector<std::string> foreign;
    for (const auto& e : fs::directory_iterator(dir, ec))
      if (!written_by_lcx(e) && !fs::equivalent(e.path(), manifest, ec)) foreign.push_back(e.path().filename().string());
    if (!foreign.empty()) {
      std::sort(foreign.begin(), foreign.end());
      if (foreign.size() > 3) foreign.resize(3), foreign.push_back("...");
      throw Error(str("run.output_dir ", dir.string(), " holds files lcx did not write (", join(foreign, ", "), ")"),
                  "run.output_dir",
                  "give the run an empty or new folder; --overwrite starts there anyway (it deletes only lcx's own "
                  "checkpoints, metrics.jsonl and TensorBoard events, never the other files)");
    }
  }
  create_output_dir(dir.string());
  lock_run_folder(dir);
}

std::string check_run_folder(const CoreConfig& cfg, const std::string& resume, bool overwrite) {
  const fs::path dir(cfg.run.output_dir);
  if (overwrite && !resume.empty())
    throw Error("--overwrite starts a new run; --resume continues one", {}, "give one of them");
  const auto checkpoints = list_checkpoints(dir.string());
  const fs::path metrics = dir / kMetrics;
  std::error_code ec;
  if (resume.empty()) {
    if (!checkpoints.empty() && !overwrite)
      throw Error(str("run.output_dir ", dir.string(), " holds checkpoints of an earlier run (newest: ",
                      fs::path(checkpoints.back()).filename().string(), ")"),
                  "run.output_dir",
                  "continue that run with --resume latest, give another run.output_dir, or start over with "
                  "--overwrite (deletes its checkpoints, metrics.jsonl and TensorBoard events)");
    if (fs::exists(metrics, ec) && !written_by_lcx(fs::directory_entry(metrics, ec)))
      throw Error(str(metrics.string(), " is not lcx's (its lines are not lcx's metrics rows)"), "run.output_dir",
                  "move it out of run.output_dir, or give the run another folder: lcx does not delete files it did not write");
    return {};
  }
  const std::string checkpoint = resolve_checkpoint(dir.string(), resume);
  if (!checkpoints.empty() && !fs::equivalent(fs::canonical(checkpoint, ec).parent_path(), dir, ec))
    throw Error(str("--resume ", checkpoint, " is outside run.output_dir ", dir.string(), ", which holds checkpoints of another run"),
                "run.output_dir", "resume into the checkpoint's own folder, or give an empty run.output_dir");
  check_same_run(cfg, checkpoint);
  return checkpoint;
}

void open_run_folder(const CoreConfig& cfg, const std::string& resume, bool overwrite) {
  const fs::path dir(cfg.run.output_dir);
  create_output_dir(dir.string());
  remove_leftovers(dir);
  // Everything is checked before the first deletion.
  const std::string checkpoint = check_run_folder(cfg, resume, overwrite);
  const auto checkpoints = list_checkpoints(dir.string());
  const fs::path metrics = dir / kMetrics;

  if (resume.empty()) {
    if (overwrite) {
      for (const auto& c : checkpoints) remove_checkpoint(c);
      if (!checkpoints.empty())
        log::info(str("--overwrite: removed ", checkpoints.size(), " checkpoint(s) of the earlier run in ", dir.string()));
    } else if (!read_metrics(metrics).empty()) {
      log::warn(str(metrics.string(), " of an earlier run that saved no checkpoint is replaced by this run's"));
    }
    fs::remove(metrics);
    for (const auto& e : events_files(dir)) fs::remove(e);
    return;
  }

  verify_checkpoint(checkpoint);
  const int64_t step = load_trainer_state(checkpoint).step;
  size_t bad_lines = 0;
  auto rows = read_metrics(metrics, &bad_lines);
  const size_t before = rows.size();
  std::erase_if(rows, [&](const nlohmann::json& r) { return r["step"].get<int64_t>() > step; });
  if (rows.size() != before || bad_lines > 0) {
    write_metrics(metrics, rows);
    log::info(str(kMetrics, ": dropped ", before - rows.size(), " row(s) after step ", step,
                  ", the step this run resumes from", bad_lines ? str(", and ", bad_lines, " line(s) cut by a kill") : ""));
  }
}

MetricsLog::MetricsLog() = default;
MetricsLog::MetricsLog(MetricsLog&&) noexcept = default;
MetricsLog::~MetricsLog() = default;

namespace {

// A step row's numbers as train/<key>; an evaluation row's eval_<name> as eval/<name> (eval/loss).
tfevents::Scalars scalars_of(const nlohmann::json& row) {
  tfevents::Scalars out;
  for (const auto& [k, v] : row.items())
    if (k != "step" && k != "time" && (v.is_number() || v.is_boolean()))
      out.emplace_back(k.starts_with("eval_") ? "eval/" + k.substr(5) : "train/" + k,
                       v.is_boolean() ? (v.get<bool>() ? 1.0f : 0.0f) : v.get<float>());
  return out;
}

}  // namespace

MetricsLog::MetricsLog(const std::string& output_dir, int64_t first_step)
    : path_((fs::path(output_dir) / kMetrics).string()) {
  const auto rows = read_metrics(path_);
  for (const auto& e : events_files(output_dir)) fs::remove(e);
  events_ = std::make_unique<tfevents::Writer>(output_dir);
  events_->write(tfevents::file_version_event(unix_time()));
  for (const auto& r : rows)
    events_->write(tfevents::scalars_event(r.value("time", 0.0), r["step"].get<int64_t>(), scalars_of(r)));
  events_->write(tfevents::start_event(unix_time(), first_step + 1));
}

void MetricsLog::append(nlohmann::json row) {
  if (path_.empty()) return;
  row["time"] = unix_time();
  std::ofstream out(path_, std::ios::app);
  out << row.dump() << "\n";
  out.flush();
  if (!out) throw Error(str("cannot write ", path_), "run.output_dir", "check free disk space");
  events_->write(tfevents::scalars_event(row["time"].get<double>(), row["step"].get<int64_t>(), scalars_of(row)));
}

}  // namespace lcx
