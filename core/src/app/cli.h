// lcx-train's command line: parsed into one struct, then acted on by main.
#pragma once
#include <string>
#include <vector>

namespace boost::program_options {
class options_description;
}

namespace lcx {

struct CliOptions {
  std::string config;
  std::vector<std::string> sets;
  std::vector<std::string> disabled;
  bool list_plugins = false;
  bool dry_run = false;
  bool set_only = false;  // --dry-run prints only the keys set
  bool plan = false;
  bool profile = false;  // --profile: run.profile = true
  bool rehearse = false;  // --rehearse: run.rehearse = true
  std::string gpu_memory;  // --gpu-memory for --plan; "" means the local GPU's
  std::string host_memory;  // --host-memory for --plan; "" means this host's
  std::string gpu_name;     // --gpu-name for --plan: the rates row; "" means [run] gpu_name
  bool verbose = false;     // --verbose: --plan prints every term of the plan
  std::string resume;
  bool overwrite = false;
  bool force = false;  // run even when the plan says the GPU is short
  std::vector<std::string> argv;  // as given, for the launcher to start workers alike  // "latest" or a checkpoint folder
  bool version = false;
  bool help = false;
  std::string help_text;
};

// Throws lcx::Error on a malformed command line.
CliOptions parse_cli(int argc, char** argv);

// A subcommand's options parsed into the variables `desc` binds; a malformed line throws
// lcx::Error pointing at `lcx-train <cmd> --help`.
void parse_subcommand(const boost::program_options::options_description& desc, int argc, char** argv, const char* cmd);

// `lcx-train config [--markdown]` (argv[0] is "config"): the keys' reference; see config_cmd.cpp.
int config_main(int argc, char** argv);

// `lcx-train tokenize ...` (argv[0] is "tokenize"): prints token ids; see tokenize_cmd.cpp.
int tokenize_main(int argc, char** argv);
// `lcx-train calibrate ...` (argv[0] is "calibrate"): measures this GPU's rates row; see calibrate_cmd.cpp.
int calibrate_main(int argc, char** argv);
// `lcx-train merge ...` (argv[0] is "merge"): a PEFT low-rank adapter merged into its base; see merge_cmd.cpp.
int merge_main(int argc, char** argv);

}  // namespace lcx
