// The rates table (plan/rates.h) and the cost model that reads it.
#include "plan/rates.h"

#include <algorithm>
#include <boost/dll/runtime_symbol_info.hpp>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "lcx/error.h"
#include "lcx/rates.h"
#include "util/file.h"
#ifdef LCX_HAVE_CUDA
#include <cuda_runtime.h>

#include "lcx/tensor.h"
#endif

namespace lcx {

namespace fs = std::filesystem;

namespace {

constexpr const char* kRequired[] = {rate_name::gemm,   rate_name::attention_forward, rate_name::attention_backward,
                                     rate_name::memory, rate_name::host_copy,         rate_name::half_rate_groups};

const char* kRatesFix = "each row is a TOML table named by the GPU (e.g. [\"NVIDIA H200\"]) of positive numbers "
                        "(gemm_flops = 640e12); `lcx-train calibrate` writes one";

// The lower-case words of a device name, the vendor's left out: "NVIDIA H100 80GB HBM3" -> h100, 80gb, hbm3.
std::set<std::string> name_words(std::string_view name) {
  std::set<std::string> out;
  std::string w;
  auto flush = [&] {
    if (!w.empty() && w != "nvidia" && w != "amd" && w != "tesla") out.insert(w);
    w.clear();
  };
  for (char c : name) {
    if (std::isalnum(static_cast<unsigned char>(c))) w += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    else flush();
  }
  flush();
  return out;
}

std::string number(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  // TOML floats need a fraction or an exponent; a bare integer would read back as one.
  if (s.find_first_of(".eE") == std::string::npos && s.find_first_of("ni") == std::string::npos) s += ".0";
  return s;
}

std::string toml_string(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

}  // namespace

std::optional<double> RatesRow::find(std::string_view name) const {
  const auto it = rates.find(name);
  if (it == rates.end()) return std::nullopt;
  return it->second;
}

double RatesRow::get(std::string_view name, double fallback) const { return find(name).value_or(fallback); }

double RatesRow::get(std::string_view name) const {
  if (auto v = find(name)) return *v;
  throw Error(str("the rates row '", device, "' (", source, ") has no ", name), std::string(name),
              str("add it to the row, or run lcx-train calibrate on that GPU (", kRatesFix, ")"));
}

RatesTable RatesTable::parse(const std::string& text, const std::string& source, bool complete) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw Error(str("rates table ", source, ":", e.source().begin.line, ":", e.source().begin.column, ": ",
                    e.description()),
                {}, "fix the TOML syntax at that line, or remove the file to use the shipped table");
  }
  RatesTable t;
  for (const auto& [device, node] : root) {
    const toml::table* row = node.as_table();
    if (!row)
      throw Error(str("rates table ", source, ":", node.source().begin.line, ": '", device.str(),
                      "' is not a table of rates"),
                  std::string(device.str()), kRatesFix);
    RatesRow r;
    r.device = std::string(device.str());
    r.source = source;
    for (const auto& [key, value] : *row) {
      if (key.str() == kRowBasisKey) {
        const std::optional<std::string> b = value.value<std::string>();
        if (!b || (*b != kBasisCalibrate && *b != kBasisDatasheet))
          throw Error(str("rates table ", source, ":", value.source().begin.line, ": ", r.device, ".", key.str(),
                          " must be \"", kBasisCalibrate, "\" or \"", kBasisDatasheet, "\""),
                      str(r.device, ".", key.str()),
                      "calibrate: measured by lcx-train calibrate; datasheet: from the vendor's published rates");
        r.basis = *b;
        continue;
      }
      const std::optional<double> v = value.value<double>();
      if (!v || !(*v > 0) || !std::isfinite(*v))
        throw Error(str("rates table ", source, ":", value.source().begin.line, ": ", r.device, ".", key.str(),
                        " is not a positive number"),
                    str(r.device, ".", key.str()), kRatesFix);
      if (key.str() == rate_name::half_rate_groups && *v <= 1)
        throw Error(str("rates table ", source, ":", value.source().begin.line, ": ", r.device, ".", key.str(),
                        " must be more than 1"),
                    str(r.device, ".", key.str()), "the head groups whose projections run at half the full width's rate, e.g. 8");
      r.rates.emplace(std::string(key.str()), *v);
    }
    if (complete)
      for (const char* k : kRequired)
        if (!r.find(k))
          throw Error(str("rates table ", source, ": the row '", r.device, "' has no ", k), str(r.device, ".", k), kRatesFix);
    t.rows.push_back(std::move(r));
  }
  return t;
}

RatesTable RatesTable::load(const std::string& path, bool complete) {
  return parse(read_file(path, "rates table", "reinstall lcx (share/lcx/rates.toml), or set LCX_RATES to a rates file"),
               path, complete);
}

void RatesTable::merge(const RatesTable& over) {
  for (const RatesRow& o : over.rows) {
    auto it = std::find_if(rows.begin(), rows.end(), [&](const RatesRow& r) { return r.device == o.device; });
    if (it == rows.end()) {
      rows.push_back(o);
      continue;
    }
    for (const auto& [k, v] : o.rates) it->rates[k] = v;
    it->source = str(it->source, " + ", o.source);
    if (!o.basis.empty()) it->basis = o.basis;
  }
}

const RatesRow* RatesTable::find(std::string_view device) const {
  for (const RatesRow& r : rows)
    if (r.device == device) return &r;
  return nullptr;
}

RatesTable::Choice RatesTable::choose(std::string_view device, int64_t memory_bytes) const {
  if (const RatesRow* r = find(device)) return {*r, true, {}};
  if (rows.empty())
    throw Error(str("the rates table has no row, not even for ", device), {}, "reinstall lcx (share/lcx/rates.toml)");
  const std::set<std::string> words = name_words(device);
  const double gib = static_cast<double>(memory_bytes) / static_cast<double>(int64_t{1} << 30);
  auto shared = [&](const RatesRow& r) {
    int n = 0;
    for (const std::string& w : name_words(r.device)) n += static_cast<int>(words.count(w));
    return n;
  };
  // How far the row's memory is from the device's, on a log scale; rows without memory_gib last.
  auto memory_gap = [&](const RatesRow& r) {
    const auto m = r.find(rate_name::memory_gib);
    if (!m || gib <= 0) return std::numeric_limits<double>::infinity();
    return std::abs(std::log(*m / gib));
  };
  const RatesRow* best = &rows.front();
  for (const RatesRow& r : rows) {
    const int a = shared(r), b = shared(*best);
    if (a > b || (a == b && memory_gap(r) < memory_gap(*best))) best = &r;
  }
  const char* how = shared(*best) > 0 ? "by name" : std::isfinite(memory_gap(*best)) ? "by memory size" : "the first row";
  return {*best, false,
          str("no rates row for '", device, "': its times are estimates from the nearest row, '", best->device, "' (",
              how, "; ", best->source, "); run `lcx-train calibrate` on that GPU to measure its own")};
}

std::string shipped_rates_path() {
  const fs::path exe = boost::dll::program_location().string();
  return (exe.parent_path().parent_path() / "share" / "lcx" / "rates.toml").string();
}

std::string user_rates_path() {
  if (const char* p = std::getenv("LCX_RATES"); p && *p) return p;
  if (const char* x = std::getenv("XDG_CONFIG_HOME"); x && *x) return (fs::path(x) / "lcx" / "rates.toml").string();
  const char* home = std::getenv("HOME");
  return (fs::path(home && *home ? home : ".") / ".config" / "lcx" / "rates.toml").string();
}

RatesTable load_rates() {
  RatesTable t = RatesTable::load(shipped_rates_path());
  const std::string user = user_rates_path();
  const bool named = std::getenv("LCX_RATES") && *std::getenv("LCX_RATES");
  if (named || fs::exists(user)) {
    RatesTable mine = RatesTable::load(user, false);
    t.merge(mine);
    for (const RatesRow& r : t.rows)
      for (const char* k : kRequired)
        if (!r.find(k))
          throw Error(str("rates table ", user, ": the row '", r.device, "' has no ", k, ", nor has the shipped table"),
                      str(r.device, ".", k), kRatesFix);
  }
  return t;
}

std::string format_rates_row(const RatesRow& row) {
  std::string out = "[" + toml_string(row.device) + "]\n";
  if (!row.basis.empty()) out += str(kRowBasisKey, " = ", toml_string(row.basis), "\n");
  for (const auto& [k, v] : row.rates) out += str(k, " = ", number(v), "\n");
  return out;
}

void write_rates_row(const std::string& path, const RatesRow& row) {
  RatesTable t;
  if (fs::exists(path)) t = RatesTable::load(path, false);
  t.merge(RatesTable{{row}});
  // Written whole: the rows as parsed (a comment in the file is not kept).
  std::string text = "# lcx rates table: one row per GPU, named by its device name; rates in FLOP/s and bytes/s\n"
                     "# (plan/rates.h). Written by `lcx-train calibrate`; its rows override the shipped table's.\n";
  for (const RatesRow& r : t.rows) text += "\n" + format_rates_row(r);
  const fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path());
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f << text;
    if (!f) throw Error(str("cannot write the rates file ", tmp), "--out", "choose a writable path");
  }
  fs::rename(tmp, p);
}

namespace {
std::mutex g_rates_mutex;
// Every row made active stays alive, so a reference active_rates() gave out (a thread-rank's
// search) outlives a later set_active_rates.
std::vector<std::unique_ptr<const RatesRow>> g_rows;
const RatesRow* g_rates = nullptr;
}  // namespace

const RatesRow& active_rates() {
  std::lock_guard lock(g_rates_mutex);
  if (!g_rates) g_rates = g_rows.emplace_back(std::make_unique<const RatesRow>(load_rates().choose(kDefaultRatesDevice).row)).get();
  return *g_rates;
}

void set_active_rates(RatesRow row) {
  std::lock_guard lock(g_rates_mutex);
  g_rates = g_rows.emplace_back(std::make_unique<const RatesRow>(std::move(row))).get();
}

std::optional<std::string> local_gpu_name() {
#ifdef LCX_HAVE_CUDA
  if (!cuda_available()) return std::nullopt;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return std::nullopt;
  return std::string(prop.name);
#else
  return std::nullopt;
#endif
}

RatesTable::Choice use_rates_for(const std::string& device, int64_t memory_bytes) {
  std::string name = device;
  std::string asked;
  if (name.empty()) {
    if (auto local = local_gpu_name()) {
      name = *local;
    } else {
      name = kDefaultRatesDevice;
      asked = str("no GPU here and none named: times are the '", name,
                  "' row's (--gpu-name or [run] gpu_name names another)");
    }
  }
  RatesTable::Choice c = load_rates().choose(name, memory_bytes);
  if (c.note.empty()) c.note = asked;
  set_active_rates(c.row);
  return c;
}

double mfu_peak_flops(double peak_tflops) {
  if (peak_tflops > 0) return peak_tflops * 1e12;
  return active_rates().get(rate_name::peak, 0);
}

double device_rate(std::string_view name, double fallback) { return active_rates().get(name, fallback); }

double predicted_step_seconds(const StepWork& w, const RatesRow& r) {
  const double gemm = r.get(rate_name::gemm), attention_forward = r.get(rate_name::attention_forward),
               attention_backward = r.get(rate_name::attention_backward), memory = r.get(rate_name::memory),
               host_copy = r.get(rate_name::host_copy), half_rate = r.get(rate_name::half_rate_groups);
  // A head group's projections are 1/groups as wide, so slower: at half_rate groups, half the
  // full width's rate (on the H200 eight groups: the 64k step ran 0.85 s more than one group,
  // beside the attention).
  const double grouped_rate =
      gemm / (1.0 + static_cast<double>(std::max<int64_t>(w.head_groups, 1) - 1) / (half_rate - 1.0));
  const double expert = r.get(rate_name::expert_gemm, gemm * kExpertGemmShare);
  return w.gemm_flops / gemm + w.grouped_gemm_flops / grouped_rate + w.expert_gemm_flops / expert +
         w.attention_forward_flops / attention_forward +
         w.attention_backward_flops / attention_backward + w.memory_bytes / memory + w.exposed_copy_bytes / host_copy;
}

double predicted_step_seconds(const StepWork& w) { return predicted_step_seconds(w, active_rates()); }

double half_rate_groups_for(double grouped_flops, int64_t groups, double extra_seconds, double gemm) {
  // extra = grouped_flops / gemm x (groups - 1) / (h - 1), solved for h.
  constexpr double kMost = 1000;
  const double steps = static_cast<double>(std::max<int64_t>(groups, 2) - 1), one = grouped_flops / gemm;
  if (!(extra_seconds > one * steps / (kMost - 1))) return kMost;
  return 1 + steps * one / extra_seconds;
}

}  // namespace lcx
