// The C boundary between core and a plugin library. The loader reads this plain struct before
// it imports any C++ symbol, so a library built against another SDK is refused by its numbers,
// not by a crash inside a mismatched vtable.
#pragma once
#include <stdint.h>

// Major: any change to a slot interface, Tensor layout or factory signature. Minor: additions
// that older plugins can ignore. A plugin loads when majors match and its minor <= core's.
#define LCX_ABI_MAJOR 1
#define LCX_ABI_MINOR 1  // 1: the MLP slot
#define LCX_PLUGIN_MAGIC 0x4C43585055474E31ull  // "LCXPUGN1"

#define LCX_STRINGIFY_(x) #x
#define LCX_STRINGIFY(x) LCX_STRINGIFY_(x)

#if defined(__clang__)
#define LCX_COMPILER_ID "clang " __clang_version__
#elif defined(__GNUC__)
#define LCX_COMPILER_ID "gcc " LCX_STRINGIFY(__GNUC__) "." LCX_STRINGIFY(__GNUC_MINOR__)
#else
#define LCX_COMPILER_ID "unknown"
#endif

// Identifies the SDK headers a plugin was compiled with; core logs it beside the file hash.
#define LCX_SDK_BUILD_ID "lcx-sdk-" LCX_STRINGIFY(LCX_ABI_MAJOR) "." LCX_STRINGIFY(LCX_ABI_MINOR)

#ifdef __cplusplus
extern "C" {
#endif

enum lcx_slot {
  LCX_SLOT_LOSS = 1,
  LCX_SLOT_POSITIONAL_ENCODING = 2,
  LCX_SLOT_MEMORY_STRATEGY = 3,
  LCX_SLOT_PARALLELISM = 4,
  LCX_SLOT_MODEL = 5,
  LCX_SLOT_MLP = 6,
};

struct lcx_plugin_description {
  uint64_t magic;         // LCX_PLUGIN_MAGIC
  uint32_t abi_major;     // LCX_ABI_MAJOR the plugin was built with
  uint32_t abi_minor;
  uint32_t slot;          // enum lcx_slot
  const char* name;       // the name a manifest uses
  const char* version;    // the plugin's own version
  const char* compiler;   // LCX_COMPILER_ID
  const char* sdk_build;  // LCX_SDK_BUILD_ID
  const char* summary;    // one line for --list-plugins
  // "ready", or "delegates to <default>" while the plugin forwards to the slot's default.
  const char* status;
};

#ifdef __cplusplus
}
#endif

// The exported symbol names; the loader looks these up by string.
#define LCX_DESCRIPTION_SYMBOL "lcx_plugin_description"
#define LCX_FACTORY_SYMBOL "lcx_plugin_factory"
