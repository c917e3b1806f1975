// `lcx-train merge`: a PEFT LoRA adapter folded into its base Hugging Face checkpoint
// (W + scale * B @ A, lcx/peft.h), written as a checkpoint transformers loads as the base.
#include <boost/program_options.hpp>
#include <iostream>

#include "app/cli.h"
#include "lcx/peft.h"
#include "lcx/error.h"

namespace po = boost::program_options;

namespace lcx {

int merge_main(int argc, char** argv) {
  std::string base, adapter, out;
  peft::MergeOptions options;
  bool help = false;
  po::options_description desc(
      "lcx-train merge: a PEFT LoRA adapter merged into its base model, W + scale * B @ A in fp32, written in the "
      "base's dtype with its config and tokenizer files\n\n"
      "Usage: lcx-train merge --base DIR --adapter DIR --out DIR [--overwrite]\n\n"
      "Options");
  desc.add_options()
      ("base", po::value(&base)->value_name("DIR"), "the Hugging Face model folder the adapter was trained on")
      ("adapter", po::value(&adapter)->value_name("DIR"), "the adapter folder (adapter_config.json, adapter_model.safetensors)")
      ("out", po::value(&out)->value_name("DIR"), "the merged model's folder: new or empty")
      ("overwrite", po::bool_switch(&options.overwrite), "write into --out even when it is not empty")
      ("threads", po::value(&options.threads)->value_name("N"), "matrices merged at once (default: the cores, at most 16)")
      ("help,h", po::bool_switch(&help), "print this help");
  parse_subcommand(desc, argc, argv, "merge");
  if (help) {
    std::cout << desc;
    return 0;
  }
  for (const auto& [value, flag] : {std::pair{&base, "--base"}, {&adapter, "--adapter"}, {&out, "--out"}})
    if (value->empty()) throw Error(str("merge needs ", flag), flag, "lcx-train merge --base DIR --adapter DIR --out DIR");
  peft::merge(base, adapter, out, options);
  return 0;
}

}  // namespace lcx
