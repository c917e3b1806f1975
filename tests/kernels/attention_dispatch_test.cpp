// The GPU attention's dispatch (kernels/attention/dispatch.h) on the CPU: which backend serves a
// described call on a described GPU, in which order, and what a forced backend that cannot serve
// says. The GPU tests (tests/gpu/ops_gpu_test.cpp) check the kernels each choice runs.
#include "kernels/attention/dispatch.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/attention/smem.h"
#include "lcx/error.h"

namespace lcx::ops::attention {
namespace {

using B = Backend;

const DeviceCaps kH100 = caps_of(9, 0);
const DeviceCaps kA100 = caps_of(8, 0);
const DeviceCaps kRtx4090 = caps_of(8, 9);
const DeviceCaps kB200 = caps_of(10, 0);

Call causal(int64_t rows, int64_t head_dim = 128, DType t = DType::bf16, bool backward = false) {
  Call c;
  c.backward = backward;
  c.dtype = t;
  c.head_dim = head_dim;
  c.rows = c.keys = rows;
  return c;
}

std::string error_of(Choice choice, const Call& c, const DeviceCaps& d, bool own = false) {
  try {
    candidates(choice, c, d, own);
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "run.attention");
    return e.what();
  }
  return "";
}

TEST(AttentionDispatch, AutoOnHopperTakesCudnnFirstThenTheOwnKernels) {
  EXPECT_EQ(candidates(Choice::automatic, causal(65536), kH100),
            (std::vector<B>{B::cudnn, B::hopper, B::mma, B::reference}));
  EXPECT_EQ(candidates(Choice::automatic, causal(65536, 128, DType::bf16, true), kH100),
            (std::vector<B>{B::cudnn, B::hopper, B::mma, B::reference}));
}

TEST(AttentionDispatch, AutoRunsTheHopperForwardAheadOfCudnnFromItsThreshold) {
  EXPECT_EQ(candidates(Choice::automatic, causal(kOwnForwardMinRows), kH100).front(), B::hopper);
  EXPECT_EQ(candidates(Choice::automatic, causal(kOwnForwardMinRows - 128), kH100).front(), B::cudnn);
  Call full = causal(kOwnForwardMinRows);
  full.causal = false;
  EXPECT_EQ(candidates(Choice::automatic, full, kH100).front(), B::cudnn);
  // The backward stays cuDNN's; past 131,072 rows the Hopper backward is not offered at all.
  EXPECT_EQ(candidates(Choice::automatic, causal(2 * kOwnForwardMinRows, 128, DType::bf16, true), kH100),
            (std::vector<B>{B::cudnn, B::mma, B::reference}));
  // A forced cuDNN keeps cuDNN at every length.
  EXPECT_EQ(candidates(Choice::cudnn, causal(kOwnForwardMinRows), kH100), (std::vector<B>{B::cudnn}));
}

TEST(AttentionDispatch, OwnNeverTakesCudnn) {
  EXPECT_EQ(candidates(Choice::own, causal(4096), kH100), (std::vector<B>{B::hopper, B::mma, B::reference}));
  EXPECT_EQ(candidates(Choice::automatic, causal(4096), kH100, true),
            (std::vector<B>{B::hopper, B::mma, B::reference}));
  // A document's rows under a forced cuDNN: the own kernels, as under auto.
  EXPECT_EQ(candidates(Choice::cudnn, causal(4096), kH100, true), (std::vector<B>{B::hopper, B::mma, B::reference}));
  DeviceCaps no_cudnn = kH100;
  no_cudnn.cudnn = false;
  EXPECT_EQ(candidates(Choice::automatic, causal(4096), no_cudnn), (std::vector<B>{B::hopper, B::mma, B::reference}));
}

// sm80: what an A100 runs, on any GPU: cuDNN, then the sm_80 kernels, never the Hopper ones; and,
// without cuDNN, refused at the start as auto is on a GPU without Hopper kernels.
TEST(AttentionDispatch, Sm80LeavesTheHopperKernelsOut) {
  EXPECT_EQ(candidates(Choice::sm80, causal(4096), kH100), (std::vector<B>{B::cudnn, B::mma, B::reference}));
  EXPECT_EQ(candidates(Choice::sm80, causal(2 * kOwnForwardMinRows), kH100),
            (std::vector<B>{B::cudnn, B::mma, B::reference}));
  EXPECT_EQ(candidates(Choice::sm80, causal(4096), kH100, true), (std::vector<B>{B::mma, B::reference}));
  EXPECT_EQ(candidates(Choice::sm80, causal(4096), kA100), candidates(Choice::automatic, causal(4096), kA100));
  DeviceCaps no_cudnn = kH100;
  no_cudnn.cudnn = false;
  EXPECT_THROW(check_fast_attention(Choice::sm80, no_cudnn), Error);
  EXPECT_NO_THROW(check_fast_attention(Choice::sm80, kH100));
}

TEST(AttentionDispatch, Fp32AndOddHeadSizesFallToTheReferenceKernels) {
  EXPECT_EQ(candidates(Choice::automatic, causal(4096, 128, DType::f32), kH100), (std::vector<B>{B::reference}));
  EXPECT_EQ(candidates(Choice::automatic, causal(4096, 80), kH100), (std::vector<B>{B::cudnn, B::reference}));
  EXPECT_EQ(candidates(Choice::automatic, causal(4096, 64, DType::f16), kH100),
            (std::vector<B>{B::cudnn, B::mma, B::reference}));
  const std::string why = error_of(Choice::automatic, causal(4096, 512), kH100);
  EXPECT_NE(why.find("no attention backend runs a causal forward bf16 head_dim 512"), std::string::npos) << why;
  EXPECT_NE(why.find("mma: the tensor-core kernels take head_dim 64, 128 or 256, not 512"), std::string::npos) << why;
}

// head_dim 256 (Gemma 3): cuDNN on sm_90 (its flash engines take 256 there, forward and backward),
// then the tensor-core kernels where a block gets their 190 KB of shared memory; an A100 has neither,
// and the fp32 kernels stop at 128.
TEST(AttentionDispatch, HeadDim256RunsOnCudnnAndTheTensorCoreKernelsOfSm90) {
  EXPECT_EQ(candidates(Choice::automatic, causal(4096, 256), kH100), (std::vector<B>{B::cudnn, B::mma}));
  EXPECT_EQ(candidates(Choice::automatic, causal(4096, 256, DType::bf16, true), kH100), (std::vector<B>{B::cudnn, B::mma}));
  EXPECT_EQ(candidates(Choice::own, causal(4096, 256, DType::f16, true), kB200), (std::vector<B>{B::mma}));
  EXPECT_EQ(smem::mma(false, 256), 194560);
  EXPECT_EQ(smem::mma(true, 256), 188416);
  const std::string why = error_of(Choice::automatic, causal(4096, 256), kA100);
  EXPECT_NE(why.find("no attention backend runs a causal forward bf16 head_dim 256"), std::string::npos) << why;
  EXPECT_NE(why.find("cudnn: cuDNN attention takes head_dim a multiple of 8 up to 128 on sm_80 (256 on sm_90), not 256"),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("mma: the tensor-core kernels need 190 KB of shared memory a block at head_dim 256; this GPU gives "
                     "163 KB"),
            std::string::npos)
      << why;
  EXPECT_NE(why.find("reference: the fp32 kernels take head_dim up to 128, not 256"), std::string::npos) << why;
}

TEST(AttentionDispatch, AmpereAndBlackwellNeverReachTheHopperKernels) {
  EXPECT_EQ(candidates(Choice::automatic, causal(kOwnForwardMinRows), kA100),
            (std::vector<B>{B::cudnn, B::mma, B::reference}));
  EXPECT_EQ(candidates(Choice::own, causal(4096, 128, DType::bf16, true), kA100), (std::vector<B>{B::mma, B::reference}));
  EXPECT_EQ(candidates(Choice::automatic, causal(kOwnForwardMinRows), kB200),
            (std::vector<B>{B::cudnn, B::mma, B::reference}));
  const std::string why = error_of(Choice::hopper, causal(4096), kA100);
  EXPECT_NE(why.find("[run] attention = \"hopper\" cannot run a causal forward"), std::string::npos) << why;
  EXPECT_NE(why.find("this GPU is sm_80"), std::string::npos) << why;
}

// sm_89 gives a block 99 KB of shared memory: the own kernels at head_dim 128 need more (110 to
// 120 KB), so cuDNN alone serves there, and the own choice is refused naming the shortfall.
TEST(AttentionDispatch, AdaServesHeadDim128OnCudnnAlone) {
  EXPECT_EQ(candidates(Choice::automatic, causal(4096), kRtx4090), (std::vector<B>{B::cudnn}));
  EXPECT_EQ(candidates(Choice::own, causal(4096, 64), kRtx4090), (std::vector<B>{B::mma, B::reference}));
  const std::string why = error_of(Choice::own, causal(4096), kRtx4090);
  EXPECT_NE(why.find("110 KB of shared memory a block at head_dim 128; this GPU gives 99 KB"), std::string::npos) << why;
  EXPECT_EQ(smem::mma(false, 128), 112640);
  EXPECT_EQ(smem::mma(true, 128), 122880);
  EXPECT_EQ(smem::reference(false, 128), 115712);
  EXPECT_LE(smem::mma(true, 64), kRtx4090.smem_per_block);
}

// Without cuDNN, auto on a GPU without the Hopper kernels would run everything on the mma kernels
// (7-8x under cuDNN's rate): refused with the fix; own or mma take it knowingly; a Hopper GPU has
// its own kernels at cuDNN's forward rate and PyTorch flash's backward rate.
TEST(AttentionDispatch, WithoutCudnnOnlyHopperRunsUnderAuto) {
  for (DeviceCaps d : {kA100, kRtx4090, kB200}) {
    d.cudnn = false;
    try {
      check_fast_attention(Choice::automatic, d);
      ADD_FAILURE() << "sm_" << d.major << d.minor << " without cuDNN was not refused";
    } catch (const Error& e) {
      EXPECT_EQ(e.key(), "run.attention");
      EXPECT_NE(std::string(e.what()).find("no cuDNN loaded"), std::string::npos) << e.what();
      EXPECT_NE(e.fix().find("nvidia-cudnn-cu13"), std::string::npos) << e.fix();
    }
    EXPECT_NO_THROW(check_fast_attention(Choice::own, d));
    EXPECT_NO_THROW(check_fast_attention(Choice::mma, d));
  }
  DeviceCaps hopper = kH100;
  hopper.cudnn = false;
  EXPECT_NO_THROW(check_fast_attention(Choice::automatic, hopper));
  EXPECT_NO_THROW(check_fast_attention(Choice::automatic, kA100));  // cuDNN loaded
}

TEST(AttentionDispatch, ForcedCudnnNamesWhatItRefuses) {
  Call ring = causal(4096);
  ring.keys = 8192;
  ring.same_positions = false;
  const std::string why = error_of(Choice::cudnn, ring, kH100);
  EXPECT_NE(why.find("[run] attention = \"cudnn\" cannot run a causal forward bf16 head_dim 128, 4096 x 8192 rows: "
                     "cuDNN attention takes causal blocks only with equal query and key positions"),
            std::string::npos)
      << why;
  EXPECT_EQ(candidates(Choice::automatic, ring, kH100), (std::vector<B>{B::hopper, B::mma, B::reference}));
  Call misaligned = causal(4096);
  misaligned.out_aligned = false;
  EXPECT_EQ(refusal(B::cudnn, misaligned, kH100), "cuDNN attention takes 16-byte aligned tensors");
  EXPECT_EQ(candidates(Choice::automatic, misaligned, kH100), (std::vector<B>{B::mma, B::reference}));
}

// A sliding window: cuDNN takes it on a causal block of equal positions (its band mask) or of queries
// at the last of the keys' positions reaching back less than the window (a ring's chunk beside its
// halo: the masks aligned bottom-right), the own kernels everywhere (they take the positions); a
// windowed long forward stays on cuDNN, whose band mask skips the tiles outside the window as the
// own kernels do.
TEST(AttentionDispatch, WindowedCallsRunOnCudnnsBandMaskOrTheOwnKernels) {
  Call win = causal(65536);
  win.window = 4096;
  EXPECT_EQ(candidates(Choice::automatic, win, kH100), (std::vector<B>{B::cudnn, B::hopper, B::mma, B::reference}));
  win.backward = true;
  EXPECT_EQ(candidates(Choice::automatic, win, kH100), (std::vector<B>{B::cudnn, B::hopper, B::mma, B::reference}));
  Call long_win = causal(kOwnForwardMinRows);
  long_win.window = 128;
  EXPECT_EQ(candidates(Choice::automatic, long_win, kH100).front(), B::cudnn);
  EXPECT_EQ(candidates(Choice::automatic, long_win, kA100), (std::vector<B>{B::cudnn, B::mma, B::reference}));

  // A ring's chunk of 4096 queries beside the 999 keys before it that its window of 1000 reaches.
  Call halo = causal(4096);
  halo.keys = 4096 + 999;
  halo.same_positions = false;
  halo.ends_aligned = true;
  halo.window = 1000;
  EXPECT_EQ(candidates(Choice::automatic, halo, kH100), (std::vector<B>{B::cudnn, B::hopper, B::mma, B::reference}));
  halo.backward = true;
  EXPECT_EQ(candidates(Choice::automatic, halo, kA100), (std::vector<B>{B::cudnn, B::mma, B::reference}));
  // Keys reaching back as far as the window or further, or not ending at the queries: the own kernels.
  halo.keys = 4096 + 1000;
  EXPECT_EQ(refusal(B::cudnn, halo, kH100),
            "cuDNN's band mask takes a causal block whose keys reach back past its queries only by less than the "
            "window (1000), not by 1000");
  Call ring = causal(4096);
  ring.keys = 8192;
  ring.same_positions = false;
  ring.window = 1000;
  EXPECT_EQ(candidates(Choice::automatic, ring, kH100), (std::vector<B>{B::hopper, B::mma, B::reference}));
  ring.window = 0;
  ring.ends_aligned = true;  // without a window such a block stays on the own kernels
  EXPECT_EQ(candidates(Choice::automatic, ring, kH100), (std::vector<B>{B::hopper, B::mma, B::reference}));
  Call full = causal(4096);
  full.causal = false;
  full.window = 1000;
  EXPECT_EQ(refusal(B::cudnn, full, kH100), "cuDNN's band mask takes a window only on a causal block");
  EXPECT_EQ(candidates(Choice::automatic, full, kH100), (std::vector<B>{B::hopper, B::mma, B::reference}));
  const std::string why = error_of(Choice::cudnn, full, kH100);
  EXPECT_NE(why.find("cannot run a full forward bf16 head_dim 128, 4096 x 4096 rows, window 1000: cuDNN's band mask"),
            std::string::npos)
      << why;
  // The own kernels and the fp32 ones take the window at every dtype and head size they take.
  Call f32 = causal(4096, 64, DType::f32);
  f32.window = 17;
  EXPECT_EQ(candidates(Choice::automatic, f32, kH100), (std::vector<B>{B::reference}));
}

TEST(AttentionDispatch, ChoiceNames) {
  for (const char* n : {"auto", "cudnn", "own", "hopper", "mma", "reference", "sm80"}) {
    const auto c = parse_choice(n);
    ASSERT_TRUE(c) << n;
    EXPECT_STREQ(name(*c), n);
  }
  EXPECT_FALSE(parse_choice("flash"));
  EXPECT_FALSE(parse_choice(""));
}

TEST(AttentionDispatch, PlanLinesNameTheBackendOfEachKindOfCall) {
  const std::vector<std::string> lines = plan_lines(Choice::automatic, DType::bf16, 128, 262144, kH100);
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines[0], "causal forward below 131072 rows: cudnn (hopper where cuDNN refuses the plan)");
  EXPECT_EQ(lines[1], "causal forward of 262144 rows: hopper");
  EXPECT_EQ(lines[2], "backward of 262144 rows: cudnn (mma where cuDNN refuses the plan)");
  EXPECT_EQ(lines[3], "a document cuDNN's batches do not take, forward: hopper");
  const std::vector<std::string> windowed = plan_lines(Choice::automatic, DType::bf16, 128, 262144, kH100, 4096);
  ASSERT_EQ(windowed.size(), 7u);
  EXPECT_EQ(windowed[5], "windowed (4096) causal forward of 262144 rows: cudnn (hopper where cuDNN refuses the plan)");
  EXPECT_EQ(windowed[6], "windowed (4096) backward of 262144 rows: cudnn (mma where cuDNN refuses the plan)");
  const std::vector<std::string> ada = plan_lines(Choice::mma, DType::bf16, 128, 4096, kRtx4090);
  EXPECT_NE(ada[0].find("refused: [run] attention = \"mma\" cannot run"), std::string::npos) << ada[0];
}

}  // namespace
}  // namespace lcx::ops::attention
