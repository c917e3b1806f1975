#include "kernels/attention/dispatch.h"

#include <atomic>

#include "kernels/attention/smem.h"
#include "lcx/error.h"

namespace lcx::ops::attention {
namespace {

std::atomic<Choice> g_choice{Choice::automatic};

bool sixteen_bit(DType t) { return t == DType::bf16 || t == DType::f16; }

std::string kib(int64_t bytes) { return str((bytes + 1023) / 1024, " KB"); }

std::string cudnn_refusal(const Call& c, const DeviceCaps& d) {
  if (!d.cudnn) return "libcudnn.so.9 is not loadable";
  if (!sixteen_bit(c.dtype)) return "cuDNN attention takes bf16 or fp16";
  if (!c.out_matches || !c.dout_matches || !c.grads_match) return "cuDNN attention takes one dtype for every tensor";
  if (!c.inputs_aligned || !c.out_aligned || !c.grads_aligned) return "cuDNN attention takes 16-byte aligned tensors";
  if (c.head_dim % 8 != 0 || c.head_dim > cudnn_max_head_dim(d))
    return str("cuDNN attention takes head_dim a multiple of 8 up to ", cudnn_max_head_dim(d), " on sm_", d.major, d.minor,
               " (256 on sm_90), not ", c.head_dim);
  const bool halo_block = c.window > 0 && c.causal && c.ends_aligned && c.keys - c.rows < c.window;
  if (c.causal && !c.same_positions && !halo_block) {
    if (c.window > 0 && c.ends_aligned)
      return str("cuDNN's band mask takes a causal block whose keys reach back past its queries only by less than the "
                 "window (", c.window, "), not by ", c.keys - c.rows);
    return "cuDNN attention takes causal blocks only with equal query and key positions, or (with a window) with the "
           "queries at the last of the keys' positions";
  }
  if (c.window > 0 && !c.causal) return "cuDNN's band mask takes a window only on a causal block";
  if (c.rows == 0 || c.keys == 0) return "empty sequence";
  return {};
}

// The Hopper kernels' limits: int32 TMA coordinates in the forward; the backward ran, matched the
// CPU and was timed up to 131,072 rows, and a call of 262,144 did not finish (hopper/backward_sm90a.cu).
constexpr int64_t kHopperForwardMaxRows = (int64_t{1} << 31) - 1;
constexpr int64_t kHopperBackwardMaxRows = 131072;

std::string hopper_refusal(const Call& c, const DeviceCaps& d) {
  if (d.major != 9 || d.minor != 0)
    return str("the Hopper kernels run on sm_90 (H100, H200) alone; this GPU is sm_", d.major, d.minor);
  if (c.dtype != DType::bf16 || !c.out_matches || !c.dout_matches || !c.grads_match)
    return "the Hopper kernels take bf16 for every tensor";
  if (!c.inputs_aligned || !c.out_aligned || !c.grads_aligned) return "the Hopper kernels take 16-byte aligned tensors";
  if (c.head_dim != 128) return str("the Hopper kernels take head_dim 128, not ", c.head_dim);
  const int64_t most = c.backward ? kHopperBackwardMaxRows : kHopperForwardMaxRows;
  if (c.rows > most || c.keys > most)
    return str("the Hopper ", c.backward ? "backward" : "forward", " takes at most ", most, " query and key rows");
  return {};
}

std::string mma_refusal(const Call& c, const DeviceCaps& d) {
  if (d.major < 8) return str("the tensor-core kernels need sm_80 or newer; this GPU is sm_", d.major, d.minor);
  if (!sixteen_bit(c.dtype)) return "the tensor-core kernels take bf16 or fp16";
  if (!c.dout_matches) return "the tensor-core kernels take dout in q's dtype";
  if (!c.inputs_aligned) return "the tensor-core kernels take 16-byte aligned q, k, v and dout";
  if (c.head_dim != 64 && c.head_dim != 128 && c.head_dim != 256)
    return str("the tensor-core kernels take head_dim 64, 128 or 256, not ", c.head_dim);
  if (const int64_t need = smem::mma(c.backward, c.head_dim); need > d.smem_per_block)
    return str("the tensor-core kernels need ", kib(need), " of shared memory a block at head_dim ", c.head_dim,
               "; this GPU gives ", kib(d.smem_per_block));
  return {};
}

std::string reference_refusal(const Call& c, const DeviceCaps& d) {
  if (c.head_dim > 128) return str("the fp32 kernels take head_dim up to 128, not ", c.head_dim);
  if (const int64_t need = smem::reference(c.backward, c.head_dim); need > d.smem_per_block)
    return str("the fp32 kernels need ", kib(need), " of shared memory a block at head_dim ", c.head_dim,
               "; this GPU gives ", kib(d.smem_per_block));
  return {};
}

}  // namespace

const char* name(Backend b) {
  switch (b) {
    case Backend::cudnn: return "cudnn";
    case Backend::hopper: return "hopper";
    case Backend::mma: return "mma";
    case Backend::reference: return "reference";
  }
  return "?";
}

const char* name(Choice c) {
  switch (c) {
    case Choice::automatic: return "auto";
    case Choice::cudnn: return "cudnn";
    case Choice::own: return "own";
    case Choice::hopper: return "hopper";
    case Choice::mma: return "mma";
    case Choice::reference: return "reference";
    case Choice::sm80: return "sm80";
  }
  return "?";
}

std::optional<Choice> parse_choice(std::string_view s) {
  for (Choice c :
       {Choice::automatic, Choice::cudnn, Choice::own, Choice::hopper, Choice::mma, Choice::reference, Choice::sm80})
    if (s == name(c)) return c;
  return std::nullopt;
}

std::string refusal(Backend b, const Call& c, const DeviceCaps& d) {
  switch (b) {
    case Backend::cudnn: return cudnn_refusal(c, d);
    case Backend::hopper: return hopper_refusal(c, d);
    case Backend::mma: return mma_refusal(c, d);
    case Backend::reference: return reference_refusal(c, d);
  }
  return "unknown backend";
}

std::string describe(const Call& c) {
  return str(c.causal ? "causal " : "full ", c.backward ? "backward " : "forward ", dtype_name(c.dtype), " head_dim ",
             c.head_dim, ", ", c.rows, " x ", c.keys, " rows", c.window > 0 ? str(", window ", c.window) : "");
}

std::vector<Backend> candidates(Choice choice, const Call& c, const DeviceCaps& d, bool own) {
  const auto forced = [&](Backend b) -> std::vector<Backend> {
    const std::string why = refusal(b, c, d);
    if (!why.empty())
      throw Error(str("[run] attention = \"", name(b), "\" cannot run a ", describe(c), ": ", why), "run.attention",
                  str("use attention = \"auto\", which picks a backend per call (", kChoiceNames, ")"));
    return {b};
  };
  switch (choice) {
    case Choice::hopper: return forced(Backend::hopper);
    case Choice::mma: return forced(Backend::mma);
    case Choice::reference: return forced(Backend::reference);
    case Choice::cudnn:
      if (!own) return forced(Backend::cudnn);
      break;
    case Choice::own: own = true; break;
    case Choice::automatic:
    case Choice::sm80: break;
  }
  std::vector<Backend> out;
  std::string whys;
  for (Backend b : kBackends) {
    if ((own && b == Backend::cudnn) || (choice == Choice::sm80 && b == Backend::hopper)) continue;
    const std::string why = refusal(b, c, d);
    if (why.empty())
      out.push_back(b);
    else
      whys += str("; ", name(b), ": ", why);
  }
  if (out.empty())
    throw Error(str("no attention backend runs a ", describe(c), whys), "run.attention",
                "fp32 or head sizes over 128 run on the CPU (run.device = \"cpu\"); see each backend's reason above");
  // A long causal forward: the Hopper kernel ahead of cuDNN (measured without a window; a windowed
  // one stays on cuDNN's band mask).
  if (!own && !c.backward && c.causal && c.window == 0 && c.rows >= kOwnForwardMinRows && out.size() > 1 &&
      out[0] == Backend::cudnn &&
      out[1] == Backend::hopper)
    std::swap(out[0], out[1]);
  return out;
}

DeviceCaps caps_of(int major, int minor) {
  DeviceCaps d;
  d.major = major;
  d.minor = minor;
  const int cc = major * 10 + minor;
  d.smem_per_block = cc == 80 || cc == 87 ? 166912 : cc == 90 || major == 10 ? 232448 : 101376;
  return d;
}

void set_choice(Choice c) { g_choice.store(c); }
Choice choice() { return g_choice.load(); }

void check_fast_attention(Choice choice, const DeviceCaps& d) {
  if ((choice != Choice::automatic && choice != Choice::sm80) || d.cudnn || (d.major == 9 && choice == Choice::automatic))
    return;
  throw Error(str("this GPU (sm_", d.major, d.minor, ") has no cuDNN loaded and no Hopper attention kernels: every attention "
                  "call would run on lcx's sm_80 kernels, 7-8x slower than cuDNN or PyTorch's flash attention"),
              "run.attention",
              "install cuDNN 9 (NVIDIA's libcudnn9-cuda-13 package, or `pip install nvidia-cudnn-cu13` and `source "
              "lcx-env.sh`, which finds the wheel); or set [run] attention = \"own\" to train on lcx's kernels anyway");
}

std::vector<std::string> plan_lines(Choice choice, DType dtype, int64_t head_dim, int64_t rows, const DeviceCaps& d,
                                    int64_t window) {
  std::vector<std::string> lines;
  auto line = [&](const std::string& kind, Call c, bool own) {
    c.dtype = dtype;
    c.head_dim = head_dim;
    std::string what;
    try {
      const std::vector<Backend> order = candidates(choice, c, d, own);
      what = name(order.front());
      if (order.front() == Backend::cudnn && order.size() > 1)
        what += str(" (", name(order[1]), " where cuDNN refuses the plan)");
    } catch (const Error& e) {
      what = str("refused: ", e.what());
    }
    lines.push_back(str(kind, ": ", what));
  };
  Call fwd;
  fwd.rows = fwd.keys = std::min(rows, kOwnForwardMinRows - 1);
  line(str("causal forward below ", kOwnForwardMinRows, " rows"), fwd, false);
  if (rows >= kOwnForwardMinRows) {
    fwd.rows = fwd.keys = rows;
    line(str("causal forward of ", rows, " rows"), fwd, false);
  }
  Call bwd = fwd;
  bwd.backward = true;
  bwd.rows = bwd.keys = rows;
  line(str("backward of ", rows, " rows"), bwd, false);
  Call doc;
  doc.rows = doc.keys = std::min<int64_t>(rows, 4096);
  line("a document cuDNN's batches do not take, forward", doc, true);
  doc.backward = true;
  line("a document cuDNN's batches do not take, backward", doc, true);
  if (window > 0) {
    Call win;
    win.rows = win.keys = rows;
    win.window = window;
    line(str("windowed (", window, ") causal forward of ", rows, " rows"), win, false);
    win.backward = true;
    line(str("windowed (", window, ") backward of ", rows, " rows"), win, false);
  }
  return lines;
}

}  // namespace lcx::ops::attention
