// lcx-train: reads the manifest, resolves each slot's provider, and runs (or describes) the run.
#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/pattern_formatter.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "app/cli.h"
#include "app/eval_cmd.h"
#include "app/plan_cmd.h"
#include "config/core_config.h"
#include "config/manifest.h"
#include "config/reference.h"
#include "data/tokenizer.h"
#include "lcx/abi.h"
#include "lcx_git_hash.h"
#include "lcx/error.h"
#include "log/detail.h"
#include "loader/plugin_loader.h"
#include "slots/resolve.h"
#include "plan/plan.h"
#include "train/run.h"
#include "train/run_folder.h"
#include "train/trainer.h"
#include "train/trainer_loop.h"

namespace lcx {
namespace {

void print_plugins(const PluginLoader& loader) {
  std::vector<std::string> problems;
  auto infos = loader.discover(&problems);
  std::printf("%-16s %-20s %-8s %-26s %s\n", "NAME", "SLOT", "VERSION", "STATUS", "PATH");
  for (const auto& i : infos)
    std::printf("%-16s %-20s %-8s %-26s %s\n", i.name.c_str(), slot_name(i.slot), i.version.c_str(),
                i.status.c_str(), i.path.c_str());
  std::printf("core defaults: loss=%s positional_encoding=%s memory_strategy=%s parallelism=%s mlp=%s optimizer=%s\n",
              default_provider_name(LCX_SLOT_LOSS), default_provider_name(LCX_SLOT_POSITIONAL_ENCODING),
              default_provider_name(LCX_SLOT_MEMORY_STRATEGY), default_provider_name(LCX_SLOT_PARALLELISM),
              default_provider_name(LCX_SLOT_MLP), default_provider_name(LCX_SLOT_OPTIMIZER));
  std::printf("searched: ");
  for (size_t k = 0; k < loader.search_dirs().size(); ++k)
    std::printf("%s%s", k ? ", " : "", loader.search_dirs()[k].c_str());
  std::printf("\n");
  for (const auto& p : problems) std::fprintf(stderr, "warning: skipped %s\n", p.c_str());
}

void print_providers(const std::map<uint32_t, SlotProvider>& providers) {
  for (const auto& [slot, first] : providers)
    for (const SlotProvider* p = &first; p; p = p->beneath.empty() ? nullptr : &p->beneath.front())
      std::printf("  %-20s %-16s %s%s\n", slot_name(slot), p->name.c_str(), p->origin.c_str(),
                  p->info.status.empty() || p->info.status == "ready" ? "" : ("  [" + p->info.status + "]").c_str());
}

// The log message as a JSON string, so the run folder's log is JSON lines whatever the text.
class JsonMessageFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg& msg, const std::tm&, spdlog::memory_buf_t& dest) override {
    std::string s = nlohmann::json(std::string(msg.payload.data(), msg.payload.size())).dump();
    dest.append(s.data(), s.data() + s.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<JsonMessageFlag>(); }
};

void setup_logging(const std::string& level, const std::string& log_file) {
  std::vector<spdlog::sink_ptr> sinks;
  auto console = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
  console->set_pattern(isatty(STDERR_FILENO) ? "%H:%M:%S %^%l%$ %v" : "[%Y-%m-%d %H:%M:%S.%e] [%l] %v");
  sinks.push_back(console);
  if (!log_file.empty()) {
    // Appended: the log keeps every start and resume of the run.
    auto file = std::make_shared<spdlog::sinks::basic_file_sink_mt>(log_file, false);
    // One JSON object a line: time, level, message (escaped by the %* flag).
    auto formatter = std::make_unique<spdlog::pattern_formatter>();
    formatter->add_flag<JsonMessageFlag>('*').set_pattern(
        R"({"time":"%Y-%m-%dT%H:%M:%S.%f","level":"%l","message":%*})");
    file->set_formatter(std::move(formatter));
    sinks.push_back(file);
  }
  auto logger = std::make_shared<spdlog::logger>("lcx", sinks.begin(), sinks.end());
  logger->set_level(spdlog::level::from_str(level));
  // Every line reaches the file as it is logged, so a kill -9 loses none.
  logger->flush_on(spdlog::level::trace);
  spdlog::set_default_logger(logger);
  // The lines the terminal's summary stands for go to the file alone (log/detail.h).
  spdlog::drop(log::kDetailLogger);
  if (!log_file.empty()) {
    auto detail = std::make_shared<spdlog::logger>(log::kDetailLogger, sinks.back());
    detail->set_level(spdlog::level::from_str(level));
    detail->flush_on(spdlog::level::trace);
    spdlog::register_logger(detail);
  }
}

// A table named after a plugin that is installed but not in [plugins] load configures nothing.
void refuse_tables_of_unloaded_plugins(const Manifest& m, const PluginLoader& loader) {
  const std::vector<std::string> loaded = requested_plugins(m, {});
  const std::vector<std::string>& core = core_section_names();
  for (const auto& name : m.table_names()) {
    if (std::find(core.begin(), core.end(), name) != core.end() ||
        std::find(loaded.begin(), loaded.end(), name) != loaded.end() || !loader.installed(name))
      continue;
    throw Error(str(m.section(name).where(), ": [", name, "] configures the plugin ", name,
                    ", which is installed but not loaded"),
                name, str("add \"", name, "\" to [plugins] load (or remove the [", name, "] table)"));
  }
}

// The run's files beside the code lcx loads (a folder is searched for plugins, not its
// subfolders): what a run writes and deletes there would sit among the plugins.
void refuse_output_dir_in_plugin_folder(const std::string& output_dir, const PluginLoader& loader) {
  std::error_code ec;
  const auto out = std::filesystem::weakly_canonical(std::filesystem::absolute(output_dir), ec);
  for (const auto& dir : loader.search_dirs())
    if (out == std::filesystem::weakly_canonical(std::filesystem::absolute(dir), ec))
      throw Error(str("run.output_dir ", output_dir, " is the plugin folder ", dir), "run.output_dir",
                  "give the run a folder of its own, e.g. a subfolder run/ (lcx-train --list-plugins names the plugin folders)");
}

// --dry-run: the plan against the GPU's budget where the run may use a GPU and the budget is known
// ([run] gpu_memory, or this machine's GPU), as a run checks it before its first step.
void check_plan_fits(const CoreConfig& core, SlotSet slots, bool force) {
  if (!slots.model || core.run.device == "cpu") return;
  const std::optional<int64_t> gpu_bytes = core.run.gpu_memory != "auto"
                                               ? std::optional<int64_t>(parse_memory_size(core.run.gpu_memory, "run.gpu_memory"))
                                               : local_gpu_memory();
  if (!gpu_bytes) return;
  Run run(core, std::move(slots), Device::cpu());
  run.check_parallelism();
  run.plan_step(plan_model_config(core.model, run.model()), core.data.seq_len, *gpu_bytes, host_memory_budget("", core.run));
  check_gpu_memory(core, run.planned(), run.plan_slots(), *gpu_bytes, force);
  check_host_memory(build_plan(run.planned(), run.plan_slots()), run.planned(), host_memory_budget("", core.run));
}

// This process's resident memory (/proc/self/statm); 0 where it cannot be read.
int64_t resident_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t pages_total = 0, pages_resident = 0;
  if (!(in >> pages_total >> pages_resident)) return 0;
  return pages_resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

// On the CPU, before any rank loads a weight: the plan's bytes against the host's (a model or a
// count of thread-ranks past it would otherwise grow until std::bad_alloc or the OOM killer).
void check_cpu_plan_fits(const CoreConfig& core, const SlotSet& slots) {
  const bool on_cpu = core.run.device == "cpu" || (core.run.device != "cuda" && !pick_device(core.run.device).is_cuda());
  if (!slots.model || !on_cpu) return;
  Run run(core, slots, Device::cpu());
  run.check_parallelism();
  PlanInputs in = plan_inputs(core, plan_model_config(core.model, run.model()), core.data.seq_len);
  in.recipe = unplanned_recipe(in, run.plan_slots(), core.train.checkpoint_every);
  const int64_t host_bytes = host_memory_budget("", core.run);
  // Each thread-rank loads its own tokenizer (a Qwen3 one holds about 67 MB), which no plan term
  // counts: measured as the memory one takes here, where several ranks share the host.
  int64_t tokenizer_bytes = 0;
  if (in.local_ranks > 1 && host_bytes >= 0 && !core.data.tokenizer.empty()) {
    const int64_t before = resident_bytes();
    const Tokenizer tokenizer = Tokenizer::load(core.data.tokenizer);
    tokenizer_bytes = std::max<int64_t>(0, resident_bytes() - before);
  }
  check_cpu_memory(build_plan(in, run.plan_slots()), in, host_bytes, tokenizer_bytes);
}

// The bytes of text a run tokenizes before its first step: token files are used in place and
// count nothing.
uint64_t text_bytes(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  auto counted = [](const fs::path& p, uint64_t size) { return p.extension() == ".tokens" ? 0 : size; };
  if (!fs::is_directory(path, ec)) return counted(path, fs::is_regular_file(path, ec) ? fs::file_size(path, ec) : 0);
  uint64_t total = 0;
  for (auto it = fs::recursive_directory_iterator(path, fs::directory_options::skip_permission_denied, ec);
       !ec && it != fs::recursive_directory_iterator(); it.increment(ec))
    if (it->is_regular_file(ec)) total += counted(it->path(), it->file_size(ec));
  return total;
}

// What the run checks once it has read its data (a seq_len longer than the data, a step of more
// sequences than an epoch holds, the last sequence's split over cp), before the run folder is
// touched: a run refused there after --overwrite would have deleted the earlier run's checkpoints.
// The text is tokenized into the token cache the run then reads. A dry run reads it where that is
// quick (token files, text of at most 64 MiB) and leaves larger text to the run, saying so.
void check_data(const CoreConfig& core, const SlotSet& slots, bool dry_run) {
  if (!slots.model) return;
  constexpr uint64_t kQuick = uint64_t{64} << 20;
  uint64_t text = core.data.source.empty() ? 0 : text_bytes(core.data.source);
  for (const auto& s : core.data.sources) text += text_bytes(s.path);
  if (core.eval.enabled() && !core.eval.source.empty()) text += text_bytes(core.eval.source);
  if (dry_run && text > kQuick) {
    std::printf("note: the data (%.1f MiB of text to tokenize) is not read by --dry-run; the run checks data.seq_len and "
                "train.grad_accum against it before its first step\n",
                static_cast<double>(text) / (1 << 20));
    return;
  }
  // In a run, the run's own opening of the data (from the token cache written here) reports it.
  struct QuietInfo {
    spdlog::level::level_enum was = spdlog::get_level();
    explicit QuietInfo(bool quiet) {
      if (quiet) spdlog::set_level(std::max(was, spdlog::level::warn));
    }
    ~QuietInfo() { spdlog::set_level(was); }
  } quiet(!dry_run);
  Run run(core, slots, Device::cpu());
  run.check_parallelism();
  run.open_data(core.data, !dry_run, core.eval.split);
  run.open_eval_data(false);
  run.check_sequence_split();
  run_length(run);
}

int run(const CliOptions& o) {
  if (o.help) {
    std::cout << o.help_text;
    return 0;
  }
  if (o.version) {
    std::printf("lcx-train %s (git %s, plugin ABI %d.%d)\n", LCX_VERSION, LCX_GIT_HASH, LCX_ABI_MAJOR, LCX_ABI_MINOR);
    return 0;
  }
  std::string dir_entry;
  std::optional<Manifest> manifest;
  if (!o.config.empty()) {
    manifest = load_run_manifest(o.config, o.sets);
    if (o.profile) manifest->set("run.profile=true");
    if (o.rehearse) manifest->set("run.rehearse=true");
    dir_entry = manifest->section("plugins").get_string("dir", "");
  }
  PluginLoader loader(PluginLoader::default_search_dirs(dir_entry));
  if (o.list_plugins) {
    print_plugins(loader);
    return 0;
  }
  if (!manifest) throw Error("no manifest given", {}, "run lcx-train --config run.toml (see --help)");

  refuse_tables_of_unloaded_plugins(*manifest, loader);
  CoreConfig core = read_core_config(*manifest, requested_plugins(*manifest, {}));
  auto providers = plan_slots(*manifest, loader, o.disabled);
  if (o.dry_run) {
    // Creating the plugins validates their tables (unknown keys, types) without any GPU work, and
    // records every key they read, for the resolved config.
    SlotSet slots = resolve_slots(*manifest, loader, o.disabled, Device::cpu(), configured_mesh(core.distributed));
    std::printf("# resolved config (%s)%s\n%s# slot providers\n", manifest->source().c_str(),
                o.set_only ? ": the keys set" : ": every key read, defaults marked",
                format_resolved(*manifest, o.set_only).c_str());
    print_providers(providers);
    // The refusals come after the config they are about, on a terminal and in a pipe alike.
    std::fflush(stdout);
    check_run_inputs(core, slots);
    if (!core.run.rehearse) check_run_folder(core, o.resume, o.overwrite);
    check_cpu_plan_fits(core, slots);
    check_data(core, slots, true);
    check_plan_fits(core, std::move(slots), o.force);
    std::printf("config OK\n");
    return 0;
  }
  if (o.plan)
    return run_plan_command(*manifest, core, loader, o.disabled, o.gpu_memory, o.host_memory, o.gpu_name, o.verbose);

  // Every table, the plugins' too, and every path are checked before the run folder gets its
  // first byte and before the corpus is tokenized.
  // Workers a launcher started (LCX_WORKER) other than rank 0 keep to the terminal: one log per job.
  const char* worker_rank = std::getenv("LCX_WORKER") ? std::getenv("RANK") : nullptr;
  // The job's first process claims the folder (torchrun's rank 0, or the process a user started).
  const char* job_rank = std::getenv("RANK");
  const bool claims = !std::getenv("LCX_WORKER") && (!job_rank || std::string(job_rank) == "0");
  {
    SlotSet slots = resolve_slots(*manifest, loader, o.disabled, Device::cpu(), configured_mesh(core.distributed));
    check_run_inputs(core, slots);
    check_cpu_plan_fits(core, slots);
    if (claims && !core.run.rehearse) check_data(core, slots, false);
  }
  if (claims) {
    refuse_output_dir_in_plugin_folder(core.run.output_dir, loader);
    // A run refused for the folder's state leaves it as it was: no lock file, no line in the earlier
    // run's log (open_run_folder checks again under the lock).
    if (!core.run.rehearse) check_run_folder(core, o.resume, o.overwrite);
    claim_output_dir(core, o.config, o.resume, o.overwrite);
  } else {
    create_output_dir(core.run.output_dir);
  }
  const bool writes_log = !worker_rank || std::string(worker_rank) == "0";
  setup_logging(core.run.log_level,
                writes_log ? (std::filesystem::path(core.run.output_dir) / "log.jsonl").string() : std::string());
  spdlog::info(str(o.resume.empty() ? "start of a new run" : "resume (--resume " + o.resume + ")", ": lcx-train ",
                   LCX_VERSION, " git ", LCX_GIT_HASH, ", pid ", getpid(), worker_rank ? str(", rank ", worker_rank) : ""));
  for (const auto& [slot, first] : providers)
    for (const SlotProvider* p = &first; p; p = p->beneath.empty() ? nullptr : &p->beneath.front())
      log::detail(str("slot ", slot_name(slot), ": ", p->name, " ", p->info.version, " ", p->origin,
                      p->info.sha256.empty() ? "" : " sha256:" + p->info.sha256));
  log::detail("config " + nlohmann::json::parse(manifest->to_json()).dump());
  SlotFactory make_slots = [&](Device device, int rank) {
    return resolve_slots(*manifest, loader, o.disabled, device, configured_mesh(core.distributed), rank);
  };
  return run_training(core, *manifest, make_slots, TrainOptions{o.resume, o.overwrite, o.force, o.argv});
}

}  // namespace
}  // namespace lcx

int main(int argc, char** argv) {
  try {
    if (argc > 1 && std::string(argv[1]) == "config") return lcx::config_main(argc - 1, argv + 1);
    if (argc > 1 && std::string(argv[1]) == "tokenize") return lcx::tokenize_main(argc - 1, argv + 1);
    if (argc > 1 && std::string(argv[1]) == "calibrate") return lcx::calibrate_main(argc - 1, argv + 1);
    if (argc > 1 && std::string(argv[1]) == "merge") return lcx::merge_main(argc - 1, argv + 1);
    if (argc > 1 && std::string(argv[1]) == "eval") return lcx::eval_main(argc - 1, argv + 1);
    if (argc > 1 && std::string(argv[1]) == "eval-plot") return lcx::eval_plot_main(argc - 1, argv + 1);
    return lcx::run(lcx::parse_cli(argc, argv));
  } catch (const lcx::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    if (!e.fix().empty()) std::fprintf(stderr, "  fix: %s\n", e.fix().c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
