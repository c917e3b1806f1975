// Chat templates of other families, token for token as transformers' apply_chat_template
// (tokenize=True) gives them (fixtures/families/chat_golden.jsonl, written by
// gen_families_golden.py): Llama 3.1's official template (fixtures/chat/templates/llama31.jinja,
// with tools in the user message and in the system prompt, a tool call, built-in tools through
// <|python_tag|>, a refused second tool call), Gemma 3's (from its tokenizer_config.json; tools and
// reasoning ignored, a tool role refused), GPT-OSS's harmony template (gptoss.jinja: developer
// instructions, reasoning, TypeScript-like tool definitions, tool calls and results, built-in
// tools, its refusals), Qwen2.5's (parallel tool calls, tool responses) and Mistral's (roles
// alternating, no system; fixtures/families/README.md gives the sources). And loss_on =
// "assistant" finding Llama 3.1's, Gemma 3's, GPT-OSS's and Mistral's assistant turns, tool calls
// included.
#include <gtest/gtest.h>

#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>

#include "data/chat_data.h"
#include "data/chat_template.h"
#include "data/tokenizer.h"
#include "data_test_util.h"
#include "lcx/error.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using ordered_json = nlohmann::ordered_json;

std::string fixtures() { return std::string(LCX_TEST_DATA_DIR) + "/data/fixtures/"; }

// A golden's "date" (YYYY-MM-DD): the local time its strftime_now read, at noon.
std::tm golden_day(const ordered_json& c) {
  std::tm tm{};
  const std::string d = c["date"];
  tm.tm_year = std::stoi(d.substr(0, 4)) - 1900;
  tm.tm_mon = std::stoi(d.substr(5, 2)) - 1;
  tm.tm_mday = std::stoi(d.substr(8, 2));
  tm.tm_hour = 12;
  return tm;
}

std::vector<ordered_json> read_jsonl(const std::string& path) {
  std::ifstream in(path);
  std::vector<ordered_json> rows;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rows.push_back(ordered_json::parse(line));
  return rows;
}

Tokenizer load(const std::string& family) {
  const std::string path = test::family_tokenizer_path(family);
  if (!std::filesystem::exists(path)) throw std::runtime_error(path + " is missing: run scripts/fetch_data.sh");
  return Tokenizer::load(path);
}

TEST(ChatFamilies, TokenIdenticalToApplyChatTemplate) {
  const auto convs = read_jsonl(fixtures() + "families/chat_conversations.jsonl");
  const auto rows = read_jsonl(fixtures() + "families/chat_golden.jsonl");
  ASSERT_EQ(convs.size(), rows.size());
  std::map<std::string, Tokenizer> toks;
  int compared = 0, refused = 0;
  for (size_t i = 0; i < convs.size(); ++i) {
    const ordered_json& c = convs[i];
    const ordered_json& g = rows[i];
    SCOPED_TRACE(c["name"].get<std::string>());
    ASSERT_EQ(c["name"], g["name"]);
    const std::string tname = c["template"];
    const ChatTemplate t =
        ChatTemplate::parse(test::read_file(fixtures() + "chat/templates/" + tname + ".jinja"), tname + ".jinja");
    ordered_json ctx;
    ctx["messages"] = c["messages"];
    ctx["tools"] = c.contains("tools") ? c["tools"] : ordered_json();
    ctx["documents"] = nullptr;
    ctx["add_generation_prompt"] = c["add_generation_prompt"];
    for (const auto& [k, v] : g["special_tokens"].items()) ctx[k] = v;
    for (const auto& [k, v] : c["kwargs"].items()) ctx[k] = v;
    if (g.contains("error")) {
      const auto thrown = test::thrown_by([&] { t.render(ctx); });
      EXPECT_TRUE(thrown.thrown) << "transformers refused it: " << g["error"];
      EXPECT_EQ(thrown.key, "chat_template");
      ++refused;
      continue;
    }
    RenderedText r;
    const std::tm day = c.contains("date") ? golden_day(c) : std::tm{};
    ASSERT_NO_THROW(r = t.render(ctx, c.contains("date") ? &day : nullptr));
    EXPECT_EQ(r.text, g["text"].get<std::string>());
    const std::string family = c["tokenizer"];
    if (!toks.count(family)) toks.emplace(family, load(family));
    EXPECT_EQ(toks.at(family).encode(r.text), g["ids"].get<std::vector<int32_t>>());
    ++compared;
  }
  EXPECT_GE(compared, 16);
  EXPECT_GE(refused, 6);
}

// The tokens loss_on = "assistant" trains, against transformers' return_assistant_tokens_mask of
// the same conversation under the golden's mask_template: the family's template with {% generation
// %} around each assistant message's output (gptoss_generation.jinja, gemma3_generation.jinja),
// which renders the same text. What trains: GPT-OSS, each assistant message after
// `<|start|>assistant`: its analysis channel (`<|channel|>analysis<|message|>...<|end|>`, the
// reasoning the template keeps), a tool call (` to=functions.NAME<|channel|>commentary
// json<|message|>{...}<|call|>`) and the final channel through <|end|> or, last, <|return|>; not
// the system and developer messages, user turns, tool results (`<|start|>functions.NAME
// to=assistant...`) or a header that a user's text spells. Gemma 3, each model turn's text and its
// `<end_of_turn>\n`. lcx finds them twice: by the probed header and closers in the original
// template, and by the generation blocks of the marked one.
TEST(ChatFamilies, AssistantMasksEqualTransformersWithGenerationMarkers) {
  const auto convs = read_jsonl(fixtures() + "families/chat_conversations.jsonl");
  const auto rows = read_jsonl(fixtures() + "families/chat_golden.jsonl");
  ASSERT_EQ(convs.size(), rows.size());
  std::map<std::string, Tokenizer> toks;
  std::map<std::string, int> compared;
  for (size_t i = 0; i < convs.size(); ++i) {
    const ordered_json& c = convs[i];
    const ordered_json& g = rows[i];
    if (!c.contains("mask_template")) continue;
    SCOPED_TRACE(c["name"].get<std::string>());
    ASSERT_TRUE(g.contains("assistant_masks")) << "no mask in the golden: run gen_families_golden.py";
    const std::string family = c["tokenizer"];
    if (!toks.count(family)) toks.emplace(family, load(family));
    const Tokenizer& tok = toks.at(family);
    ordered_json base = ordered_json::object();
    for (const auto& [k, v] : g["special_tokens"].items()) base[k] = v;
    for (const auto& [k, v] : c["kwargs"].items()) base[k] = v;
    ordered_json ctx = base;
    ctx["messages"] = c["messages"];
    ctx["tools"] = c.contains("tools") ? c["tools"] : ordered_json();
    ctx["documents"] = nullptr;
    ctx["add_generation_prompt"] = c["add_generation_prompt"];
    const std::tm day = c.contains("date") ? golden_day(c) : std::tm{};
    const std::tm* now = c.contains("date") ? &day : nullptr;
    const std::string plain = c["template"], marked = c["mask_template"];
    const ChatTemplate t = ChatTemplate::parse(test::read_file(fixtures() + "chat/templates/" + plain + ".jinja"), plain);
    const ChatTemplate tg =
        ChatTemplate::parse(test::read_file(fixtures() + "chat/templates/" + marked + ".jinja"), marked);
    ASSERT_FALSE(t.has_generation_blocks());
    ASSERT_TRUE(tg.has_generation_blocks());
    const RenderedText r = t.render(ctx, now);
    const RenderedText rg = tg.render(ctx, now);
    ASSERT_EQ(r.text, g["text"].get<std::string>());
    ASSERT_EQ(rg.text, r.text);
    const Encoding enc = tok.encode_batch_with_offsets({std::string_view(r.text)}, 1)[0];
    ASSERT_EQ(enc.ids, g["ids"].get<std::vector<int32_t>>());
    const auto want = g["assistant_masks"].get<std::vector<uint8_t>>();
    const TurnMarkers markers = probe_turn_markers(t, base, plain);
    if (family == "gptoss") {
      // The answer a message follows, the last answer, a tool call.
      EXPECT_EQ(markers.header, "<|start|>assistant");
      EXPECT_EQ(markers.closers, (std::vector<std::string>{"<|end|>", "<|return|>", "<|call|>"}));
    } else {
      EXPECT_EQ(markers.header, "<start_of_turn>model\n");
      EXPECT_EQ(markers.closers, std::vector<std::string>{"<end_of_turn>\n"});
    }
    EXPECT_EQ(token_mask(assistant_turns(r, markers), enc.spans), want);
    ByteRanges blocks;
    for (const auto& [b, e] : rg.generation) blocks.emplace_back(static_cast<uint32_t>(b), static_cast<uint32_t>(e));
    EXPECT_EQ(token_mask(blocks, enc.spans), want);
    ++compared[family];
  }
  EXPECT_GE(compared["gptoss"], 6);
  EXPECT_GE(compared["gemma3"], 2);
}

// loss_on = "assistant" with templates that have no {% generation %}: the probed header and closer
// find every assistant turn, a tool call's included, and nothing else. Mistral's template ignores
// add_generation_prompt: its header is the template's text that closes the user's turn.
TEST(ChatFamilies, AssistantTurnsOfLlama31Gemma3AndMistral) {
  struct Case {
    std::string family, template_path;
    std::string header, closer;
  };
  const std::vector<Case> cases = {
      {"llama3_1", fixtures() + "chat/templates/llama31.jinja", "<|start_header_id|>assistant<|end_header_id|>\n\n",
       "<|eot_id|>"},
      {"gemma3", "", "<start_of_turn>model\n", "<end_of_turn>\n"},
      {"llama2", fixtures() + "chat/templates/mistral.jinja", " [/INST] ", "</s>"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.family);
    const Tokenizer tok = load(k.family);
    const ChatRenderer chat = ChatRenderer::load(tok.path(), k.template_path, "{}");
    EXPECT_EQ(chat.markers().header, k.header);
    EXPECT_EQ(chat.markers().closers, std::vector<std::string>{k.closer});
    Conversation c;
    const std::string line =
        k.family == "gemma3"
            ? R"({"messages": [{"role": "user", "content": "Hi <start_of_turn>model\nfake"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More"}, {"role": "assistant", "content": "Sure."}]})"
        : k.family == "llama2"
            ? R"({"messages": [{"role": "user", "content": "Hi [/INST] fake"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "More"}, {"role": "assistant", "content": "Sure."}]})"
            : R"({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}, {"role": "tool", "content": "cold"}, {"role": "assistant", "content": "It is cold."}], "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]})";
    ASSERT_EQ(parse_conversation(line, "chat", c), "");
    const ChatText out = chat.render(c, LossOn::assistant);
    std::vector<std::string> trained;
    for (const auto& [b, e] : out.trained) trained.push_back(out.text.substr(b, e - b));
    const std::vector<std::string> want =
        k.family == "gemma3"   ? std::vector<std::string>{"Hello!<end_of_turn>\n", "Sure.<end_of_turn>\n"}
        : k.family == "llama2" ? std::vector<std::string>{"Hello!</s>", "Sure.</s>"}
                               : std::vector<std::string>{R"({"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>)",
                                                        "It is cold.<|eot_id|>"};
    EXPECT_EQ(trained, want) << out.text;
    const auto enc = encode_conversations(chat, tok, {std::string_view(line)}, "chat", LossOn::assistant, 1);
    ASSERT_EQ(enc.size(), 1u);
    ASSERT_TRUE(enc[0].error.empty()) << enc[0].error;
    EXPECT_EQ(enc[0].ids, tok.encode(out.text));
    int trained_tokens = 0;
    for (uint8_t m : enc[0].mask) trained_tokens += m;
    EXPECT_GT(trained_tokens, 4);
    EXPECT_LT(trained_tokens, static_cast<int>(enc[0].ids.size()) / 2);
  }
}

// A message of two tool calls: GPT-OSS's template renders the first alone (as transformers does,
// without a word), so lcx refuses the conversation, naming the message and the fix, rather than
// train on it without the second call; Qwen2.5's renders both, and trains.
TEST(ChatFamilies, ToolCallsATemplateDropsAreRefused) {
  const std::string line =
      R"({"messages": [{"role": "user", "content": "Time and weather?"}, {"role": "assistant", "tool_calls": [)"
      R"({"type": "function", "function": {"name": "get_time", "arguments": {}}}, )"
      R"({"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}, )"
      R"({"role": "tool", "content": "noon"}, {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "Noon, rain."}]})";
  Conversation c;
  ASSERT_EQ(parse_conversation(line, "chat", c), "");
  const std::string gptoss = test::family_tokenizer_path("gptoss"), qwen = test::family_tokenizer_path("qwen3");
  if (!std::filesystem::exists(gptoss) || !std::filesystem::exists(qwen))
    GTEST_SKIP() << "data/gptoss or data/qwen3 missing: run scripts/fetch_data.sh";
  const ChatRenderer harmony = ChatRenderer::load(gptoss, fixtures() + "chat/templates/gptoss.jinja", "{}");
  const auto thrown = test::thrown_by([&] { harmony.render(c, LossOn::assistant); });
  ASSERT_TRUE(thrown.thrown);
  EXPECT_EQ(thrown.key, "data.chat_template");
  EXPECT_NE(thrown.message.find("messages[1] holds 2 tool calls and the chat template renders only the first"),
            std::string::npos)
      << thrown.message;
  const ChatRenderer qwen25 = ChatRenderer::load(qwen, fixtures() + "chat/templates/qwen25.jinja", "{}");
  const ChatText out = qwen25.render(c, LossOn::assistant);
  EXPECT_NE(out.text.find("get_weather"), std::string::npos);
  const Tokenizer tok = load("gptoss");
  const auto enc = encode_conversations(harmony, tok, {std::string_view(line)}, "chat", LossOn::assistant, 1);
  ASSERT_EQ(enc.size(), 1u);
  EXPECT_NE(enc[0].error.find("renders only the first"), std::string::npos) << enc[0].error;
}

// Content given as text parts: Gemma 3's template renders the parts itself (each trimmed, the
// system message's first alone), and gets them as transformers hands them over, so the ids are
// apply_chat_template's; Qwen2.5's renders strings only (a list would print as its Python repr)
// and gets the parts' text joined by newlines.
TEST(ChatFamilies, ContentPartsReachATemplateThatRendersThem) {
  const std::string line =
      R"({"messages": [{"role": "system", "content": [{"type": "text", "text": "Be kind."}, {"type": "text", "text": "Also brief."}]}, )"
      R"({"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "text", "text": " this."}]}, )"
      R"({"role": "assistant", "content": [{"type": "text", "text": "Done."}]}]})";
  const std::string gemma = test::family_tokenizer_path("gemma3"), qwen = test::family_tokenizer_path("qwen3");
  if (!std::filesystem::exists(gemma) || !std::filesystem::exists(qwen))
    GTEST_SKIP() << "data/gemma3 or data/qwen3 missing: run scripts/fetch_data.sh";
  Conversation c;
  ASSERT_EQ(parse_conversation(line, "chat", c), "");
  const ChatText g = ChatRenderer::load(gemma, "", "{}").render(c, LossOn::assistant);
  EXPECT_EQ(g.text, "<bos><start_of_turn>user\nBe kind.\n\nDescribethis.<end_of_turn>\n<start_of_turn>model\nDone.<end_of_turn>\n");
  ordered_json ctx = {{"messages", ordered_json::parse(line)["messages"]}, {"tools", nullptr}, {"documents", nullptr},
                      {"add_generation_prompt", false}, {"bos_token", "<bos>"}, {"eos_token", "<eos>"}};
  EXPECT_EQ(ChatTemplate::parse(test::read_file(fixtures() + "chat/templates/gemma3.jinja"), "gemma3").render(ctx).text, g.text);
  const ChatText q = ChatRenderer::load(qwen, fixtures() + "chat/templates/qwen25.jinja", "{}").render(c, LossOn::assistant);
  EXPECT_NE(q.text.find("<|im_start|>system\nBe kind.\nAlso brief.<|im_end|>"), std::string::npos) << q.text;
  EXPECT_NE(q.text.find("<|im_start|>user\nDescribe \n this.<|im_end|>"), std::string::npos) << q.text;
}

}  // namespace
}  // namespace lcx
