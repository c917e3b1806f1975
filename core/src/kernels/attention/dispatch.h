// lcx's GPU attention backends and the one place that chooses among them. Each backend is a folder
// of kernels/attention/:
//   cudnn      cuDNN's fused flash kernels (graphs through the cuDNN 9 backend API): single calls
//              and batches of documents; loaded at run time, absent on some machines
//   hopper     lcx's own TMA + wgmma kernels, built for sm_90a alone: H100, H200
//   mma        lcx's own tensor-core kernels (WMMA, bf16/fp16), every GPU from sm_80
//   reference  lcx's own fp32 CUDA-core kernels: any float dtype, exact to fp32 rounding, the
//              fallback and the second opinion
// Each backend says whether it serves a call (refusal: dtype, head size, alignment, causal block
// positions, rows, direction, the device's compute capability and shared memory, cuDNN loaded),
// and candidates() orders those that do, as flash-attention's heuristics pick among its kernels.
// The run's choice is [run] attention: auto; own (lcx's own kernels, the best that serves, never
// cuDNN: what a machine without cuDNN runs); sm80 (auto without the Hopper kernels: what an A100
// runs, on any GPU); or one backend forced, which makes a call it cannot serve an error naming why. Pure logic, no CUDA: CPU tests check every rule.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "lcx/dtype.h"

namespace lcx::ops::attention {

enum class Backend { cudnn, hopper, mma, reference };
enum class Choice { automatic, cudnn, own, hopper, mma, reference, sm80 };
inline constexpr Backend kBackends[] = {Backend::cudnn, Backend::hopper, Backend::mma, Backend::reference};
inline constexpr const char* kChoiceNames = "auto, cudnn, own, hopper, mma, reference or sm80";

const char* name(Backend b);
const char* name(Choice c);
// The choice of a [run] attention value; nullopt for anything but kChoiceNames.
std::optional<Choice> parse_choice(std::string_view s);
// Whether cuDNN may run calls under this choice (auto and cudnn).
inline bool cudnn_allowed(Choice c) { return c == Choice::automatic || c == Choice::cudnn || c == Choice::sm80; }

// The device as the backends judge it.
struct DeviceCaps {
  int major = 9, minor = 0;
  int64_t smem_per_block = 232448;  // the opt-in dynamic shared memory limit (sharedMemPerBlockOptin)
  bool cudnn = true;                // libcudnn.so.9 loaded
};

// A GPU of this compute capability, with cuDNN: its opt-in shared memory a block from the
// capability (163 KB on sm_80 and sm_87, 227 KB on sm_90 and sm_100, 99 KB on the others), for
// planning a GPU that is not here (--plan with another rates row).
DeviceCaps caps_of(int major, int minor);

// One attention call as the backends judge it. Forward: out; backward: dout, dq, dk, dv as well.
struct Call {
  bool backward = false;
  DType dtype = DType::bf16;  // q's, and k's and v's (ops.cpp checks they match)
  bool dout_matches = true;   // dout in q's dtype (backward)
  bool out_matches = true;    // out in q's dtype
  bool grads_match = true;    // dq, dk, dv in q's dtype (backward)
  bool inputs_aligned = true;  // q, k, v (and dout) 16-byte aligned
  bool out_aligned = true;
  bool grads_aligned = true;   // dq, dk, dv (backward)
  int64_t head_dim = 128;
  int64_t rows = 1, keys = 1;  // query rows T, key rows S
  bool causal = true;
  bool same_positions = true;  // T == S at equal offsets: a causal block cuDNN's mask expresses
  // > 0: the sliding window (ops::AttentionParams::window). The own kernels take it anywhere,
  // skipping the key tiles outside it, so a windowed call costs T x W rather than T x S / 2. cuDNN
  // takes it as its band mask on a causal block of equal positions, or on one whose queries are the
  // last T of the keys' positions (`ends_aligned`: the keys reach `halo` = S - T rows further back,
  // a ring's chunk beside the rows before it that its window reaches), its masks then aligned
  // bottom-right, where the first query's window reaches the first key (halo < window).
  int64_t window = 0;
  bool ends_aligned = false;  // q_offset + T == k_offset + S with T <= S
};

// The automatic choice runs a causal forward (without a window) of at least this many query rows on
// the Hopper kernel, ahead of cuDNN, where that serves: there it measured 1.07-1.09x cuDNN's rate on three
// H100s, where at 16k-64k tokens it ranged from 0.93x to 1.02x from one card to the next
// (docs/PERF.md, the kernel table). The backward stays cuDNN's wherever cuDNN loads.
inline constexpr int64_t kOwnForwardMinRows = 131072;

// The largest head_dim cuDNN's attention takes on this device (both directions): 256 on sm_90, whose
// flash engines take it forward and backward; 128 elsewhere.
inline int64_t cudnn_max_head_dim(const DeviceCaps& d) { return d.major == 9 && d.minor == 0 ? 256 : 128; }

// Why `b` does not serve the call on this device, or "" when it does. cuDNN may still refuse when
// it builds the call's plan; the caller then goes on to the next candidate (auto) or fails (cudnn).
std::string refusal(Backend b, const Call& c, const DeviceCaps& d);

// The backends to try for the call, best first: under auto, cuDNN (the Hopper forward ahead of it
// from kOwnForwardMinRows causal rows), then the own kernels, hopper, mma, reference, each where it
// serves; the choice own, or `own` set, leaves cuDNN out (a document's rows that cuDNN's batches
// did not take run on the own kernels, under auto and cudnn alike). A forced backend is the only
// candidate. Refuses
// (lcx::Error naming [run] attention, the call and each backend's reason) where nothing serves.
std::vector<Backend> candidates(Choice choice, const Call& c, const DeviceCaps& d, bool own = false);

// "causal forward bf16 head_dim 128, 65536 x 65536 rows" (", window 4096" where it has one): a
// call in a refusal.
std::string describe(const Call& c);

// The choice the GPU attention runs under ([run] attention; auto until set), process-wide.
void set_choice(Choice c);
Choice choice();

// Under auto on a GPU without cuDNN and without the Hopper kernels (anything but sm_90), every
// attention call of 16-bit head_dim <= 128 would run on the mma kernels, which measured 47.7 TFLOP/s
// forward and 39.1 backward at 32,768 causal tokens on an H200, 7-8x under PyTorch's flash backend
// (docs/PERF.md). Such a run is refused at its start with the fix (cuDNN), not taken silently;
// [run] attention = "own" or "mma" takes it knowingly. Throws lcx::Error naming run.attention.
void check_fast_attention(Choice choice, const DeviceCaps& d);

// Which backend each kind of call of a run takes: one line per kind (causal forward below and from
// kOwnForwardMinRows rows, backward, a document's rows on the own kernels, and with `window` > 0 a
// windowed layer's forward and backward), for the log and --plan.
std::vector<std::string> plan_lines(Choice choice, DType dtype, int64_t head_dim, int64_t rows, const DeviceCaps& d,
                                    int64_t window = 0);

}  // namespace lcx::ops::attention
