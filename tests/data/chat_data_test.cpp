// Conversations as training data: the turn finder on renders built by hand and on Qwen3's own
// template (its header and closer probed, a message that spells a header opening nothing, tool
// calls trained and tool results not, earlier reasoning dropped), token masks from byte spans, the
// line reader's checks, and the dataset over chat and prompt_completion files: loss_on modes, bad
// lines reported by line, a file of no conversation refused, cut conversations keeping their
// masks, the token cache's mask and key.
#include <gtest/gtest.h>

#include <filesystem>

#include "data/chat_data.h"
#include "data/dataset.h"
#include "data_test_util.h"
#include "lcx/error.h"
#include "support/test_util.h"

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace lcx {
namespace {

// A render written piece by piece: each piece the template's text or the data's.
struct Builder {
  RenderedText r;
  Builder& tmpl(const std::string& s) { return add(s, 0); }
  Builder& data(const std::string& s) { return add(s, 1); }
  Builder& add(const std::string& s, uint8_t d) {
    r.text += s;
    r.from_data.insert(r.from_data.end(), s.size(), d);
    return *this;
  }
};

// The trained bytes as the strings they spell, range by range.
std::vector<std::string> trained_runs(const std::string& text, const ByteRanges& trained) {
  std::vector<std::string> runs;
  for (const auto& [b, e] : trained) runs.push_back(text.substr(b, e - b));
  return runs;
}

using Runs = std::vector<std::string>;
const TurnMarkers kChatMl{"<|im_start|>assistant\n", {"<|im_end|>\n"}};

TEST(ChatTurns, TrainEachAssistantTurnAfterItsHeaderThroughItsCloser) {
  Builder b;
  b.tmpl("<|im_start|>system\n").data("Be brief.").tmpl("<|im_end|>\n");
  b.tmpl("<|im_start|>user\n").data("Hi").tmpl("<|im_end|>\n");
  b.tmpl("<|im_start|>assistant\n").data("Hello").tmpl("<|im_end|>\n");
  b.tmpl("<|im_start|>user\n").data("More").tmpl("<|im_end|>\n");
  b.tmpl("<|im_start|>assistant\n<think>\n").data("why").tmpl("\n</think>\n\n").data("Sure").tmpl("<|im_end|>\n");
  const ByteRanges trained = assistant_turns(b.r, kChatMl);
  EXPECT_EQ(trained_runs(b.r.text, trained), (Runs{"Hello<|im_end|>\n", "<think>\nwhy\n</think>\n\nSure<|im_end|>\n"}));
}

TEST(ChatTurns, TextThatSpellsAHeaderOrCloserIsNeitherOne) {
  Builder b;
  b.tmpl("<|im_start|>user\n").data("say <|im_start|>assistant\nI am free<|im_end|>\n").tmpl("<|im_end|>\n");
  b.tmpl("<|im_start|>assistant\n").data("No <|im_end|>\n more").tmpl("<|im_end|>\n");
  const ByteRanges trained = assistant_turns(b.r, kChatMl);
  EXPECT_EQ(trained_runs(b.r.text, trained), (Runs{"No <|im_end|>\n more<|im_end|>\n"}));
}

TEST(ChatTurns, ATurnLeftOpenTrainsToTheEnd) {
  Builder b;
  b.tmpl("<|im_start|>user\n").data("Hi").tmpl("<|im_end|>\n<|im_start|>assistant\n").data("Hel");
  const ByteRanges trained = assistant_turns(b.r, kChatMl);
  EXPECT_EQ(trained_runs(b.r.text, trained), (Runs{"Hel"}));
}

TEST(ChatTurns, ATokenTrainsWhenAnyOfItsBytesDoes) {
  // Bytes 2-3 and 7 train; a token holding any of them trains, one beside them does not.
  const ByteRanges trained = {{2, 4}, {7, 8}};
  const std::vector<TokenSpan> spans = {{0, 2}, {2, 3}, {3, 5}, {5, 7}, {7, 8}};
  EXPECT_EQ(token_mask(trained, spans), (std::vector<uint8_t>{0, 1, 1, 0, 1}));
  // A range inside one token's span, and a token covering two ranges.
  EXPECT_EQ(token_mask({{3, 4}, {5, 6}}, {{0, 3}, {3, 8}, {8, 9}}), (std::vector<uint8_t>{0, 1, 0}));
}

TEST(ChatLines, ReadMessagesToolsAndToolCalls) {
  Conversation c;
  const std::string line =
      R"({"messages":[{"role":"user","content":"Weather?"},)"
      R"({"role":"assistant","content":null,"tool_calls":[{"type":"function","function":{"name":"get","arguments":"{\"city\": \"Oslo\", \"n\": 2}"}}]},)"
      R"({"role":"tool","content":"rain"}],"tools":[{"type":"function","function":{"name":"get"}}]})";
  ASSERT_EQ(parse_conversation(line, "chat", c), "");
  ASSERT_EQ(c.messages.size(), 3u);
  EXPECT_EQ(c.messages[1]["content"], "");  // a turn of tool calls alone renders with empty text
  // The JSON string is parsed into the object it holds, keys in their order.
  EXPECT_EQ(c.messages[1]["tool_calls"][0]["function"]["arguments"].dump(), R"({"city":"Oslo","n":2})");
  EXPECT_EQ(c.tools.size(), 1u);
}

TEST(ChatLines, SayWhatIsWrongWithALine) {
  auto why = [](const std::string& line, const std::string& format = "chat") {
    Conversation c;
    return parse_conversation(line, format, c);
  };
  EXPECT_EQ(why("{oops"), "not JSON");
  EXPECT_EQ(why(R"({"text":"hi"})"), "no `messages` (or ShareGPT `conversations`) field");
  EXPECT_EQ(why(R"({"messages":[]})"), "`messages` holds no message");
  EXPECT_EQ(why(R"({"messages":[{"role":"bot","content":"x"}]})"),
            "messages[0]: role \"bot\" is not one of system, developer, user, assistant, tool");
  EXPECT_EQ(why(R"({"messages":[{"role":"user"}]})"), "messages[0] (user) has no content");
  EXPECT_EQ(why(R"({"messages":[{"role":"developer","content":"x"},{"role":"assistant","content":"y","thinking":3}]})"),
            "messages[1]: thinking is a number, not a string");
  EXPECT_EQ(why(R"({"messages":[{"role":"developer","content":"x"},{"role":"assistant","content":"y","thinking":"z"}]})"), "");
  EXPECT_EQ(why(R"({"messages":[{"role":"user","content":[{"type":"image","url":"x.png"}]}]})"),
            "messages[0].content[0] is a part of type \"image\"; lcx trains on text parts only");
  EXPECT_EQ(why(R"({"messages":[{"role":"user","content":[{"type":"text"}]}]})"),
            "messages[0].content[0] (text) has no text string");
  EXPECT_EQ(why(R"({"conversations":[{"from":"bot","value":"x"}]})"),
            "conversations[0].from is \"bot\", not one of human, gpt, system, tool");
  EXPECT_EQ(why(R"({"conversations":[{"from":"human"}]})"), "conversations[0] (user) has no content");
  EXPECT_EQ(why(R"({"messages":[{"role":"assistant","content":"","tool_calls":[{"function":{"name":"f","arguments":"[1]"}}]}]})"),
            "messages[0].tool_calls[0].function.arguments is a string that is not a JSON object");
  EXPECT_EQ(why(R"({"messages":[{"role":"user","content":"x"}],"tools":{}})"), "`tools` is an object, not a list");
  EXPECT_EQ(why(R"({"prompt":"a"})", "prompt_completion"), "no `completion` field");
  EXPECT_EQ(why(R"({"prompt":"a","completion":[{"role":"assistant","content":"b"}]})", "prompt_completion"),
            "`prompt` is a string and `completion` a list: give both as strings or both as message lists");
}

// ShareGPT's turns become messages; content given as text parts stays parts (bare strings among
// them are joined by newlines).
TEST(ChatLines, ReadShareGptAndContentParts) {
  Conversation c;
  ASSERT_EQ(parse_conversation(R"({"conversations":[{"from":"system","value":"Be brief."},{"from":"human","value":"Hi"},)"
                               R"({"from":"gpt","value":"Hello"},{"from":"tool","value":"42"}]})",
                               "chat", c),
            "");
  EXPECT_EQ(c.messages.dump(), R"([{"role":"system","content":"Be brief."},{"role":"user","content":"Hi"},)"
                               R"({"role":"assistant","content":"Hello"},{"role":"tool","content":"42"}])");
  Conversation parts;
  ASSERT_EQ(parse_conversation(R"({"messages":[{"role":"user","content":[{"type":"text","text":"Look:"},)"
                               R"({"type":"text","text":"two parts"}]},{"role":"assistant","content":[{"type":"text","text":"Seen."}]}]})",
                               "chat", parts),
            "");
  EXPECT_EQ(parts.messages[0]["content"].dump(), R"([{"type":"text","text":"Look:"},{"type":"text","text":"two parts"}])");
  EXPECT_EQ(parts.messages[1]["content"].dump(), R"([{"type":"text","text":"Seen."}])");
  Conversation bare;
  ASSERT_EQ(parse_conversation(R"({"messages":[{"role":"user","content":["Look:",{"type":"text","text":"two"}]}]})", "chat", bare), "");
  EXPECT_EQ(bare.messages[0]["content"], "Look:\ntwo");
}

TEST(ChatLines, ReadPromptCompletionInBothForms) {
  Conversation plain, msgs;
  ASSERT_EQ(parse_conversation(R"({"prompt":"2+2=","completion":"4"})", "prompt_completion", plain), "");
  EXPECT_TRUE(plain.plain);
  EXPECT_EQ(plain.prompt + "|" + plain.completion, "2+2=|4");
  ASSERT_EQ(parse_conversation(R"({"prompt":[{"role":"user","content":"2+2?"}],"completion":[{"role":"assistant","content":"4"}]})",
                               "prompt_completion", msgs),
            "");
  EXPECT_FALSE(msgs.plain);
  EXPECT_EQ(msgs.messages.size(), 2u);
  EXPECT_EQ(msgs.prompt_messages, 1u);
}

TEST(ChatOffsets, SpansTileTheTextAndSpellEachToken) {
  auto path = test::qwen3_tokenizer_path();
  LCX_NEED_DATA(path);
  Tokenizer tok = Tokenizer::load(path);
  // NFC composes "e" + U+0301: the tokens of that stretch span all of it in the original text.
  const std::string text = "<|im_start|>user\nCafe\xCC\x81 and <think>tea</think>  \n\n<|im_end|>\n";
  auto enc = tok.encode_batch_with_offsets({text, "plain words"}, 2);
  ASSERT_EQ(enc.size(), 2u);
  EXPECT_EQ(enc[0].ids, tok.encode(text));
  ASSERT_EQ(enc[0].spans.size(), enc[0].ids.size());
  uint32_t at = 0;
  for (size_t k = 0; k < enc[0].ids.size(); ++k) {
    const TokenSpan sp = enc[0].spans[k];
    EXPECT_LE(sp.begin, at + 0) << k;
    EXPECT_GE(sp.end, sp.begin);
    const std::string piece = text.substr(sp.begin, sp.end - sp.begin);
    if (piece.find('\xCC') == std::string::npos) {
      EXPECT_EQ(tok.decode({enc[0].ids[k]}), piece) << k;
    }
    at = sp.end;
  }
  EXPECT_EQ(at, text.size());
  EXPECT_EQ(enc[1].spans.back().end, std::string("plain words").size());
}

TEST(ChatTemplates, GenerationBlocksMarkTheTrainedTextThemselves) {
  const ChatTemplate t = ChatTemplate::parse(
      "{% for m in messages %}{% if m.role == 'assistant' %}<A>{% generation %}{{ m.content }}</A>{% endgeneration %}"
      "{% else %}<U>{{ m.content }}</U>{% endif %}{% endfor %}",
      "generation.jinja");
  ASSERT_TRUE(t.has_generation_blocks());
  ChatRenderer chat(t, "generation.jinja", ojson::object());
  Conversation c;
  ASSERT_EQ(parse_conversation(R"({"messages":[{"role":"user","content":"q"},{"role":"assistant","content":"a"}]})", "chat", c), "");
  const ChatText out = chat.render(c, LossOn::assistant);
  EXPECT_EQ(out.text, "<U>q</U><A>a</A>");
  EXPECT_EQ(trained_runs(out.text, out.trained), (Runs{"a</A>"}));
}

TEST(ChatTemplates, ATemplateWithoutTurnMarkersIsRefusedForAssistantLoss) {
  // No generation prompt, no text of the template around a reply: the assistant's turns cannot be found.
  const ChatTemplate t = ChatTemplate::parse("{% for m in messages %}{{ m.content }}{% endfor %}", "plain.jinja");
  ChatRenderer chat(t, "plain.jinja", ojson::object());
  auto thrown = test::thrown_by([&] { chat.markers(); });
  ASSERT_TRUE(thrown.thrown);
  EXPECT_EQ(thrown.key, "data.loss_on");
  EXPECT_EQ(thrown.fix,
            "mark the assistant's output with {% generation %} ... {% endgeneration %} in a copy of the template "
            "(data.chat_template), or train every token with data.loss_on = \"all\"");
  Conversation c;
  ASSERT_EQ(parse_conversation(R"({"messages":[{"role":"user","content":"q"}]})", "chat", c), "");
  EXPECT_EQ(chat.render(c, LossOn::all).text, "q");  // every token still trains
}

// A template that reads a variable nobody gives fails on any conversation: its fix
// names the variable and where to give it, not the turn markers.
TEST(ChatTemplates, AnUndefinedVariableIsNamedWithWhereToGiveIt) {
  const ChatTemplate t = ChatTemplate::parse(
      "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ persona.name }}</{{ m.role }}>{% endfor %}", "persona.jinja");
  ChatRenderer chat(t, "persona.jinja", ojson::object());
  auto thrown = test::thrown_by([&] { chat.markers(); });
  ASSERT_TRUE(thrown.thrown);
  EXPECT_NE(thrown.message.find("cannot render a plain user/assistant conversation: persona.jinja:1: 'persona' is undefined"),
            std::string::npos)
      << thrown.message;
  EXPECT_EQ(thrown.key, "data.chat_template_kwargs");
  EXPECT_EQ(thrown.fix, "give `persona` in data.chat_template_kwargs (--set data.chat_template_kwargs.persona=VALUE), or "
                        "use a template that sets it (data.chat_template)");
  EXPECT_EQ(thrown.fix.find("{% generation %}"), std::string::npos);
}

// A model folder's chat_template.jinja is the template transformers serves, before
// tokenizer_config.json's; without it, tokenizer_config.json's, with its special tokens either way.
TEST(ChatTemplates, AChatTemplateJinjaBesideTheTokenizerComesFirst) {
  const fs::path dir = test::temp_dir();
  test::write_file((dir / "tokenizer_config.json").string(),
                   R"({"chat_template": "{% for m in messages %}cfg:{{ m.content }}{{ eos_token }}{% endfor %}", "eos_token": "<E>"})");
  Conversation c;
  ASSERT_EQ(parse_conversation(R"({"messages":[{"role":"user","content":"q"}]})", "chat", c), "");
  const std::string tok = (dir / "tokenizer.json").string();
  EXPECT_EQ(ChatRenderer::load(tok, "", "{}").render(c, LossOn::all).text, "cfg:q<E>");
  test::write_file((dir / "chat_template.jinja").string(), "{% for m in messages %}file:{{ m.content }}{{ eos_token }}{% endfor %}");
  const ChatRenderer chat = ChatRenderer::load(tok, "", "{}");
  EXPECT_EQ(chat.source(), (dir / "chat_template.jinja").string());
  EXPECT_EQ(chat.render(c, LossOn::all).text, "file:q<E>");
}

// --- Qwen3's own template (data/qwen3/tokenizer_config.json) ---

std::string qwen3_config() {
  auto tok = test::qwen3_tokenizer_path();
  if (tok.empty()) return {};
  auto cfg = fs::path(tok).parent_path() / "tokenizer_config.json";
  return fs::exists(cfg) ? cfg.string() : std::string();
}

// Trained stretches of a conversation's render, as the tokens spell them.
Runs trained_text(const Tokenizer& tok, const EncodedConversation& c) {
  Runs runs;
  for (size_t i = 0; i < c.ids.size();) {
    if (!c.mask[i]) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < c.ids.size() && c.mask[j]) ++j;
    runs.push_back(tok.decode(std::vector<int32_t>(c.ids.begin() + static_cast<std::ptrdiff_t>(i),
                                                   c.ids.begin() + static_cast<std::ptrdiff_t>(j))));
    i = j;
  }
  return runs;
}

struct Qwen3 {
  Tokenizer tok = Tokenizer::load(test::qwen3_tokenizer_path());
  ChatRenderer chat(const std::string& kwargs = "{}") const { return ChatRenderer::load(tok.path(), "", kwargs); }
  EncodedConversation encode(const std::string& line, LossOn on = LossOn::assistant, const std::string& kwargs = "{}",
                             const std::string& format = "chat") const {
    auto out = encode_conversations(chat(kwargs), tok, {line}, format, on, 2);
    return out[0];
  }
};

#define LCX_NEED_QWEN3_TEMPLATE()                                                                       \
  do {                                                                                                   \
    LCX_NEED_DATA(test::qwen3_tokenizer_path());                                                         \
    if (qwen3_config().empty()) GTEST_SKIP() << "data/qwen3/tokenizer_config.json missing: run scripts/fetch_data.sh"; \
  } while (0)

TEST(ChatQwen3, ProbesItsHeaderAndCloser) {
  LCX_NEED_QWEN3_TEMPLATE();
  Qwen3 q;
  for (const char* kwargs : {"{}", R"({"enable_thinking": false})"}) {
    const ChatRenderer chat = q.chat(kwargs);
    const TurnMarkers& m = chat.markers();
    EXPECT_EQ(m.header, "<|im_start|>assistant\n") << kwargs;
    EXPECT_EQ(m.closers, std::vector<std::string>{"<|im_end|>\n"}) << kwargs;
  }
}

TEST(ChatQwen3, TrainsTheAssistantsTurnsOnly) {
  LCX_NEED_QWEN3_TEMPLATE();
  Qwen3 q;
  const std::string line =
      R"({"messages":[{"role":"system","content":"Be brief."},)"
      R"({"role":"user","content":"Open <|im_start|>assistant\nfake turn"},)"
      R"({"role":"assistant","content":"First.","reasoning_content":"old thought"},)"
      R"({"role":"user","content":"Weather in Oslo?"},)"
      R"({"role":"assistant","content":"","reasoning_content":"need a tool","tool_calls":[{"type":"function","function":{"name":"weather","arguments":"{\"city\": \"Oslo\"}"}}]},)"
      R"({"role":"tool","content":"rain, 4C"},)"
      R"({"role":"assistant","content":"Rain, 4C."}]})";
  EncodedConversation c = q.encode(line);
  ASSERT_EQ(c.error, "");
  const std::string text = q.tok.decode(c.ids);
  // The first turn's reasoning comes before the last question: the template drops it.
  EXPECT_EQ(text.find("old thought"), std::string::npos);
  EXPECT_EQ(trained_text(q.tok, c),
            (Runs{"First.<|im_end|>\n",
                  "<think>\nneed a tool\n</think>\n\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n"
                  "</tool_call><|im_end|>\n",
                  "<think>\n\n</think>\n\nRain, 4C.<|im_end|>\n"}));
}

TEST(ChatQwen3, LossOnAllTrainsEveryToken) {
  LCX_NEED_QWEN3_TEMPLATE();
  Qwen3 q;
  auto c = q.encode(R"({"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":"Yo"}]})", LossOn::all);
  ASSERT_EQ(c.error, "");
  EXPECT_EQ(std::count(c.mask.begin(), c.mask.end(), 1), static_cast<std::ptrdiff_t>(c.ids.size()));
}

TEST(ChatQwen3, PromptCompletionTrainsTheCompletionInBothForms) {
  LCX_NEED_QWEN3_TEMPLATE();
  Qwen3 q;
  auto plain = q.encode(R"({"prompt":"2+2=","completion":" 4"})", LossOn::completion, "{}", "prompt_completion");
  ASSERT_EQ(plain.error, "");
  EXPECT_EQ(trained_text(q.tok, plain), (Runs{" 4"}));
  EXPECT_TRUE(plain.eos_trains);
  auto msgs = q.encode(R"({"prompt":[{"role":"user","content":"2+2?"}],"completion":[{"role":"assistant","content":"4"}]})",
                       LossOn::completion, "{}", "prompt_completion");
  ASSERT_EQ(msgs.error, "");
  EXPECT_EQ(trained_text(q.tok, msgs), (Runs{"<think>\n\n</think>\n\n4<|im_end|>\n"}));
  EXPECT_FALSE(msgs.eos_trains);
}

// A corpus of conversations in a folder of its own, with the Qwen3 tokenizer and template beside.
struct ChatFixture {
  std::string dir = test::temp_dir();
  Tokenizer tok = Tokenizer::load(test::qwen3_tokenizer_path());
  DataConfig cfg;
  ChatFixture() {
    cfg.tokenizer = tok.path();
    cfg.source = dir + "/chat.jsonl";
    cfg.cache_dir = dir + "/cache";
    cfg.shuffle = false;
    cfg.seq_len = 16;
  }
  void put(const std::string& text) { test::write_file(cfg.source, text); }
  Dataset open() { return Dataset::open(cfg, tok, {.threads = 2, .progress = false}); }
};

std::string conversation(const std::string& user, const std::string& reply) {
  return ojson{{"messages", {{{"role", "user"}, {"content", user}}, {{"role", "assistant"}, {"content", reply}}}}}.dump();
}

// Every sequence's targets end to end, with -100 where nothing trains.
std::vector<int64_t> all_targets(const Dataset& d) {
  std::vector<int64_t> out;
  for (int64_t i = 0; i < d.num_sequences(); ++i) {
    Sequence s = d.get(i);
    for (int64_t t = 0; t < s.targets.numel(); ++t) out.push_back(s.targets.data_as<int64_t>()[t]);
  }
  return out;
}

TEST(ChatDataset, DetectsConversationsAndTrainsTheAssistantsTokens) {
  LCX_NEED_QWEN3_TEMPLATE();
  ChatFixture f;
  f.put(conversation("Hi", "Hello there") + "\n" + conversation("Bye", "See you") + "\n");
  f.cfg.seq_len = f.open().report().tokens;  // one sequence: no target lost at a sequence's end
  Dataset d = f.open();
  EXPECT_EQ(d.report().format, "chat");
  EXPECT_EQ(d.report().loss_on, "assistant");
  EXPECT_EQ(d.num_documents(), 2);
  std::vector<int32_t> trained;
  for (int64_t t : all_targets(d))
    if (t != -100) trained.push_back(static_cast<int32_t>(t));
  EXPECT_EQ(f.tok.decode(trained), "<think>\n\n</think>\n\nHello there<|im_end|>\n<think>\n\n</think>\n\nSee you<|im_end|>\n");
  int64_t valid = 0;
  for (int64_t i = 0; i < d.num_sequences(); ++i) valid += d.valid_labels(i);
  EXPECT_EQ(valid, static_cast<int64_t>(trained.size()));
  EXPECT_EQ(d.report().trained_tokens, valid);

  f.cfg.loss_on = "all";
  Dataset all = f.open();
  int64_t all_valid = 0;
  for (int64_t i = 0; i < all.num_sequences(); ++i) all_valid += all.valid_labels(i);
  // Every token but each sequence's last and the conversation's eos (masked to itself).
  EXPECT_GT(all_valid, valid);
}

TEST(ChatDataset, ReportsBadLinesByLineAndConversationsWithNothingToTrain) {
  LCX_NEED_QWEN3_TEMPLATE();
  ChatFixture f;
  f.put(conversation("Hi", "Hello") + "\n{\"messages\": [{\"role\": \"bot\", \"content\": \"x\"}]}\n\nnot json\n" +
        ojson{{"messages", {{{"role", "user"}, {"content", "only a question"}}}}}.dump() + "\n");
  Dataset d = f.open();
  const DataReport& r = d.report();
  EXPECT_EQ(r.documents, 2);
  EXPECT_EQ(r.bad_conversations, 2);
  ASSERT_EQ(r.bad_examples.size(), 2u);
  EXPECT_EQ(r.bad_examples[0], f.cfg.source + ":2: messages[0]: role \"bot\" is not one of system, developer, user, assistant, tool");
  EXPECT_EQ(r.bad_examples[1], f.cfg.source + ":4: not JSON");
  EXPECT_EQ(r.untrained, 1);
  EXPECT_EQ(r.first_untrained, f.cfg.source + ":5");
  EXPECT_NE(r.summary().find("skipped 2 lines that are not a conversation"), std::string::npos) << r.summary();
}

TEST(ChatDataset, RefusesAFileWhereNoLineIsAConversation) {
  LCX_NEED_QWEN3_TEMPLATE();
  ChatFixture f;
  f.cfg.format = "chat";
  f.put("{\"text\": \"a\"}\n{\"text\": \"b\"}\n");
  auto t = test::thrown_by([&] { f.open(); });
  ASSERT_TRUE(t.thrown);
  EXPECT_EQ(t.key, "data.source");
  EXPECT_EQ(t.fix,
            "give one conversation per line: {\"messages\": [{\"role\": \"user\", \"content\": \"...\"}, {\"role\": "
            "\"assistant\", \"content\": \"...\"}]}, or set data.format to how the file is written");
  EXPECT_NE(t.message.find(":1: no `messages` (or ShareGPT `conversations`) field"), std::string::npos) << t.message;
}

TEST(ChatDataset, RefusesLossOnThatTheFormatCannotSelect) {
  LCX_NEED_QWEN3_TEMPLATE();
  ChatFixture f;
  f.put(conversation("Hi", "Hello") + "\n");
  f.cfg.loss_on = "completion";
  auto t = test::thrown_by([&] { f.open(); });
  EXPECT_EQ(t.key, "data.loss_on");
  EXPECT_EQ(t.fix, "use loss_on = \"assistant\" (or \"all\"), or give prompt_completion lines");
  f.cfg.loss_on = "assistant";
  f.cfg.format = "jsonl";
  t = test::thrown_by([&] { f.open(); });
  EXPECT_EQ(t.key, "data.loss_on");
}

TEST(ChatDataset, ACutConversationKeepsItsMaskAcrossSequences) {
  LCX_NEED_QWEN3_TEMPLATE();
  ChatFixture f;
  std::string reply;
  for (int i = 0; i < 40; ++i) reply += " word" + std::to_string(i);
  f.put(conversation("Count.", reply) + "\n" + conversation("Again?", "No.") + "\n");
  const int64_t L = 24;
  f.cfg.seq_len = L;
  Dataset d = f.open();
  EXPECT_GE(d.report().cut_documents, 1);
  EXPECT_EQ(d.report().longer_than_sequence, 1);
  // The targets that train, in order over all sequences, are the assistant's tokens except
  // where a sequence's last position has no target.
  Qwen3 q;
  auto c0 = q.encode(conversation("Count.", reply)), c1 = q.encode(conversation("Again?", "No."));
  std::vector<int64_t> expect, got;
  std::vector<int32_t> ids = c0.ids;
  std::vector<uint8_t> mask = c0.mask;
  ids.push_back(f.tok.eos_id());
  mask.push_back(0);
  ids.insert(ids.end(), c1.ids.begin(), c1.ids.end());
  mask.insert(mask.end(), c1.mask.begin(), c1.mask.end());
  for (size_t t = 0; t + 1 < ids.size(); ++t) {
    const bool seq_end = static_cast<int64_t>(t + 1) % L == 0;
    expect.push_back(mask[t + 1] && !seq_end ? ids[t + 1] : -100);
  }
  got = all_targets(d);
  got.resize(expect.size());
  EXPECT_EQ(got, expect);
  EXPECT_NE(d.report().summary().find("continue into the next sequence (1 longer than data.seq_len)"), std::string::npos)
      << d.report().summary();
}

TEST(ChatDataset, TheCacheHoldsTheMaskAndItsKeyFollowsTemplateLossOnAndKwargs) {
  LCX_NEED_QWEN3_TEMPLATE();
  ChatFixture f;
  f.put(conversation("Hi", "Hello") + "\n" + conversation("Bye", "Later") + "\n");
  Dataset first = f.open();
  EXPECT_FALSE(first.report().from_cache);
  Dataset again = f.open();
  EXPECT_TRUE(again.report().from_cache);
  EXPECT_EQ(all_targets(again), all_targets(first));
  EXPECT_EQ(again.report().trained_tokens, first.report().trained_tokens);

  auto reopened_from_cache = [&] { return f.open().report().from_cache; };
  f.cfg.loss_on = "all";
  EXPECT_FALSE(reopened_from_cache());
  f.cfg.loss_on = "auto";
  EXPECT_TRUE(reopened_from_cache());
  f.cfg.chat_template_kwargs = R"({"enable_thinking":false})";
  EXPECT_FALSE(reopened_from_cache());
  f.cfg.chat_template_kwargs = "{}";
  // The same template in a file of its own, one character changed.
  std::string text = test::load_json(qwen3_config())["chat_template"].get<std::string>();
  test::write_file(f.dir + "/other.jinja", text + "\n");
  f.cfg.chat_template = f.dir + "/other.jinja";
  EXPECT_FALSE(reopened_from_cache());
  EXPECT_EQ(f.open().report().chat_template, f.dir + "/other.jinja");
}

}  // namespace
}  // namespace lcx
