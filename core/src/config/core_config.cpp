#include "config/core_config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>
#include <nlohmann/json.hpp>
#include <optional>

#include "lcx/error.h"
#include "util/text.h"

namespace lcx {

const std::vector<std::string>& core_section_names() {
  static const std::vector<std::string> names = {"run", "model", "data", "eval", "train", "plugins", "distributed"};
  return names;
}

namespace {

constexpr int64_t kMaxRanksPerNode = 1024;

// Core's keys that name a file or folder.
constexpr const char* kPathKeys[][2] = {{"run", "output_dir"}, {"model", "path"},         {"data", "tokenizer"},
                                        {"data", "source"},     {"data", "cache_dir"},      {"data", "chat_template"},
                                        {"eval", "source"},     {"plugins", "dir"}};

// A plugin's table names a file or folder by a key `init_from` or one ending in `_dir` or `_path`:
// made absolute as core's own path keys are, so a plugin never reads a path against the working
// folder.
bool plugin_path_key(std::string_view key) {
  return key == "init_from" || key.ends_with("_dir") || key.ends_with("_path");
}

// Each relative path key of `root` made absolute against `base`, in place (the node keeps its
// source line, for errors).
void resolve_paths(toml::table& root, const std::filesystem::path& base) {
  auto resolve = [&](toml::value<std::string>* v) {
    // A blank value stays blank, for the key's own check to refuse it by name.
    if (!v || v->get().find_first_not_of(" \t\r\n") == std::string::npos || std::filesystem::path(v->get()).is_absolute())
      return;
    v->get() = (base / v->get()).lexically_normal().string();
  };
  for (const auto& [section, key] : kPathKeys) {
    toml::table* t = root[section].as_table();
    resolve(t ? t->get_as<std::string>(key) : nullptr);
  }
  if (toml::table* data = root["data"].as_table())
    if (toml::array* sources = data->get_as<toml::array>("sources"))
      for (auto&& entry : *sources)
        if (toml::table* t = entry.as_table()) resolve(t->get_as<std::string>("path"));
  static const std::set<std::string_view> core_sections = {"run", "model", "data", "train", "eval", "plugins", "distributed"};
  for (auto&& [name, node] : root) {
    toml::table* t = node.as_table();
    if (!t || core_sections.count(name.str())) continue;
    for (auto&& [key, value] : *t)
      if (plugin_path_key(key.str())) resolve(value.as_string());
  }
}

// The table at `path` of the manifest as compact JSON ("{}" when absent).
std::string toml_table_json(const Manifest& m, const std::vector<std::string>& path) {
  nlohmann::json j = nlohmann::json::parse(m.to_json(), nullptr, false);
  for (const auto& k : path) {
    if (!j.is_object() || !j.contains(k)) return "{}";
    j = j[k];
  }
  return j.is_object() ? j.dump() : "{}";
}

// [[data.sources]]: each table's path and its weight or fraction, every source alike.
std::vector<DataSource> read_data_sources(const Manifest& m, const ConfigView& v) {
  if (!v.has("sources")) {
    // Absent, the key still gets its line in the reference (a getter records type and default).
    v.table("sources");
    return {};
  }
  nlohmann::json j = nlohmann::json::parse(m.to_json(), nullptr, false);
  const nlohmann::json& list = j["data"]["sources"];
  const std::string fix = "give each source as a table: [[data.sources]] path = \"a.jsonl\" weight = 3 (or fraction = 0.5)";
  if (!list.is_array() || list.empty()) v.fail("sources", "is not a list of tables", fix);
  std::vector<DataSource> out;
  int by_weight = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& t = list[i];
    const std::string at = str("sources[", i, "]");
    if (!t.is_object()) v.fail("sources", str(at, " is not a table"), fix);
    for (const auto& [k, _] : t.items())
      if (k != "path" && k != "weight" && k != "fraction")
        v.fail("sources", str(at, " has an unknown key `", k, "`"), "a source has path and weight (or fraction)");
    DataSource d;
    if (!t.contains("path") || !t["path"].is_string() || t["path"].get<std::string>().empty())
      v.fail("sources", str(at, " has no path"), fix);
    d.path = t["path"].get<std::string>();
    const bool w = t.contains("weight"), f = t.contains("fraction");
    if (w == f) v.fail("sources", str(at, w ? " has both weight and fraction" : " has neither weight nor fraction"), fix);
    const nlohmann::json& n = w ? t["weight"] : t["fraction"];
    if (!n.is_number() || n.get<double>() <= 0)
      v.fail("sources", str(at, ".", w ? "weight" : "fraction", " is ", n.dump(), ", not a number > 0"), fix);
    (w ? d.weight : d.fraction) = n.get<double>();
    by_weight += w;
    out.push_back(std::move(d));
  }
  if (by_weight != 0 && by_weight != static_cast<int>(out.size()))
    v.fail("sources", "mixes weight and fraction", "give every source a weight (shares of the mixture) or every one a fraction (shares of itself)");
  return out;
}

}  // namespace

std::string data_sources_text(const DataConfig& d) {
  std::string s;
  for (const DataSource& x : d.sources)
    s += str(s.empty() ? "" : "; ", x.path, x.weight > 0 ? str(" weight=", x.weight) : str(" fraction=", x.fraction));
  return s;
}

DataConfig eval_data_config(const CoreConfig& c) {
  DataConfig d = c.data;
  if (!c.eval.source.empty()) d.source = c.eval.source;
  d.shuffle = false;
  return d;
}

void resolve_manifest_paths(Manifest& m, const std::string& base) {
  m.edit([&](toml::table& root) { resolve_paths(root, base); });
}

Manifest load_run_manifest(const std::string& path, const std::vector<std::string>& sets) {
  Manifest m = Manifest::load(path);
  resolve_manifest_paths(m, std::filesystem::absolute(path).parent_path().string());
  for (const auto& s : sets) m.set(s);
  resolve_manifest_paths(m, std::filesystem::current_path().string());
  return m;
}

static void one_of(const ConfigView& v, const std::string& key, const std::string& value,
                   const std::vector<std::string>& allowed) {
  v.describe(key, {}, join(allowed, ", "));
  if (std::find(allowed.begin(), allowed.end(), value) == allowed.end())
    v.fail(key, str("'", value, "' is not allowed"), str("use one of: ", join(allowed, ", ")));
}

// A value outside its range, refused with the key, the value and the range.
template <typename T>
static void need(const ConfigView& v, const std::string& key, T value, bool ok, const std::string& range,
                 const std::string& fix = {}) {
  v.describe(key, {}, range.rfind("must be ", 0) == 0 ? range.substr(8) : range);
  if (!ok) v.fail(key, str(value, " is out of range: ", range), fix);
}

CoreConfig read_core_config(const Manifest& m, const std::vector<std::string>& plugin_names) {
  CoreConfig c;
  {
    ConfigView v = m.section("run");
    v.describe("output_dir", "the run's folder: log.jsonl, metrics.jsonl, checkpoints, TensorBoard events");
    v.describe("seed", "seed of the random initialisation and of the data's shuffle");
    v.describe("device", "where the run computes: auto takes the GPU when there is one");
    v.describe("log_level", "the lowest level of the log's lines, on the terminal and in log.jsonl");
    v.describe("memory_timeline", "record one step's allocations: memory_timeline.json and an SVG in output_dir");
    v.describe("memory_timeline_step", "which step the memory timeline records, 1 = the first", ">= 1");
    v.describe("profile", "time every op of one step: a table in the log and a JSON trace in output_dir");
    v.describe("profile_step", "which step is profiled, 1 = the first (2 leaves out the warm-up)", ">= 1");
    c.run.output_dir = v.get_string("output_dir", c.run.output_dir);
    if (c.run.output_dir.find_first_not_of(" \t\r\n") == std::string::npos)
      v.fail("output_dir", c.run.output_dir.empty() ? "is empty" : "is blank", "give the run's folder, e.g. output_dir = \"runs/my-run\" (created when missing)");
    c.run.seed = v.get_int("seed", c.run.seed);
    c.run.device = v.get_string("device", c.run.device);
    one_of(v, "device", c.run.device, {"auto", "cpu", "cuda"});
    c.run.log_level = v.get_string("log_level", c.run.log_level);
    one_of(v, "log_level", c.run.log_level, {"debug", "info", "warn", "error"});
    c.run.memory_timeline = v.get_bool("memory_timeline", c.run.memory_timeline);
    c.run.memory_timeline_step = v.get_int("memory_timeline_step", c.run.memory_timeline_step);
    if (c.run.memory_timeline_step < 1)
      v.fail("memory_timeline_step", str("must be 1 or more, got ", c.run.memory_timeline_step),
             "1 records the first step of the run, 2 the second (without the first step's one-time allocations)");
    c.run.profile = v.get_bool("profile", c.run.profile);
    c.run.profile_step = v.get_int("profile_step", c.run.profile_step);
    if (c.run.profile_step < 1)
      v.fail("profile_step", str("must be 1 or more, got ", c.run.profile_step),
             "2 (the default) profiles the second step of the run, without the first step's warm-up");
    v.describe("rehearse", "one step's allocations at full size with the attention math cut, measured against the plan");
    c.run.rehearse = v.get_bool("rehearse", c.run.rehearse);
    v.describe("attention", "which kernels run the GPU's attention: auto picks per call (cuDNN; the Hopper forward from "
               "131,072 causal rows; else lcx's own); own: lcx's own kernels, never cuDNN; sm80: auto without the Hopper "
               "kernels (what an A100 runs); cudnn, hopper (H100/H200), mma (tensor cores, sm_80+) or reference (fp32): "
               "that backend alone, a call it cannot serve an error");
    c.run.attention = v.get_string("attention", c.run.attention);
    one_of(v, "attention", c.run.attention, {"auto", "cudnn", "own", "hopper", "mma", "reference", "sm80"});
    v.describe("grouped_gemm", "which kernels run the experts' grouped GEMMs: cublas, cuBLAS's grouped GEMM; hopper "
               "(experimental: not yet verified at a step's sizes), lcx's Hopper kernels on an H100/H200 where they "
               "serve (bf16, widths of 256s), cuBLAS's elsewhere and under attention = \"sm80\"");
    c.run.grouped_gemm = v.get_string("grouped_gemm", c.run.grouped_gemm);
    one_of(v, "grouped_gemm", c.run.grouped_gemm, {"cublas", "hopper"});
    // A memory budget: "auto" or a size parse_memory_size reads.
    auto budget = [&v](const char* key, std::string& value, const char* meaning) {
      try {
        value = v.get_string(key, value);
      } catch (const Error&) {  // a bare number: its unit is unknown
        v.fail(key, "expected a string: a size with its unit, or \"auto\"",
               str("write it in quotes with its unit, e.g. ", key, " = \"80GiB\", or \"auto\" (", meaning, ")"));
      }
      if (value == "auto") return;
      try {
        parse_memory_size(value, str("run.", key));
      } catch (const Error& e) {
        v.fail(key, e.what(), str("\"auto\" (", meaning, ") or a size such as \"40GiB\""));
      }
    };
    v.describe("gpu_memory", "the GPU memory the plan's recipe may use; the fastest recipe that fits it is taken",
               "\"auto\" (the device's) or a size, e.g. \"40GiB\"");
    budget("gpu_memory", c.run.gpu_memory, "the device's memory");
    v.describe("host_memory", "the host memory this node's ranks may pin together",
               "\"auto\" (MemAvailable and the cgroup's room) or a size, e.g. \"200GiB\"");
    budget("host_memory", c.run.host_memory, "what the host and the cgroup leave");
    v.describe("gpu_name", "the GPU whose rates row (share/lcx/rates.toml) times the plan's recipes; empty: this GPU's, "
               "else the H200's", {}, "this GPU's");
    c.run.gpu_name = v.get_string("gpu_name", c.run.gpu_name);
    v.describe("peak_tflops", "the dense bf16 peak the MFU is reported against, TFLOP/s; 0: the rates row's peak_flops",
               ">= 0");
    c.run.peak_tflops = v.get_double("peak_tflops", c.run.peak_tflops);
    if (!(c.run.peak_tflops >= 0) || !std::isfinite(c.run.peak_tflops))
      v.fail("peak_tflops", str("must be a positive number of TFLOP/s, got ", c.run.peak_tflops),
             "the GPU's dense bf16 peak, e.g. 989.4 (H100/H200 SXM); leave it out for the rates table's");
    v.check_unknown();
  }
  {
    ConfigView v = m.section("model");
    v.describe("module", "the model module plugin that builds the model, e.g. \"qwen3\"");
    v.describe("path", "a Hugging Face model folder (config.json, safetensors) to load and fine-tune");
    v.describe("init", "random weights instead of `path`: a preset name or a JSON object of config.json keys");
    v.describe("dtype", "the weights' dtype on the device");
    c.model.module = v.get_string("module", c.model.module);
    c.model.path = v.get_string("path", c.model.path);
    c.model.init = v.get_string("init", c.model.init);
    c.model.dtype = v.get_string("dtype", c.model.dtype);
    one_of(v, "dtype", c.model.dtype, {"bf16", "fp16", "fp32"});
    if (!c.model.path.empty() && !c.model.init.empty())
      v.fail("init", "both `path` and `init` are set", "keep `path` to load a checkpoint, or `init` for random weights");
    v.check_unknown();
  }
  {
    ConfigView v = m.section("data");
    v.describe("tokenizer", "the tokenizer.json that turns text into token ids");
    v.describe("source", "the training data: a file or a folder of .txt, .jsonl or .json files (each may be .gz or "
               ".zst), or a .tokens file; a file that is not what its name says is refused");
    v.describe("format", "how `source` is read; auto goes by the file names, and records whose first one has "
               "`messages` or ShareGPT's `conversations` (or `prompt` and `completion`) are read as chat (or "
               "prompt_completion), others as text from text_field");
    v.describe("loss_on", "which tokens train: the assistant's turns (content, reasoning the template keeps, tool calls "
               "and the turn's closing tokens, not its role header), the completion, or every token; auto: assistant "
               "for chat, completion for prompt_completion, all for text");
    v.describe("chat_template", "the Jinja chat template conversations are rendered with: a template file or a "
               "tokenizer_config.json; \"\": the tokenizer_config.json beside data.tokenizer", {}, "\"\" (beside the tokenizer)");
    v.describe("chat_template_kwargs", "variables the chat template sees, e.g. {enable_thinking = false} for Qwen3; "
               "--set data.chat_template_kwargs.enable_thinking=false");
    v.describe("text_field", "the field of each .jsonl line that holds its text");
    v.describe("seq_len", "tokens in one training sequence (documents are packed end to end)", ">= 2");
    v.describe("pad_to_multiple_of", "the last, shorter sequence is padded to a multiple of this");
    v.describe("shuffle", "shuffle the order of the sequences each epoch (seeded by run.seed)");
    v.describe("cache_dir", "where token caches are kept; \"\": .lcx-cache beside the source", {}, "\"\" (beside the source)");
    v.describe("drop_last", "drop the final partial sequence instead of padding it");
    v.describe("attend_across_documents",
               "false: each packed document attends only to itself and its positions restart; true: one text");
    v.describe("sources", "instead of source, several sources mixed: [[data.sources]] tables of path and weight (its "
               "share of the mixture's sequences, relative to the others') or fraction (this share of its own "
               "sequences; 2 repeats each twice); drawn and interleaved by run.seed, the same on resume",
               "an array of tables: [[data.sources]] path = \"a.jsonl\" weight = 3", "none");
    v.describe("packing", "stream: documents end to end, each sequence cut at seq_len (a document may continue into "
               "the next sequence, without its start); bfd: best-fit decreasing, as TRL's, each sequence holds whole "
               "documents and the rest is padding");
    v.describe("overlong", "a document longer than seq_len: continue (its rest goes on in the next sequences), "
               "truncate (its first seq_len tokens are kept) or drop (it is left out); the log counts them");
    c.data.tokenizer = v.get_string("tokenizer", c.data.tokenizer);
    // A model folder carries its tokenizer: unset, the tokenizer is model.path's.
    if (c.data.tokenizer.empty() && !c.model.path.empty())
      c.data.tokenizer = (std::filesystem::path(c.model.path) / "tokenizer.json").string();
    c.data.source = v.get_string("source", c.data.source);
    c.data.sources = read_data_sources(m, v);
    if (!c.data.sources.empty() && !c.data.source.empty())
      v.fail("sources", "lists sources and data.source names one too", "keep one: data.source, or [[data.sources]] tables");
    c.data.format = v.get_string("format", c.data.format);
    one_of(v, "format", c.data.format, {"auto", "txt", "jsonl", "tokens", "chat", "prompt_completion"});
    c.data.text_field = v.get_string("text_field", c.data.text_field);
    c.data.loss_on = v.get_string("loss_on", c.data.loss_on);
    one_of(v, "loss_on", c.data.loss_on, {"auto", "all", "assistant", "completion"});
    c.data.chat_template = v.get_string("chat_template", c.data.chat_template);
    // Any table: its keys are the template's variables, not lcx's.
    v.table("chat_template_kwargs");
    c.data.chat_template_kwargs = toml_table_json(m, {"data", "chat_template_kwargs"});
    c.data.seq_len = v.get_int("seq_len", c.data.seq_len);
    if (c.data.seq_len < 2) v.fail("seq_len", str(c.data.seq_len, " is too short"), "use at least 2 tokens");
    c.data.pad_to_multiple_of = v.get_int("pad_to_multiple_of", c.data.pad_to_multiple_of);
    need(v, "pad_to_multiple_of", c.data.pad_to_multiple_of, c.data.pad_to_multiple_of >= 1, "must be >= 1");
    c.data.shuffle = v.get_bool("shuffle", c.data.shuffle);
    c.data.cache_dir = v.get_string("cache_dir", c.data.cache_dir);
    c.data.drop_last = v.get_bool("drop_last", c.data.drop_last);
    c.data.attend_across_documents = v.get_bool("attend_across_documents", c.data.attend_across_documents);
    c.data.packing = v.get_string("packing", c.data.packing);
    one_of(v, "packing", c.data.packing, {"stream", "bfd"});
    c.data.overlong = v.get_string("overlong", c.data.overlong);
    one_of(v, "overlong", c.data.overlong, {"continue", "truncate", "drop"});
    v.check_unknown();
  }
  {
    ConfigView v = m.section("eval");
    auto& e = c.eval;
    v.describe("source", "held-out data whose loss is measured during training, read as [data] reads its source "
               "(its tokenizer, seq_len, format, masks); \"\" turns evaluation off", {}, "\"\" (no evaluation)");
    v.describe("every", "evaluate after every this many optimizer steps; 0: not during training", ">= 0");
    v.describe("max_sequences", "evaluate the first this many sequences of source; 0: all of them", ">= 0");
    v.describe("at_start", "evaluate once before the first step (the starting weights' loss)");
    v.describe("split", "instead of source: this share of [data]'s sequences is held out and evaluated, drawn from "
               "run.seed and never trained on (with data.packing = \"bfd\" each held-out sequence holds whole "
               "documents); 0: none", "0 <= split < 1");
    e.source = v.get_string("source", e.source);
    e.every = v.get_int("every", e.every);
    need(v, "every", e.every, e.every >= 0, "must be >= 0", "0 turns evaluation during training off; 100 evaluates every 100 steps");
    e.max_sequences = v.get_int("max_sequences", e.max_sequences);
    need(v, "max_sequences", e.max_sequences, e.max_sequences >= 0, "must be >= 0", "0 evaluates every sequence of eval.source");
    e.at_start = v.get_bool("at_start", e.at_start);
    e.split = v.get_double("split", e.split);
    need(v, "split", e.split, e.split >= 0 && e.split < 1, "must be >= 0 and < 1", "0.01 holds out 1% of the sequences");
    if (e.split > 0 && !e.source.empty())
      v.fail("split", "holds out part of [data] but eval.source names held-out data already",
             "keep one: eval.source = \"\" to evaluate on a share of [data], or split = 0");
    if (e.split > 0 && e.every == 0 && !e.at_start)
      v.fail("split", "holds out data that no evaluation reads", "set [eval] every (e.g. 100) or at_start = true, or split = 0");
    if (e.source.empty() && e.split == 0 && (e.every > 0 || e.at_start))
      v.fail(e.every > 0 ? "every" : "at_start", "asks for an evaluation but neither eval.source nor eval.split is set",
             "set [eval] source to held-out data (any source [data] reads) or split to a share of [data] (0.01), or leave "
             "every = 0 and at_start = false");
    v.check_unknown();
  }
  {
    ConfigView v = m.section("train");
    auto& t = c.train;
    v.describe("lr", "the peak learning rate of AdamW");
    v.describe("schedule", "the learning rate's shape after the warm-up");
    v.describe("warmup_steps", "steps of linear warm-up from 0 to lr");
    v.describe("max_steps", "optimizer steps to run; -1 runs `epochs` epochs");
    v.describe("epochs", "passes over the data when max_steps is -1 (fractions allowed)");
    v.describe("weight_decay", "AdamW's decoupled weight decay");
    v.describe("beta1", "AdamW's first-moment decay");
    v.describe("beta2", "AdamW's second-moment decay");
    v.describe("eps", "AdamW's epsilon");
    v.describe("max_grad_norm", "clip the gradients to this global norm; 0 turns clipping off");
    v.describe("grad_accum", "sequences whose gradients are summed into one optimizer step");
    v.describe("master_dtype", "the dtype of the master weights and AdamW's moments");
    v.describe("grad_dtype", "the GEMM weights' gradients: auto keeps the weights' dtype where nothing needs fp32");
    v.describe("checkpoint_every",
               "gradient checkpointing: save every k-th layer's input and recompute the rest in the backward; auto: the plan's choice");
    v.describe("rebuild_each",
               "with checkpoint_every >= 3: rebuild each recomputed layer input from the saved one, holding one at a time "
               "(less memory, more forward); auto: the plan's choice",
               "true, false, \"auto\"", "\"auto\"");
    v.describe("save_steps", "save a checkpoint every this many steps; 0 saves only at the end");
    v.describe("keep_checkpoints", "how many checkpoints are kept; older ones are deleted; 0 keeps all");
    v.describe("save_final", "save a checkpoint after the last step");
    v.describe("log_every", "print and record the step's metrics every this many steps");
    t.lr = v.get_double("lr", t.lr);
    need(v, "lr", t.lr, t.lr >= 0 && std::isfinite(t.lr), "must be >= 0 and finite", "e.g. lr = 2e-5");
    t.schedule = v.get_string("schedule", t.schedule);
    one_of(v, "schedule", t.schedule, {"constant", "linear", "cosine"});
    t.warmup_steps = v.get_int("warmup_steps", t.warmup_steps);
    need(v, "warmup_steps", t.warmup_steps, t.warmup_steps >= 0, "must be >= 0", "0 starts at the full learning rate");
    t.max_steps = v.get_int("max_steps", t.max_steps);
    need(v, "max_steps", t.max_steps, t.max_steps >= 1 || t.max_steps == -1,
         "must be >= 1, or -1 (the default) to run `epochs` epochs");
    t.epochs = v.get_double("epochs", t.epochs);
    need(v, "epochs", t.epochs, t.epochs > 0 && std::isfinite(t.epochs), "must be > 0 and finite");
    t.weight_decay = v.get_double("weight_decay", t.weight_decay);
    need(v, "weight_decay", t.weight_decay, t.weight_decay >= 0 && std::isfinite(t.weight_decay),
         "must be >= 0 and finite", "0 turns decay off; 0.01 to 0.1 is usual");
    t.beta1 = v.get_double("beta1", t.beta1);
    need(v, "beta1", t.beta1, t.beta1 >= 0 && t.beta1 < 1, "must be in [0, 1)", "0.9 is AdamW's default");
    t.beta2 = v.get_double("beta2", t.beta2);
    need(v, "beta2", t.beta2, t.beta2 >= 0 && t.beta2 < 1, "must be in [0, 1)", "0.999 is AdamW's default");
    t.eps = v.get_double("eps", t.eps);
    need(v, "eps", t.eps, t.eps > 0 && std::isfinite(t.eps), "must be > 0 and finite", "1e-8 is AdamW's default");
    t.max_grad_norm = v.get_double("max_grad_norm", t.max_grad_norm);
    need(v, "max_grad_norm", t.max_grad_norm, t.max_grad_norm >= 0 && !std::isnan(t.max_grad_norm),
         "must be >= 0 (0 turns clipping off)");
    t.grad_accum = v.get_int("grad_accum", t.grad_accum);
    // Far past any step's sequences, and a bound that keeps the step's count and the data's
    // position inside 64 bits.
    need(v, "grad_accum", t.grad_accum, t.grad_accum >= 1 && t.grad_accum <= (int64_t{1} << 20),
         "must be in [1, 1048576]");
    t.master_dtype = v.get_string("master_dtype", t.master_dtype);
    one_of(v, "master_dtype", t.master_dtype, {"fp32", "bf16"});
    t.grad_dtype = v.get_string("grad_dtype", t.grad_dtype);
    one_of(v, "grad_dtype", t.grad_dtype, {"auto", "fp32", "bf16"});
    {
      const char* fix = "\"auto\" (the plan's choice) or a count >= 1: 1 saves every layer's input, k every k-th";
      const std::optional<int64_t> every = v.get_int_or_auto("checkpoint_every", fix);
      t.checkpoint_every = every.value_or(0);
      need(v, "checkpoint_every", t.checkpoint_every, !every || *every >= 1, "must be >= 1", fix);
    }
    try {
      const bool on = v.get_bool("rebuild_each", false);
      t.rebuild_each = v.has("rebuild_each") ? (on ? 1 : 0) : -1;
    } catch (const Error&) {  // not a bool: the one string it may be is "auto"
      const std::string text = v.get_string("rebuild_each", "auto");
      if (text != "auto")
        v.fail("rebuild_each", str("'", text, "' is neither true, false nor \"auto\""), "true, false or \"auto\" (the plan's choice)");
    }
    t.save_steps = v.get_int("save_steps", t.save_steps);
    need(v, "save_steps", t.save_steps, t.save_steps >= 0, "must be >= 0 (0 saves only at the end)");
    t.keep_checkpoints = v.get_int("keep_checkpoints", t.keep_checkpoints);
    need(v, "keep_checkpoints", t.keep_checkpoints, t.keep_checkpoints >= 0, "must be >= 0 (0 keeps every checkpoint)");
    t.save_final = v.get_bool("save_final", t.save_final);
    t.log_every = v.get_int("log_every", t.log_every);
    need(v, "log_every", t.log_every, t.log_every >= 1, "must be >= 1", "1 logs every step");
    v.check_unknown();
  }
  {
    ConfigView v = m.section("plugins");
    v.describe("dir", "a folder searched first for plugins, relative to the manifest's folder", {}, "\"\" (the installed plugins)");
    v.describe("load", "the plugins this run loads, by name (each brings its own [name] table)");
    c.plugins.dir = v.get_string("dir", c.plugins.dir);
    if (!c.plugins.dir.empty() && std::filesystem::path(c.plugins.dir).is_relative())
      c.plugins.dir = (std::filesystem::path(m.source()).parent_path() / c.plugins.dir).lexically_normal().string();
    c.plugins.load = v.get_strings("load", c.plugins.load);
    v.check_unknown();
  }
  {
    ConfigView v = m.section("distributed");
    auto& d = c.distributed;
    v.describe("nproc_per_node", "processes (GPUs) on this node, one rank each", ">= 1");
    v.describe("dp", "data-parallel ranks: each takes other sequences; 1 widens to the ranks cp x sp leave", ">= 1");
    v.describe("cp", "context-parallel ranks: one sequence split along its tokens", ">= 1");
    v.describe("sp", "sequence-parallel ranks: the sequence split, attention by heads", ">= 1");
    v.describe("order", "which mesh axis takes neighbouring ranks");
    v.describe("ep",
               "expert parallelism: every ep consecutive ranks split each sparse layer's experts (a mixture of experts)",
               "a divisor of the world size and of the model's experts");
    v.describe("shard_parameters", "parameters, gradients and optimizer state split across the ranks (ZeRO-3/FSDP)");
    v.describe("virtual_ranks", "ranks as threads of one process sharing one GPU (tests, debugging)");
    v.describe("timeout_s", "seconds a collective may wait before the run fails");
    d.nproc_per_node = v.get_int("nproc_per_node", d.nproc_per_node);
    d.dp = v.get_int("dp", d.dp);
    d.cp = v.get_int("cp", d.cp);
    d.sp = v.get_int("sp", d.sp);
    d.ep = v.get_int("ep", d.ep);
    const std::string order = v.get_string("order", mesh_order_name(d.order));
    one_of(v, "order", order, {"sp_inner", "cp_inner"});
    d.order = order == "cp_inner" ? MeshOrder::cp_inner : MeshOrder::sp_inner;
    for (const char* k : {"nproc_per_node", "dp", "cp", "sp", "ep"})
      if (v.get_int(k, 1) < 1) v.fail(k, "must be >= 1");
    // Ranks of one node: a GPU each, or a thread each (virtual_ranks, the CPU).
    need(v, "nproc_per_node", d.nproc_per_node, d.nproc_per_node <= kMaxRanksPerNode, str("at most ", kMaxRanksPerNode),
         "one rank per GPU of the node (8 on an HGX node); more nodes are started by torchrun or srun");
    d.shard_parameters = v.get_bool("shard_parameters", d.shard_parameters);
    d.virtual_ranks = v.get_bool("virtual_ranks", d.virtual_ranks);
    d.timeout_s = v.get_double("timeout_s", d.timeout_s);
    need(v, "timeout_s", d.timeout_s, d.timeout_s > 0 && !std::isnan(d.timeout_s), "must be > 0 (seconds per collective)");
    v.check_unknown();
  }
  std::vector<std::string> known = core_section_names();
  known.insert(known.end(), plugin_names.begin(), plugin_names.end());
  for (const auto& name : m.table_names()) {
    if (std::find(known.begin(), known.end(), name) != known.end()) continue;
    std::string near = closest(name, known);
    throw Error(str(m.section(name).where(), ": unknown table [", name, "]",
                    near.empty() ? "" : str(": did you mean [", near, "]?")),
                name,
                str("tables are the core sections (", join(core_section_names(), ", "),
                    ") and the plugins listed in [plugins] load"));
  }
  return c;
}

}  // namespace lcx
