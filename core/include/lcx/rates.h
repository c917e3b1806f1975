// The rates this kind of GPU reaches, for a provider's cost model: one row of lcx's rates table
// (share/lcx/rates.toml beside the binaries, overridden row by row by a user's file that
// `lcx-train calibrate` writes), the row of the GPU the run plans for. A row holds named rates;
// a provider may read its own names from it, which a row without them leaves at the provider's
// default.
#pragma once
#include <string_view>

namespace lcx {

// The rate `name` of the row this run plans with, or `fallback` where the row has none.
double device_rate(std::string_view name, double fallback);

}  // namespace lcx
