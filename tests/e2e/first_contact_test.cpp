// What a new user and a hostile probe tried: paths resolved against
// the manifest, every input checked before long work, the run folder locked and protected,
// damaged or non-finite state never taken or saved, sizes and ranks bounded, messages that name
// the file and the fix. Each case runs the real binary, as a user would.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "lcx/safetensors.h"
#include "support/test_util.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

void write_tokens(const fs::path& p, uint32_t n, uint32_t (*id)(uint32_t)) {
  std::ofstream out(p, std::ios::binary);
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t v = id(i);
    out.write(reinterpret_cast<const char*>(&v), 4);
  }
}

struct FirstContact : ::testing::Test {
  fs::path dir = test::temp_dir("first-contact");

  void SetUp() override {
    if (!fs::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
    write_tokens(dir / "data.tokens", 512, [](uint32_t i) { return (i * 7) % 256; });
  }

  // The tiny run of test_util in dir/run.toml (output dir/out), with `train` lines and `tables`.
  std::string manifest(const std::string& train = "max_steps = 1\n", const std::string& tables = {}) {
    test::write_file(dir / "run.toml", test::tiny_run_manifest(dir / "out", dir / "data.tokens", 1, true, train, tables));
    return (dir / "run.toml").string();
  }

  test::CommandResult lcx(const std::string& args, const std::string& cwd = {}) {
    return test::run_command((cwd.empty() ? "" : "cd '" + cwd + "' && ") + test::lcx_train() + " " + args);
  }
};

// Case 1: paths in the file resolve against its folder, those of --set against the working folder.
TEST_F(FirstContact, Case1RelativePathsResolveAgainstTheManifestsFolder) {
  const fs::path cfg = dir / "configs";
  std::string text = test::tiny_run_manifest("../out", "../data.tokens", 1, true, "max_steps = 1\n");
  const std::string tok = test::qwen3_tokenizer();
  text.replace(text.find(tok), tok.size(), fs::relative(tok, cfg).string());
  test::write_file(cfg / "run.toml", text);
  auto from_root = lcx("--config " + (cfg / "run.toml").string(), "/");
  EXPECT_EQ(from_root.exit_code, 0) << from_root.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-1")) << from_root.output;
  // The checkpoint's manifest names the files absolute, so it reads the same from anywhere.
  std::ifstream saved(dir / "out" / "checkpoint-1" / "manifest.toml");
  const std::string saved_text((std::istreambuf_iterator<char>(saved)), {});
  EXPECT_TRUE(has(saved_text, (dir / "data.tokens").string())) << saved_text;

  // --overwrite: the folder holds the run's checkpoint, which a dry run refuses as the run would.
  auto from_dir = lcx("--config configs/run.toml --dry-run --overwrite --set data.source=data.tokens", dir.string());
  EXPECT_EQ(from_dir.exit_code, 0) << from_dir.output;
  auto from_cfg = lcx("--config run.toml --dry-run --set data.source=data.tokens", cfg.string());
  EXPECT_EQ(from_cfg.exit_code, 2) << from_cfg.output;
  EXPECT_TRUE(has(from_cfg.output, (cfg / "data.tokens").string() + " does not exist")) << from_cfg.output;
}

// Case 2: --dry-run and a run look at every input before any long work.
TEST_F(FirstContact, Case2EveryInputIsCheckedBeforeLongWork) {
  const std::string m = manifest();
  struct Case {
    std::string set, says;
  };
  const Case cases[] = {{"data.tokenizer=" + (dir / "none.json").string(), "none.json' does not exist"},
                        {"data.source=" + (dir / "none.tokens").string(), "none.tokens does not exist"},
                        {"model.init= --set model.path=" + (dir / "no-model").string(), "no-model does not exist"}};
  for (const auto& c : cases) {
    auto r = lcx("--config " + m + " --dry-run --set " + c.set);
    EXPECT_EQ(r.exit_code, 2) << c.set << "\n" << r.output;
    EXPECT_TRUE(has(r.output, c.says)) << c.set << "\n" << r.output;
    EXPECT_FALSE(has(r.output, "config OK")) << r.output;
  }
  // A model folder whose config.json is not a model's.
  test::write_file(dir / "bad-model" / "config.json", "{\"model_type\": \"llama\"}");
  auto bad = lcx("--config " + m + " --dry-run --set model.init= --set model.path=" + (dir / "bad-model").string());
  EXPECT_EQ(bad.exit_code, 2) << bad.output;
  EXPECT_FALSE(has(bad.output, "config OK")) << bad.output;
  // A real run refuses a missing model folder before the corpus is read or the run folder made.
  test::write_file(dir / "corpus.txt", "In the beginning God created the heaven and the earth.\n");
  auto run = lcx("--config " + m + " --set model.init= --set model.path=" + (dir / "no-model").string() +
                 " --set data.source=" + (dir / "corpus.txt").string());
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_TRUE(has(run.output, "no-model does not exist")) << run.output;
  EXPECT_FALSE(fs::exists(dir / "out")) << run.output;
}

// Case 3: a plan short of the GPU's budget is refused with what would make it fit; --force runs.
TEST_F(FirstContact, Case3PlanShortOfTheGpuIsRefusedUnlessForced) {
  const std::string m = manifest() + " --dry-run --set run.device=auto --set run.gpu_memory=1MB";
  auto r = lcx("--config " + m);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "short by")) << r.output;
  EXPECT_TRUE(has(r.output, "--force runs anyway")) << r.output;
  auto forced = lcx("--config " + m + " --force");
  EXPECT_EQ(forced.exit_code, 0) << forced.output;
  EXPECT_TRUE(has(forced.output, "config OK")) << forced.output;
}

// Case 10: one run folder, one lcx-train: the second is refused, naming the first.
TEST_F(FirstContact, Case10SecondRunOnOneFolderIsRefused) {
  const std::string m = manifest();
  fs::create_directories(dir / "out");
  const int fd = ::open((dir / "out" / ".lcx.lock").c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  const std::string holder = "pid 4242 on host elsewhere\n";
  ASSERT_EQ(::write(fd, holder.data(), holder.size()), static_cast<ssize_t>(holder.size()));
  auto second = lcx("--config " + m);
  EXPECT_EQ(second.exit_code, 2) << second.output;
  EXPECT_TRUE(has(second.output, "in use by another lcx-train (pid 4242 on host elsewhere)")) << second.output;
  EXPECT_FALSE(fs::exists(dir / "out" / "checkpoint-1"));
  ::close(fd);
  auto first = lcx("--config " + m);
  EXPECT_EQ(first.exit_code, 0) << first.output;
  std::ifstream lock(dir / "out" / ".lcx.lock");
  std::string word;
  lock >> word;
  EXPECT_EQ(word, "pid");
}

// Case 16: the root, the home folder and a folder of other files are not run folders.
TEST_F(FirstContact, Case16OutputDirRootHomeAndOtherFilesAreRefused) {
  const std::string m = manifest();
  fs::create_symlink("/", dir / "root-link");
  for (const std::string& out : {std::string("/"), (dir / "root-link").string()}) {
    auto r = lcx("--config " + m + " --overwrite --set run.output_dir=" + out);
    EXPECT_EQ(r.exit_code, 2) << out << "\n" << r.output;
    EXPECT_TRUE(has(r.output, "is the root folder")) << r.output;
  }
  fs::create_directories(dir / "home");
  auto home = test::run_command("HOME=" + (dir / "home").string() + " " + test::lcx_train() + " --config " + m +
                                " --set run.output_dir=" + (dir / "home").string());
  EXPECT_EQ(home.exit_code, 2) << home.output;
  EXPECT_TRUE(has(home.output, "is the home folder")) << home.output;

  test::write_file(dir / "out" / "notes.txt", "mine");
  auto other = lcx("--config " + m);
  EXPECT_EQ(other.exit_code, 2) << other.output;
  EXPECT_TRUE(has(other.output, "holds files lcx did not write (notes.txt)")) << other.output;
  // --overwrite trains there, and rotation and --overwrite delete only lcx's own files.
  auto over = lcx("--config " + m + " --overwrite --set train.max_steps=3 --set train.save_steps=1 --set train.keep_checkpoints=1");
  EXPECT_EQ(over.exit_code, 0) << over.output;
  auto again = lcx("--config " + m + " --overwrite");
  EXPECT_EQ(again.exit_code, 0) << again.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "notes.txt"));
  EXPECT_FALSE(fs::exists(dir / "out" / "checkpoint-3"));
  // A metrics.jsonl that is not lcx's is never replaced, even with --overwrite (MEH case).
  test::write_file(dir / "mine" / "metrics.jsonl", "my own notes\n");
  auto metrics = lcx("--config " + m + " --overwrite --set run.output_dir=" + (dir / "mine").string());
  EXPECT_EQ(metrics.exit_code, 2) << metrics.output;
  EXPECT_TRUE(has(metrics.output, "metrics.jsonl is not lcx's")) << metrics.output;
  std::ifstream kept(dir / "mine" / "metrics.jsonl");
  std::string line;
  std::getline(kept, line);
  EXPECT_EQ(line, "my own notes");
}

// Case 9: a damaged optimizer state is refused on resume; weights that are not finite are never
// saved, and the good checkpoints before them stay.
TEST_F(FirstContact, Case9DamagedOptimizerStateIsRefusedOnResume) {
  const std::string m = manifest("max_steps = 2\nsave_steps = 1\n");
  ASSERT_EQ(lcx("--config " + m).exit_code, 0);
  const fs::path ckpt = dir / "out" / "checkpoint-2";
  const fs::path opt = ckpt / "optimizer.safetensors";
  // The checks behind the checksums (tests/e2e/nothing_lost_test.cpp), as a checkpoint of an
  // older lcx, without them, meets them.
  fs::remove(ckpt / "lcx-checksums.json");
  // A negative second moment, written as a well-formed file.
  {
    auto file = safetensors::Checkpoint::open(opt.string());
    std::vector<safetensors::NamedTensor> tensors;
    bool damaged = false;
    for (const auto& name : file.names()) {
      Tensor t = file.load(name, DType::f32);
      if (name.ends_with(".exp_avg_sq") && !damaged) damaged = (t.data_as<float>()[0] = -1.0f) < 0;
      tensors.push_back({name, t});
    }
    fs::copy_file(opt, dir / "optimizer.good", fs::copy_options::overwrite_existing);
    safetensors::write_file(opt.string(), tensors, DType::f32, {{"format", "lcx-adamw"}});
  }
  auto negative = lcx("--config " + m + " --resume latest --set train.max_steps=3");
  EXPECT_EQ(negative.exit_code, 2) << negative.output;
  EXPECT_TRUE(has(negative.output, "a second moment below 0")) << negative.output;
  EXPECT_TRUE(has(negative.output, "fix:")) << negative.output;
  // 0xFF bytes over the last tensor's values: NaN.
  fs::copy_file(dir / "optimizer.good", opt, fs::copy_options::overwrite_existing);
  {
    std::fstream f(opt, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-16, std::ios::end);
    const char ff[16] = {-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1};
    f.write(ff, sizeof ff);
  }
  auto nan = lcx("--config " + m + " --resume latest --set train.max_steps=3");
  EXPECT_EQ(nan.exit_code, 2) << nan.output;
  EXPECT_TRUE(has(nan.output, "optimizer.safetensors")) << nan.output;
  EXPECT_TRUE(has(nan.output, "nan")) << nan.output;
}

TEST_F(FirstContact, Case9WeightsThatAreNotFiniteAreNeverSaved) {
  const std::string m = manifest("max_steps = 2\nsave_steps = 1\nkeep_checkpoints = 2\n");
  ASSERT_EQ(lcx("--config " + m).exit_code, 0);
  // An lr past float's range makes the next update infinite.
  auto r = lcx("--config " + m + " --resume latest --set train.max_steps=4 --set train.lr=1e300");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "checkpoint-3 is not saved")) << r.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-1"));
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-2"));
  EXPECT_FALSE(fs::exists(dir / "out" / "checkpoint-3"));
}

// Case 11: under cp the epoch's shorter last sequence is judged at the start, and the fix given
// there is what a resume accepts.
TEST_F(FirstContact, Case11ShortLastSequenceUnderCpIsJudgedAtTheStart) {
  write_tokens(dir / "data.tokens", 512 + 10, [](uint32_t i) { return (i * 7) % 256; });
  const std::string tables = "[plugins]\nload = [\"cp_ring\"]\n[distributed]\nnproc_per_node = 2\ncp = 2\n";
  std::string m = manifest("save_steps = 5\n", tables);
  // The padding takes the tokenizer's end-of-text id: the model's vocabulary must hold it.
  std::string text = test::tiny_run_manifest(dir / "out", dir / "data.tokens", 1, true, "save_steps = 5\n", tables);
  const std::string vocab = "\"vocab_size\": 256";
  text.replace(text.find(vocab), vocab.size(), "\"vocab_size\": 151936");
  test::write_file(m, text);
  auto r = lcx("--config " + m + " --set data.drop_last=false");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "pad_to_multiple_of = 4")) << r.output;
  EXPECT_FALSE(fs::exists(dir / "out" / "checkpoint-5")) << r.output;
  const std::string fixed = " --set data.drop_last=false --set data.pad_to_multiple_of=4";
  auto first = lcx("--config " + m + fixed + " --set train.max_steps=10");
  EXPECT_EQ(first.exit_code, 0) << first.output;
  auto resumed = lcx("--config " + m + fixed + " --resume latest");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-17")) << resumed.output;
}

// Case 12: sizes past what 64-bit arithmetic holds are refused, naming the key.
TEST_F(FirstContact, Case12HugeMemorySizesAreRefused) {
  const std::string m = manifest();
  auto gpu = lcx("--config " + m + " --plan --gpu-memory 1e30GB");
  EXPECT_EQ(gpu.exit_code, 2) << gpu.output;
  EXPECT_TRUE(has(gpu.output, "--gpu-memory '1e30GB'")) << gpu.output;
  auto host = lcx("--config " + m + " --dry-run --set run.host_memory=1e30GB");
  EXPECT_EQ(host.exit_code, 2) << host.output;
  EXPECT_TRUE(has(host.output, "run.host_memory")) << host.output;
  EXPECT_TRUE(has(host.output, "2^62 bytes")) << host.output;
}

// Case 13: ranks per node are bounded, with an error line.
TEST_F(FirstContact, Case13RanksPerNodeAreBounded) {
  auto r = lcx("--config " + manifest() + " --set distributed.nproc_per_node=100000");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "distributed.nproc_per_node: 100000 is out of range: at most 1024")) << r.output;
  EXPECT_FALSE(has(r.output, "terminate called")) << r.output;
}

// Case 14: tokenize reads regular files only.
TEST_F(FirstContact, Case14TokenizeRefusesDevices) {
  auto r = test::run_command("timeout 20 " + test::lcx_train() + " tokenize --tokenizer " + test::qwen3_tokenizer() +
                             " --file /dev/zero --count");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "'/dev/zero' is not a regular file")) << r.output;
}

// Case 15: a damaged tokenizer and folders lcx cannot write exit 2, the path named, with a fix.
TEST_F(FirstContact, Case15DamagedTokenizerAndUnwritableFoldersAreNamed) {
  std::ifstream in(test::qwen3_tokenizer());
  nlohmann::json tok = nlohmann::json::parse(in);
  tok["model"].erase("vocab");
  test::write_file(dir / "tokenizer.json", tok.dump());
  auto t = lcx("--config " + manifest() + " --dry-run --set data.tokenizer=" + (dir / "tokenizer.json").string());
  EXPECT_EQ(t.exit_code, 2) << t.output;
  EXPECT_TRUE(has(t.output, (dir / "tokenizer.json").string() + ": tokenizer.json has no model.vocab")) << t.output;
  EXPECT_TRUE(has(t.output, "fix:")) << t.output;

  test::write_file(dir / "a-file", "x");
  for (const std::string& out : {std::string("/proc/lcx-eval"), (dir / "a-file").string()}) {
    auto e = lcx("eval --config " + manifest() + " --model " + (dir / "model").string() + " --seq-len 32 --out " + out);
    EXPECT_EQ(e.exit_code, 2) << out << "\n" << e.output;
    EXPECT_TRUE(has(e.output, "--out " + out)) << e.output;
    EXPECT_TRUE(has(e.output, "fix:")) << e.output;
  }
  auto run = lcx("--config " + manifest() + " --set run.output_dir=/proc/lcx-run");
  EXPECT_EQ(run.exit_code, 2) << run.output;
  EXPECT_TRUE(has(run.output, "run.output_dir /proc/lcx-run")) << run.output;
}

// Case 6: the help, did-you-mean for other trainers' names, type errors the right way round, a
// table of an installed plugin not loaded, and the model folder's tokenizer by default.
TEST_F(FirstContact, Case6MessagesANewUserMeets) {
  auto help = lcx("--help");
  for (const char* sub : {"lcx-train tokenize", "lcx-train eval ", "lcx-train eval-plot"})
    EXPECT_TRUE(has(help.output, sub)) << sub << "\n" << help.output;
  const std::string m = manifest();
  auto alias = lcx("--config " + m + " --dry-run --set train.learning_rate=1e-5");
  EXPECT_EQ(alias.exit_code, 2) << alias.output;
  EXPECT_TRUE(has(alias.output, "did you mean 'lr'?")) << alias.output;
  auto accum = lcx("--config " + m + " --dry-run --set train.gradient_accumulation_steps=4");
  EXPECT_TRUE(has(accum.output, "did you mean 'grad_accum'?")) << accum.output;
  auto lr = lcx("--config " + m + " --dry-run --set train.lr=abc");
  EXPECT_EQ(lr.exit_code, 2) << lr.output;
  EXPECT_TRUE(has(lr.output, "train.lr wants a float")) << lr.output;
  EXPECT_TRUE(has(lr.output, "got a string")) << lr.output;
  auto steps = lcx("--config " + m + " --dry-run --set train.max_steps=abc");
  EXPECT_TRUE(has(steps.output, "wants an integer")) << steps.output;
  EXPECT_FALSE(has(steps.output, "a integer")) << steps.output;
  auto yarn = lcx("--config " + manifest("max_steps = 1\n", "[rope_yarn]\nfactor = 4.0\n") + " --dry-run");
  EXPECT_EQ(yarn.exit_code, 2) << yarn.output;
  EXPECT_TRUE(has(yarn.output, "add \"rope_yarn\" to [plugins] load")) << yarn.output;

  // A model folder with its tokenizer: data.tokenizer may be left out.
  const fs::path model = dir / "model";
  test::write_file(model / "config.json",
                   R"({"model_type": "qwen3", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, )"
                   R"("num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, )"
                   R"("tie_word_embeddings": true, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0})");
  fs::copy_file(test::qwen3_tokenizer(), model / "tokenizer.json");
  std::string text = test::tiny_run_manifest(dir / "out", dir / "data.tokens", 1, true, "max_steps = 1\n");
  const std::string tok_line = "tokenizer = \"" + test::qwen3_tokenizer() + "\"\n";
  text.erase(text.find(tok_line), tok_line.size());
  test::write_file(dir / "no-tok.toml", text);
  auto no_tok = lcx("--config " + (dir / "no-tok.toml").string() + " --dry-run --set model.init= --set model.path=" + model.string());
  EXPECT_EQ(no_tok.exit_code, 0) << no_tok.output;
  auto neither = lcx("--config " + (dir / "no-tok.toml").string() + " --dry-run");
  EXPECT_EQ(neither.exit_code, 2) << neither.output;
  EXPECT_TRUE(has(neither.output, "[data] tokenizer is not set")) << neither.output;
}

// MEH cases: a token file of only end-of-text ids, an output_dir that is the plugin folder.
TEST_F(FirstContact, MehNoTrainableTargetAndOutputDirInThePluginFolder) {
  write_tokens(dir / "eos.tokens", 512, [](uint32_t) { return 151643u; });
  auto eos = lcx("--config " + manifest() + " --set data.source=" + (dir / "eos.tokens").string());
  EXPECT_EQ(eos.exit_code, 2) << eos.output;
  EXPECT_TRUE(has(eos.output, "has no trainable target")) << eos.output;
  EXPECT_FALSE(has(eos.output, "not finite")) << eos.output;
  fs::create_directories(dir / "plugins");
  auto inside = lcx("--config " + manifest("max_steps = 1\n", "[plugins]\ndir = \"plugins\"\n") +
                    " --set run.output_dir=" + (dir / "plugins").string());
  EXPECT_EQ(inside.exit_code, 2) << inside.output;
  EXPECT_TRUE(has(inside.output, "is the plugin folder")) << inside.output;
  EXPECT_FALSE(fs::exists(dir / "plugins" / "log.jsonl"));
}

// MEH cases: a number for a size, an empty output_dir, a memory timeline past the last step.
TEST_F(FirstContact, MehSizesWithoutUnitsAndEmptyOutputDir) {
  auto number = lcx("--config " + manifest() + " --dry-run --set run.gpu_memory=5");
  EXPECT_EQ(number.exit_code, 2) << number.output;
  EXPECT_TRUE(has(number.output, "fix: write it in quotes with its unit")) << number.output;
  auto empty = lcx("--config " + manifest() + " --dry-run --set run.output_dir=");
  EXPECT_EQ(empty.exit_code, 2) << empty.output;
  EXPECT_TRUE(has(empty.output, "run.output_dir: is empty")) << empty.output;
  auto late = lcx("--config " + manifest() + " --set run.memory_timeline=true --set run.memory_timeline_step=5");
  EXPECT_EQ(late.exit_code, 0) << late.output;
  EXPECT_TRUE(has(late.output, "run.memory_timeline_step = 5 is past this run's last step")) << late.output;
}

}  // namespace
}  // namespace lcx
