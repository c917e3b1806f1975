// Small string helpers shared by the config, the loader and the CLI.
#pragma once
#include <string>
#include <vector>

namespace lcx {

// The candidate nearest to `word` by edit distance, or "" when none is reasonably close.
std::string closest(const std::string& word, const std::vector<std::string>& candidates);
std::string join(const std::vector<std::string>& items, const std::string& sep);

}  // namespace lcx
