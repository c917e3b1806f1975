// The rates table: what each kind of GPU reaches, one row per device name, for the cost model
// (predicted_step_seconds), the MFU's peak and providers' own cost models (lcx/rates.h). Rows are
// TOML tables named by the GPU's name as its device properties give it, each key a named rate in
// base units (FLOP/s, bytes/s):
//   ["NVIDIA H200"]
//   gemm_flops = 640e12
// The shipped table (share/lcx/rates.toml beside the binaries, as the plugins are) holds the
// measured rows; a user's file (LCX_RATES, else $XDG_CONFIG_HOME/lcx/rates.toml or
// ~/.config/lcx/rates.toml, written by `lcx-train calibrate`) adds rows and overrides rates key by
// key.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "lcx/plan.h"

namespace lcx {

// The rates core's cost model reads from every row (a row lacking one is refused).
namespace rate_name {
inline constexpr const char* gemm = "gemm_flops";                      // bf16 GEMMs through cuBLASLt, FLOP/s
inline constexpr const char* attention_forward = "attention_forward_flops";    // causal, FLOP/s
inline constexpr const char* attention_backward = "attention_backward_flops";  // 2.5x the forward's FLOPs
inline constexpr const char* memory = "memory_bytes";                  // elementwise passes, bytes/s read + written
inline constexpr const char* host_copy = "host_copy_bytes";            // pinned host <-> GPU, bytes/s each way
// The head groups at which a head group's projections (1/groups as wide) run at half the full
// width's rate: g groups run at 1 / (1 + (g - 1) / (this - 1)) of it.
inline constexpr const char* half_rate_groups = "head_groups_at_half_rate";
// Optional: the experts' grouped GEMMs over their sorted rows (ops::grouped_matmul: lcx's Hopper
// kernels on an H100/H200, cuBLAS's grouped GEMM elsewhere), FLOP/s, as calibrate measures them; a
// row without it takes kExpertGemmShare of its gemm_flops.
inline constexpr const char* expert_gemm = "expert_gemm_flops";
// Optional: the dense bf16 peak the MFU is reported against (the datasheet's), FLOP/s; and the
// device's memory in GiB, for choosing the nearest row of a GPU without its own.
inline constexpr const char* peak = "peak_flops";
inline constexpr const char* memory_gib = "memory_gib";
// Optional: the GPU's compute capability (9.0 for an H100), for planning which attention kernels
// its calls take where that GPU is not here (--plan).
inline constexpr const char* compute_capability = "compute_capability";
}  // namespace rate_name

// The experts' grouped GEMM rate as a share of the dense one where a row does not give it: measured
// at Qwen3-30B-A3B's shapes (128 experts, 2048 -> 768 and back, about 2,048 rows each), 281 of 650
// TFLOP/s on the H200 and 282 on the H100 (docs/PERF.md).
inline constexpr double kExpertGemmShare = 0.43;

// The device planned for where no GPU is at hand and none is named (--gpu-name, [run] gpu_name).
inline constexpr const char* kDefaultRatesDevice = "NVIDIA H200";

// What a row's figures rest on, its TOML key `source`: "calibrate" (measured by `lcx-train
// calibrate` on that GPU) or "datasheet" (the vendor's published peaks, scaled as the measured rows
// reach theirs: share/lcx/rates.toml says how).
inline constexpr const char* kRowBasisKey = "source";
inline constexpr const char* kBasisCalibrate = "calibrate";
inline constexpr const char* kBasisDatasheet = "datasheet";

struct RatesRow {
  std::string device;
  std::map<std::string, double, std::less<>> rates;
  std::string source;  // the file(s) the row came from
  std::string basis;   // kRowBasisKey's value: calibrate or datasheet; "" where the row does not say

  std::optional<double> find(std::string_view name) const;
  double get(std::string_view name, double fallback) const;
  double get(std::string_view name) const;  // refuses a missing rate, naming the row and its file
};

struct RatesTable {
  std::vector<RatesRow> rows;

  // Parses a table's TOML text; `source` names it in every refusal (a malformed file, a key that is
  // not a positive number, a row without one of core's rates when `complete`).
  static RatesTable parse(const std::string& text, const std::string& source, bool complete = true);
  // Reads a file; refuses a missing or malformed one naming it.
  static RatesTable load(const std::string& path, bool complete = true);
  // Adds over's rows; a row of the same device takes over's rates key by key.
  void merge(const RatesTable& over);
  const RatesRow* find(std::string_view device) const;

  // The row for `device`, or where the table has none the nearest: the row whose name shares the
  // most words with it (the vendor's left out), ties and no shared word settled by the nearest
  // memory_gib to memory_bytes (<= 0: unknown). note says which and how where it is not the device's own.
  struct Choice {
    RatesRow row;
    bool exact = false;
    std::string note;
  };
  Choice choose(std::string_view device, int64_t memory_bytes = 0) const;
};

// share/lcx/rates.toml beside the binaries (<exe>/../share/lcx/rates.toml).
std::string shipped_rates_path();
// The user's rates file: LCX_RATES, else $XDG_CONFIG_HOME/lcx/rates.toml, else
// ~/.config/lcx/rates.toml.
std::string user_rates_path();
// The shipped table with the user's file over it (when it exists; LCX_RATES must).
RatesTable load_rates();

// The TOML text of one row, and `path`'s table with `row` written in (its other rows as they are;
// a row of the same device replaced key by key). Creates the file and its folder when missing.
std::string format_rates_row(const RatesRow& row);
void write_rates_row(const std::string& path, const RatesRow& row);

// The row the run plans with (device_rate, predicted_step_seconds): set once by the command that
// knows the device; until set, the shipped table's kDefaultRatesDevice row.
const RatesRow& active_rates();
void set_active_rates(RatesRow row);
// Chooses the row for `device` ("" : this GPU's name, else kDefaultRatesDevice) from load_rates(),
// makes it the active one and returns the choice (its note says where it is not the device's own
// or the device was not asked).
RatesTable::Choice use_rates_for(const std::string& device, int64_t memory_bytes);
// The name of GPU 0, or nullopt without a usable GPU.
std::optional<std::string> local_gpu_name();

// The dense peak the MFU is reported against, FLOP/s: peak_tflops ([run] peak_tflops) when
// positive, else the active row's peak_flops; 0 where neither gives one.
double mfu_peak_flops(double peak_tflops);

// The cost model: a step's work (MemoryPlan::work) in seconds at a row's rates (the active row's).
double predicted_step_seconds(const StepWork& w, const RatesRow& rates);
double predicted_step_seconds(const StepWork& w);
// Its head-group charge inverted, for calibrate: the head_groups_at_half_rate at which
// predicted_step_seconds charges `extra_seconds` more for `grouped_flops`
// (StepWork::grouped_gemm_flops) run in `groups` head groups than in one, at GEMM rate `gemm`;
// 1000 (groups that cost nothing) where the extra is nil or too small to tell.
double half_rate_groups_for(double grouped_flops, int64_t groups, double extra_seconds, double gemm);

}  // namespace lcx
