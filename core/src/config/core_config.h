// Core's own manifest sections, read and validated in one place. Each section rejects unknown
// keys like a plugin table does. Plugin tables are named after the plugin ([<name>]).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/manifest.h"
#include "lcx/mesh_shape.h"

namespace lcx {

struct RunConfig {
  std::string output_dir = "runs/default";
  int64_t seed = 0;
  std::string device = "auto";  // auto | cpu | cuda
  std::string log_level = "info";
  bool memory_timeline = false;
  int64_t memory_timeline_step = 1;  // which step of this run the timeline records, 1 = the first
  bool profile = false;        // a trace of one step: every op timed, by kind and phase
  int64_t profile_step = 2;    // which step of this run, 1 = the first (2 leaves out its warm-up)
  // The GPU memory the plan's recipe may use: "auto" (the device's), or a size ("40GiB") to leave
  // room for another process or to match a budget; the fastest recipe that fits it is taken.
  std::string gpu_memory = "auto";
  // The host memory this node's ranks may pin together: "auto" (MemAvailable and the cgroup's
  // room, lcx/pinned.h), or a size; a recipe whose pinned bytes x local ranks pass it is refused.
  std::string host_memory = "auto";
  // The GPU whose rates the plan's times use (its row of the rates table, plan/rates.h): "" for
  // this GPU's, or the shipped H200 row where there is none.
  std::string gpu_name;
  // The dense peak the MFU is reported against, TFLOP/s; 0: the rates row's peak_flops.
  double peak_tflops = 0;
  // One step's allocations at full length and depth with the attention math cut, the measured
  // peaks compared with the plan's (train/trainer.cpp); nothing saved, its loss meaningless.
  bool rehearse = false;
  // Which kernels run the GPU's attention (kernels/attention/dispatch.h): auto | cudnn | own |
  // hopper | mma | reference.
  std::string attention = "auto";
  // Which kernels run the experts' grouped GEMMs: cublas (cuBLAS's grouped GEMM) | hopper (lcx's
  // Hopper kernels on an H100/H200 where they serve, cuBLAS's elsewhere; not yet verified at a
  // step's sizes, so not the default).
  std::string grouped_gemm = "cublas";
};

struct ModelSection {
  std::string module;  // the model module plugin, e.g. "qwen3"
  std::string path;    // an HF folder to load
  std::string init;    // a preset name or a JSON object of config.json keys, for random init
  std::string dtype = "bf16";
};

// One of several sources mixed into the training data ([[data.sources]]).
struct DataSource {
  std::string path;
  double weight = 0;    // its share of the mixture's sequences, relative to the others' weights
  double fraction = 0;  // or: this share of its own sequences (2 = each twice)
};

struct DataConfig {
  std::string tokenizer;
  std::string source;
  std::vector<DataSource> sources;  // instead of `source`: several, mixed by seed
  std::string format = "auto";  // auto | txt | jsonl | tokens | chat | prompt_completion
  std::string text_field = "text";
  // Which tokens train: auto (assistant for chat, completion for prompt_completion, else all) |
  // all | assistant | completion.
  std::string loss_on = "auto";
  // The chat template: a Jinja file, or a tokenizer_config.json holding one; "": the
  // tokenizer_config.json beside the tokenizer. Checkpoints carry the one the run trained with.
  std::string chat_template;
  std::string chat_template_kwargs = "{}";  // the [data.chat_template_kwargs] table as compact JSON
  int64_t seq_len = 4096;
  int64_t pad_to_multiple_of = 1;
  bool shuffle = true;
  std::string cache_dir;
  bool drop_last = false;  // drop the final partial sequence instead of padding it
  // false: a token attends only to its own document and positions restart at each one (packed
  // documents masked); true: the packed sequence is one text.
  bool attend_across_documents = false;
  // stream: documents end to end, cut every seq_len; bfd: best-fit decreasing, whole documents in
  // each sequence and the rest padded.
  std::string packing = "stream";
  // A document longer than seq_len: continue (into the next sequences) | truncate | drop.
  std::string overlong = "continue";
};

// [eval]: the loss on held-out data during training, forward only through the step's slots.
struct EvalConfig {
  std::string source;         // read as [data] reads its source; "" = no evaluation
  int64_t every = 0;          // optimizer steps between evaluations; 0 = none during training
  int64_t max_sequences = 0;  // the first sequences of source evaluated; 0 = all of them
  bool at_start = false;      // one evaluation before the first step
  // A share of [data]'s sequences held out for evaluation instead of a source: drawn from
  // run.seed, never trained on; 0 = none.
  double split = 0;
  bool enabled() const { return (!source.empty() || split > 0) && (every > 0 || at_start); }
};

struct TrainConfig {
  double lr = 2e-5;
  std::string schedule = "linear";  // constant | linear | cosine
  int64_t warmup_steps = 0;
  int64_t max_steps = -1;
  double epochs = 1;
  double weight_decay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double max_grad_norm = 1.0;
  int64_t grad_accum = 1;
  std::string master_dtype = "fp32";
  // The GEMM weights' gradients: "auto" keeps them in the weights' dtype where nothing needs fp32
  // (no fp32 master, no accumulation over sequences, one rank), as PyTorch does; else fp32.
  std::string grad_dtype = "auto";
  // Save the input of every k-th layer only and rebuild the others in the backward (Recipe::
  // checkpoint_every); 0: "auto", the plan's choice.
  int64_t checkpoint_every = 0;
  // With checkpoint_every >= 3, rebuild each unsaved input from the segment's saved one rather
  // than holding the segment's (Recipe::rebuild_each): -1 "auto" (the plan's choice), 0 or 1.
  int rebuild_each = -1;
  int64_t save_steps = 0;
  int64_t keep_checkpoints = 2;
  bool save_final = true;  // a checkpoint after the last step (benchmarks turn it off)
  int64_t log_every = 1;
};

struct PluginsSection {
  std::string dir;  // resolved against the manifest's folder
  std::vector<std::string> load;
};

struct DistributedConfig {
  int64_t nproc_per_node = 1;
  int64_t dp = 1, cp = 1, sp = 1;
  MeshOrder order = MeshOrder::sp_inner;  // "sp_inner" | "cp_inner": which axis takes neighbouring ranks
  int64_t ep = 1;  // expert parallelism: consecutive ranks that split each sparse layer's experts (MeshShape::ep)
  // Parameters, gradients and optimizer state split across all ranks (ZeRO-3); else replicated
  // with gradients all-reduced.
  bool shard_parameters = true;
  // Thread-ranks in one process sharing one GPU (tests and debugging) instead of one process per GPU.
  bool virtual_ranks = false;
  double timeout_s = 600;  // per collective
};

// The mesh as [distributed] gives it, which plugins are created for (PluginArgs::mesh); dp as
// given (the trainer widens dp = 1 to the ranks cp x sp leave).
inline MeshShape configured_mesh(const DistributedConfig& d) {
  return {static_cast<int>(d.dp), static_cast<int>(d.cp), static_cast<int>(d.sp), d.order, static_cast<int>(d.ep)};
}

struct CoreConfig {
  RunConfig run;
  ModelSection model;
  DataConfig data;
  EvalConfig eval;
  TrainConfig train;
  PluginsSection plugins;
  DistributedConfig distributed;
};

// [[data.sources]] as one line ("path weight=3; path fraction=0.5"), for logs and resume checks.
std::string data_sources_text(const DataConfig& d);

// The data [eval] reads: [data] with eval's source (or [data]'s own with eval.split), so the
// tokenizer, seq_len, format, masks and packing are the training data's; in corpus order, so
// max_sequences takes the same ones each time.
DataConfig eval_data_config(const CoreConfig& c);

// The manifest at `path` with `sets` (--set section.key=value) applied. A relative path in the
// file (run.output_dir, model.path, data.tokenizer, data.source, data.cache_dir, plugins.dir)
// resolves against the file's folder, one given by --set against the working folder; both are
// stored absolute, so a checkpoint's manifest.toml names the same files from anywhere.
Manifest load_run_manifest(const std::string& path, const std::vector<std::string>& sets);
// Each relative path key of `m` made absolute against the folder `base`.
void resolve_manifest_paths(Manifest& m, const std::string& base);

// The names of core's sections.
const std::vector<std::string>& core_section_names();
// Reads every core section; throws on unknown keys and wrong types. Refuses a top-level table that
// is neither a core section nor one of `plugin_names` (suggesting the closest).
CoreConfig read_core_config(const Manifest& m, const std::vector<std::string>& plugin_names);

// "80GB", "141GiB", "81920MiB", "85899345920": GB and GiB both mean 2^30 bytes, as GPU memory is
// quoted. Throws naming the option on anything else, and past 2^62 bytes.
int64_t parse_memory_size(const std::string& text, const std::string& option = "--gpu-memory");

}  // namespace lcx
