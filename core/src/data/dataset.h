// Training sequences from a corpus: documents tokenized once into a memory-mapped token cache,
// concatenated end to end with the tokenizer's EOS between them, cut into sequences of seq_len.
//
//   lcx::Tokenizer tok = lcx::Tokenizer::load(cfg.data.tokenizer);
//   lcx::Dataset data = lcx::Dataset::open(cfg.data, tok, {.seed = cfg.run.seed});
//   for (int64_t step = 0; step < data.steps_per_epoch(1) * epochs; ++step) {
//     lcx::Batch b = data.batch(step, 1);      // b.sequences[0].tokens int32 [L], .targets int64 [L]
//     ... b.tokens, b.valid_labels for the log line and the loss mean
//   }
//
// Sources (data.source, data.format): a file, or a folder's data files (recursive, sorted by path;
// names starting with '.' skipped, files that are no data counted): .txt (one document), .jsonl
// (one record a line), .json (a list of records, or an object holding one), each plain, .gz or
// .zst and read streaming (data/data_file.h); a record is text (its data.text_field) or a
// conversation (`messages`, ShareGPT's `conversations`, `prompt`/`completion`). A pre-tokenized
// .tokens file of uint32 ids is used as is (documents are the stretches between EOS ids). A file
// that is not what its name says, or whose name is no data lcx reads, is refused by name.
// Packing (data.packing): "stream", a document that does not fit in the current sequence continues
// in the next one (a sequence may hold the tail of one document, whole ones, and the head of
// another); "bfd", best-fit decreasing, each sequence holds whole documents, padded with EOS to a
// multiple of pad_to_multiple_of, the padding a document of its own. data.overlong says what
// becomes of a document longer than seq_len: continue (cut into sequences), truncate, or drop. Targets are
// shifted (targets[t] = tokens[t+1]); the last position of a sequence and padding get -100.
// Unless data.attend_across_documents, each sequence carries its document bounds
// (Sequence::document_bounds: each document attends only to itself, positions restart) and each
// document's EOS gets -100 too: it cannot see the next document it would predict.
// The final partial sequence is kept, padded with EOS up to a multiple of pad_to_multiple_of (so
// it can be shorter than seq_len), unless data.drop_last; dropped tokens are logged with the reason.
// Bad input (invalid UTF-8, empty files, lines that are not JSON or lack the field, unreadable
// files) is counted and reported in one summary line naming the first offending path of each kind.
// Conversations (data.format chat or prompt_completion, data/chat_data.h): each line rendered by the
// model's chat template is one document whose per-token mask (data.loss_on) travels in the token
// cache; a token that does not train is a -100 target. Lines that are not conversations are
// reported with their line numbers and why; a file where none is one is refused.
// Several sources (data.sources): each read as one is, then mixed into a fixed list of sequences by
// weight or fraction, drawn by the seed (Dataset::open_mixture). Options::held_out keeps a share
// of the sequences, drawn by the seed, for evaluation ([eval] split): the training dataset serves
// the others, the evaluation's only those.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config/core_config.h"
#include "data/tokenizer.h"
#include "lcx/sequence.h"

namespace lcx {

// What reading the source found; the summary is logged when the dataset opens.
struct DataReport {
  int64_t files = 0, documents = 0;
  int64_t empty = 0, unreadable = 0, not_json = 0, missing_field = 0;
  int64_t other_files = 0;  // in a folder, files whose names are no data (a README), not read
  std::string first_other_file;
  int64_t invalid_utf8_documents = 0, invalid_utf8_sequences = 0;
  std::string first_empty, first_unreadable, first_not_json, first_missing_field, first_invalid_utf8;
  std::string format;  // as read: data.format, or what auto found
  // Conversations: the template, which tokens train, lines that are none (the first few as
  // "path:line: what is wrong"), those with no trained token.
  std::string chat_template, loss_on;
  int64_t bad_conversations = 0;
  std::vector<std::string> bad_examples;
  int64_t untrained = 0;
  std::string first_untrained;
  int64_t trained_tokens = 0;  // mask entries that are 1
  // Documents that continue into the next sequence, and those longer than one sequence.
  int64_t cut_documents = 0, longer_than_sequence = 0;
  // data.overlong: documents longer than a sequence truncated (and the tokens cut) or dropped.
  int64_t truncated_documents = 0, truncated_tokens = 0, dropped_documents = 0, dropped_document_tokens = 0;
  std::string packing, overlong;  // data.packing, data.overlong
  int64_t tokens = 0;          // the whole stream, EOS separators included
  int64_t sequences = 0;
  int64_t positions = 0;       // the sequences' lengths, padding included
  int64_t seq_len = 0;         // data.seq_len
  int64_t padding = 0;         // EOS tokens added to fill sequences (stream: the final one)
  int64_t untrained_sequences = 0;  // sequences with no target that trains
  std::string mixture;         // [[data.sources]]: how the sources were mixed ("" for one source)
  int64_t held_out = 0;        // sequences held out for evaluation (Options::held_out)
  bool held_out_side = false;  // this dataset serves them (else it serves the rest)
  int64_t dropped_tokens = 0;  // at the end of the stream
  std::string dropped_why;
  bool from_cache = false;
  std::string cache_path;
  std::string summary() const;  // one line
};

struct Batch {
  std::vector<Sequence> sequences;
  int64_t epoch = 0;
  int64_t tokens = 0;        // non-padding tokens
  int64_t valid_labels = 0;  // targets != -100
};

class Dataset {
 public:
  struct Options {
    int64_t seed = 0;      // [run] seed: the shuffle of each epoch derives from it
    int threads = 0;       // tokenizing threads; 0 = all
    bool progress = true;  // progress bar with ETA on stderr while tokenizing
    // A share of the sequences held out for evaluation ([eval] split), drawn from the seed: the
    // dataset serves the others, or with held_out_side only them.
    double held_out = 0;
    bool held_out_side = false;
  };
  static Dataset open(const DataConfig& cfg, const Tokenizer& tok, const Options& opt);
  static Dataset open(const DataConfig& cfg, const Tokenizer& tok) { return open(cfg, tok, Options{}); }

  int64_t num_sequences() const;
  int64_t seq_len() const;
  int64_t num_documents() const;
  // Sequence `index` in corpus order (0 .. num_sequences-1).
  Sequence get(int64_t index) const;
  int64_t length(int64_t index) const;        // its padded length
  int64_t valid_labels(int64_t index) const;  // its targets that are not -100
  // The sequence seen at `position` of `epoch`: a permutation drawn from (seed, epoch) when
  // data.shuffle, else corpus order.
  int64_t index_at(int64_t epoch, int64_t position) const;
  int64_t steps_per_epoch(int64_t batch_size) const;  // the last batch of an epoch may be smaller
  Batch batch(int64_t step, int64_t batch_size) const;  // step counts across epochs
  const DataReport& report() const;

  struct State;

 private:
  static Dataset open_mixture(const DataConfig& cfg, const Tokenizer& tok, const Options& opt);
  static Dataset finish(std::shared_ptr<State> s, const Options& opt);
  std::shared_ptr<const State> s_;
};

}  // namespace lcx
