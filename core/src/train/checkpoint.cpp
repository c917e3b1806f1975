#include "train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <span>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "lcx/comm.h"
#include "lcx/log.h"
#include "lcx/safetensors.h"
#include "util/crc32c.h"

namespace fs = std::filesystem;

namespace lcx {
namespace {

constexpr const char* kPrefix = "checkpoint-";
constexpr const char* kState = "trainer_state.json";
constexpr const char* kDeletingPrefix = ".deleting-";
constexpr const char* kChecksums = "lcx-checksums.json";

int64_t step_of(const fs::path& p) {
  std::string name = p.filename().string();
  if (!name.starts_with(kPrefix)) return -1;
  std::string digits = name.substr(std::string(kPrefix).size());
  if (digits.empty() || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return -1;
  return std::stoll(digits);
}

// The fix for a checkpoint that cannot be resumed: the complete one before it, where there is one.
std::string earlier_checkpoint_fix(const std::string& dir) {
  fs::path self(dir);
  if (self.filename().empty()) self = self.parent_path();  // "checkpoint-4/"
  const auto all = list_checkpoints(self.parent_path().string());
  for (auto it = all.rbegin(); it != all.rend(); ++it)
    if (step_of(*it) < step_of(self))
      return str("resume from the checkpoint before it: --resume ", *it, " (or delete ", dir, ")");
  return "this checkpoint cannot be resumed: give --resume an earlier checkpoint-<step> folder, or start a new run "
         "from its weights alone (model.path = \"" + dir + "\") if they are intact";
}

// The trainer state as JSON, with the keys a resume needs; a damaged file is named with a fix.
nlohmann::json read_state_json(const std::string& dir) {
  const fs::path p = fs::path(dir) / kState;
  std::ifstream in(p);
  nlohmann::json js;
  std::string problem;
  try {
    if (!in) problem = "cannot be opened";
    else in >> js;
    if (problem.empty())
      for (const char* k : {"step", "sequences_done", "num_tokens", "seed"})
        if (!js.is_object() || !js.contains(k) || !js[k].is_number()) {
          problem = str("has no number `", k, "`");
          break;
        }
    // Counts a save never writes (a hand edit): resumed, they would train the wrong data and schedule.
    if (problem.empty())
      for (const char* k : {"step", "sequences_done", "num_tokens"})
        if (js[k].get<double>() < 0) {
          problem = str("has `", k, "` = ", js[k].dump(), ", below 0");
          break;
        }
    fs::path self(dir);
    if (self.filename().empty()) self = self.parent_path();
    if (problem.empty() && step_of(self) >= 0 && js["step"].get<double>() != static_cast<double>(step_of(self)))
      problem = str("has `step` = ", js["step"].dump(), ", but the folder is ", self.filename().string());
  } catch (const nlohmann::json::exception& e) {
    problem = str("is not valid JSON (", e.what(), ")");
  }
  if (problem.empty()) return js;
  throw Error(str(p.string(), " ", problem), {}, earlier_checkpoint_fix(dir));
}

// "<name> element <i> is nan" for the first element of `t` that is not finite; "" when all are.
std::string first_nonfinite(const std::string& name, const Tensor& t) {
  if (!is_floating(t.dtype())) return {};
  // fp32 on the host (the optimizer's state) is read in place; anything else converted.
  const bool in_place = t.dtype() == DType::f32 && !t.device().is_cuda();
  const std::vector<float> converted = in_place ? std::vector<float>() : t.to_floats();
  const float* v = in_place ? t.data_as<float>() : converted.data();
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!std::isfinite(v[i])) return str(name, " element ", i, " is ", v[i]);
  return {};
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
  out.flush();
  if (!out) throw Error(str("cannot write ", p.string()), {}, "check free disk space and permissions");
}

std::string read_text(const fs::path& p, const std::string& key) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw Error(str("cannot read ", p.string()), key, "check the path");
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

nlohmann::ordered_json read_json_object(const fs::path& p, const std::string& key) {
  nlohmann::ordered_json js = nlohmann::ordered_json::parse(read_text(p, key), nullptr, false);
  if (!js.is_object())
    throw Error(str(p.string(), " is not a JSON object"), key, "give a tokenizer_config.json that is valid JSON");
  return js;
}

// The template of [data] chat_template as the data read it: a Jinja file's text, or a
// tokenizer_config.json's chat_template (a string, or the "default" of a list of named ones).
std::string run_template(const std::string& path) {
  if (fs::path(path).extension() != ".json") return read_text(path, "data.chat_template");
  const nlohmann::ordered_json js = read_json_object(path, "data.chat_template");
  const auto it = js.find("chat_template");
  if (it != js.end() && it->is_string()) return it->get<std::string>();
  if (it != js.end() && it->is_array())
    for (const auto& t : *it)
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string())
        return t["template"].get<std::string>();
  throw Error(str(path, " holds no chat_template string (nor a \"default\" one)"), "data.chat_template",
              "set data.chat_template to a Jinja template file or a tokenizer_config.json with its chat_template");
}

// What a Hugging Face folder carries beside the weights for chat use, and where each is taken
// from first: the tokenizer's settings and chat template belong with the tokenizer.json copied
// (data.tokenizer's folder, which is [model] path's unless the run names another tokenizer), the
// generation defaults (stop tokens, sampling) with the model.
void copy_model_files(const fs::path& to, const CheckpointContents& c) {
  struct File {
    const char* name;
    bool tokenizer_first;
  };
  constexpr File kFiles[] = {{"tokenizer_config.json", true},
                             {"special_tokens_map.json", true},
                             {"chat_template.jinja", true},
                             {"generation_config.json", false}};
  std::error_code ec;
  for (const File& f : kFiles) {
    const std::string order[2] = {f.tokenizer_first ? c.tokenizer_dir : c.model_dir,
                                  f.tokenizer_first ? c.model_dir : c.tokenizer_dir};
    for (const std::string& dir : order) {
      if (dir.empty() || !fs::is_regular_file(fs::path(dir) / f.name, ec)) continue;
      fs::copy_file(fs::path(dir) / f.name, to / f.name, fs::copy_options::overwrite_existing);
      break;
    }
  }
  if (c.chat_template_path.empty()) return;
  const std::string chat_template = run_template(c.chat_template_path);
  const fs::path config = to / "tokenizer_config.json";
  nlohmann::ordered_json js =
      fs::exists(config, ec) ? read_json_object(config, "data.tokenizer") : nlohmann::ordered_json::object();
  js["chat_template"] = chat_template;
  std::string text;
  try {
    text = js.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::strict);
  } catch (const nlohmann::json::exception&) {
    throw Error(str("data.chat_template ", c.chat_template_path, " is not valid UTF-8"), "data.chat_template",
                "save the template as UTF-8");
  }
  write_text(config, text + "\n");
  // transformers reads chat_template.jinja before tokenizer_config.json's key: both say the same.
  if (fs::exists(to / "chat_template.jinja", ec)) write_text(to / "chat_template.jinja", chat_template);
}

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

// Every file of the folder but the state file (written after it): its size and CRC-32C, which a
// resume checks. The files are read back from the page cache just written: a few percent of the
// save's time (docs/PERF.md).
void write_checksums(const fs::path& dir) {
  nlohmann::ordered_json files = nlohmann::ordered_json::object();
  std::vector<fs::path> paths;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());
  for (const fs::path& p : paths) {
    const FileChecksum sum = checksum_file(p.string());
    files[fs::relative(p, dir).generic_string()] = {{"bytes", sum.bytes}, {"crc32c", hex32(sum.crc32c)}};
  }
  const nlohmann::ordered_json js = {{"format", "lcx-checksums"}, {"algorithm", "crc32c"}, {"files", files}};
  write_text(dir / kChecksums, js.dump(2) + "\n");
}

}  // namespace

std::vector<std::string> list_checkpoints(const std::string& output_dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return {};
  for (const auto& e : fs::directory_iterator(output_dir, ec)) {
    int64_t s = step_of(e.path());
    if (s >= 0 && is_lcx_checkpoint(e.path().string())) found.emplace_back(s, e.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [s, p] : found) out.push_back(p);
  return out;
}

bool is_lcx_checkpoint(const std::string& dir) {
  std::error_code ec;
  if (fs::is_regular_file(fs::path(dir) / kChecksums, ec)) return true;
  // lcx's own trainer state counts sequences; the Hugging Face Trainer's file of that name does not.
  std::ifstream in(fs::path(dir) / kState);
  if (!in) return false;
  const nlohmann::json js = nlohmann::json::parse(in, nullptr, false);
  return js.is_object() && js.contains("sequences_done") && js.contains("seed");
}

void verify_checkpoint(const std::string& dir) {
  const fs::path list = fs::path(dir) / kChecksums;
  std::error_code ec;
  if (!fs::exists(list, ec)) {
    log::warn(str(dir, " has no ", kChecksums, " (an older lcx wrote it): its files are resumed unchecked"));
    return;
  }
  const nlohmann::json js = nlohmann::json::parse(read_text(list, "--resume"), nullptr, false);
  if (!js.is_object() || !js.contains("files") || !js["files"].is_object())
    throw Error(str(list.string(), " is damaged (not the JSON lcx writes)"), {}, earlier_checkpoint_fix(dir));
  for (const auto& [name, want] : js["files"].items()) {
    const fs::path p = fs::path(dir) / name;
    std::string problem;
    if (!want.is_object() || !want.contains("bytes") || !want.contains("crc32c")) {
      problem = str("has no size and checksum in ", list.string());
    } else if (!fs::is_regular_file(p, ec)) {
      problem = "is missing";
    } else {
      const FileChecksum got = checksum_file(p.string());
      const uint64_t bytes = want["bytes"].is_number_unsigned() ? want["bytes"].get<uint64_t>() : 0;
      const std::string crc = want["crc32c"].is_string() ? want["crc32c"].get<std::string>() : std::string();
      if (got.bytes != bytes)
        problem = str("has ", got.bytes, " bytes, but the save wrote ", bytes);
      else if (hex32(got.crc32c) != crc)
        problem = str("does not hold the bytes the save wrote (CRC-32C ", hex32(got.crc32c), ", recorded ", crc, ")");
    }
    if (!problem.empty())
      throw Error(str(p.string(), " ", problem, ": the checkpoint was changed or damaged after it was saved"), {},
                  earlier_checkpoint_fix(dir));
  }
}

static std::string optimizer_file(const RankIO& io) {
  if (io.sharded) return str("optimizer-rank", io.rank, "-of-", io.size, ".safetensors");
  if (io.ep > 1) return str("optimizer-experts", expert_index(MeshShape{.ep = io.ep}, io.rank), "-of-", io.ep, ".safetensors");
  return "optimizer.safetensors";
}

// Whether this rank writes an optimizer file: rank 0, each shard's rank, or each of the first
// expert-parallel group's ranks (the other groups hold the same experts' state).
static bool writes_optimizer(const RankIO& io) { return io.rank == 0 || io.sharded || io.rank < io.ep; }

std::string save_checkpoint(const std::string& output_dir, Model& model, const Optimizer& opt,
                            const TrainerState& state, const CheckpointContents& contents, int64_t keep,
                            const RankIO& io, const Adapter* adapter) {
  fs::path final_dir = fs::path(output_dir) / str(kPrefix, state.step);
  fs::path tmp = fs::path(output_dir) / str(".", kPrefix, state.step, ".tmp");
  auto barrier = [&] {
    if (io.comm) io.comm->barrier();
  };
  // A checkpoint of weights that are not finite would be useless, and rotation would delete the
  // good ones before it: every rank looks at what it saves first, and all stop together.
  OptimizerState os;
  std::string bad;
  if (writes_optimizer(io)) {
    os = opt.state();
    for (const auto& [name, t] : os.tensors)
      if (bad.empty()) bad = first_nonfinite(name, t);
    const bool has_master = std::any_of(os.tensors.begin(), os.tensors.end(),
                                        [](const auto& nt) { return nt.first.ends_with(".master"); });
    if (!has_master)  // the model's values are the weights the optimizer updates
      for (Parameter* p : model.parameters())
        if (bad.empty() && !p->frozen) bad = first_nonfinite(p->name, p->value);
  }
  double bad_ranks = bad.empty() ? 0 : 1;
  if (io.comm) io.comm->all_reduce(std::span<double>(&bad_ranks, 1));
  if (bad_ranks > 0)
    throw Error(str("step ", state.step, ": the weights or optimizer state are not finite (",
                    bad.empty() ? std::string("on another rank") : bad, "): checkpoint-", state.step,
                    " is not saved, and the earlier checkpoints in ", output_dir, " are kept"),
                "train.lr", "resume from the last good checkpoint (--resume latest) with a lower lr, or check the data");
  if (io.rank == 0) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    if (adapter)
      adapter->save(tmp.string(), contents.model_dir);
    else
      model.save_hf(tmp.string(), contents.model_dtype, contents.rope_parameters_json);
    if (!contents.tokenizer_path.empty() && fs::exists(contents.tokenizer_path))
      fs::copy_file(contents.tokenizer_path, tmp / "tokenizer.json", fs::copy_options::overwrite_existing);
    copy_model_files(tmp, contents);
    write_text(tmp / "manifest.toml", contents.manifest_toml);
  }
  barrier();
  if (writes_optimizer(io)) {
    std::vector<safetensors::NamedTensor> tensors;
    for (auto& [name, t] : os.tensors) tensors.push_back({name, t});
    safetensors::write_file((tmp / optimizer_file(io)).string(), tensors, DType::f32,
                            {{"format", "lcx-adamw"}, {"step", std::to_string(os.step)}, {"world_size", std::to_string(io.size)}});
  }
  barrier();
  if (io.rank != 0) {
    barrier();  // rank 0 renames
    return final_dir.string();
  }
  write_checksums(tmp);
  nlohmann::json js = {{"step", state.step},
                       {"optimizer_step", opt.steps()},
                       {"world_size", io.size},
                       {"sharded", io.sharded},
                       {"ep", io.ep},
                       {"sequences_done", state.sequences_done},
                       {"num_tokens", state.num_tokens},
                       {"seed", state.seed},
                       {"nonfinite_in_row", state.nonfinite_in_row},
                       {"nonfinite_total", state.nonfinite_total},
                       {"total_steps", state.total_steps},
                       {"recent_loss_max", std::isfinite(state.recent_loss_max) ? nlohmann::json(state.recent_loss_max)
                                                                                : nlohmann::json(nullptr)}};
  // The state file is written last: its presence marks the folder complete.
  write_text(tmp / kState, js.dump(2));
  ::sync();

  if (fs::exists(final_dir)) {
    if (!is_lcx_checkpoint(final_dir.string()))
      throw Error(str(final_dir.string(), " exists and lcx did not write it: checkpoint-", state.step, " is not saved"),
                  "run.output_dir", str("move ", final_dir.string(), " out of run.output_dir, then --resume latest"));
    remove_checkpoint(final_dir.string());
  }
  fs::rename(tmp, final_dir);

  if (keep > 0) {
    auto all = list_checkpoints(output_dir);
    std::error_code ec;
    for (size_t i = 0; i + static_cast<size_t>(keep) < all.size(); ++i)
      if (contents.rotation_keeps.empty() || !fs::equivalent(all[i], contents.rotation_keeps, ec)) remove_checkpoint(all[i]);
  }
  barrier();
  return final_dir.string();
}

void remove_checkpoint(const std::string& dir) {
  const fs::path p(dir);
  const fs::path doomed = p.parent_path() / str(kDeletingPrefix, p.filename().string());
  fs::remove_all(doomed);
  fs::rename(p, doomed);
  fs::remove_all(doomed);
}

std::string resolve_checkpoint(const std::string& output_dir, const std::string& which) {
  if (which == "latest") {
    auto all = list_checkpoints(output_dir);
    if (all.empty())
      throw Error(str("--resume latest: no complete checkpoint in ", output_dir), "run.output_dir",
                  "train first, or give --resume PATH to a checkpoint folder");
    return all.back();
  }
  if (!fs::exists(fs::path(which) / kState))
    throw Error(str("--resume ", which, ": not a complete checkpoint (no ", kState, ")"), {},
                "give a checkpoint-<step> folder, or --resume latest");
  return which;
}

TrainerState load_trainer_state(const std::string& dir) {
  const nlohmann::json js = read_state_json(dir);
  TrainerState s;
  s.step = js.at("step").get<int64_t>();
  s.sequences_done = js.at("sequences_done").get<int64_t>();
  s.num_tokens = js.at("num_tokens").get<double>();
  s.seed = js.at("seed").get<uint64_t>();
  s.nonfinite_in_row = js.value("nonfinite_in_row", int64_t{0});
  s.nonfinite_total = js.value("nonfinite_total", int64_t{0});
  s.total_steps = js.value("total_steps", int64_t{0});
  if (js.contains("recent_loss_max") && js["recent_loss_max"].is_number()) s.recent_loss_max = js["recent_loss_max"].get<double>();
  return s;
}

void load_optimizer_state(const std::string& dir, Optimizer& opt, const RankIO& io) {
  const nlohmann::json js = read_state_json(dir);
  const bool was_sharded = js.value("sharded", false);
  const int was_world = js.value("world_size", 1);
  if (was_sharded != io.sharded || (io.sharded && was_world != io.size))
    throw Error(str(dir, " holds ", was_sharded ? str("optimizer state sharded over ", was_world, " ranks") : "whole optimizer state",
                    "; this run has ", io.sharded ? str("state sharded over ", io.size, " ranks") : "whole state"),
                "distributed.nproc_per_node", "resume with the same number of ranks and distributed.shard_parameters");
  const int was_ep = js.value("ep", 1);
  if (was_ep != io.ep)
    throw Error(str(dir, " holds optimizer state of experts split over ep = ", was_ep, " ranks; this run has ep = ", io.ep),
                "distributed.ep", str("resume with [distributed] ep = ", was_ep));
  auto ckpt = safetensors::Checkpoint::open((fs::path(dir) / optimizer_file(io)).string());
  OptimizerState st;
  st.step = js.value("optimizer_step", js.at("step").get<int64_t>());
  // Checked as the model's weights are: a damaged state would make every later step NaN.
  for (const auto& name : ckpt.names()) {
    st.tensors.emplace_back(name, ckpt.load(name, DType::f32, Device::cpu(), true));
    if (!name.ends_with(".exp_avg_sq")) continue;
    const Tensor& t = st.tensors.back().second;
    const float* v = t.data_as<float>();
    for (int64_t i = 0; i < t.numel(); ++i)
      if (v[i] < 0)
        throw Error(str(ckpt.file_of(name), ": ", name, " element ", i, " is ", v[i],
                        ", a second moment below 0: the optimizer state is damaged"),
                    {}, "resume from another checkpoint (its optimizer.safetensors intact), or start from its weights "
                        "alone: a new run with model.path = \"" + dir + "\"");
  }
  opt.load_state(st);
}

}  // namespace lcx
