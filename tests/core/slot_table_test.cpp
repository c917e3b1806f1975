// The slot table (LCX_SLOTS, lcx/abi.h): every list of slots in core is made from it, so these
// check the table itself and what follows from it: ids, names, defaults, the resolver's set.
#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <set>
#include <string>

#include "config/manifest.h"
#include "lcx/slots.h"
#include "loader/plugin_loader.h"
#include "slots/resolve.h"

namespace lcx {
namespace {

TEST(SlotTable, RowsHaveDistinctIdsNamesAndTheirDefaults) {
  std::set<uint32_t> ids;
  std::set<std::string> names;
  std::vector<uint32_t> order;
  for_each_slot([&]<class T>(const SlotRow<T>& row) {
    order.push_back(row.id);
    EXPECT_TRUE(ids.insert(row.id).second) << row.name;
    EXPECT_TRUE(names.insert(row.name).second) << row.name;
    EXPECT_STREQ(slot_name(row.id), row.name);
    EXPECT_STREQ(default_provider_name(row.id), row.default_name ? row.default_name : "(none)");
    EXPECT_EQ(row.default_name == nullptr, row.make_default == nullptr) << row.name;
    if (row.make_default) {
      std::unique_ptr<T> made = row.make_default();
      EXPECT_NE(dynamic_cast<T*>(made.get()), nullptr) << row.name;
    }
  });
  EXPECT_EQ(order.size(), 8u);
  EXPECT_EQ(order.front(), static_cast<uint32_t>(LCX_SLOT_MODEL));  // the model plans first
  EXPECT_STREQ(slot_name(0), "unknown");
}

TEST(SlotTable, ResolvingAnEmptyManifestGivesEveryDefault) {
  const Manifest m = Manifest::parse("", "empty manifest");
  const PluginLoader loader(std::vector<std::string>{});
  const SlotSet s = resolve_slots(m, loader, {}, Device::cpu());
  for_each_slot([&]<class T>(const SlotRow<T>& row) {
    EXPECT_EQ(s.get<T>() != nullptr, row.make_default != nullptr) << row.name;
    if (row.default_name) {
      EXPECT_EQ(s.providers.at(row.id).name, row.default_name);
    }
  });
  EXPECT_EQ(s.providers.count(LCX_SLOT_MODEL), 0u);
}

// The slot contracts sit together in lcx/slots/, one header per interface named after it
// (MlpStrategy in mlp_strategy.h), and nothing else sits there: a new slot's header goes beside them.
TEST(SlotTable, EveryInterfaceHasItsHeaderInTheSlotsFolder) {
#define LCX_TYPE_NAME_(ID, NUMBER, TYPE, ...) #TYPE,
  const std::vector<std::string> types = {LCX_SLOTS(LCX_TYPE_NAME_)};
#undef LCX_TYPE_NAME_
  std::set<std::string> want, have;
  for (const std::string& type : types) {
    std::string file;
    for (char c : type) {
      if (std::isupper(static_cast<unsigned char>(c)) && !file.empty()) file += '_';
      file += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    want.insert(file + ".h");
  }
  const std::filesystem::path folder = std::filesystem::path(LCX_SOURCE_DIR) / "core/include/lcx/slots";
  for (const auto& e : std::filesystem::directory_iterator(folder))
    have.insert(e.path().filename().string());
  EXPECT_EQ(have, want);
  EXPECT_EQ(want.size(), 8u);
}

}  // namespace
}  // namespace lcx
