#include "app/cli.h"

#include <boost/program_options.hpp>
#include <sstream>

#include "lcx/error.h"

namespace po = boost::program_options;

namespace lcx {

void parse_subcommand(const po::options_description& desc, int argc, char** argv, const char* cmd) {
  try {
    po::variables_map vm;
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw Error(e.what(), {}, str("see lcx-train ", cmd, " --help"));
  }
}

CliOptions parse_cli(int argc, char** argv) {
  CliOptions o;
  po::options_description desc(
      "lcx-train: long-context fine-tuning of Hugging Face decoder models (Qwen3, Llama, Mistral, Qwen2, Gemma 3, GPT-OSS)\n\n"
      "Usage: lcx-train --config run.toml [--set section.key=value]... [--disable NAME]...\n"
      "       lcx-train config [--markdown]   (every key: type, default, meaning)\n"
      "       lcx-train tokenize --tokenizer FILE (--text STRING | --file PATH) [--count]\n"
      "       lcx-train tokenize --tokenizer FILE --chat JSONL [--tokenizer-config FILE] [--kwargs JSON] [--mask]\n"
      "       lcx-train eval --config run.toml (--checkpoint DIR | --model DIR) --seq-len N --out DIR\n"
      "       lcx-train eval-plot --out FILE.svg CSV_OR_DIR...\n"
      "       lcx-train calibrate [--out FILE]   (measure this GPU's rates row, see calibrate --help)\n"
      "       lcx-train merge --base DIR --adapter DIR --out DIR   (a PEFT low-rank adapter merged into its base)\n"
      "(each subcommand's --help lists its options)\n\n"
      "Options");
  desc.add_options()
      ("config,c", po::value(&o.config)->value_name("FILE"), "the run manifest (TOML)")
      ("set,s", po::value(&o.sets)->composing()->value_name("KEY=VALUE"),
       "override a manifest key, e.g. --set train.lr=1e-5 (repeatable, type-checked)")
      ("disable,d", po::value(&o.disabled)->composing()->value_name("NAME"),
       "drop a plugin named in [plugins] load; its slot falls back to core's default (repeatable)")
      ("list-plugins", po::bool_switch(&o.list_plugins), "list the plugins found: name, slot, version, status, path")
      ("dry-run", po::bool_switch(&o.dry_run),
       "print the resolved config (every key, defaults marked) and each slot's provider, then exit")
      ("set-only", po::bool_switch(&o.set_only), "with --dry-run: print only the keys set, in the manifest or by --set")
      ("plan", po::bool_switch(&o.plan),
       "whether a step fits the GPU and the host (no GPU work, no weights loaded): the verdict, the recipe chosen, "
       "fixes as --set lines, the per-GPU breakdown and the longest sequence that fits; exit 1 when it does not fit")
      ("verbose", po::bool_switch(&o.verbose), "with --plan: every term of the plan, per phase")
      ("profile", po::bool_switch(&o.profile),
       "time every op of one step (run.profile_step, default 2): a table in the log and <output_dir>/trace-step<N>.json")
      ("rehearse", po::bool_switch(&o.rehearse),
       "a rehearsal, not training: one step's exact allocations (GPU and pinned host) with the attention math cut, "
       "the measured peaks against the plan's; exit 0 when they agree, 1 when not. Writes no checkpoint or metrics")
      ("gpu-memory", po::value(&o.gpu_memory)->value_name("SIZE"),
       "GPU memory for --plan, e.g. 80GB or 141GB (GB = GiB); default: the local GPU's")
      ("gpu-name", po::value(&o.gpu_name)->value_name("NAME"),
       "the GPU whose rates time --plan's recipes, e.g. \"NVIDIA H100 80GB HBM3\" (its rates table row, or the "
       "nearest); default: run.gpu_name, else the local GPU's, else the H200's")
      ("host-memory", po::value(&o.host_memory)->value_name("SIZE"),
       "host memory of the node for --plan, shared by its ranks' pinned buffers; default: what this one leaves "
       "(MemAvailable and the cgroup's limit)")
      ("resume", po::value(&o.resume)->value_name("latest|PATH"),
       "continue from the newest checkpoint in output_dir, or from a checkpoint folder")
      ("overwrite", po::bool_switch(&o.overwrite),
       "start a new run in an output_dir that holds an earlier run: its checkpoints, metrics.jsonl and "
       "TensorBoard events are deleted first")
      ("force", po::bool_switch(&o.force),
       "run even when the plan says the GPU's memory is short (refused by default, with what would make it fit)")
      ("version", po::bool_switch(&o.version), "print the version and exit")
      ("help,h", po::bool_switch(&o.help), "print this help");
  o.argv.assign(argv, argv + argc);
  std::ostringstream help;
  help << desc;
  o.help_text = help.str();
  try {
    po::variables_map vm;
    po::store(po::command_line_parser(argc, argv).options(desc).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw Error(e.what(), {}, "see lcx-train --help");
  }
  return o;
}

}  // namespace lcx
