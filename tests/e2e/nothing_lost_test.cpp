// What a probe of lcx-train found could be lost or go unbounded: a checkpoint's files
// checked before a resume, rotation that keeps the checkpoint a damaged resume started from,
// another trainer's checkpoint never deleted, eval's files kept in --out, and a CPU run past the
// host's memory refused before any work. Each case runs the real binary, as a user would.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lcx/safetensors.h"
#include "support/test_util.h"

namespace lcx {
namespace {

namespace fs = std::filesystem;

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

struct NothingLost : ::testing::Test {
  fs::path dir = test::temp_dir("nothing-lost");

  void SetUp() override {
    if (!fs::exists(test::qwen3_tokenizer())) GTEST_SKIP() << "data/qwen3/tokenizer.json absent: run scripts/fetch_data.sh";
    std::ofstream out(dir / "data.tokens", std::ios::binary);
    for (uint32_t i = 0; i < 512; ++i) {
      const uint32_t id = (i * 7) % 256;
      out.write(reinterpret_cast<const char*>(&id), 4);
    }
  }

  std::string manifest(const std::string& train, const std::string& tables = {}) {
    test::write_file(dir / "run.toml", test::tiny_run_manifest(dir / "out", dir / "data.tokens", 1, true, train, tables));
    return (dir / "run.toml").string();
  }

  test::CommandResult lcx(const std::string& args) { return test::run_command(test::lcx_train() + " " + args); }
};

// Item 5: bytes flipped inside the newest optimizer state (finite values, a well-formed file) are
// found by the checksum the save recorded; the resume is refused naming the file and the
// checkpoint before it, and no checkpoint is deleted.
TEST_F(NothingLost, FlippedBytesInACheckpointAreFoundBeforeTheResume) {
  const std::string m = manifest("max_steps = 3\nsave_steps = 1\nkeep_checkpoints = 2\n");
  ASSERT_EQ(lcx("--config " + m).exit_code, 0);
  const fs::path ckpt = dir / "out" / "checkpoint-3";
  ASSERT_TRUE(fs::exists(ckpt / "lcx-checksums.json"));
  const auto listed = nlohmann::json::parse(std::ifstream(ckpt / "lcx-checksums.json"));
  EXPECT_TRUE(listed["files"].contains("optimizer.safetensors")) << listed.dump();
  EXPECT_TRUE(listed["files"].contains("model.safetensors")) << listed.dump();
  EXPECT_EQ(listed["files"]["optimizer.safetensors"]["bytes"].get<uint64_t>(), fs::file_size(ckpt / "optimizer.safetensors"));
  {
    std::fstream f(ckpt / "optimizer.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    const float big = 1e29f;
    for (int k = 1; k <= 4; ++k) {
      f.seekp(-16 * k, std::ios::end);
      f.write(reinterpret_cast<const char*>(&big), sizeof big);
    }
  }
  auto r = lcx("--config " + m + " --resume latest --set train.max_steps=6");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, (ckpt / "optimizer.safetensors").string() + " does not hold the bytes the save wrote"))
      << r.output;
  EXPECT_TRUE(has(r.output, "fix: resume from the checkpoint before it: --resume " + (dir / "out" / "checkpoint-2").string()))
      << r.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-2"));
  EXPECT_TRUE(fs::exists(ckpt));
  EXPECT_FALSE(fs::exists(dir / "out" / "checkpoint-4"));
  // A missing file says so, with the same fix; a file cut short too.
  fs::remove(ckpt / "optimizer.safetensors");
  auto missing = lcx("--config " + m + " --resume latest --set train.max_steps=6");
  EXPECT_EQ(missing.exit_code, 2) << missing.output;
  EXPECT_TRUE(has(missing.output, (ckpt / "optimizer.safetensors").string() + " is missing")) << missing.output;
  EXPECT_TRUE(has(missing.output, "fix: resume from the checkpoint before it: --resume " +
                                      (dir / "out" / "checkpoint-2").string()))
      << missing.output;
  fs::resize_file(ckpt / "model.safetensors", 100);
  auto cut = lcx("--config " + m + " --resume latest --set train.max_steps=6");
  EXPECT_EQ(cut.exit_code, 2) << cut.output;
  EXPECT_TRUE(has(cut.output, "has 100 bytes, but the save wrote")) << cut.output;
}

// Item 5: a damage no check sees (a checkpoint of an older lcx has no checksums) shows as losses
// far above those before the checkpoint; rotation then keeps the checkpoint the run resumed from,
// and lets it go once a resumed run trains past it with losses in their range.
TEST_F(NothingLost, RotationKeepsTheResumedCheckpointUntilTheRunTrainsPastItWell) {
  const std::string m = manifest("max_steps = 3\nsave_steps = 1\nkeep_checkpoints = 1\n");
  ASSERT_EQ(lcx("--config " + m).exit_code, 0);
  const fs::path ckpt = dir / "out" / "checkpoint-3";
  ASSERT_TRUE(fs::exists(ckpt));
  fs::copy(dir / "out", dir / "healthy", fs::copy_options::recursive);

  // The final norm's master weights at 300: every logit 300 times too large, the loss finite and
  // far up, a well-formed file.
  {
    const fs::path opt = ckpt / "optimizer.safetensors";
    auto file = safetensors::Checkpoint::open(opt.string());
    std::vector<safetensors::NamedTensor> tensors;
    for (const auto& name : file.names()) {
      Tensor t = file.load(name, DType::f32);
      if (name == "model.norm.weight.master")
        for (int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = 300.0f;
      tensors.push_back({name, t});
    }
    safetensors::write_file(opt.string() + ".new", tensors, DType::f32, {{"format", "lcx-adamw"}});
    fs::rename(opt.string() + ".new", opt);
    fs::remove(ckpt / "lcx-checksums.json");
  }
  auto damaged = lcx("--config " + m + " --resume latest --set train.max_steps=5");
  EXPECT_EQ(damaged.exit_code, 0) << damaged.output;
  EXPECT_TRUE(has(damaged.output, "has no lcx-checksums.json")) << damaged.output;
  EXPECT_TRUE(has(damaged.output, "is far above the losses before " + ckpt.string())) << damaged.output;
  EXPECT_TRUE(fs::exists(ckpt)) << "rotation deleted the checkpoint the damaged run resumed from";
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-5"));
  EXPECT_FALSE(fs::exists(dir / "out" / "checkpoint-4"));

  // The same resume from intact files: the checkpoint is trained past well and rotated away.
  const std::string healthy = " --set run.output_dir=" + (dir / "healthy").string();
  auto good = lcx("--config " + m + healthy + " --resume latest --set train.max_steps=5");
  EXPECT_EQ(good.exit_code, 0) << good.output;
  EXPECT_FALSE(has(good.output, "is far above")) << good.output;
  EXPECT_FALSE(fs::exists(dir / "healthy" / "checkpoint-3"));
  EXPECT_TRUE(fs::exists(dir / "healthy" / "checkpoint-5"));
}

// Item 6: a checkpoint-<digits> folder another trainer wrote is never deleted: --overwrite (and
// any run) is refused before anything is removed, and so is a foreign metrics.jsonl.
TEST_F(NothingLost, OverwriteNeverDeletesAnotherTrainersCheckpoint) {
  const std::string m = manifest("max_steps = 1\n");
  const fs::path hf = dir / "out" / "checkpoint-500";
  test::write_file(hf / "trainer_state.json", R"({"global_step": 500, "log_history": [], "best_metric": null})");
  test::write_file(hf / "optimizer.pt", "weights of months");
  auto r = lcx("--config " + m + " --overwrite");
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "holds checkpoint-500, which lcx did not write")) << r.output;
  EXPECT_TRUE(fs::exists(hf / "optimizer.pt"));
  EXPECT_TRUE(fs::exists(hf / "trainer_state.json"));

  // lcx's own checkpoint beside a metrics.jsonl it did not write: nothing is deleted.
  fs::remove_all(hf);
  ASSERT_EQ(lcx("--config " + m).exit_code, 0);
  ASSERT_TRUE(fs::exists(dir / "out" / "checkpoint-1"));
  test::write_file(dir / "out" / "metrics.jsonl", "my own notes\n");
  auto metrics = lcx("--config " + m + " --overwrite");
  EXPECT_EQ(metrics.exit_code, 2) << metrics.output;
  EXPECT_TRUE(has(metrics.output, "metrics.jsonl is not lcx's")) << metrics.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-1")) << "deleted before the refusal";
}

// Item 7: eval's --out gets the run folder's checks, and a --label is a file name inside it.
TEST_F(NothingLost, EvalWritesOnlyInsideItsOutFolder) {
  const std::string m = manifest("max_steps = 1\n");
  const std::string eval = "eval --config " + m + " --model " + (dir / "none").string() + " --seq-len 8";
  auto root = lcx(eval + " --out /");
  EXPECT_EQ(root.exit_code, 2) << root.output;
  EXPECT_TRUE(has(root.output, "error: --out / is the root folder")) << root.output;
  for (const std::string& label : {std::string("../escape"), (dir / "abs").string(), std::string("..")}) {
    auto r = lcx(eval + " --out " + (dir / "ev").string() + " --label " + label);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_TRUE(has(r.output, "--label '" + label + "' is not a plain file name")) << r.output;
  }
  EXPECT_FALSE(fs::exists(dir / "ev"));
}

// Item 8: on the CPU the plan's bytes, every thread-rank counted, are held to the host's memory
// before any weight is loaded, as a GPU run's are to the GPU's.
TEST_F(NothingLost, CpuRunPastTheHostMemoryIsRefusedBeforeAnyWork) {
  const std::string m = manifest("max_steps = 1\n");
  auto small = lcx("--config " + m + " --set run.host_memory=64KB");
  EXPECT_EQ(small.exit_code, 2) << small.output;
  EXPECT_TRUE(has(small.output, "error: on the CPU the step needs ")) << small.output;
  EXPECT_TRUE(has(small.output, " of host memory but the host has 64.0 KiB")) << small.output;
  EXPECT_FALSE(fs::exists(dir / "out")) << "the run folder was made for a refused run";
  auto dry = lcx("--config " + m + " --dry-run --set run.host_memory=64KB");
  EXPECT_EQ(dry.exit_code, 2) << dry.output;
  EXPECT_FALSE(has(dry.output, "config OK")) << dry.output;

  // Qwen3-32B in fp32 with AdamW (about 500 GB) against this host's memory.
  auto big = lcx("--config " + m + " --set model.init=qwen3-32b");
  EXPECT_EQ(big.exit_code, 2) << big.output;
  EXPECT_TRUE(has(big.output, "error: on the CPU the step needs ")) << big.output;
  // Each thread-rank's tokenizer counts too (64 ranks of the tiny model hold about 5 GB).
  auto ranks = lcx("--config " + m + " --set distributed.nproc_per_node=64 --set run.host_memory=1GB");
  EXPECT_EQ(ranks.exit_code, 2) << ranks.output;
  EXPECT_TRUE(has(ranks.output, " x 64 thread-ranks, each with its tokenizer's ")) << ranks.output;
  EXPECT_TRUE(has(ranks.output, ") but the host has 1.00 GiB")) << ranks.output;
  EXPECT_FALSE(fs::exists(dir / "out"));
}

// Item 13: a run refused for the folder's state leaves it as it was (no line in the earlier run's
// log, no lock file in a folder it made), and --dry-run refuses it too, after the config it prints.
TEST_F(NothingLost, RefusedRunWritesNothingAndDryRunSaysSo) {
  const std::string m = manifest("max_steps = 1\n");
  ASSERT_EQ(lcx("--config " + m).exit_code, 0);
  const auto log_bytes = fs::file_size(dir / "out" / "log.jsonl");
  auto again = lcx("--config " + m);
  EXPECT_EQ(again.exit_code, 2) << again.output;
  EXPECT_TRUE(has(again.output, "holds checkpoints of an earlier run")) << again.output;
  EXPECT_EQ(fs::file_size(dir / "out" / "log.jsonl"), log_bytes);
  auto dry = lcx("--config " + m + " --dry-run");
  EXPECT_EQ(dry.exit_code, 2) << dry.output;
  EXPECT_FALSE(has(dry.output, "config OK")) << dry.output;
  EXPECT_GT(dry.output.find("error: run.output_dir"), dry.output.find("# slot providers")) << dry.output;

  auto nothing = lcx("--config " + m + " --resume latest --set run.output_dir=" + (dir / "fresh").string());
  EXPECT_EQ(nothing.exit_code, 2) << nothing.output;
  EXPECT_TRUE(has(nothing.output, "no complete checkpoint")) << nothing.output;
  EXPECT_FALSE(fs::exists(dir / "fresh"));
}

// Item 13: --dry-run reads the data as the run does where that is quick, and refuses what the run
// would refuse at its start (a seq_len longer than the data, a step larger than an epoch), after
// the config it prints.
TEST_F(NothingLost, DryRunChecksTheDataAsTheRunDoes) {
  const std::string m = manifest("max_steps = 1\n");
  auto longer = lcx("--config " + m + " --dry-run --set data.seq_len=100000");
  EXPECT_EQ(longer.exit_code, 2) << longer.output;
  EXPECT_TRUE(has(longer.output, "error: data.seq_len = 100000 is longer than the 512 tokens")) << longer.output;
  EXPECT_FALSE(has(longer.output, "config OK")) << longer.output;
  EXPECT_GT(longer.output.find("error: data.seq_len"), longer.output.find("# slot providers")) << longer.output;
  auto accum = lcx("--config " + m + " --dry-run --set train.grad_accum=20");
  EXPECT_EQ(accum.exit_code, 2) << accum.output;
  EXPECT_TRUE(has(accum.output, "fix: set train.grad_accum <= 16")) << accum.output;
  // Text past what a dry run tokenizes quickly is left to the run, saying so.
  {
    std::ofstream big(dir / "big.txt");
    const std::string line(1023, 'a');
    for (int i = 0; i < 65 * 1024; ++i) big << line << '\n';
  }
  auto big = lcx("--config " + m + " --dry-run --set data.source=" + (dir / "big.txt").string());
  EXPECT_EQ(big.exit_code, 0) << big.output;
  EXPECT_TRUE(has(big.output, "is not read by --dry-run")) << big.output;
  EXPECT_FALSE(fs::exists(dir / ".lcx-cache")) << big.output;
  EXPECT_FALSE(fs::exists(dir / "out"));
}

// Item 13: a run the data refuses (a seq_len longer than it) is refused before the run folder is
// touched: --overwrite deletes no checkpoint of the earlier run, its log gets no line, and a new
// folder is not made.
TEST_F(NothingLost, RunRefusedByItsDataTouchesNoRunFolder) {
  const std::string m = manifest("max_steps = 1\n");
  ASSERT_EQ(lcx("--config " + m).exit_code, 0);
  const auto log_bytes = fs::file_size(dir / "out" / "log.jsonl");
  auto over = lcx("--config " + m + " --overwrite --set data.seq_len=100000");
  EXPECT_EQ(over.exit_code, 2) << over.output;
  EXPECT_TRUE(has(over.output, "error: data.seq_len = 100000 is longer than the 512 tokens")) << over.output;
  EXPECT_FALSE(has(over.output, "--overwrite: removed")) << over.output;
  EXPECT_TRUE(fs::exists(dir / "out" / "checkpoint-1")) << "--overwrite deleted the checkpoint of a run it then refused";
  EXPECT_EQ(fs::file_size(dir / "out" / "log.jsonl"), log_bytes);
  auto fresh = lcx("--config " + m + " --set data.seq_len=100000 --set run.output_dir=" + (dir / "fresh").string());
  EXPECT_EQ(fresh.exit_code, 2) << fresh.output;
  EXPECT_FALSE(fs::exists(dir / "fresh")) << "a refused run made its folder (lock and log)";
}

// Item 12: a disk that fills during the first save (a file-size limit stands in for it: writes past
// it fail as on a full disk) names the checkpoint, the folder and the fix, and leaves no
// half-written checkpoint that a resume would take.
TEST_F(NothingLost, FullDiskDuringTheFirstSaveSaysWhatToDo) {
  const std::string m = manifest("max_steps = 2\nsave_steps = 1\n");
  auto r = test::run_command("trap '' XFSZ; ulimit -f 60; " + test::lcx_train() + " --config " + m);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_TRUE(has(r.output, "error: checkpoint-1 is not saved in " + (dir / "out").string() + ": ")) << r.output;
  EXPECT_TRUE(has(r.output, "fix: free space on its disk, or give run.output_dir on another one")) << r.output;
  EXPECT_FALSE(has(r.output, "filesystem error")) << r.output;
  EXPECT_FALSE(fs::exists(dir / "out" / "checkpoint-1"));
  auto resume = lcx("--config " + m + " --resume latest");
  EXPECT_EQ(resume.exit_code, 2) << resume.output;
  EXPECT_TRUE(has(resume.output, "no complete checkpoint")) << resume.output;
}

// Item 13: text in a folder that cannot be written (a read-only mount) trains, its token cache in
// the user's cache folder; a folder that can be written keeps it beside the text.
TEST_F(NothingLost, TokenCacheOfAReadOnlyDataFolderGoesToTheUsersCache) {
  const fs::path data = dir / "data", ro = dir / "ro", cache = dir / "xdg";
  std::string text;
  for (int i = 0; i < 200; ++i) text += "In the beginning God created the heaven and the earth. ";
  test::write_file(data / "book.txt", text);
  // Root writes through permission bits: a read-only bind mount stands in for the mount, where
  // this may make one; any other user reads a folder without write permission.
  fs::create_directories(ro);
  bool read_only = false;
  if (::geteuid() == 0) {
    read_only = test::run_command("mount --bind " + data.string() + " " + ro.string() + " && mount -o remount,ro,bind " +
                                  ro.string()).exit_code == 0;
  } else {
    fs::copy_file(data / "book.txt", ro / "book.txt");
    fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec, fs::perm_options::replace);
    read_only = true;
  }
  if (!read_only) GTEST_SKIP() << "no read-only folder could be made here (root without a bind mount)";
  // Text takes the tokenizer's whole vocabulary.
  std::string run = test::tiny_run_manifest(dir / "out", dir / "data.tokens", 1, true, "max_steps = 1\n");
  const std::string vocab = "\"vocab_size\": 256";
  run.replace(run.find(vocab), vocab.size(), "\"vocab_size\": 151936");
  test::write_file(dir / "run.toml", run);
  const std::string m = (dir / "run.toml").string();
  const std::string env = "XDG_CACHE_HOME=" + cache.string() + " ";
  auto r = test::run_command(env + test::lcx_train() + " --config " + m + " --set data.source=" + (ro / "book.txt").string());
  if (::geteuid() == 0) test::run_command("umount " + ro.string());
  else fs::permissions(ro, fs::perms::owner_all, fs::perm_options::replace);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(has(r.output, "cannot be written (a read-only mount?): the token cache goes to " + (cache / "lcx" / "tokens").string()))
      << r.output;
  EXPECT_TRUE(fs::exists(cache / "lcx" / "tokens")) << r.output;
  EXPECT_FALSE(fs::exists(ro / ".lcx-cache")) << r.output;
  // A folder that can be written keeps its cache beside the text, as before.
  auto w = test::run_command(env + test::lcx_train() + " --config " + m + " --overwrite --set data.source=" +
                             (data / "book.txt").string());
  EXPECT_EQ(w.exit_code, 0) << w.output;
  EXPECT_TRUE(fs::exists(data / ".lcx-cache")) << w.output;
}

// Item 12: the probe's confusing cases, each refused (or said) by its key with a fix.
TEST_F(NothingLost, ConfusingCasesAreRefusedByTheirKey) {
  const std::string m = manifest("max_steps = 2\nsave_steps = 1\n");
  auto etc = lcx("--config " + m + " --overwrite --set run.output_dir=/etc");
  EXPECT_EQ(etc.exit_code, 2) << etc.output;
  EXPECT_TRUE(has(etc.output, "error: run.output_dir /etc is the system folder /etc")) << etc.output;
  fs::create_symlink(dir / "gone", dir / "link");
  auto dangling = lcx("--config " + m + " --set run.output_dir=" + (dir / "link").string());
  EXPECT_EQ(dangling.exit_code, 2) << dangling.output;
  EXPECT_TRUE(has(dangling.output, "link is a symbolic link to " + (dir / "gone").string() + ", which does not exist"))
      << dangling.output;
  auto blank = lcx("--config " + m + " --set 'run.output_dir=\"  \"'");
  EXPECT_EQ(blank.exit_code, 2) << blank.output;
  EXPECT_TRUE(has(blank.output, "run.output_dir: is blank")) << blank.output;
  auto epochs = lcx("--config " + m + " --set train.max_steps=-1 --set train.epochs=1e300");
  EXPECT_EQ(epochs.exit_code, 2) << epochs.output;
  EXPECT_TRUE(has(epochs.output, "error: train.epochs = 1e+300 is ")) << epochs.output;
  EXPECT_FALSE(fs::exists(dir / "out" / "checkpoint-1"));
  auto accum = lcx("--config " + m + " --set train.grad_accum=20");
  EXPECT_EQ(accum.exit_code, 2) << accum.output;
  EXPECT_TRUE(has(accum.output, "error: a step takes 20 sequences (train.grad_accum = 20), but an epoch of 32-token "
                                "sequences holds 16"))
      << accum.output;
  EXPECT_TRUE(has(accum.output, "fix: set train.grad_accum <= 16")) << accum.output;
  EXPECT_FALSE(fs::exists(dir / "out" / "checkpoint-1"));

  // A hand-edited trainer state is refused, with the checkpoint before it as the fix.
  ASSERT_EQ(lcx("--config " + m).exit_code, 0);
  test::write_file(dir / "out" / "checkpoint-2" / "trainer_state.json",
                   R"({"step": 600, "sequences_done": -5, "num_tokens": 0, "seed": 1})");
  auto edited = lcx("--config " + m + " --resume latest --set train.max_steps=4");
  EXPECT_EQ(edited.exit_code, 2) << edited.output;
  EXPECT_TRUE(has(edited.output, "trainer_state.json has `sequences_done` = -5, below 0")) << edited.output;
  EXPECT_TRUE(has(edited.output, "--resume " + (dir / "out" / "checkpoint-1").string())) << edited.output;
  test::write_file(dir / "out" / "checkpoint-2" / "trainer_state.json",
                   R"({"step": 600, "sequences_done": 2, "num_tokens": 64, "seed": 1})");
  auto step = lcx("--config " + m + " --resume latest --set train.max_steps=4");
  EXPECT_EQ(step.exit_code, 2) << step.output;
  EXPECT_TRUE(has(step.output, "has `step` = 600, but the folder is checkpoint-2")) << step.output;

  // A resume toward another length says what becomes of the decaying schedule.
  auto longer = lcx("--config " + m + " --resume " + (dir / "out" / "checkpoint-1").string() +
                    " --set train.max_steps=4 --set train.schedule=\"linear\"");
  EXPECT_EQ(longer.exit_code, 0) << longer.output;
  EXPECT_TRUE(has(longer.output, "the checkpoint was trained toward 2 steps, this run goes to 4: the linear schedule is "
                                 "recomputed for 4 steps"))
      << longer.output;
}

}  // namespace
}  // namespace lcx
