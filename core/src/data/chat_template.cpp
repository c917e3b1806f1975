// The glue between lcx and the Jinja engine in jinja/: parsing once, converting the context to
// engine values (marking what is the conversation's data), and turning the engine's failures
// into lcx::Error naming the template and line.
#include "data/chat_template.h"

#include "data/jinja/ast.h"
#include "data/jinja/builtins.h"
#include "data/jinja/interpreter.h"
#include "lcx/error.h"
#include "util/sha256.h"

namespace lcx {

struct ChatTemplate::Impl {
  std::string name;
  std::string hash;
  jinja::Program program;
};

ChatTemplate ChatTemplate::parse(const std::string& source, const std::string& name) {
  auto impl = std::make_shared<Impl>();
  impl->name = name;
  impl->hash = sha256_string(source);
  int line = 0;
  try {
    impl->program = jinja::parse_program(source, &line);
  } catch (const jinja::Failure& e) {
    throw Error(str(name, ":", line, ": ", e.what()), "chat_template",
                "lcx implements the part of Jinja that chat templates use and refuses the rest rather than render it "
                "differently; rewrite that part of the template without it");
  }
  ChatTemplate t;
  t.impl_ = std::move(impl);
  return t;
}

RenderedText ChatTemplate::render(const nlohmann::ordered_json& context, const std::tm* now) const {
  std::vector<std::pair<std::string, jinja::Value>> vars;
  int line = 0;
  try {
    if (!context.is_object()) throw jinja::Failure("the context is not a JSON object");
    for (const auto& [key, value] : context.items()) {
      // The conversation's own text is data; the run's settings and special tokens are not.
      if (key == "messages")
        vars.emplace_back(key, jinja::from_json_messages(value));
      else
        vars.emplace_back(key, jinja::from_json(value, key == "tools" ? 1 : 0));
    }
    jinja::Rendered r = jinja::run(impl_->program, std::move(vars), &line, now);
    RenderedText out;
    out.text = r.text.str();
    out.from_data.reserve(out.text.size());
    r.text.flags_into(out.from_data);
    out.generation = std::move(r.generation);
    return out;
  } catch (const jinja::TemplateRaised& e) {
    throw Error(str(impl_->name, ":", line, ": the chat template refused the conversation: ", e.what()),
                "chat_template", "the conversation does not have the shape this template accepts; fix or drop it");
  } catch (const jinja::Failure& e) {
    throw Error(str(impl_->name, ":", line, ": ", e.what()), "chat_template",
                "the conversation's fields do not have the types this template expects (transformers fails on it "
                "too), or the template uses a Jinja feature lcx does not implement");
  }
}

bool ChatTemplate::has_generation_blocks() const { return impl_->program.has_generation; }
const std::string& ChatTemplate::hash() const { return impl_->hash; }

}  // namespace lcx
