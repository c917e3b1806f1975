// `lcx-train eval`: per-position loss of a model over sequences of --seq-len tokens from the
// manifest's [eval] source when it sets one, else its [data] source (either read as the training
// data is: any format the dataset reads, its masks deciding which targets count), with the manifest's slots (so a position-scaling encoding applies when it is
// loaded, and --disable of it compares without). Runs written into one --out folder share one plot.
#include "app/eval_cmd.h"
#include "app/cli.h"

#include <algorithm>
#include <boost/program_options.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "config/core_config.h"
#include "config/manifest.h"
#include "data/dataset.h"
#include "eval/position_loss.h"
#include "lcx/error.h"
#include "lcx/log.h"
#include "loader/plugin_loader.h"
#include "train/run_folder.h"
#include "slots/resolve.h"
#include "train/checkpoint.h"
#include "train/run.h"
#include "train/step.h"

namespace po = boost::program_options;
namespace fs = std::filesystem;

namespace lcx {
namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw Error(str("cannot read ", p.string()), {}, "check the path");
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  if (!out || !(out << text)) throw Error(str("cannot write ", p.string()), "--out", "give a writable folder");
}

bool is_bins_csv(const fs::path& p) {
  const std::string n = p.filename().string();
  const std::string tokens = ".tokens.csv";
  const bool is_tokens = n.size() >= tokens.size() && n.compare(n.size() - tokens.size(), tokens.size(), tokens) == 0;
  return p.extension() == ".csv" && !is_tokens;
}

// The runs of the CSVs given (a folder stands for its bins CSVs, sorted by name), and the
// entropy (when asked and still NaN) and the trained length (when asked and still 0) from the
// first <label>.json found beside them that has them.
std::vector<RunCurve> collect_runs(const std::vector<std::string>& inputs, double* entropy, int64_t* trained = nullptr) {
  std::vector<fs::path> files;
  for (const auto& in : inputs) {
    if (fs::is_directory(in)) {
      std::vector<fs::path> here;
      for (const auto& e : fs::directory_iterator(in))
        if (e.is_regular_file() && is_bins_csv(e.path())) here.push_back(e.path());
      std::sort(here.begin(), here.end());
      files.insert(files.end(), here.begin(), here.end());
    } else {
      files.emplace_back(in);
    }
  }
  std::vector<RunCurve> runs;
  for (const auto& f : files) {
    auto r = parse_bins_csv(read_text(f));
    runs.insert(runs.end(), r.begin(), r.end());
    fs::path meta = f;
    meta.replace_extension(".json");
    if (((entropy && std::isnan(*entropy)) || (trained && *trained == 0)) && fs::exists(meta)) {
      auto j = nlohmann::json::parse(read_text(meta));
      if (entropy && std::isnan(*entropy) && j.contains("unigram_entropy_nats") && j["unigram_entropy_nats"].is_number())
        *entropy = j["unigram_entropy_nats"].get<double>();
      if (trained && *trained == 0 && j.contains("trained_positions") && j["trained_positions"].is_number_integer())
        *trained = j["trained_positions"].get<int64_t>();
    }
  }
  return runs;
}

// The positions the model was trained on: its rope parameters' original_max_position_embeddings
// when its positions were scaled (YaRN), else its max_position_embeddings.
int64_t trained_positions(const ModelConfig& mc) {
  const auto j = nlohmann::json::parse(mc.rope_parameters_json, nullptr, false);
  const char* key = "original_max_position_embeddings";
  if (j.is_object() && j.contains(key) && j[key].is_number_integer()) return j[key].get<int64_t>();
  return mc.max_position_embeddings;
}

}  // namespace

int eval_main(int argc, char** argv) {
  std::string config, checkpoint, model_dir, out, label, title;
  std::vector<std::string> sets, disabled;
  int64_t seq_len = 0, max_sequences = 4, chunk = 256;
  int bins = 64;
  bool help = false;
  po::options_description desc(
      "lcx-train eval: loss by position of a model over long sequences\n\n"
      "Usage: lcx-train eval --config run.toml (--checkpoint DIR | --model DIR) --seq-len N --out DIR\n"
      "                      [--set KEY=VALUE]... [--disable NAME]... [--bins B] [--max-sequences K] [--label NAME]\n\n"
      "The sequences are [eval] source's when the manifest sets one, else [data] source's.\n"
      "Writes DIR/<label>.csv (label,bin_start,bin_end,mean_loss,count), DIR/<label>.tokens.csv (the token\n"
      "ids of each sequence), DIR/<label>.json (means, unigram entropy) and redraws DIR/loss_by_position.svg\n"
      "with every run in DIR.\n\nOptions");
  desc.add_options()
      ("config,c", po::value(&config)->value_name("FILE"), "the run's manifest: its [model], [data] and [plugins]")
      ("set,s", po::value(&sets)->composing()->value_name("KEY=VALUE"), "override a manifest key (repeatable)")
      ("disable,d", po::value(&disabled)->composing()->value_name("NAME"), "do not load this plugin (repeatable)")
      ("checkpoint", po::value(&checkpoint)->value_name("DIR"), "a checkpoint folder, or `latest` of [run] output_dir")
      ("model", po::value(&model_dir)->value_name("DIR"), "a Hugging Face model folder")
      ("seq-len", po::value(&seq_len)->value_name("N"), "tokens per evaluated sequence")
      ("out", po::value(&out)->value_name("DIR"), "folder for the CSV, JSON and SVG (shared by runs to compare)")
      ("bins", po::value(&bins)->value_name("B"), "position bins (default 64)")
      ("max-sequences", po::value(&max_sequences)->value_name("K"), "sequences evaluated, from the corpus start (default 4)")
      ("label", po::value(&label)->value_name("NAME"), "the run's name in the plot and file names (default: model folder@N)")
      ("title", po::value(&title)->value_name("TEXT"), "the plot's title")
      ("chunk-rows", po::value(&chunk)->value_name("R"), "rows of logits computed at once (default 256)")
      ("help,h", po::bool_switch(&help), "print this help");
  parse_subcommand(desc, argc, argv, "eval");
  if (help) {
    std::cout << desc;
    return 0;
  }
  if (config.empty()) throw Error("eval needs --config", "--config", "pass the run's manifest");
  if (checkpoint.empty() == model_dir.empty())
    throw Error("eval needs exactly one of --checkpoint and --model", "--model", "pass --checkpoint DIR or --model DIR");
  if (seq_len < 2) throw Error("eval needs --seq-len of at least 2", "--seq-len", "pass --seq-len 4096");
  if (out.empty()) throw Error("eval needs --out", "--out", "pass a folder for the results");
  if (max_sequences < 1) throw Error("--max-sequences must be at least 1", "--max-sequences", "pass --max-sequences 4");
  if (chunk < 1) throw Error("--chunk-rows must be at least 1", "--chunk-rows", "pass --chunk-rows 256");

  // The results' folder and their names, checked before the weights are loaded and the sequences evaluated.
  refuse_shared_folder(out, "--out");
  if (!label.empty() && (label == "." || label == ".." || label.find('/') != std::string::npos ||
                         label.find('\0') != std::string::npos))
    throw Error(str("--label '", label, "' is not a plain file name: the results are written to --out/<label>.csv"),
                "--label", "give a name without '/', e.g. --label base@4096");
  create_output_dir(out, "--out");
  Manifest manifest = load_run_manifest(config, sets);
  PluginLoader loader(PluginLoader::default_search_dirs(manifest.section("plugins").get_string("dir", "")));
  const CoreConfig core = read_core_config(manifest, requested_plugins(manifest, {}));
  const Device device = pick_device(core.run.device);
  choose_attention(core.run);
  Run run(core, resolve_slots(manifest, loader, disabled, device, configured_mesh(core.distributed)), device);
  if (run.slots().parallel->size() != 1)
    throw Error("eval runs on one rank", "distributed", "evaluate with --disable of the parallelism plugin");

  const std::string dir = checkpoint.empty() ? model_dir : resolve_checkpoint(core.run.output_dir, checkpoint);
  if (label.empty()) label = str(fs::path(dir).lexically_normal().filename().string(), "@", seq_len);

  check_eval_source(core);
  DataConfig dc = core.eval.source.empty() ? core.data : eval_data_config(core);
  dc.seq_len = seq_len;
  run.open_data(dc, true);
  run.load_or_init_weights(dir);  // a plain folder's weights, or an adapter checkpoint over [model]'s base
  run.configure_step();
  const SlotSet& slots = run.slots();
  if (seq_len > slots.positional->effective_max_positions())
    log::warn(str("sequences of ", seq_len, " tokens go beyond the ", slots.positional->effective_max_positions(),
                  " positions this model and positional encoding place correctly"));
  const Model& model = run.model();
  const Dataset& data = run.data();
  StepSlots& step = run.step();

  // The evaluated text's unigram entropy: the distribution of every target of the dataset.
  std::vector<int64_t> counts(static_cast<size_t>(model.config().vocab_size), 0);
  for (int64_t i = 0; i < data.num_sequences(); ++i) {
    const Sequence s = data.get(i);
    const int64_t* t = s.targets.data_as<int64_t>();
    for (int64_t k = 0; k < s.targets.numel(); ++k)
      if (t[k] >= 0 && t[k] < static_cast<int64_t>(counts.size())) counts[static_cast<size_t>(t[k])]++;
  }
  const double entropy = unigram_entropy(counts);

  PositionLoss pl;
  std::string tokens_csv = "sequence,token_ids\n";
  int64_t done = 0;
  double slot_sum = 0, own_sum = 0;  // the first sequence's, as a check
  for (int64_t i = 0; i < data.num_sequences() && done < max_sequences; ++i) {
    if (data.length(i) != seq_len) continue;  // the corpus' short tail
    const Sequence s = data.get(i);
    const auto t0 = std::chrono::steady_clock::now();
    const Shard shard = slots.parallel->shard(s, 0);
    const std::vector<float> loss = per_position_loss(step, shard, device, chunk);
    pl.add(loss, shard.targets);
    if (done == 0) {
      // The head and log-softmax here are eval's own; the Loss slot's sum over the same
      // sequence says they agree with what training optimizes.
      slot_sum = eval_step(step, shard, device).loss_sum;
      for (float v : loss) own_sum += v;
      if (std::fabs(slot_sum - own_sum) > 1e-3 * std::fabs(slot_sum))
        log::warn(str("per-position losses sum to ", own_sum, " but the loss slot gives ", slot_sum, " on sequence ", i));
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::string ids;
    const int32_t* tk = s.tokens.data_as<int32_t>();
    for (int64_t k = 0; k < s.tokens.numel(); ++k) ids += str(k ? " " : "", tk[k]);
    tokens_csv += str(i, ",", ids, "\n");
    ++done;
    log::info(str("eval ", label, ": sequence ", i, " (", done, "/", max_sequences, ") in ", secs, " s"));
  }
  if (done == 0)
    throw Error(str("the data holds no full sequence of ", seq_len, " tokens"), "--seq-len", "pass a smaller --seq-len or more data");

  RunCurve curve{label, bin_positions(pl, bins)};
  const double mean_all = pl.mean(0, seq_len);
  const int64_t tail_start = seq_len - seq_len / 10;
  const double mean_tail = pl.mean(tail_start, seq_len);
  write_text(fs::path(out) / (label + ".csv"), bins_csv(curve));
  write_text(fs::path(out) / (label + ".tokens.csv"), tokens_csv);
  nlohmann::json meta = {{"label", label},
                         {"model", dir},
                         {"seq_len", seq_len},
                         {"sequences", done},
                         {"effective_max_positions", slots.positional->effective_max_positions()},
                         {"trained_positions", trained_positions(model.config())},
                         {"disabled", disabled},
                         {"sets", sets},
                         {"mean_loss", mean_all},
                         {"mean_loss_last_10pct", mean_tail},
                         {"last_10pct_from", tail_start},
                         {"unigram_entropy_nats", entropy},
                         {"first_sequence_loss_sum", own_sum},
                         {"first_sequence_loss_slot_sum", slot_sum}};
  write_text(fs::path(out) / (label + ".json"), meta.dump(2) + "\n");

  auto runs = collect_runs({out}, nullptr);
  write_text(fs::path(out) / "loss_by_position.svg",
             loss_plot_svg(runs, entropy, title.empty() ? "loss by position" : title, trained_positions(model.config()),
                           "trained length"));
  std::printf("%s: %lld %s of %lld tokens, mean loss %.4f, last 10%% %.4f, unigram entropy %.4f nats\n", label.c_str(),
              static_cast<long long>(done), done == 1 ? "sequence" : "sequences", static_cast<long long>(seq_len), mean_all,
              mean_tail, entropy);
  return 0;
}

int eval_plot_main(int argc, char** argv) {
  std::vector<std::string> inputs;
  std::string out, title = "loss by position", mark_label = "trained length";
  double entropy = std::nan("");
  int64_t mark = 0;
  bool help = false;
  po::options_description desc(
      "lcx-train eval-plot: one SVG from the bins CSVs of lcx-train eval\n\n"
      "Usage: lcx-train eval-plot --out FILE.svg [--title TEXT] [--entropy NATS] [--mark N] CSV_OR_DIR...\n\n"
      "The entropy line comes from --entropy, else from the first <label>.json beside a CSV.\n\nOptions");
  desc.add_options()
      ("out", po::value(&out)->value_name("FILE"), "the SVG to write")
      ("title", po::value(&title)->value_name("TEXT"), "the plot's title")
      ("entropy", po::value(&entropy)->value_name("NATS"), "the dashed reference line")
      ("mark", po::value(&mark)->value_name("N"),
       "a dotted vertical line at position N; default: the trained length in the first <label>.json")
      ("mark-label", po::value(&mark_label)->value_name("TEXT"), "its name (default: trained length)")
      ("input", po::value(&inputs)->composing(), "bins CSVs or folders of them")
      ("help,h", po::bool_switch(&help), "print this help");
  po::positional_options_description pos;
  pos.add("input", -1);
  po::variables_map vm;
  try {
    po::store(po::command_line_parser(argc, argv).options(desc).positional(pos).run(), vm);
    po::notify(vm);
  } catch (const po::error& e) {
    throw Error(e.what(), {}, "see lcx-train eval-plot --help");
  }
  if (help) {
    std::cout << desc;
    return 0;
  }
  if (out.empty() || inputs.empty())
    throw Error("eval-plot needs --out and at least one CSV or folder", "--out", "see lcx-train eval-plot --help");
  auto runs = collect_runs(inputs, &entropy, &mark);
  if (runs.empty()) throw Error("no bins CSV found in the inputs", {}, "give CSVs written by lcx-train eval");
  write_text(out, loss_plot_svg(runs, entropy, title, mark, mark_label));
  std::printf("%s: %zu %s\n", out.c_str(), runs.size(), runs.size() == 1 ? "run" : "runs");
  return 0;
}

}  // namespace lcx
