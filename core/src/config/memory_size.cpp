// Memory sizes as a manifest or the command line gives them: "80GB", "141GiB", "81920MiB" or a
// byte count.
#include <cctype>
#include <cmath>
#include <exception>

#include "config/core_config.h"
#include "lcx/error.h"

namespace lcx {

int64_t parse_memory_size(const std::string& text, const std::string& option) {
  auto bad = [&]() -> Error {
    return Error(str(option, " '", text, "' is not a size"), option, "e.g. 80GB, 141GiB, 81920MiB or a byte count");
  };
  // A decimal number ("1.5", "1e30"): stod alone would also read "0x10" (16), "inf" and "nan".
  size_t used = 0;
  while (used < text.size() && std::isspace(static_cast<unsigned char>(text[used]))) ++used;
  const size_t number = used;
  auto digits = [&] {
    while (used < text.size() && (std::isdigit(static_cast<unsigned char>(text[used])) || text[used] == '.')) ++used;
  };
  digits();
  if (used > number && used + 1 < text.size() && (text[used] == 'e' || text[used] == 'E')) {
    size_t exp = used + 1;
    if (text[exp] == '+' || text[exp] == '-') ++exp;
    if (exp < text.size() && std::isdigit(static_cast<unsigned char>(text[exp]))) {
      used = exp;
      while (used < text.size() && std::isdigit(static_cast<unsigned char>(text[used]))) ++used;
    }
  }
  double value = 0;
  try {
    size_t read = 0;
    if (used == number) throw bad();
    value = std::stod(text.substr(number, used - number), &read);
    if (read != used - number) throw bad();
  } catch (const std::exception&) {
    throw bad();
  }
  std::string unit;
  for (size_t i = used; i < text.size(); ++i)
    if (!std::isspace(static_cast<unsigned char>(text[i])))
      unit += static_cast<char>(std::toupper(static_cast<unsigned char>(text[i])));
  int shift = -1;
  if (unit.empty() || unit == "B") shift = 0;
  else if (unit == "K" || unit == "KB" || unit == "KIB") shift = 10;
  else if (unit == "M" || unit == "MB" || unit == "MIB") shift = 20;
  else if (unit == "G" || unit == "GB" || unit == "GIB") shift = 30;
  else if (unit == "T" || unit == "TB" || unit == "TIB") shift = 40;
  if (shift < 0 || !(value > 0) || !std::isfinite(value)) throw bad();
  // Sums and multiples of budgets stay within int64: sizes past 2^62 bytes are refused.
  const double bytes = std::ldexp(value, shift);
  if (bytes > std::ldexp(1.0, 62))
    throw Error(str(option, " '", text, "' is ", bytes, " bytes, past the 4 EiB (2^62 bytes) lcx's 64-bit sizes hold"), option,
                "give the memory of the GPU or host, e.g. 80GB, 141GiB or 2TB");
  return static_cast<int64_t>(bytes);
}

}  // namespace lcx
