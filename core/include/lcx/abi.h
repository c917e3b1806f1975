// The C boundary between core and a plugin library. The loader reads this plain struct before
// it imports any C++ symbol, so a library built against another SDK is refused by its numbers,
// not by a crash inside a mismatched vtable.
#pragma once
#include <stdint.h>

// Major: any change to a slot interface, Tensor layout or factory signature. Minor: additions
// that older plugins can ignore. A plugin loads when majors match and its minor <= core's.
#define LCX_ABI_MAJOR 13
#define LCX_ABI_MINOR 0
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

// The slots, one row each: X(ID, number, C++ interface, member, slot name, core's default provider's
// name, its factory). The number is LCX_SLOT_<ID>, fixed by the ABI (never reuse one); the member
// holds the provider in core's slot sets (lcx/slots.h); the slot name is what --list-plugins and
// errors print; the default is what runs when no plugin provides the slot (lcx/defaults.h; the
// model has none). Rows are in planning order: the model plans first (lcx/plan.h). Every list of
// slots in core expands this table, so a new slot is one row here plus its interface header.
#define LCX_SLOTS(X)                                                                                   \
  X(MODEL, 5, Model, model, "model", LCX_NO_DEFAULT, LCX_NO_DEFAULT)                                 \
  X(ADAPTER, 8, Adapter, adapter, "adapter", "none", make_no_adapter)                                 \
  X(MLP, 6, MlpStrategy, mlp, "mlp", "whole", make_whole_mlp)                                         \
  X(LOSS, 1, Loss, loss, "loss", "nll", make_full_logits_loss)                                        \
  X(POSITIONAL_ENCODING, 2, PositionalEncoding, positional, "positional_encoding", "rope", make_default_rope) \
  X(MEMORY_STRATEGY, 3, MemoryStrategy, memory, "memory_strategy", "on_device", make_on_device_memory) \
  X(PARALLELISM, 4, Parallelism, parallel, "parallelism", "single", make_single_rank)                \
  X(OPTIMIZER, 7, Optimizer, optimizer, "optimizer", "adamw", make_adamw_optimizer)
#define LCX_NO_DEFAULT nullptr  // expanded by C++ only (lcx/slots.h)

#define LCX_SLOT_ENUM_(ID, NUMBER, TYPE, MEMBER, NAME, DEFAULT_NAME, DEFAULT_FACTORY) LCX_SLOT_##ID = NUMBER,
enum lcx_slot { LCX_SLOTS(LCX_SLOT_ENUM_) };
#undef LCX_SLOT_ENUM_

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
