// Checkpoints: output_dir/checkpoint-<step>/ holds the model as a Hugging Face folder (config.json
// with the rope parameters used, safetensors), the tokenizer files and what transformers, vLLM and
// TRL read to use it as a chat model (tokenizer_config.json with the chat template the run trained
// with, generation_config.json, special_tokens_map.json, chat_template.jinja, each where the source
// folders have it), optimizer.safetensors (fp32
// master weights and moments), trainer_state.json (step, data position, RNG seed, counters) and the
// resolved manifest. A checkpoint is written under a temporary name and renamed when complete, so
// a crash mid-write leaves the previous one intact; only complete folders are ever resumed.
#pragma once
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "lcx/slots/adapter.h"
#include "lcx/slots/model.h"
#include "lcx/slots/optimizer.h"

namespace lcx {

struct TrainerState {
  int64_t step = 0;              // optimizer steps done
  int64_t sequences_done = 0;    // position in the data stream (sequences consumed)
  double num_tokens = 0;         // tokens trained on, as the reference logs them
  uint64_t seed = 0;
  int64_t nonfinite_in_row = 0;
  int64_t nonfinite_total = 0;
  int64_t total_steps = 0;  // the run's length its schedule was computed for (0: not recorded)
  // The highest finite loss of the steps since the checkpoint before (NaN: none), the range a
  // resumed run's losses are held to before rotation may delete the checkpoint it resumed from.
  double recent_loss_max = std::numeric_limits<double>::quiet_NaN();
};

class Communicator;

// Which rank writes what: rank 0 writes the model and the trainer state; with sharded parameters
// each rank writes its own optimizer shard (optimizer-rank<r>-of-<n>.safetensors). Saving is a
// collective when `comm` is set.
// Under expert parallelism (ep > 1) each rank of the first expert-parallel group writes its
// optimizer state (optimizer-experts<i>-of-<ep>.safetensors: its experts' and a copy of the rest),
// and every rank reads the file of its place in its group.
struct RankIO {
  int rank = 0;
  int size = 1;
  Communicator* comm = nullptr;
  bool sharded = false;
  int ep = 1;
};

struct CheckpointContents {
  std::string manifest_toml;
  std::string tokenizer_path;  // copied beside the model when set
  // Where the chat model's files are copied from: tokenizer_config.json, special_tokens_map.json
  // and chat_template.jinja from the tokenizer's folder, else the model's; generation_config.json
  // from the model's folder ([model] path; "" for a random init), else the tokenizer's.
  std::string model_dir, tokenizer_dir;
  // [data] chat_template (a Jinja file, or a tokenizer_config.json): the checkpoint's
  // tokenizer_config.json chat_template (and chat_template.jinja, which transformers reads first,
  // where one was copied) become its template.
  std::string chat_template_path;
  std::string rope_parameters_json = "{}";
  DType model_dtype = DType::bf16;
  // A checkpoint rotation must not delete ("" none): the one a resumed run started from, until
  // the run has trained past it with losses like those before it.
  std::string rotation_keeps;
};

// Writes checkpoint-<state.step> under `output_dir` and keeps the newest `keep` (0: keep all) and
// contents.rotation_keeps. Every file but trainer_state.json gets its size and CRC-32C in
// lcx-checksums.json, which verify_checkpoint checks.
// Returns the folder written.
// With sharded parameters the model's full values must be gathered around the call.
// With an active `adapter` the folder holds the adapter's files (Adapter::save) in place of the
// model's weights, which stay those of [model].
std::string save_checkpoint(const std::string& output_dir, Model& model, const Optimizer& opt,
                            const TrainerState& state, const CheckpointContents& contents, int64_t keep,
                            const RankIO& io = {}, const Adapter* adapter = nullptr);
// Whether lcx wrote the checkpoint-<step> folder `dir` (its lcx-checksums.json, or a trainer state
// of lcx's keys): the Hugging Face Trainer names its folders alike.
bool is_lcx_checkpoint(const std::string& dir);
// Every file of lcx-checksums.json has the size and CRC-32C it was saved with; throws naming the
// first that differs, with the checkpoint before it as the fix. A folder without the list (an
// older lcx's) is warned about and taken.
void verify_checkpoint(const std::string& dir);
// "latest" -> the newest complete checkpoint in output_dir; else the path itself. Throws when none.
std::string resolve_checkpoint(const std::string& output_dir, const std::string& which);
// A damaged trainer_state.json throws naming the file, with an earlier checkpoint as the fix.
TrainerState load_trainer_state(const std::string& checkpoint_dir);
// A sharded checkpoint resumes on the same world size only (the error says so).
void load_optimizer_state(const std::string& checkpoint_dir, Optimizer& opt, const RankIO& io = {});
// Renames the folder to .deleting-<name>, which is never listed, then deletes it: a kill during
// the deletion leaves no half-deleted checkpoint that looks complete.
void remove_checkpoint(const std::string& dir);
// lcx's checkpoint folders in output_dir (complete ones), oldest first.
std::vector<std::string> list_checkpoints(const std::string& output_dir);

}  // namespace lcx
