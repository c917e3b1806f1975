// Conversations as training data: one JSON line, checked, rendered by the checkpoint's own chat
// template, the bytes that train marked, then tokenized with each token's mask.
//
//   lcx::ChatRenderer chat = lcx::ChatRenderer::load(tok.path(), cfg.chat_template, cfg.chat_template_kwargs);
//   auto out = lcx::encode_conversations(chat, tok, lines, "chat", lcx::LossOn::assistant, 0);
//   out[i].ids, out[i].mask (1 where the token trains), or out[i].error: why line i is no conversation
//
// Which bytes train (LossOn::assistant): each assistant turn after its role header, through the
// template's closer and the newline it writes after it (`<|im_end|>\n` in Qwen3: TRL's training
// templates put the same bytes inside {% generation %}). The header and closers are learned by
// rendering probe conversations (probe_turn_markers) and found in a real render only where no byte
// of them came from the data, so text that spells a header cannot open a turn. GPT-OSS's harmony
// format opens every assistant message, each channel's, with `<|start|>assistant` and closes it
// with <|end|>, <|return|> (the conversation's last) or <|call|> (a tool call): each such message
// trains from after the header through its closer. A template with {% generation %} blocks says
// it itself: its blocks train instead.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "data/chat_template.h"
#include "data/tokenizer.h"

namespace lcx {

enum class LossOn { all, assistant, completion };
const char* loss_on_name(LossOn l);

// One line, checked: what the template is given.
struct Conversation {
  // prompt_completion: prompt, then completion. A content of text parts stays a list of parts:
  // the renderer gives a template that renders parts (Gemma 3's) the list, as transformers does,
  // and the others the parts' text joined by newlines.
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  nlohmann::ordered_json tools;  // null when the line has none
  size_t prompt_messages = 0;    // prompt_completion as messages: messages[0, prompt_messages) are the prompt
  bool plain = false;            // prompt_completion as two strings, trained without a template
  std::string prompt, completion;
};

// Reads one JSON line as `format` ("chat" or "prompt_completion"): "" with `c` filled, else what is
// wrong with it, in a few words.
std::string parse_conversation(std::string_view line, const std::string& format, Conversation& c);

// The strings that open and close an assistant turn in the template's own text: one header, and
// the closers a turn may end with (one in most templates).
struct TurnMarkers {
  std::string header;
  std::vector<std::string> closers;
};
// Renders [user], [user] with the generation prompt, [user, assistant] and [user, assistant, user]
// with `base`'s variables: the header is what the generation prompt and both assistant turns have
// in common before the reply, the closer what follows the reply in both. Where the last turn
// closes otherwise than one a message follows (harmony's <|return|> and <|end|>), both are
// closers: the last's is all that follows it, the other's what precedes the next turn's opening
// (the text that shares the most with the header). A tool call whose turn holds neither gets the
// closer its template writes after the arguments (harmony's <|call|>), from a probe with one
// call; a template that refuses that probe has none. Throws lcx::Error (key data.loss_on) when
// the template shows no header or closer.
TurnMarkers probe_turn_markers(const ChatTemplate& t, const nlohmann::ordered_json& base, const std::string& name);

// Byte ranges [begin, end) of a text, in order and apart: the bytes that train.
using ByteRanges = std::vector<std::pair<uint32_t, uint32_t>>;

// Each assistant turn's bytes: from the end of a header whose bytes are all the template's
// through the end of the first closer so written after it (or the end of the text).
ByteRanges assistant_turns(const RenderedText& r, const TurnMarkers& m);

// 1 for each token with a trained byte in its span (transformers marks a generation span's tokens
// from the one holding its first character through the one holding its last).
std::vector<uint8_t> token_mask(const ByteRanges& trained, const std::vector<TokenSpan>& spans);

struct ChatText {
  std::string text;
  ByteRanges trained;
  // The eos packed after it trains: plain prompt_completion, as TRL appends eos to a completion.
  bool eos_trains = false;
};

class ChatRenderer {
 public:
  // The template of `template_path` (a Jinja file, or a tokenizer_config.json and its
  // chat_template) or, when that is "", of the tokenizer_config.json beside `tokenizer_path`;
  // bos_token, eos_token, pad_token and unk_token from that tokenizer_config.json; `kwargs_json` a
  // JSON object of the template's variables.
  static ChatRenderer load(const std::string& tokenizer_path, const std::string& template_path,
                           const std::string& kwargs_json);
  // `base`: the variables every render gets (special tokens, kwargs).
  ChatRenderer(ChatTemplate t, std::string source, nlohmann::ordered_json base);

  // The conversation's text and the bytes `loss_on` trains. Throws lcx::Error where the template
  // raises or the conversation cannot be trained so (its message says why).
  ChatText render(Conversation c, LossOn loss_on) const;

  const std::string& source() const;  // where the template came from
  const std::string& key() const;     // sha256 of the template, the variables and the special tokens
  const ChatTemplate& chat_template() const;
  // The probed markers; throws the probe's error when the template shows none.
  const TurnMarkers& markers() const;

  struct State;

 private:
  std::shared_ptr<const State> s_;
};

struct EncodedConversation {
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;  // one per id
  bool eos_trains = false;
  std::string error;  // non-empty: the line is not a conversation lcx can train on, and why
};

// Parses, renders and tokenizes each line (valid UTF-8), conversations in parallel on `threads`
// (0: all cores).
std::vector<EncodedConversation> encode_conversations(const ChatRenderer& chat, const Tokenizer& tok,
                                                      const std::vector<std::string_view>& lines,
                                                      const std::string& format, LossOn loss_on, int threads);

}  // namespace lcx
