// `lcx-train config`: the reference of every manifest key, core's and the installed plugins',
// as the code that reads each key describes it; `--markdown` is docs/config.md.
#include <boost/program_options.hpp>
#include <cstdio>
#include <iostream>

#include "app/cli.h"
#include "config/reference.h"
#include "lcx/error.h"

namespace po = boost::program_options;

namespace lcx {

int config_main(int argc, char** argv) {
  bool markdown = false, help = false;
  std::string plugin_dir;
  po::options_description desc(
      "lcx-train config: every manifest key with its type, default, range and meaning\n\n"
      "Usage: lcx-train config [--markdown] [--plugin-dir DIR]\n\n"
      "Options");
  desc.add_options()
      ("markdown", po::bool_switch(&markdown), "print markdown, as docs/config.md")
      ("plugin-dir", po::value(&plugin_dir)->value_name("DIR"), "a plugin folder searched first, as [plugins] dir")
      ("help,h", po::bool_switch(&help), "print this help");
  parse_subcommand(desc, argc, argv, "config");
  if (help) {
    std::cout << desc;
    return 0;
  }
  std::vector<std::string> skipped;
  const auto tables = config_reference(PluginLoader(PluginLoader::default_search_dirs(plugin_dir)), &skipped);
  std::fputs(format_reference(tables, markdown).c_str(), stdout);
  for (const auto& s : skipped) std::fprintf(stderr, "warning: skipped %s\n", s.c_str());
  return 0;
}

}  // namespace lcx
