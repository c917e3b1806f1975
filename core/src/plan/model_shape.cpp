// The model's shape for a plan, with no weight loaded: the model module describes the config.json
// under [model] path, or [model] init (a preset or a JSON object), exactly as it would load them.
#include <cctype>
#include <filesystem>

#include "lcx/error.h"
#include "plan/plan.h"

namespace lcx {

ModelConfig plan_model_config(const ModelSection& model, const Model& module, std::string* source) {
  namespace fs = std::filesystem;
  if (!model.path.empty() && fs::exists(fs::path(model.path) / "config.json")) {
    if (source) *source = (fs::path(model.path) / "config.json").string();
    return module.describe(model.path);
  }
  if (!model.init.empty()) {
    if (source) *source = model.init.front() == '{' ? "[model] init" : "preset " + model.init;
    return module.describe(model.init);
  }
  if (!model.path.empty()) {
    // A plan is often made before the checkpoint is downloaded: a folder named after a public
    // model (models/Qwen3-8B) has that model's shape, when the module knows it as a preset.
    std::string folder = fs::path(model.path).lexically_normal().filename().string();
    if (folder.empty()) folder = fs::path(model.path).lexically_normal().parent_path().filename().string();
    for (auto& ch : folder) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    try {
      ModelConfig c = module.describe(folder);
      if (source) *source = str("the public ", folder, " shape (", model.path, " has no config.json here)");
      return c;
    } catch (const Error&) {
      throw Error(str("[model] path '", model.path, "' has no config.json here, and the plan needs the model's shape"),
                  "model.path",
                  "point path at a model folder, or give a shape with --set model.path= --set model.init=qwen3-8b");
    }
  }
  throw Error("the manifest names no model ([model] path or init)", "model",
              "set [model] path to a Hugging Face folder or [model] init to a preset such as qwen3-8b");
}

}  // namespace lcx
