#include <gtest/gtest.h>

#include "config/core_config.h"
#include "config/manifest.h"
#include "config/reference.h"
#include "lcx/error.h"
#include "support/test_util.h"

namespace lcx {
namespace {

const char* kManifest = R"([train]
lr = 1e-4
max_steps = 10
schedule = "cosine"

[my_plugin]
rows = 64
name = "x"
flags = ["a", "b"]
[my_plugin.inner]
depth = 3
)";

TEST(ConfigView, ReadsTypedValuesAndDefaults) {
  Manifest m = Manifest::parse(kManifest, "m.toml");
  ConfigView v = m.section("my_plugin");
  EXPECT_EQ(v.get_int("rows", 1), 64);
  EXPECT_EQ(v.get_int("absent", 7), 7);
  EXPECT_EQ(v.get_string("name", ""), "x");
  EXPECT_EQ(v.get_strings("flags", {}), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(v.table("inner").get_int("depth", 0), 3);
  EXPECT_EQ(v.where("rows"), "m.toml:7");
  EXPECT_NO_THROW(v.check_unknown());
}

TEST(ConfigView, WrongTypeNamesFileLineKeyAndTypes) {
  Manifest m = Manifest::parse(kManifest, "m.toml");
  ConfigView v = m.section("my_plugin");
  try {
    v.get_int("name", 0);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "m.toml:8: my_plugin.name: expected integer, found string");
    EXPECT_EQ(e.key(), "my_plugin.name");
  }
  EXPECT_THROW(v.get_bool("rows", false), Error);
  EXPECT_DOUBLE_EQ(m.section("train").get_double("max_steps", 0), 10.0);  // integers read as floats
}

TEST(ConfigView, UnknownKeyListsTheValidOnes) {
  Manifest m = Manifest::parse(kManifest, "m.toml");
  ConfigView v = m.section("my_plugin");
  v.get_int("rows", 0);
  v.get_string("nmae", "");
  try {
    v.check_unknown();
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "my_plugin.flags");
    EXPECT_NE(e.fix().find("valid keys: nmae, rows"), std::string::npos) << e.fix();
  }
}

TEST(Manifest, SetOverridesAndTypeChecks) {
  Manifest m = Manifest::parse(kManifest, "m.toml");
  m.set("train.lr=3");  // an integer where a float was: accepted as float
  EXPECT_DOUBLE_EQ(m.section("train").get_double("lr", 0), 3.0);
  m.set("train.schedule=linear");  // bare word -> string
  EXPECT_EQ(m.section("train").get_string("schedule", ""), "linear");
  m.set("new_section.key=[1, 2]");
  EXPECT_TRUE(m.section("new_section").has("key"));
  // A fraction over a whole number is the key's reader's to judge (lora.alpha = 16 in the
  // file takes --set lora.alpha=2.5); one read as an integer is refused by its name.
  Manifest fraction = Manifest::parse(kManifest, "m.toml");
  fraction.set("train.max_steps=1.5");
  const test::Thrown t = test::thrown_by([&] { fraction.section("train").get_int("max_steps", 0); });
  EXPECT_TRUE(t.thrown);
  EXPECT_EQ(t.key, "train.max_steps");
  EXPECT_THROW(m.set("train.max_steps"), Error);
  EXPECT_THROW(m.set("lr=1"), Error);
  // A value from --set is named by its override, whether the file had the key or not.
  EXPECT_EQ(m.section("train").where("schedule"), "--set train.schedule=linear");
  m.set("train.warmup_steps=-3");
  EXPECT_EQ(m.section("train").where("warmup_steps"), "--set train.warmup_steps=-3");
  try {
    read_core_config(m, {"new_section", "my_plugin"});
    ADD_FAILURE() << "warmup_steps = -3 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "--set train.warmup_steps=-3: train.warmup_steps: -3 is out of range: must be >= 0");
    EXPECT_EQ(e.key(), "train.warmup_steps");
  }
}

TEST(CoreConfig, ValidatesSectionsAndUnknownTables) {
  Manifest m = Manifest::parse("[train]\nlr = 0.1\nschedule = \"cosine\"\n[run]\ndevice = \"cpu\"\n", "c.toml");
  CoreConfig c = read_core_config(m, {});
  EXPECT_DOUBLE_EQ(c.train.lr, 0.1);
  EXPECT_EQ(c.train.schedule, "cosine");
  EXPECT_EQ(c.run.device, "cpu");
  Manifest bad = Manifest::parse("[train]\nschedule = \"exp\"\n", "c.toml");
  EXPECT_THROW(read_core_config(bad, {}), Error);
  Manifest plugin_table = Manifest::parse("[offload]\nprefetch = 2\n", "c.toml");
  EXPECT_THROW(read_core_config(plugin_table, {}), Error);
  EXPECT_NO_THROW(read_core_config(plugin_table, {"offload"}));
}

// train.checkpoint_every: "auto" (0: the plan's choice, also when absent) or a count >= 1; anything
// else is refused by key with the fix.
TEST(CoreConfig, CheckpointEveryIsAutoOrACount) {
  EXPECT_EQ(read_core_config(Manifest::parse("[train]\nlr = 0.1\n", "c.toml"), {}).train.checkpoint_every, 0);
  EXPECT_EQ(read_core_config(Manifest::parse("[train]\ncheckpoint_every = \"auto\"\n", "c.toml"), {}).train.checkpoint_every, 0);
  EXPECT_EQ(read_core_config(Manifest::parse("[train]\ncheckpoint_every = 3\n", "c.toml"), {}).train.checkpoint_every, 3);
  for (const char* bad : {"0", "-2", "\"every\""}) {
    try {
      read_core_config(Manifest::parse(str("[train]\ncheckpoint_every = ", bad, "\n"), "c.toml"), {});
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.key(), "train.checkpoint_every") << bad;
      EXPECT_NE(e.fix().find("\"auto\""), std::string::npos) << bad << ": " << e.fix();
    }
  }
}

// [distributed] order places cp and sp on the ranks: sp_inner unless set, carried into the mesh
// the plugins are created for; any other value is refused by key, the fix naming both.
TEST(CoreConfig, DistributedOrderIsSpInnerOrCpInner) {
  EXPECT_EQ(read_core_config(Manifest::parse("[distributed]\ncp = 2\n", "c.toml"), {}).distributed.order,
            MeshOrder::sp_inner);
  const CoreConfig c = read_core_config(Manifest::parse("[distributed]\ncp = 2\nsp = 4\norder = \"cp_inner\"\n", "c.toml"), {});
  EXPECT_EQ(c.distributed.order, MeshOrder::cp_inner);
  EXPECT_EQ(configured_mesh(c.distributed).order, MeshOrder::cp_inner);
  try {
    read_core_config(Manifest::parse("[distributed]\norder = \"ring_inner\"\n", "c.toml"), {});
    ADD_FAILURE() << "order = ring_inner was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "distributed.order");
    EXPECT_NE(std::string(e.what()).find("'ring_inner' is not allowed"), std::string::npos) << e.what();
    EXPECT_NE(e.fix().find("sp_inner, cp_inner"), std::string::npos) << e.fix();
  }
}

const KeyRecord* find_key(const std::vector<KeyRecord>& keys, const std::string& table, const std::string& key) {
  for (const KeyRecord& k : keys)
    if (k.table == table && k.key == key) return &k;
  return nullptr;
}

// describe() gives a key its line; the getter its type, default and value; the reference refuses a
// key read without its line, naming it.
TEST(ConfigView, DescribeGivesTheKeyItsLineBesideTypeAndDefault) {
  Manifest m = Manifest::parse(kManifest, "m.toml");
  ConfigView v = m.section("my_plugin");
  v.describe("rows", "rows at once", ">= 1").get_int("rows", 1);
  v.describe("mode", "how fast", {}, "the model's").get_string("mode", "fast");
  v.get_double("absent", 0.5);
  const auto keys = m.keys();
  const KeyRecord* rows = find_key(keys, "my_plugin", "rows");
  ASSERT_NE(rows, nullptr);
  EXPECT_EQ(rows->type, "integer");
  EXPECT_EQ(rows->default_value, "1");
  EXPECT_EQ(rows->values, ">= 1");
  EXPECT_EQ(rows->meaning, "rows at once");
  EXPECT_EQ(rows->value, "64");
  EXPECT_TRUE(rows->set);
  const KeyRecord* mode = find_key(keys, "my_plugin", "mode");
  ASSERT_NE(mode, nullptr);
  EXPECT_TRUE(mode->default_is_text);  // words, not a TOML value
  EXPECT_FALSE(mode->set);
  try {
    require_described(reference_tables(m));
    ADD_FAILURE() << "a key without its line passed";
  } catch (const Error& e) {
    EXPECT_EQ(e.key(), "my_plugin.absent");
    EXPECT_EQ(e.fix(), "describe it beside its read: config.describe(\"absent\", \"what it means\")");
  }
  v.describe("absent", "a key the manifest leaves out");
  EXPECT_NO_THROW(require_described(reference_tables(m)));
  // The resolved config: set keys with their value, the others with their default, marked.
  const std::string resolved = format_resolved(m, false);
  EXPECT_NE(resolved.find("[my_plugin]\nrows = 64\n"), std::string::npos) << resolved;
  EXPECT_NE(resolved.find("absent = 0.5  # default"), std::string::npos) << resolved;
  EXPECT_NE(resolved.find("# mode: the model's (default)"), std::string::npos) << resolved;
  EXPECT_EQ(format_resolved(m, true).find("absent"), std::string::npos);
}

// Every key of core's sections has its line, type and default; the reference lists the six.
TEST(CoreConfig, EveryCoreKeyIsDescribed) {
  Manifest m = Manifest::parse("", "empty.toml");
  read_core_config(m, {});
  const auto tables = reference_tables(m);
  EXPECT_NO_THROW(require_described(tables));
  ASSERT_EQ(tables.size(), core_section_names().size());
  size_t n = 0;
  for (const ReferenceTable& t : tables)
    for (const KeyRecord& k : t.keys) {
      EXPECT_FALSE(k.type.empty()) << t.name << "." << k.key;
      EXPECT_FALSE(k.default_value.empty()) << t.name << "." << k.key;
      ++n;
    }
  EXPECT_GE(n, 50u);
  const auto keys = m.keys();
  const KeyRecord* lr = find_key(keys, "train", "lr");
  ASSERT_NE(lr, nullptr);
  EXPECT_EQ(lr->default_value, "2e-05");
  EXPECT_EQ(lr->values, ">= 0 and finite");
  const KeyRecord* schedule = find_key(keys, "train", "schedule");
  ASSERT_NE(schedule, nullptr);
  EXPECT_EQ(schedule->values, "constant, linear, cosine");
}

TEST(Manifest, SyntaxErrorNamesLine) {
  try {
    Manifest::parse("[a]\nx = 1\ny = \n", "bad.toml");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("bad.toml:3", 0), 0u) << e.what();
  }
}

}  // namespace
}  // namespace lcx
