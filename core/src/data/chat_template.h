// A Hugging Face chat template (the Jinja text of tokenizer_config.json's `chat_template`),
// rendered as transformers' apply_chat_template renders it: Jinja with trim_blocks and
// lstrip_blocks, transformers' tojson (json.dumps, ensure_ascii=False), raise_exception,
// strftime_now, loop controls and {% generation %} blocks. Only the subset of Jinja that chat
// templates use is implemented; anything else is refused when parsing, naming the construct and
// its line, never rendered approximately.
//
//   lcx::ChatTemplate t = lcx::ChatTemplate::parse(text, "tokenizer_config.json");
//   nlohmann::ordered_json ctx = {{"messages", messages}, {"add_generation_prompt", false}};
//   lcx::RenderedText r = t.render(ctx);   // r.text, r.from_data[i]: byte i came from the data
//
// Provenance: every string read from the context's `messages` and `tools` is data, except the
// value of each message's `role` (the reader has checked it against a closed list, so it is
// structure); the other variables (special tokens, add_generation_prompt, chat_template_kwargs)
// and strings written in the template are not. Operations keep it per byte
// (concatenation, slicing, filters and methods mark their result as data when their input was).
// The trainer finds the assistant's turns by the template's own header and closer in the bytes
// that are not data, so a message whose text contains `<|im_start|>assistant` cannot open a turn.
#pragma once
#include <cstdint>
#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lcx {

struct RenderedText {
  std::string text;
  std::vector<uint8_t> from_data;  // one per byte of text: 1 where it came from the context's data
  // Byte ranges [begin, end) written inside {% generation %} ... {% endgeneration %}, in order.
  std::vector<std::pair<int64_t, int64_t>> generation;
};

class ChatTemplate {
 public:
  // Throws lcx::Error naming the construct and "<name>:<line>" for what is outside the subset.
  static ChatTemplate parse(const std::string& source, const std::string& name);

  // Renders with `context` as the template's variables (messages, tools, add_generation_prompt,
  // bos_token, eos_token, and chat_template_kwargs such as enable_thinking). strftime_now reads
  // `now` (a local time: a render that must not depend on the day, as GPT-OSS's "Current date"
  // in a golden) or the clock where it is null. Throws lcx::Error on raise_exception and on
  // runtime errors (an undefined value called, a type without that method), naming the template's
  // line.
  RenderedText render(const nlohmann::ordered_json& context, const std::tm* now = nullptr) const;

  bool has_generation_blocks() const;
  const std::string& hash() const;  // sha256 of the source, for the token cache's key

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

}  // namespace lcx
