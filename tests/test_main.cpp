// The main of every test binary: GoogleTest's, plus --attention=CHOICE, which sets the GPU
// attention choice for the whole run as [run] attention does for lcx-train (e.g. the GPU suite
// with --attention=sm80 runs as on an A100: cuDNN, else lcx's sm_80 kernels, never the Hopper ones).
#include <gtest/gtest.h>

#include <cstdio>
#include <string_view>

#include "kernels/attention/dispatch.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (!arg.starts_with("--attention=")) {
      std::fprintf(stderr, "unknown argument %s (GoogleTest's flags, or --attention=CHOICE)\n", argv[i]);
      return 2;
    }
    const auto choice = lcx::ops::attention::parse_choice(arg.substr(12));
    if (!choice) {
      std::fprintf(stderr, "--attention: one of %s\n", lcx::ops::attention::kChoiceNames);
      return 2;
    }
    lcx::ops::attention::set_choice(*choice);
    std::printf("attention choice for this run: %s\n", lcx::ops::attention::name(*choice));
  }
  return RUN_ALL_TESTS();
}
