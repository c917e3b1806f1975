#include <gtest/gtest.h>

#include <cmath>
#include <numbers>

#include <signal.h>
#include <unistd.h>

#include "lcx/error.h"
#include "train/progress.h"
#include "train/schedule.h"
#include "train/stop_signal.h"
#include "train/trainer.h"

namespace lcx {
namespace {

TEST(PythonFloat, MatchesRepr) {
  EXPECT_EQ(python_float(2e-05), "2e-05");
  EXPECT_EQ(python_float(0.0001), "0.0001");
  EXPECT_EQ(python_float(1049000.0), "1049000.0");
  EXPECT_EQ(python_float(4.311), "4.311");
  EXPECT_EQ(python_float(29.25), "29.25");
  EXPECT_EQ(python_float(0.25), "0.25");
  EXPECT_EQ(python_float(1e16), "1e+16");
  EXPECT_EQ(python_float(123456789012345.0), "123456789012345.0");
  EXPECT_EQ(python_float(-1.5e-07), "-1.5e-07");
  EXPECT_EQ(python_float(0.1 + 0.2), "0.30000000000000004");
  EXPECT_EQ(python_float(0.0), "0.0");
  EXPECT_DOUBLE_EQ(python_round(4.31149, 4), 4.3115);
}

TEST(StepLog, LooksLikeTheReference) {
  EXPECT_EQ(step_dict({{"loss", 4.311}, {"grad_norm", 29.25}, {"learning_rate", 2e-05},
                       {"num_tokens", 1049000.0}, {"epoch", 0.25}}),
            "{'loss': 4.311, 'grad_norm': 29.25, 'learning_rate': 2e-05, 'num_tokens': 1049000.0, 'epoch': 0.25}");
  EXPECT_EQ(progress_line(1, 12, 380.10), "  8%|▊         | 1/12 [06:20<1:09:41, 380.10s/it]");
  EXPECT_EQ(progress_line(12, 12, 24), "100%|██████████| 12/12 [00:24<00:00, 2.00s/it]");
  EXPECT_EQ(progress_line(0, 5, 0), "  0%|          | 0/5 [00:00<?, ?it/s]");
  EXPECT_EQ(progress_line(30, 60, 3), " 50%|█████     | 30/60 [00:03<00:03, 10.00it/s]");
  // The step's throughput, MFU and peak memory after the rate, as tqdm places a postfix.
  EXPECT_EQ(progress_line(1, 12, 380.10, -1, step_postfix(2150, 0.4128, "GPU", int64_t{31} << 30)),
            "  8%|▊         | 1/12 [06:20<1:09:41, 380.10s/it, 2.15k tok/s, MFU 41.3%, GPU 31.00 GiB]");
  EXPECT_EQ(step_postfix(523, -1, "host", 200 << 20), "523 tok/s, host 200.0 MiB");
  EXPECT_EQ(step_postfix(3.5e6, 0.05, "GPU", 0), "3.50M tok/s, MFU 5.0%");
}

TEST(Schedule, TransformersFormulas) {
  // linear: warmup 2, total 10
  EXPECT_DOUBLE_EQ(schedule_factor("linear", 0, 2, 10), 0.0);
  EXPECT_DOUBLE_EQ(schedule_factor("linear", 1, 2, 10), 0.5);
  EXPECT_DOUBLE_EQ(schedule_factor("linear", 2, 2, 10), 1.0);
  EXPECT_DOUBLE_EQ(schedule_factor("linear", 6, 2, 10), 0.5);
  EXPECT_DOUBLE_EQ(schedule_factor("linear", 10, 2, 10), 0.0);
  // cosine, num_cycles 0.5: halfway through the decay the factor is 0.5
  EXPECT_NEAR(schedule_factor("cosine", 6, 2, 10), 0.5, 1e-12);
  EXPECT_NEAR(schedule_factor("cosine", 4, 2, 10), 0.5 * (1 + std::cos(std::numbers::pi * 0.25)), 1e-12);
  EXPECT_DOUBLE_EQ(schedule_factor("constant", 7, 2, 10), 1.0);
  EXPECT_DOUBLE_EQ(schedule_factor("linear", 0, 0, 12), 1.0);
  EXPECT_THROW(schedule_factor("exp", 0, 0, 1), Error);
}

// A signal that comes after a step's ranks have read the stop request (its reduce) is
// seen by the next step's, which is the one that finishes: the handler names that one.
TEST(StopSignal, NamesTheStepThatWillFinish) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const int saved_err = ::dup(STDERR_FILENO);
  ::dup2(fds[1], STDERR_FILENO);
  {
    StopSignals signals;
    StopSignals::speak(true);
    StopSignals::step_running(8);
    StopSignals::request_read(8);
    ::raise(SIGINT);
    EXPECT_EQ(StopSignals::requested(), SIGINT);
  }
  ::dup2(saved_err, STDERR_FILENO);
  ::close(saved_err);
  ::close(fds[1]);
  char buf[512] = {};
  const ssize_t n = ::read(fds[0], buf, sizeof buf - 1);
  ::close(fds[0]);
  const std::string said(buf, n > 0 ? static_cast<size_t>(n) : 0);
  EXPECT_NE(said.find("SIGINT received: step 9 will finish, then a checkpoint is saved"), std::string::npos) << said;
}

// The command printed to go on after a stop keeps the run's own arguments.
TEST(ResumeCommand, KeepsTheOverridesAndResumesTheLatest) {
  EXPECT_EQ(resume_command({"lcx-train", "--config", "run.toml", "--set", "train.lr=1e-5", "--overwrite"}),
            "lcx-train --config run.toml --set train.lr=1e-5 --resume latest");
  EXPECT_EQ(resume_command({"lcx-train", "--config", "a b.toml", "--resume", "runs/x/checkpoint-4", "--set",
                            "run.output_dir=it's"}),
            "lcx-train --config 'a b.toml' --set 'run.output_dir=it'\\''s' --resume latest");
  EXPECT_EQ(resume_command({}), "");
}

}  // namespace
}  // namespace lcx
