// The slot table (LCX_SLOTS in lcx/abi.h) as C++: each slot's interface, name and default, and
// SlotTuple, one holder per slot, from which core's slot sets are made (resolve, the plan, the
// step). Code that treats every slot alike visits the table with for_each_slot instead of naming
// the slots, so a slot added to the table reaches it without an edit.
#pragma once
#include <memory>
#include <type_traits>

#include "lcx/abi.h"
#include "lcx/defaults.h"
#include "lcx/slots/adapter.h"
#include "lcx/slots/loss.h"
#include "lcx/slots/memory_strategy.h"
#include "lcx/slots/mlp_strategy.h"
#include "lcx/slots/model.h"
#include "lcx/slots/optimizer.h"
#include "lcx/slots/parallelism.h"
#include "lcx/slots/positional_encoding.h"

namespace lcx {

// One row of the table, for the interface T.
template <class T>
struct SlotRow {
  uint32_t id;                // LCX_SLOT_<ID>
  const char* name;           // "loss", "positional_encoding", ...
  const char* default_name;   // core's default provider ("nll", ...), null for the model
  std::unique_ptr<T> (*make_default)();  // null for the model
};

// Calls f(SlotRow<T>) for every slot, in the table's (planning) order.
template <class F>
void for_each_slot(F&& f) {
#define LCX_SLOT_VISIT_(ID, NUMBER, TYPE, MEMBER, NAME, DEFAULT_NAME, DEFAULT_FACTORY) \
  f(SlotRow<TYPE>{LCX_SLOT_##ID, NAME, DEFAULT_NAME, DEFAULT_FACTORY});
  LCX_SLOTS(LCX_SLOT_VISIT_)
#undef LCX_SLOT_VISIT_
}

// One holder per slot, named as the table's member column: SlotTuple<std::shared_ptr> owns the
// providers, SlotTuple<SlotPtr> points at them. get<T>() is the holder of interface T.
template <class T>
using SlotPtr = T*;
template <class T>
using ConstSlotPtr = const T*;

template <template <class> class Hold>
struct SlotTuple {
#define LCX_SLOT_MEMBER_(ID, NUMBER, TYPE, MEMBER, NAME, DEFAULT_NAME, DEFAULT_FACTORY) Hold<TYPE> MEMBER{};
  LCX_SLOTS(LCX_SLOT_MEMBER_)
#undef LCX_SLOT_MEMBER_

  template <class T>
  Hold<T>& get() {
#define LCX_SLOT_GET_(ID, NUMBER, TYPE, MEMBER, NAME, DEFAULT_NAME, DEFAULT_FACTORY) \
  if constexpr (std::is_same_v<T, TYPE>) return MEMBER; else
    LCX_SLOTS(LCX_SLOT_GET_)
#undef LCX_SLOT_GET_
    static_assert(sizeof(T) == 0, "not a slot interface (LCX_SLOTS, lcx/abi.h)");
  }
  template <class T>
  const Hold<T>& get() const {
    return const_cast<SlotTuple*>(this)->template get<T>();
  }
};

}  // namespace lcx
