// `lcx-train --plan`: the memory plan of a manifest and the recipe it chooses, with no GPU work.
#pragma once
#include <string>
#include <vector>

#include "config/core_config.h"
#include "config/manifest.h"
#include "loader/plugin_loader.h"

namespace lcx {

// Resolves the slots without GPU work (a provider that refuses its table is planned by its
// slot's default, with a warning), prints whether the step fits, the recipe, the fixes, the
// breakdown (with every term when verbose) and the candidates. gpu_memory: the --gpu-memory
// text, "" for the local GPU's; host_memory: the --host-memory text, "" for this host's; gpu_name:
// the --gpu-name text, "" for [run] gpu_name (the GPU whose rates row times the recipes: this
// GPU's, else the H200's). Returns the exit code: 0 when the step fits both budgets, 1 when not.
int run_plan_command(const Manifest& m, const CoreConfig& cfg, const PluginLoader& loader,
                     const std::vector<std::string>& disabled, const std::string& gpu_memory,
                     const std::string& host_memory, const std::string& gpu_name, bool verbose);

}  // namespace lcx
