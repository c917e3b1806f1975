#include "data/chat_data.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <filesystem>
#include <mutex>
#include <thread>

#include "lcx/error.h"
#include "util/file.h"
#include "util/sha256.h"
#include "util/text.h"

namespace fs = std::filesystem;

namespace lcx {

using ojson = nlohmann::ordered_json;

const char* loss_on_name(LossOn l) {
  switch (l) {
    case LossOn::all: return "all";
    case LossOn::assistant: return "assistant";
    case LossOn::completion: return "completion";
  }
  return "?";
}

namespace {

const char* json_kind(const ojson& j) {
  switch (j.type()) {
    case ojson::value_t::null: return "null";
    case ojson::value_t::object: return "an object";
    case ojson::value_t::array: return "a list";
    case ojson::value_t::string: return "a string";
    case ojson::value_t::boolean: return "a boolean";
    default: return "a number";
  }
}

// Runs f(i) for i in [0, n) on up to `threads` threads (0: all cores); the first exception is
// rethrown once all have stopped.
template <typename F>
void parallel_for(size_t n, int threads, F&& f) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = static_cast<int>(std::min<size_t>(static_cast<size_t>(threads), n));
  if (threads <= 1) {
    for (size_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::exception_ptr failure;
  std::mutex mu;
  std::vector<std::thread> pool;
  for (int w = 0; w < threads; ++w)
    pool.emplace_back([&] {
      try {
        for (size_t i; (i = next.fetch_add(1)) < n;) f(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!failure) failure = std::current_exception();
        next = n;
      }
    });
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

// A message's text parts joined by a newline, as OpenAI-compatible servers join them for
// templates that render only strings.
std::string parts_text(const ojson& parts) {
  std::string text;
  for (size_t k = 0; k < parts.size(); ++k)
    text += (k ? "\n" : "") + (parts[k].is_string() ? parts[k].get<std::string>() : parts[k]["text"].get<std::string>());
  return text;
}

// Every message's content given as parts, as its joined text.
void join_parts(ojson& messages) {
  for (ojson& m : messages)
    if (auto c = m.find("content"); c != m.end() && c->is_array()) *c = parts_text(*c);
}

// Checks a message list in place and brings it to the form templates are written for: an
// assistant message without text gets "" (Qwen3's template tests `'</think>' in content`, which
// Jinja refuses on null, so a turn of tool calls alone would not render), and tool-call arguments
// given as a JSON string (the OpenAI wire format) are parsed into the object that string holds, as
// transformers' chat-template docs ask of its users (json.loads before apply_chat_template):
// templates print arguments with tojson or iterate them, and a string would be printed quoted or
// refused.
std::string check_messages(ojson& msgs, const char* field) {
  if (!msgs.is_array()) return str("`", field, "` is ", json_kind(msgs), ", not a list of messages");
  if (msgs.empty()) return str("`", field, "` holds no message");
  for (size_t i = 0; i < msgs.size(); ++i) {
    ojson& m = msgs[i];
    const std::string at = str(field, "[", i, "]");
    if (!m.is_object()) return str(at, " is ", json_kind(m), ", not a message object");
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) return str(at, " has no role");
    const std::string r = role->get<std::string>();
    // developer: the OpenAI role GPT-OSS's template renders as its developer message.
    if (r != "system" && r != "developer" && r != "user" && r != "assistant" && r != "tool")
      return str(at, ": role \"", r, "\" is not one of system, developer, user, assistant, tool");
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      if (r != "assistant") return str(at, " (", r, ") has no content");
      m["content"] = "";
    } else if (content->is_array()) {
      // Parts as the OpenAI and transformers message formats write them, kept for a template that
      // renders parts (join_parts joins them for the others); an image or audio part has no text
      // to train on and is refused by its type. Bare strings among them are joined here.
      bool bare = false;
      for (size_t k = 0; k < content->size(); ++k) {
        const ojson& part = (*content)[k];
        const std::string pat = str(at, ".content[", k, "]");
        if (part.is_string()) {
          bare = true;
          continue;
        }
        if (!part.is_object()) return str(pat, " is ", json_kind(part), ", not a part object");
        auto type = part.find("type");
        if (type == part.end() || !type->is_string()) return str(pat, " has no type");
        if (*type != "text")
          return str(pat, " is a part of type \"", type->get<std::string>(), "\"; lcx trains on text parts only");
        auto t = part.find("text");
        if (t == part.end() || !t->is_string()) return str(pat, " (text) has no text string");
      }
      if (bare || content->empty()) *content = parts_text(*content);
    } else if (!content->is_string()) {
      return str(at, ": content is ", json_kind(*content), ", not a string");
    }
    // The reasoning: Qwen3's templates read reasoning_content, GPT-OSS's thinking.
    for (const char* field : {"reasoning_content", "thinking"})
      if (auto rc = m.find(field); rc != m.end() && !rc->is_null() && !rc->is_string())
        return str(at, ": ", field, " is ", json_kind(*rc), ", not a string");
    auto calls = m.find("tool_calls");
    if (calls == m.end() || calls->is_null()) continue;
    if (r != "assistant") return str(at, " (", r, ") has tool_calls; only the assistant calls tools");
    if (!calls->is_array()) return str(at, ": tool_calls is ", json_kind(*calls), ", not a list");
    for (size_t k = 0; k < calls->size(); ++k) {
      ojson& call = (*calls)[k];
      const std::string cat = str(at, ".tool_calls[", k, "]");
      if (!call.is_object()) return str(cat, " is ", json_kind(call), ", not an object");
      if (auto type = call.find("type"); type != call.end() && *type != "function")
        return str(cat, ": type is ", type->dump(), ", not \"function\"");
      auto fn_it = call.find("function");
      if (fn_it == call.end() || !fn_it->is_object()) return str(cat, " has no function object");
      ojson& fn = *fn_it;
      auto name = fn.find("name");
      if (name == fn.end() || !name->is_string() || name->get_ref<const std::string&>().empty())
        return str(cat, ".function has no name");
      auto args = fn.find("arguments");
      if (args == fn.end()) return str(cat, ".function has no arguments");
      if (args->is_string()) {
        ojson parsed = ojson::parse(args->get_ref<const std::string&>(), nullptr, false);
        if (parsed.is_discarded() || !parsed.is_object())
          return str(cat, ".function.arguments is a string that is not a JSON object");
        *args = std::move(parsed);
      } else if (!args->is_object()) {
        return str(cat, ".function.arguments is ", json_kind(*args), ", not an object");
      }
    }
  }
  return {};
}

// ShareGPT's turns ({"from": "human", "value": ...}) as messages; a list already in messages' form
// is left as it is.
std::string sharegpt_to_messages(ojson& turns) {
  if (!turns.is_array()) return {};
  for (size_t i = 0; i < turns.size(); ++i) {
    ojson& t = turns[i];
    if (!t.is_object() || t.contains("role") || !t.contains("from")) continue;
    const ojson& from = t["from"];
    if (!from.is_string()) return str("conversations[", i, "].from is ", json_kind(from), ", not a string");
    const std::string f = from.get<std::string>();
    const char* role = f == "human" || f == "user"       ? "user"
                       : f == "gpt" || f == "assistant"  ? "assistant"
                       : f == "system"                   ? "system"
                       : f == "tool"                     ? "tool"
                                                         : nullptr;
    if (!role) return str("conversations[", i, "].from is \"", f, "\", not one of human, gpt, system, tool");
    ojson m = ojson::object();
    m["role"] = role;
    auto v = t.find("value");
    m["content"] = v == t.end() ? ojson(nullptr) : std::move(*v);
    t = std::move(m);
  }
  return {};
}

std::string common_prefix(std::string_view a, std::string_view b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return std::string(a.substr(0, n));
}

bool from_template(const RenderedText& r, size_t at, size_t n) {
  const uint8_t* p = r.from_data.data() + at;
  for (size_t i = 0; i < n; ++i)
    if (p[i]) return false;
  return true;
}

// transformers renders with tools=None and documents=None when a conversation has none.
ojson render_context(const ojson& base, ojson messages, ojson tools, bool generation_prompt) {
  ojson ctx = base;
  ctx["messages"] = std::move(messages);
  ctx["tools"] = std::move(tools);
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = generation_prompt;
  return ctx;
}

// A tokenizer_config.json's chat_template: a string, or a list of named templates of which
// transformers takes "default".
std::string template_text(const ojson& cfg, const std::string& where) {
  auto it = cfg.find("chat_template");
  if (it == cfg.end() || it->is_null())
    throw Error(str(where, " has no chat_template"), "data.chat_template",
                "give the model's own tokenizer_config.json, or set data.chat_template to a Jinja template file");
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    std::vector<std::string> names;
    for (const auto& t : *it) {
      if (!t.is_object() || !t.contains("name") || !t.contains("template") || !t["name"].is_string() ||
          !t["template"].is_string())
        continue;
      if (t["name"] == "default") return t["template"].get<std::string>();
      names.push_back(t["name"].get<std::string>());
    }
    throw Error(str(where, ": chat_template is a list of named templates without \"default\" (it has: ",
                    names.empty() ? std::string("none") : join(names, ", "), ")"),
                "data.chat_template", "save the one to train with as a Jinja file and set data.chat_template to it");
  }
  throw Error(str(where, ": chat_template is ", json_kind(*it), ", not a template"), "data.chat_template",
              "give the model's own tokenizer_config.json, or set data.chat_template to a Jinja template file");
}

ojson read_json_file(const std::string& path, const std::string& key) {
  const std::string text = read_file(path, key, "give a readable file");
  ojson j = ojson::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    throw Error(str(path, " is not a JSON object"), key, "give the model's own tokenizer_config.json");
  return j;
}

// The special tokens transformers hands every template (its special_tokens_map): each as its
// text, whether the file writes a string or an added-token object.
void add_special_tokens(const ojson& cfg, ojson& base) {
  for (const char* k : {"bos_token", "eos_token", "pad_token", "unk_token"}) {
    auto it = cfg.find(k);
    if (it == cfg.end()) continue;
    if (it->is_string()) base[k] = *it;
    else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) base[k] = (*it)["content"];
  }
}

}  // namespace

std::string parse_conversation(std::string_view line, const std::string& format, Conversation& c) {
  ojson j = ojson::parse(line.begin(), line.end(), nullptr, false);
  if (j.is_discarded()) return "not JSON";
  if (!j.is_object()) return str("a JSON ", j.is_array() ? "list" : "value", ", not an object");
  if (format == "chat") {
    auto it = j.find("messages");
    if (it == j.end()) it = j.find("conversations");
    if (it == j.end()) return "no `messages` (or ShareGPT `conversations`) field";
    const char* field = it.key() == "messages" ? "messages" : "conversations";
    if (std::string e = sharegpt_to_messages(*it); !e.empty()) return e;
    if (std::string e = check_messages(*it, field); !e.empty()) return e;
    c.messages = std::move(*it);
  } else {
    auto p = j.find("prompt"), q = j.find("completion");
    if (p == j.end() || q == j.end())
      return p == j.end() && q == j.end() ? "no `prompt` and `completion` fields"
                                          : str("no `", p == j.end() ? "prompt" : "completion", "` field");
    if (p->is_string() && q->is_string()) {
      c.plain = true;
      c.prompt = p->get<std::string>();
      c.completion = q->get<std::string>();
      if (c.completion.empty()) return "`completion` is empty";
    } else if (p->is_array() && q->is_array()) {
      if (std::string e = check_messages(*p, "prompt"); !e.empty()) return e;
      if (std::string e = check_messages(*q, "completion"); !e.empty()) return e;
      c.prompt_messages = p->size();
      c.messages = std::move(*p);
      for (auto& m : *q) c.messages.push_back(std::move(m));
    } else {
      return str("`prompt` is ", json_kind(*p), " and `completion` ", json_kind(*q),
                 ": give both as strings or both as message lists");
    }
  }
  if (auto t = j.find("tools"); t != j.end() && !t->is_null()) {
    if (!t->is_array()) return str("`tools` is ", json_kind(*t), ", not a list");
    for (size_t i = 0; i < t->size(); ++i)
      if (!(*t)[i].is_object()) return str("tools[", i, "] is ", json_kind((*t)[i]), ", not an object");
    c.tools = std::move(*t);
  }
  return {};
}

namespace {

// Where, in the text between an assistant turn's reply and the next message's words, that
// message's turn opens: the position (not the first) whose text shares the longest prefix with the
// assistant's header, as every turn of a template opens alike (`<|start|>`, `<|im_start|>`); 0
// where none shares a byte.
size_t turn_opening(std::string_view between, std::string_view header) {
  size_t best = 0, best_len = 0;
  for (size_t p = 1; p < between.size(); ++p) {
    size_t n = 0;
    while (n < header.size() && p + n < between.size() && between[p + n] == header[n]) ++n;
    if (n > best_len) best = p, best_len = n;
  }
  return best;
}

// The closer of a turn that calls a tool, where its template closes it with none of `m`'s
// closers: rendered with one call (arguments {}) and its result, the turn opens at a header the
// template wrote, and closes with what the template writes after the arguments' closing brace,
// up to where the result's turn opens. "" where the template refuses the probe or needs nothing.
std::string tool_call_closer(const ChatTemplate& t, const ojson& base, const TurnMarkers& m) {
  const std::string user = "lcx probe: the user's words", result = "lcx probe: the tool's result";
  const ojson call = {{"type", "function"}, {"function", {{"name", "lcx_probe"}, {"arguments", ojson::object()}}}};
  const ojson messages = ojson::array({{{"role", "user"}, {"content", user}},
                                       {{"role", "assistant"}, {"content", ""}, {"tool_calls", ojson::array({call})}},
                                       {{"role", "tool"}, {"content", result}}});
  const ojson tools = ojson::array({{{"type", "function"},
                                     {"function", {{"name", "lcx_probe"}, {"description", "lcx probe"},
                                                   {"parameters", {{"type", "object"}, {"properties", ojson::object()}}}}}}});
  RenderedText r;
  try {
    r = t.render(render_context(base, messages, tools, false));
  } catch (const Error&) {
    return {};
  }
  const std::string& s = r.text;
  size_t at = s.find(user);
  if (at == std::string::npos) return {};
  while ((at = s.find(m.header, at)) != std::string::npos && !from_template(r, at, m.header.size())) ++at;
  if (at == std::string::npos) return {};
  const size_t begin = at + m.header.size(), result_at = s.find(result, begin);
  if (result_at == std::string::npos) return {};
  const std::string_view turn = std::string_view(s).substr(begin, result_at - begin);
  for (const std::string& c : m.closers)
    if (turn.find(c) != std::string_view::npos) return {};
  const size_t opens = turn_opening(turn, m.header), brace = turn.substr(0, opens).rfind('}');
  if (opens == 0 || brace == std::string_view::npos || brace + 1 >= opens ||
      !from_template(r, begin + brace + 1, opens - brace - 1))
    return {};
  return std::string(turn.substr(brace + 1, opens - brace - 1));
}

// Whether the template renders a content given as text parts itself (Gemma 3's iterates them, as
// transformers hands them over) rather than strings only (Qwen3's renders a list as nothing,
// Qwen2.5's as its Python repr): each part's text in the render, not inside quotes.
bool renders_parts(const ChatTemplate& t, const ojson& base) {
  const std::string one = "lcx probe: part one", two = "lcx probe: part two";
  const ojson parts = ojson::array({{{"type", "text"}, {"text", one}}, {{"type", "text"}, {"text", two}}});
  RenderedText r;
  try {
    r = t.render(render_context(base, ojson::array({{{"role", "user"}, {"content", parts}}}), nullptr, false));
  } catch (const Error&) {
    return false;
  }
  for (const std::string& p : {one, two}) {
    const size_t at = r.text.find(p);
    if (at == std::string::npos || (at > 0 && (r.text[at - 1] == '\'' || r.text[at - 1] == '"'))) return false;
  }
  return true;
}

}  // namespace

TurnMarkers probe_turn_markers(const ChatTemplate& t, const ojson& base, const std::string& name) {
  auto fail = [&](const std::string& what) {
    throw Error(str(name, ": the assistant's turns cannot be told apart in this chat template: ", what), "data.loss_on",
                "mark the assistant's output with {% generation %} ... {% endgeneration %} in a copy of the template "
                "(data.chat_template), or train every token with data.loss_on = \"all\"");
  };
  const std::string user = "lcx probe: the user's words", reply = "lcx probe: the assistant's reply",
                    again = "lcx probe: the user once more";
  auto msg = [](const char* role, const std::string& content) { return ojson{{"role", role}, {"content", content}}; };
  auto render = [&](ojson messages, bool gen) {
    try {
      return t.render(render_context(base, std::move(messages), nullptr, gen));
    } catch (const Error& e) {
      // The template fails on a plain conversation: its own error and fix, not the turn markers'.
      const std::string what = e.what();
      const size_t undefined = what.find("' is undefined");
      const size_t open = undefined == std::string::npos || undefined == 0 ? std::string::npos : what.rfind('\'', undefined - 1);
      if (open != std::string::npos) {
        const std::string variable = what.substr(open + 1, undefined - open - 1);
        throw Error(str(name, ": the chat template cannot render a plain user/assistant conversation: ", what),
                    "data.chat_template_kwargs",
                    str("give `", variable, "` in data.chat_template_kwargs (--set data.chat_template_kwargs.", variable,
                        "=VALUE), or use a template that sets it (data.chat_template)"));
      }
      throw Error(str(name, ": the chat template cannot render a plain user/assistant conversation: ", what),
                  "data.chat_template", "fix the template, or name the model's own with data.chat_template");
    }
    return RenderedText{};
  };
  const RenderedText r0 = render(ojson::array({msg("user", user)}), false);
  const RenderedText r1 = render(ojson::array({msg("user", user)}), true);
  const RenderedText r2 = render(ojson::array({msg("user", user), msg("assistant", reply)}), false);
  const RenderedText r3 = render(ojson::array({msg("user", user), msg("assistant", reply), msg("user", again)}), false);
  const std::string& t0 = r0.text;
  for (const RenderedText* r : {&r1, &r2, &r3})
    if (!r->text.starts_with(t0)) fail("a conversation renders differently once a message follows it");
  const std::string_view prompt = std::string_view(r1.text).substr(t0.size());
  const std::string_view turn2 = std::string_view(r2.text).substr(t0.size()), turn3 = std::string_view(r3.text).substr(t0.size());
  const size_t a2 = turn2.find(reply), a3 = turn3.find(reply);
  if (a2 == std::string_view::npos || a3 == std::string_view::npos) fail("the assistant's reply is not in its render");
  TurnMarkers m;
  m.header = common_prefix(common_prefix(prompt, turn2.substr(0, a2)), turn3.substr(0, a3));
  size_t header_at = t0.size();
  if (m.header.empty() && prompt.empty()) {
    // A template that ignores add_generation_prompt (Mistral's): the assistant's turn is told by the
    // template's text that closes the user's turn before it, back to the user's own words.
    const size_t e2 = t0.size() + a2, e3 = t0.size() + a3;
    size_t n = 0;
    while (n < e2 && n < e3 && r2.text[e2 - 1 - n] == r3.text[e3 - 1 - n] && from_template(r2, e2 - 1 - n, 1) &&
           from_template(r3, e3 - 1 - n, 1))
      ++n;
    m.header = r2.text.substr(e2 - n, n);
    header_at = e2 - n;
  }
  if (m.header.empty()) fail("the generation prompt and the assistant's turns begin with nothing in common");
  if (!from_template(r2, header_at, m.header.size())) fail("the assistant's header holds the message's own text");
  const size_t tail2_at = t0.size() + a2 + reply.size(), tail3_at = t0.size() + a3 + reply.size();
  const std::string_view tail2 = std::string_view(r2.text).substr(tail2_at);
  const std::string_view tail3 = std::string_view(r3.text).substr(tail3_at);
  const std::string shared = common_prefix(tail2, tail3);
  if (!shared.empty() && shared.size() == tail2.size()) {
    if (!from_template(r2, tail2_at, shared.size())) fail("the assistant's closer holds the message's own text");
    m.closers = {shared};
  } else {
    // The last turn closes otherwise than one a message follows: all that follows the last is its
    // closer; the other's ends where the user's turn opens.
    const size_t again_at = tail3.find(again);
    const size_t opens = again_at == std::string_view::npos ? 0 : turn_opening(tail3.substr(0, again_at), m.header);
    if (tail2.empty() || opens == 0) fail("nothing in the template closes the assistant's turn");
    if (!from_template(r2, tail2_at, tail2.size()) || !from_template(r3, tail3_at, opens))
      fail("the assistant's closer holds the message's own text");
    m.closers = {std::string(tail3.substr(0, opens)), std::string(tail2)};
  }
  if (std::string call = tool_call_closer(t, base, m); !call.empty()) m.closers.push_back(std::move(call));
  return m;
}

ByteRanges assistant_turns(const RenderedText& r, const TurnMarkers& m) {
  const std::string& s = r.text;
  LCX_CHECK(r.from_data.size() == s.size() && s.size() < (uint64_t{1} << 32) && !m.header.empty() && !m.closers.empty());
  ByteRanges out;
  for (size_t at = 0; (at = s.find(m.header, at)) != std::string::npos;) {
    if (!from_template(r, at, m.header.size())) {
      ++at;
      continue;
    }
    const size_t begin = at + m.header.size();
    // The first closer the template wrote after the header; of two at one place, the longer.
    size_t end = s.size(), first = std::string::npos;
    for (const std::string& closer : m.closers) {
      LCX_CHECK(!closer.empty());
      for (size_t c = begin; (c = s.find(closer, c)) != std::string::npos && c <= first; ++c)
        if (from_template(r, c, closer.size())) {
          if (c < first || c + closer.size() > end) first = c, end = c + closer.size();
          break;
        }
    }
    if (end > begin) out.emplace_back(static_cast<uint32_t>(begin), static_cast<uint32_t>(end));
    at = end;
  }
  return out;
}

std::vector<uint8_t> token_mask(const ByteRanges& trained, const std::vector<TokenSpan>& spans) {
  // Spans ascend, and so do the ranges: one walk over both.
  std::vector<uint8_t> out(spans.size(), 0);
  size_t r = 0;
  for (size_t k = 0; k < spans.size() && r < trained.size(); ++k) {
    while (r < trained.size() && trained[r].second <= spans[k].begin) ++r;
    if (r < trained.size() && trained[r].first < spans[k].end && spans[k].end > spans[k].begin) out[k] = 1;
  }
  return out;
}

struct ChatRenderer::State {
  ChatTemplate tmpl;
  std::string source, key;
  ojson base;
  TurnMarkers markers;
  std::string probe_error, probe_key, probe_fix;  // set when the probe failed
  bool parts = false;  // the template renders content given as parts itself
};

ChatRenderer::ChatRenderer(ChatTemplate t, std::string source, ojson base) {
  auto s = std::make_shared<State>();
  s->tmpl = std::move(t);
  s->source = std::move(source);
  s->base = std::move(base);
  // The version names the rules that turn a template into tokens and masks (a turn closes at any
  // of its probed closers; a message whose tool calls the template drops is refused; content
  // parts reach a template that renders them): a token cache written under other rules is not read.
  s->key = sha256_string(str("lcx-chat 2\n", s->tmpl.hash(), "\n", s->base.dump()));
  s->parts = renders_parts(s->tmpl, s->base);
  // Probed once per template; kept for the render to use, or its failure for when it is needed.
  if (!s->tmpl.has_generation_blocks()) {
    try {
      s->markers = probe_turn_markers(s->tmpl, s->base, s->source);
    } catch (const Error& e) {
      s->probe_error = e.what();
      s->probe_key = e.key();
      s->probe_fix = e.fix();
    }
  }
  s_ = std::move(s);
}

ChatRenderer ChatRenderer::load(const std::string& tokenizer_path, const std::string& template_path,
                                const std::string& kwargs_json) {
  const fs::path beside = fs::path(tokenizer_path).parent_path() / "tokenizer_config.json";
  ojson cfg;
  std::string text, source;
  if (!template_path.empty()) {
    source = template_path;
    std::string ext = fs::path(template_path).extension().string();
    if (ext == ".json") {
      cfg = read_json_file(template_path, "data.chat_template");
      text = template_text(cfg, template_path);
    } else {
      text = read_file(template_path, "data.chat_template", "give a Jinja chat template file or a tokenizer_config.json");
      if (fs::exists(beside)) cfg = read_json_file(beside.string(), "data.tokenizer");
    }
  } else {
    // transformers reads a chat_template.jinja beside the tokenizer before tokenizer_config.json's
    // template (save_pretrained writes it there), so a folder with both serves that one.
    const fs::path jinja = beside.parent_path() / "chat_template.jinja";
    if (!fs::exists(beside) && !fs::exists(jinja))
      throw Error(str("conversations are rendered by the model's chat template, and there is no ", beside.string(),
                      " beside data.tokenizer"),
                  "data.chat_template",
                  "put the model's tokenizer_config.json beside its tokenizer.json (scripts/fetch_data.sh fetches "
                  "Qwen3's into data/qwen3/), or set data.chat_template to a template file");
    if (fs::exists(beside)) cfg = read_json_file(beside.string(), "data.tokenizer");
    if (fs::exists(jinja)) {
      source = jinja.string();
      text = read_file(source, "data.tokenizer", "give the model folder's chat_template.jinja read access");
    } else {
      source = beside.string();
      text = template_text(cfg, source);
    }
  }
  ojson base = ojson::object();
  add_special_tokens(cfg, base);
  ojson kwargs = ojson::parse(kwargs_json, nullptr, false);
  if (kwargs.is_discarded() || !kwargs.is_object())
    throw Error(str("chat_template_kwargs ", kwargs_json, " is not a JSON object"), "data.chat_template_kwargs",
                "give a table of the template's variables, e.g. [data.chat_template_kwargs] enable_thinking = false");
  for (auto& [k, v] : kwargs.items()) base[k] = v;
  return ChatRenderer(ChatTemplate::parse(text, source), source, std::move(base));
}

const std::string& ChatRenderer::source() const { return s_->source; }
const std::string& ChatRenderer::key() const { return s_->key; }
const ChatTemplate& ChatRenderer::chat_template() const { return s_->tmpl; }

const TurnMarkers& ChatRenderer::markers() const {
  if (!s_->probe_error.empty()) throw Error(s_->probe_error, s_->probe_key, s_->probe_fix);
  return s_->markers;
}

ChatText ChatRenderer::render(Conversation c, LossOn loss_on) const {
  const State& s = *s_;
  ChatText out;
  if (c.plain) {
    // A prompt and completion as plain strings are plain text, as TRL reads them.
    out.text = c.prompt + c.completion;
    out.trained = {{loss_on == LossOn::all ? 0u : static_cast<uint32_t>(c.prompt.size()), static_cast<uint32_t>(out.text.size())}};
    out.eos_trains = true;
    return out;
  }
  if (!s.parts) join_parts(c.messages);
  ojson prompt_ctx;
  if (loss_on == LossOn::completion) {
    if (c.prompt_messages == 0)
      throw Error("loss_on = \"completion\" needs prompt_completion data: a conversation has no completion",
                  "data.loss_on", "use loss_on = \"assistant\" for chat data");
    ojson prompt = ojson::array();
    for (size_t i = 0; i < c.prompt_messages; ++i) prompt.push_back(c.messages[i]);
    prompt_ctx = render_context(s.base, std::move(prompt), c.tools, true);
  }
  // A message of several tool calls whose template renders only some of them (GPT-OSS's renders
  // the first, as transformers does, silently): the render with its first call alone is the same.
  std::vector<size_t> parallel_calls;
  for (size_t i = 0; i < c.messages.size(); ++i) {
    auto calls = c.messages[i].find("tool_calls");
    if (calls != c.messages[i].end() && calls->is_array() && calls->size() > 1) parallel_calls.push_back(i);
  }
  const ojson messages = parallel_calls.empty() ? ojson() : c.messages;
  const ojson tools = parallel_calls.empty() ? ojson() : c.tools;
  RenderedText r = s.tmpl.render(render_context(s.base, std::move(c.messages), std::move(c.tools), false));
  for (size_t i : parallel_calls) {
    ojson fewer = messages;
    ojson& calls = fewer[i]["tool_calls"];
    const size_t n = calls.size();
    calls = ojson::array({calls[0]});
    if (s.tmpl.render(render_context(s.base, std::move(fewer), tools, false)).text == r.text)
      throw Error(str("messages[", i, "] holds ", n, " tool calls and the chat template renders only the first, so the "
                      "others would not be trained on"),
                  "data.chat_template",
                  "split them into one assistant message each, with each call's tool result after it (GPT-OSS's "
                  "template takes one call a message)");
  }
  if (r.text.size() >= (uint64_t{1} << 32))
    throw Error(str("a conversation renders to ", r.text.size(), " bytes, more than lcx's 4 GiB a conversation"));
  const uint32_t size = static_cast<uint32_t>(r.text.size());
  switch (loss_on) {
    case LossOn::all: out.trained = {{0, size}}; break;
    case LossOn::assistant:
      if (s.tmpl.has_generation_blocks()) {
        for (const auto& [b, e] : r.generation)
          if (e > b) out.trained.emplace_back(static_cast<uint32_t>(b), static_cast<uint32_t>(std::min<int64_t>(e, size)));
      } else {
        out.trained = assistant_turns(r, markers());
      }
      break;
    case LossOn::completion: {
      // As TRL finds a completion: the prompt rendered with the generation prompt is the
      // beginning of the whole, and what follows it is the completion.
      const RenderedText p = s.tmpl.render(prompt_ctx);
      if (!r.text.starts_with(p.text))
        throw Error("the template renders the prompt differently once the completion follows it, so the completion "
                    "cannot be found",
                    "data.loss_on", "train the assistant's turns with data.loss_on = \"assistant\"");
      out.trained = {{static_cast<uint32_t>(p.text.size()), size}};
      break;
    }
  }
  out.text = std::move(r.text);
  return out;
}

std::vector<EncodedConversation> encode_conversations(const ChatRenderer& chat, const Tokenizer& tok,
                                                      const std::vector<std::string_view>& lines,
                                                      const std::string& format, LossOn loss_on, int threads) {
  std::vector<EncodedConversation> out(lines.size());
  std::vector<ChatText> texts(lines.size());
  parallel_for(lines.size(), threads, [&](size_t i) {
    Conversation c;
    out[i].error = parse_conversation(lines[i], format, c);
    if (!out[i].error.empty()) return;
    try {
      texts[i] = chat.render(std::move(c), loss_on);
      out[i].eos_trains = texts[i].eos_trains;
    } catch (const Error& e) {
      out[i].error = e.what();
    }
  });
  std::vector<std::string_view> views;
  std::vector<size_t> which;
  for (size_t i = 0; i < lines.size(); ++i)
    if (out[i].error.empty()) views.push_back(texts[i].text), which.push_back(i);
  std::vector<Encoding> enc = tok.encode_batch_with_offsets(views, threads);
  parallel_for(which.size(), threads, [&](size_t k) {
    const size_t i = which[k];
    out[i].mask = token_mask(texts[i].trained, enc[k].spans);
    out[i].ids = std::move(enc[k].ids);
    enc[k].spans = {};
    texts[i] = {};
  });
  return out;
}

}  // namespace lcx
