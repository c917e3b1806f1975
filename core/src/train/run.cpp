#include "train/run.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include "data/dataset.h"
#include "data/tokenizer.h"
#include "distributed/sharded_params.h"
#include "kernels/adamw_kernel.h"
#include "kernels/attention/dispatch.h"
#include "kernels/grouped_gemm_choice.h"
#include "lcx/pinned.h"
#include "lcx/error.h"
#include "lcx/log.h"
#include "loader/plugin_loader.h"
#include "util/text.h"
#ifdef LCX_HAVE_CUDA
#include "cuda/gpu_check.h"
#endif

namespace lcx {

Device pick_device(const std::string& want) {
  if (want == "cpu") return Device::cpu();
  if (want == "cuda" && !cuda_available())
    throw Error("run.device = \"cuda\" but no GPU is visible to this build", "run.device",
                "use device = \"auto\" or \"cpu\"");
  if (!cuda_available()) return Device::cpu();
#ifdef LCX_HAVE_CUDA
  cuda::check_gpu_supported(0);
#endif
  return Device::cuda(0);
}

void choose_attention(const RunConfig& run) {
  const std::optional<ops::attention::Choice> c = ops::attention::parse_choice(run.attention);
  LCX_CHECK(c, "run.attention was checked when the manifest was read");
  ops::attention::set_choice(*c);
  ops::set_own_grouped_gemm(run.grouped_gemm == "hopper" && run.attention != "sm80");
}

void check_run_inputs(const CoreConfig& cfg, const SlotSet& slots) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const std::string& path = cfg.model.path;
  if (!path.empty()) {
    const char* fix = "give a Hugging Face model folder (config.json and *.safetensors), or [model] init = \"qwen3-0.6b\" "
                      "(a preset or a JSON object of config.json keys) for random weights";
    if (!fs::is_directory(path, ec))
      throw Error(str("[model] path ", path, fs::exists(path, ec) ? " is not a folder" : " does not exist"), "model.path", fix);
    if (!fs::is_regular_file(fs::path(path) / "config.json", ec))
      throw Error(str("[model] path ", path, " has no config.json"), "model.path", fix);
    if (slots.model) slots.model->describe(path);
  }
  if (cfg.data.tokenizer.empty())
    throw Error("[data] tokenizer is not set", "data.tokenizer", "give the path of a tokenizer.json");
  Tokenizer::load(cfg.data.tokenizer);
  if (cfg.data.source.empty() && cfg.data.sources.empty())
    throw Error("data.source is not set", "data.source", "name a folder of .txt files, a .jsonl file or a .tokens file");
  if (!cfg.data.source.empty() && !fs::exists(cfg.data.source, ec))
    throw Error(str("data.source ", cfg.data.source, " does not exist"), "data.source", "check the path");
  for (const DataSource& s : cfg.data.sources)
    if (!fs::exists(s.path, ec))
      throw Error(str("data.sources: ", s.path, " does not exist"), "data.sources", "check the path");
  if (!cfg.data.chat_template.empty() && !fs::is_regular_file(cfg.data.chat_template, ec))
    throw Error(str("data.chat_template ", cfg.data.chat_template, " is not a file"), "data.chat_template",
                "give the path of a Jinja chat template, or leave it out for the tokenizer's own");
  check_eval_source(cfg);
}

void check_eval_source(const CoreConfig& cfg) {
  std::error_code ec;
  if (!cfg.eval.source.empty() && !std::filesystem::exists(cfg.eval.source, ec))
    throw Error(str("eval.source ", cfg.eval.source, " does not exist"), "eval.source",
                "check the path, or remove [eval] source to train without evaluation");
}

void check_gpu_memory(const CoreConfig& cfg, const PlanInputs& in, const PlanSlots& slots, int64_t gpu_bytes, bool force) {
  const int64_t peak = build_plan(in, slots).peak(true).bytes;
  if (gpu_bytes <= 0 || peak <= gpu_bytes) return;
  const std::string what = str("the plan's GPU peak for this run is ", format_bytes(peak), " (reserve included) but the GPU ",
                               cfg.run.gpu_memory == "auto" ? "has " : str("budget run.gpu_memory = \"", cfg.run.gpu_memory, "\" is "),
                               format_bytes(gpu_bytes), ": short by ", format_bytes(peak - gpu_bytes));
  if (force) {
    log::warn(what + "; --force: running anyway, expect out of memory");
    return;
  }
  const PluginLoader loader(PluginLoader::default_search_dirs(cfg.plugins.dir));
  std::vector<std::string> fixes;
  for (const PlanKnob& k : plan_knobs(in, slots, &loader, gpu_bytes, plan_seq_unit(in, cfg.data.pad_to_multiple_of)))
    if (k.fits) fixes.push_back(str(k.action, " (peak ", format_bytes(k.peak), ")"));
  throw Error(what, "data.seq_len",
              str(fixes.empty() ? std::string("a smaller model, or more GPUs per sequence") : join(fixes, "; or "),
                  " (lcx-train --plan shows the breakdown); --force runs anyway"));
}

// ZeRO-3 around the step: non-layer weights (embedding, final norm, head) are gathered for the
// whole step; each layer's weights are gathered before its forward and again before its recompute,
// the next layer's gather overlapping this one's compute; each layer's gradients are
// reduce-scattered as soon as its backward is done.
class ShardingHooks final : public StepHooks {
 public:
  ShardingHooks(ShardedParams& sp, int layers) : sp_(sp) {
    for (int l = 0; l < layers; ++l) layer_names_.push_back(sp.names_with_prefix(str("model.layers.", l, ".")));
    std::vector<std::string> all = sp.names_with_prefix("");
    for (const auto& n : all)
      if (!n.starts_with("model.layers.")) other_.push_back(n);
  }
  void begin_step() override {
    sp_.gather(other_, true);
    if (!layer_names_.empty()) sp_.prefetch(layer_names_[0]);
  }
  void before_layer_forward(int l) override {
    sp_.gather(layer(l));
    if (l + 1 < static_cast<int>(layer_names_.size())) sp_.prefetch(layer(l + 1));
  }
  void after_layer_forward(int l) override {
    // The last layer is the first one backward needs: keep it.
    if (l + 1 < static_cast<int>(layer_names_.size())) sp_.release(layer(l));
  }
  void before_layer_backward(int l) override {
    sp_.gather(layer(l), true);
    if (l > 0) sp_.prefetch(layer(l - 1));
  }
  void after_layer_backward(int l) override {
    sp_.reduce_grads_async(layer(l));
    sp_.release(layer(l));
  }
  void end_step() override {
    sp_.reduce_grads(other_);
    sp_.release(other_);
  }
  // Evaluation: the same gathers without gradients, and nothing kept for a backward.
  void begin_forward_only() override {
    sp_.gather(other_);
    if (!layer_names_.empty()) sp_.prefetch(layer_names_[0]);
  }
  void end_forward_only() override {
    if (!layer_names_.empty()) sp_.release(layer_names_.back());
    sp_.release(other_);
  }
  // Every full value, for the whole-model HF export.
  void gather_all() { sp_.gather(sp_.names_with_prefix("")); }
  void release_all() { sp_.release(sp_.names_with_prefix("")); }

 private:
  const std::vector<std::string>& layer(int l) const { return layer_names_[static_cast<size_t>(l)]; }
  ShardedParams& sp_;
  std::vector<std::vector<std::string>> layer_names_;
  std::vector<std::string> other_;
};

Run::Run(const CoreConfig& cfg, SlotSet slots, Device device, RankSetup rank, const std::string& model_needed_for)
    : cfg_(cfg), device_(device), rank_(rank), slots_(std::move(slots)), dtype_(dtype_from_name(cfg.model.dtype)) {
  if (!slots_.model)
    throw Error(str("the manifest names no model module", model_needed_for.empty() ? "" : ", and ", model_needed_for),
                "model.module", "add `module = \"qwen3\"` to [model]");
  if (!slots_.adapter) slots_.adapter = make_no_adapter();  // a slot set made by hand: full fine-tuning
  // Before any data or device work: a provider that cannot mask documents is never run unmasked.
  if (!cfg_.data.attend_across_documents && slots_.parallel && !slots_.parallel->masks_documents()) {
    auto it = slots_.providers.find(LCX_SLOT_PARALLELISM);
    const std::string name = it != slots_.providers.end() ? it->second.name : "the parallelism provider";
    throw Error(str("[data] attend_across_documents = false asks each packed document to attend only to itself, and ",
                    name, " cannot mask documents"),
                "data.attend_across_documents",
                "set [data] attend_across_documents = true when the documents are one continuous text (books "
                "concatenated end to end), or choose a Parallelism provider that masks documents (one rank does; "
                "each plugin's README says whether it does)");
  }
}

Run::~Run() = default;

int Run::rank() const { return rank_.world ? rank_.world->rank() : 0; }
int Run::world_size() const { return rank_.world ? rank_.world->size() : 1; }
MeshShape Run::mesh_shape() const { return rank_.mesh ? rank_.mesh->shape() : MeshShape{}; }
MeshCoord Run::mesh_coord() const { return rank_.mesh ? rank_.mesh->coord() : MeshCoord{}; }

int Run::seq_rank() const { return seq_index(mesh_shape(), mesh_coord()); }

RankIO Run::rank_io() const { return RankIO{rank(), world_size(), rank_.world, sharded(), mesh_shape().ep}; }

void Run::check_parallelism() const {
  // A plan builds no ranks: it checks the mesh the manifest asks for.
  const MeshShape shape = rank_.mesh ? mesh_shape() : configured_mesh(cfg_.distributed);
  // ZeRO-3 shards every parameter over the world, a partitioned one's part too, while ep gives
  // each partition's ranks different parts: the two would need those shards gathered over the
  // ranks holding the same part only (GradGroup::partition_replicas), which ShardedParams does not do.
  if (shape.ep > 1 && cfg_.distributed.shard_parameters)
    throw Error(str("[distributed] ep = ", shape.ep, " with shard_parameters = true: ZeRO-3 does not shard the parameters "
                    "ep partitions over its ranks"),
                "distributed.shard_parameters",
                "set [distributed] shard_parameters = false (each rank then holds its 1/ep part of the partitioned "
                "parameters and every other parameter whole), or ep = 1");
  const Parallelism& par = *slots_.parallel;
  auto it = slots_.providers.find(LCX_SLOT_PARALLELISM);
  const std::string name = it != slots_.providers.end() ? it->second.name : std::string("the parallelism");
  // Each axis that splits a sequence needs a provider serving it: a mesh nothing would run is
  // refused here, before a plan prints it or a launch starts its ranks.
  // A stacked pair (two-dimensional sequence parallelism) serves both providers' axes.
  const std::string served = par.mesh_axis();
  const std::string inner = slots_.parallel_inner ? slots_.parallel_inner->mesh_axis() : std::string();
  for (const auto& [axis, ranks] : {std::pair<std::string, int>{"cp", shape.cp}, {"sp", shape.sp}}) {
    if (ranks <= 1 || axis == served || axis == inner) continue;
    throw Error(str("[distributed] ", axis, " = ", ranks, " but the loaded parallelism (", name, ") ",
                    served.empty() ? std::string("splits no sequence") : str("serves only the ", served, " axis"),
                    ": nothing would split the sequence over that axis"),
                str("distributed.", axis),
                str("set distributed.", axis, " = 1, or load the parallelism plugin that serves the ", axis,
                    " axis instead (lcx-train --list-plugins)"));
  }
  const int seq_ranks = shape.cp * shape.sp;
  if (par.size() != seq_ranks)
    throw Error(str("the parallelism plugin splits a sequence over ", par.size(), " ranks but the mesh has cp x sp = ",
                    seq_ranks),
                "distributed.cp", "make [distributed] cp / sp match the plugin's size");
}

const Tokenizer& Run::tokenizer() {
  if (!tokenizer_) {
    if (cfg_.data.tokenizer.empty()) throw Error("[data] tokenizer is not set", "data.tokenizer", "give the path of a tokenizer.json");
    tokenizer_ = std::make_unique<Tokenizer>(Tokenizer::load(cfg_.data.tokenizer));
  }
  return *tokenizer_;
}

void Run::open_data(const DataConfig& data, bool progress, double held_out) {
  Dataset::Options opt;
  opt.seed = cfg_.run.seed;
  opt.progress = progress;
  opt.held_out = held_out;
  data_ = std::make_unique<Dataset>(Dataset::open(data, tokenizer(), opt));
}

void Run::open_eval_data(bool progress) {
  if (!cfg_.eval.enabled()) return;
  Dataset::Options opt;
  opt.seed = cfg_.run.seed;
  opt.progress = progress;
  if (cfg_.eval.source.empty()) {
    // The share of [data] the training leaves out.
    opt.held_out = cfg_.eval.split;
    opt.held_out_side = true;
  }
  try {
    eval_data_ = std::make_unique<Dataset>(Dataset::open(eval_data_config(cfg_), tokenizer(), opt));
  } catch (const Error& e) {
    if (cfg_.eval.source.empty()) throw;
    // The dataset names [data]'s keys; here the source is eval's.
    if (e.key() != "data.source" && e.key() != "data.seq_len") throw;
    std::string what = e.what();
    if (const size_t at = what.find("data.source"); at != std::string::npos) what.replace(at, 11, "eval.source");
    throw Error(what, "eval.source",
                e.key() == "data.source" ? e.fix() : "give held-out data of at least [data] seq_len tokens");
  }
  if (!progress) return;
  const EvalConfig& e = cfg_.eval;
  const int64_t n = eval_data_->num_sequences(), used = e.max_sequences > 0 ? std::min(e.max_sequences, n) : n;
  const std::string data = cfg_.data.sources.empty() ? cfg_.data.source : str("[[data.sources]]");
  const std::string of = cfg_.eval.source.empty() ? str("held out of ", data, " (eval.split = ", e.split, ")")
                                                   : str("of ", cfg_.eval.source);
  log::info(str("eval: ", used, " of the ", n, " sequences ", of, ", forward only",
                e.at_start ? ", before the first step" : "", e.every > 0 ? str(e.at_start ? " and" : "", " every ", e.every, " steps") : ""));
}

void Run::check_sequence_split() const {
  // The last sequence may be shorter (the stream's remainder, padded to pad_to_multiple_of): it is
  // cut at the start too, not at the end of the epoch.
  for (const Dataset* d : {data_.get(), eval_data_.get()}) {
    if (!d) continue;
    const int64_t n = d->num_sequences();
    if (n > 0) slots_.parallel->shard(d->get(0), seq_rank());
    if (n > 1 && d->length(n - 1) != d->length(0)) slots_.parallel->shard(d->get(n - 1), seq_rank());
  }
  // Packed best-fit, a sequence may be any multiple of pad_to_multiple_of long; what the providers
  // need of a length is that it divide evenly, so one of the multiple itself stands for them all.
  const DataConfig& dc = cfg_.data;
  if (dc.packing == "bfd" && dc.pad_to_multiple_of < dc.seq_len) {
    const int64_t m = dc.pad_to_multiple_of;
    Sequence probe;
    probe.tokens = Tensor::zeros({m}, DType::i32);
    probe.targets = Tensor::empty({m}, DType::i64);
    for (int64_t t = 0; t < m; ++t) probe.targets.data_as<int64_t>()[t] = -100;
    if (!dc.attend_across_documents) probe.document_bounds = {0, m};
    slots_.parallel->shard(probe, seq_rank());
  }
}

void Run::load_weights(const std::string& dir) { model().load_hf(dir, device_, dtype_); }

void Run::load_or_init_weights(const std::string& resume_dir) {
  load_base_weights(resume_dir);
  // The adapter over the weights: its factors from the checkpoint it wrote, else its own start.
  Adapter& adapter = *slots_.adapter;
  const bool resumed = !resume_dir.empty() && adapter.saved_in(resume_dir);
  const bool shards = rank_.world && cfg_.distributed.shard_parameters && world_size() > 1;
  Communicator* partition = rank_.mesh ? rank_.mesh->partition() : nullptr;
  adapter.attach(model(), AdapterContext{device_, dtype_, static_cast<uint64_t>(cfg_.run.seed), resumed ? resume_dir : "",
                                         !shards && grad_dtype_for(cfg_.train, dtype_, world_size()) == DType::f32,
                                         partition ? partition->rank() : 0});
}

void Run::load_base_weights(const std::string& resume_dir) {
  // An adapter run's checkpoint holds no model weights to train whole.
  if (!resume_dir.empty() && !slots_.adapter->active() &&
      std::filesystem::exists(std::filesystem::path(resume_dir) / "adapter_config.json"))
    throw Error(str("--resume ", resume_dir, " is an adapter's checkpoint (adapter_config.json), but this run trains the "
                    "whole model (no Adapter plugin is loaded)"),
                "plugins.load",
                str("resume with the checkpoint's own [plugins] (its manifest.toml); to train the whole model from it, "
                    "merge it first (lcx-train merge --base <base> --adapter ", resume_dir, " --out DIR) and start a new "
                    "run with model.path = DIR"));
  // A checkpoint of an adapter run holds the adapter, not the base: the base comes from [model].
  if (!resume_dir.empty() && !slots_.adapter->saved_in(resume_dir)) {
    load_weights(resume_dir);
  } else if (!cfg_.model.path.empty()) {
    load_weights(cfg_.model.path);
  } else if (!cfg_.model.init.empty()) {
    const auto start = std::chrono::steady_clock::now();
    model().init_random(cfg_.model.init, static_cast<uint64_t>(cfg_.run.seed), device_, dtype_);
    int64_t n = 0;
    for (Parameter* p : model().parameters()) n += p->value.numel();
    if (lead())
      log::info(str("random init of ", n, " parameters in ",
                    std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), " s"));
  } else {
    throw Error("[model] gives neither `path` nor `init`", "model.path",
                "set path = \"<HF folder>\" or init = \"qwen3-0.6b\" (or a JSON object of config keys)");
  }
}

void Run::configure_step() {
  step_ = StepSlots{model(), *slots_.loss, *slots_.positional, *slots_.memory, *slots_.parallel};
  step_.mlp = slots_.mlp.get();
  step_.optimizer = slots_.optimizer.get();
  step_.adapter = slots_.adapter.get();
  step_.activation_dtype = dtype_;
  step_.mesh = rank_.mesh;
  configure_slots(step_);
}

void Run::shard_parameters() {
  if (!rank_.world || !cfg_.distributed.shard_parameters || world_size() <= 1) return;
  // The adapter's factors shard beside the model's parameters (they are named as the layer's),
  // and the frozen base shards without gradients.
  std::vector<Parameter*> params = model().parameters();
  for (Parameter* p : slots_.adapter->parameters()) params.push_back(p);
  shards_ = std::make_unique<ShardedParams>(params, *rank_.world);
  hooks_ = std::make_unique<ShardingHooks>(*shards_, static_cast<int>(model().config().num_layers));
  step_.hooks = hooks_.get();
}

void Run::choose_grad_dtype() {
  grad_dtype_ = grad_dtype_for(cfg_.train, dtype_, world_size());
  // A shard's gradient is ShardedParams'. Unsharded, every trained parameter gets its gradient
  // here, once the base is frozen or sharded: the GEMM weights' in the chosen dtype, the rest fp32.
  if (sharded()) return;
  for (Parameter* p : trainable_parameters()) {
    const DType dt = p->gemm_grad ? grad_dtype_ : DType::f32;
    if (!p->grad.defined() || p->grad.dtype() != dt)
      p->grad = Tensor::zeros(p->value.shape(), dt, device_, MemoryCategory::gradients);
  }
}

void Run::plan_step(const ModelConfig& shape, int64_t seq_len, int64_t gpu_bytes, int64_t host_bytes) {
  planned_ = plan_inputs(cfg_, shape, seq_len);
  if (rank_.local_ranks > 0) planned_.local_ranks = rank_.local_ranks;
  planned_.recipe = choose_recipe(planned_, plan_slots(), gpu_bytes, host_bytes, cfg_.train.checkpoint_every);
  step_.recipe = planned_.recipe;
}

void Run::plan_local_step(bool force) {
  const ModelConfig& shape = model().config();
  const int64_t host_budget = host_memory_budget("", cfg_.run);
  if (device_.is_cuda()) {
    // [run] gpu_memory: the budget the recipe must fit, where the device's whole memory is not.
    const int64_t budget = cfg_.run.gpu_memory == "auto" ? local_gpu_memory().value_or(0)
                                                         : parse_memory_size(cfg_.run.gpu_memory, "run.gpu_memory");
    plan_step(shape, data_->seq_len(), budget, host_budget);
    check_gpu_memory(cfg_, planned_, plan_slots(), budget, force);
  } else {
    planned_ = plan_inputs(cfg_, shape, data_->seq_len());
    if (rank_.local_ranks > 0) planned_.local_ranks = rank_.local_ranks;
    // Host memory is the only budget: every knob at its provider's default (what saves work),
    // every layer saved unless told otherwise.
    planned_.recipe = unplanned_recipe(planned_, plan_slots(), cfg_.train.checkpoint_every);
    step_.recipe = planned_.recipe;
  }
  check_host_memory(build_plan(planned_, plan_slots()), planned_, host_budget);
}

void Run::make_optimizer(const std::string& resume_dir) {
  OptimizerConfig o;
  o.beta1 = cfg_.train.beta1;
  o.beta2 = cfg_.train.beta2;
  o.eps = cfg_.train.eps;
  o.weight_decay = cfg_.train.weight_decay;
  o.master_dtype = cfg_.train.master_dtype;
  slots_.optimizer->configure(sharded() ? shards_->shards() : trainable_parameters(), o,
                              OptimizerScope{world_size(), sharded()});
  if (!resume_dir.empty()) load_optimizer_state(resume_dir, optimizer(), rank_io());
}

void Run::zero_grads() {
  if (shards_)
    shards_->zero_grads();
  else
    for (Parameter* p : trainable_parameters()) p->grad.zero();
}

std::vector<Parameter*> Run::trainable_parameters() const {
  std::vector<Parameter*> out;
  for (Parameter* p : model().parameters())
    if (!p->frozen) out.push_back(p);
  for (Parameter* p : slots_.adapter->parameters()) out.push_back(p);
  return out;
}

double Run::grad_norm() {
  if (shards_) return shards_->grad_norm();
  const double norm = optimizer().grad_norm();
  Communicator* group = rank_.mesh ? rank_.mesh->partition() : nullptr;
  if (!group) return norm;
  // The provider's norm counts this rank's gradients: every one is the same on every rank after
  // the all-reduce but a partitioned parameter's, whose ranks hold other parts. Their squares are
  // summed over the partition, so each part counts once, as on one rank.
  double mine = 0;
  for (Parameter* p : trainable_parameters())
    if (p->grad_group == GradGroup::partition_replicas) mine += adamw::sum_squares(p->grad);
  double all = mine;
  group->all_reduce(std::span<double>(&all, 1));
  return std::sqrt(std::max(0.0, norm * norm - mine + all));
}

std::string Run::save(const TrainerState& state, const CheckpointContents& contents) {
  optimizer().synchronize();  // the weights saved are the updated ones
  if (hooks_) hooks_->gather_all();
  // Rank 0 writes every part of a partitioned parameter (the model's or the adapter's), as it
  // writes ZeRO-3's gathered parameters: the parts gathered over the partition (rank order is
  // row order) for the save, then its own again. Only the first partition's ranks take part; the
  // others hold copies. One parameter is gathered on the GPU at a time and rank 0 keeps it in
  // host memory for the writer (which copies every tensor to the host anyway): all of
  // Qwen3-30B-A3B's partitioned weights at once would be 57 GB more on each GPU of the
  // partition, past an 80 GB card's budget.
  std::vector<std::pair<Parameter*, Tensor>> own;
  Communicator* group = rank_.mesh ? rank_.mesh->partition() : nullptr;
  std::vector<Parameter*> params = model().parameters();
  if (slots_.adapter->active())
    for (Parameter* p : slots_.adapter->parameters()) params.push_back(p);
  if (group && rank() < group->size())
    for (Parameter* p : params) {
      if (p->grad_group != GradGroup::partition_replicas) continue;
      Shape shape = p->value.shape();
      shape[0] *= group->size();
      Tensor whole = Tensor::empty(shape, p->value.dtype(), p->value.device(), MemoryCategory::weights);
      group->all_gather(p->value, whole);
      if (rank() != 0) continue;
      own.emplace_back(p, p->value);
      p->value = whole.device().is_cuda() ? whole.to(Device::cpu()) : whole;
    }
  std::string dir;
  // A full disk or a lost mount mid-save: the folder, the step and what to do, where the
  // filesystem's own message says none of them.
  const auto not_saved = [&](const std::string& why) {
    return Error(str("checkpoint-", state.step, " is not saved in ", cfg_.run.output_dir, ": ", why), "run.output_dir",
                 "free space on its disk, or give run.output_dir on another one; the checkpoints saved before are kept "
                 "(--resume latest goes on from the newest), and the unfinished folder is removed at the next start");
  };
  try {
    dir = save_checkpoint(cfg_.run.output_dir, model(), optimizer(), state, contents, cfg_.train.keep_checkpoints,
                          rank_io(), slots_.adapter->active() ? slots_.adapter.get() : nullptr);
  } catch (const std::filesystem::filesystem_error& e) {
    for (auto& [p, v] : own) p->value = v;
    throw not_saved(e.what());
  } catch (const Error& e) {
    for (auto& [p, v] : own) p->value = v;
    if (!e.fix().empty()) throw;
    throw not_saved(e.what());
  } catch (...) {
    for (auto& [p, v] : own) p->value = v;
    throw;
  }
  for (auto& [p, v] : own) p->value = v;
  if (hooks_) hooks_->release_all();
  return dir;
}

}  // namespace lcx
