#include <dlfcn.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include "config/manifest.h"
#include "lcx/slots/loss.h"
#include "loader/plugin_loader.h"
#include "slots/resolve.h"
#include "support/test_util.h"

namespace lcx {
namespace {

using test::error_of;

const std::string kFixtures = LCX_FIXTURE_PLUGIN_DIR;

PluginLoader loader_with_fixtures() { return PluginLoader({test::build_plugin_dir(), kFixtures}); }

TEST(PluginLoader, DescribesTheFiveProjectPlugins) {
  PluginLoader loader({test::build_plugin_dir()});
  auto infos = loader.discover();
  std::map<std::string, uint32_t> slots;
  for (const auto& i : infos) slots[i.name] = i.slot;
  EXPECT_EQ(slots.at("loss_chunked"), static_cast<uint32_t>(LCX_SLOT_LOSS));
  EXPECT_EQ(slots.at("rope_yarn"), static_cast<uint32_t>(LCX_SLOT_POSITIONAL_ENCODING));
  EXPECT_EQ(slots.at("offload"), static_cast<uint32_t>(LCX_SLOT_MEMORY_STRATEGY));
  EXPECT_EQ(slots.at("cp_ring"), static_cast<uint32_t>(LCX_SLOT_PARALLELISM));
  EXPECT_EQ(slots.at("sp_ulysses"), static_cast<uint32_t>(LCX_SLOT_PARALLELISM));
  PluginInfo info = loader.describe("loss_chunked");
  EXPECT_EQ(info.abi_major, static_cast<uint32_t>(LCX_ABI_MAJOR));
  EXPECT_EQ(info.sha256.size(), 64u);
  EXPECT_FALSE(info.version.empty());
}

TEST(PluginLoader, RefusesMissingLibraryWithItsPath) {
  auto msg = error_of([] { loader_with_fixtures().describe("/nowhere/lcx_gone.so"); });
  EXPECT_NE(msg.find("plugin library missing"), std::string::npos) << msg;
  EXPECT_NE(msg.find("/nowhere/lcx_gone.so"), std::string::npos) << msg;
}

TEST(PluginLoader, UnknownNameListsSearchedPathsAndSuggests) {
  auto msg = error_of([] { loader_with_fixtures().describe("loss_chunkd"); });
  EXPECT_NE(msg.find("unknown plugin 'loss_chunkd'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("did you mean 'loss_chunked'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(kFixtures + "/lcx_loss_chunkd.so"), std::string::npos) << msg;
}

TEST(PluginLoader, RefusesALibraryThatIsNotAPlugin) {
  auto msg = error_of([] { loader_with_fixtures().describe(kFixtures + "/lcx_not_lcx.so"); });
  EXPECT_NE(msg.find("is not an lcx plugin"), std::string::npos) << msg;
}

TEST(PluginLoader, RefusesAFileThatIsNotALibrary) {
  auto dir = test::temp_dir("notlib");
  test::write_file(dir / "lcx_text.so", "just text");
  auto msg = error_of([&] { loader_with_fixtures().describe((dir / "lcx_text.so").string()); });
  EXPECT_NE(msg.find("is not a shared library (no ELF header in its 9 bytes)"), std::string::npos) << msg;
}

// A library cut short (an interrupted copy) maps pages past its end, and dlopen
// touching them is a bus error; its headers are checked against its size first, in a listing, a
// dry run and a run alike.
TEST(PluginLoader, RefusesALibraryCutShortBeforeOpeningIt) {
  namespace fs = std::filesystem;
  const auto dir = test::temp_dir("cut");
  const fs::path whole = fs::path(test::build_plugin_dir()) / "lcx_loss_chunked.so";
  const fs::path lib = dir / "lcx_loss_chunked.so";
  fs::copy_file(whole, lib);
  fs::resize_file(lib, fs::file_size(whole) / 2);
  fs::permissions(dir, fs::perms::group_write | fs::perms::others_write, fs::perm_options::remove);
  PluginLoader loader({dir.string()});
  test::Thrown e = test::thrown_by([&] { loader.describe("loss_chunked"); });
  ASSERT_TRUE(e.thrown);
  EXPECT_NE(e.message.find("plugin library '" + lib.string() + "' is cut short: it has " +
                           std::to_string(fs::file_size(lib)) + " bytes"),
            std::string::npos)
      << e.message;
  EXPECT_EQ(e.fix, "rebuild or reinstall the plugin, or remove the file from the plugin folder");
  std::vector<std::string> problems;
  EXPECT_TRUE(loader.discover(&problems).empty());
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("is cut short"), std::string::npos) << problems[0];

  auto list = test::run_command("LCX_PLUGIN_PATH=" + dir.string() + " " + test::lcx_train() + " --list-plugins");
  EXPECT_EQ(list.exit_code, 0) << list.output;
  EXPECT_NE(list.output.find("is cut short"), std::string::npos) << list.output;
}

TEST(PluginLoader, RefusesAPluginSomeoneElseCouldReplace) {
  // A copy made under umask 022 loads, as the build's own plugins do.
  namespace fs = std::filesystem;
  const auto dir = test::temp_dir("trust");
  const fs::path lib = dir / "lcx_loss_chunked.so";
  fs::copy_file(fs::path(test::build_plugin_dir()) / "lcx_loss_chunked.so", lib);
  fs::permissions(lib, fs::perms::group_write | fs::perms::others_write, fs::perm_options::remove);
  fs::permissions(dir, fs::perms::group_write | fs::perms::others_write, fs::perm_options::remove);
  PluginLoader loader({dir.string()});
  EXPECT_EQ(loader.describe("loss_chunked").name, "loss_chunked");

  fs::permissions(lib, fs::perms::group_write, fs::perm_options::add);
  test::Thrown e = test::thrown_by([&] { loader.describe("loss_chunked"); });
  EXPECT_EQ(e.fix, "chmod go-w " + lib.string());
  EXPECT_NE(e.message.find("plugin library '" + lib.string() + "' is writable by its group"), std::string::npos)
      << e.message;
  // Listing the folder skips it with the same reason instead of running its code.
  std::vector<std::string> problems;
  EXPECT_TRUE(loader.discover(&problems).empty());
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_NE(problems[0].find("is writable by its group"), std::string::npos) << problems[0];
  fs::permissions(lib, fs::perms::group_write, fs::perm_options::remove);

  fs::permissions(dir, fs::perms::others_write, fs::perm_options::add);
  e = test::thrown_by([&] { loader.describe("loss_chunked"); });
  EXPECT_EQ(e.fix, "chmod go-w " + dir.string());
  EXPECT_NE(e.message.find("the folder of plugin 'lcx_loss_chunked.so', " + dir.string() + " is writable by others"),
            std::string::npos)
      << e.message;
  fs::permissions(dir, fs::perms::others_write, fs::perm_options::remove);

  if (::geteuid() != 0) {
    std::printf("[  NOTE    ] not root: the check of another owner is not exercised\n");
    return;
  }
  ASSERT_EQ(::chown(lib.c_str(), 4242, static_cast<gid_t>(-1)), 0);
  e = test::thrown_by([&] { loader.describe("loss_chunked"); });
  EXPECT_EQ(e.fix.rfind(str("chown ", ::geteuid(), " ", lib.string()), 0), 0u) << e.fix;
  EXPECT_NE(e.message.find("is owned by user 4242, not by this user"), std::string::npos) << e.message;
}

// A plugin given by path in a shared folder such as /tmp (sticky, writable by all) is
// refused with a fix that moves it, never one that would chmod the shared folder.
TEST(PluginLoader, APluginInASharedFolderIsToldToMove) {
  namespace fs = std::filesystem;
  const auto dir = test::temp_dir("shared");
  const fs::path lib = dir / "lcx_loss_chunked.so";
  fs::copy_file(fs::path(test::build_plugin_dir()) / "lcx_loss_chunked.so", lib);
  fs::permissions(lib, fs::perms::group_write | fs::perms::others_write, fs::perm_options::remove);
  fs::permissions(dir, fs::perms::all | fs::perms::sticky_bit, fs::perm_options::replace);
  PluginLoader loader({test::build_plugin_dir()});
  const test::Thrown e = test::thrown_by([&] { loader.describe(lib.string()); });
  fs::permissions(dir, fs::perms::owner_all, fs::perm_options::replace);
  ASSERT_TRUE(e.thrown);
  EXPECT_NE(e.message.find(dir.string() + " is a shared folder anyone may write"), std::string::npos) << e.message;
  EXPECT_EQ(e.fix.find("chmod"), std::string::npos) << e.fix;
  EXPECT_NE(e.fix.find("mv " + lib.string() + " ~/.local/lib/lcx/plugins/"), std::string::npos) << e.fix;
}

TEST(PluginLoader, RefusesAnotherAbiMajorNamingBothVersions) {
  auto msg = error_of([] { loader_with_fixtures().describe("other_abi"); });
  EXPECT_NE(msg.find(str("ABI ", LCX_ABI_MAJOR + 1, ".0")), std::string::npos) << msg;
  EXPECT_NE(msg.find(str("this lcx has ABI ", LCX_ABI_MAJOR, ".", LCX_ABI_MINOR)), std::string::npos) << msg;
  // create() must refuse too, before importing a factory (the fixture has none).
  const test::Thrown created =
      test::thrown_by([] { loader_with_fixtures().create("other_abi", PluginArgs{"other_abi", {}, {}}); });
  EXPECT_EQ(created.fix, "rebuild the plugin against this lcx's SDK headers");
}

TEST(PluginLoader, RefusesTwoProvidersForOneSlot) {
  Manifest m = Manifest::parse("[plugins]\nload = [\"loss_chunked\", \"second_loss\"]\n", "two.toml");
  const test::Thrown e = test::thrown_by([&] { plan_slots(m, loader_with_fixtures(), {}); });
  EXPECT_EQ(e.key, "plugins.load");
  EXPECT_EQ(e.fix, "keep one in [plugins] load, or --disable second_loss");
  EXPECT_NE(e.message.find("two providers for slot loss"), std::string::npos) << e.message;
  // Disabling one of them resolves it.
  auto providers = plan_slots(m, loader_with_fixtures(), {"second_loss"});
  EXPECT_EQ(providers.at(LCX_SLOT_LOSS).name, "loss_chunked");
}

// Two parallelism providers stack when exactly one stacks over the other (sp_ulysses over
// cp_ring, whichever order [plugins] load names them); otherwise, or with a third, they are refused.
TEST(PluginLoader, StacksTwoParallelismProvidersOnlyWhenOneStacksOverTheOther) {
  for (const char* load : {"\"cp_ring\", \"sp_ulysses\"", "\"sp_ulysses\", \"cp_ring\""}) {
    Manifest m = Manifest::parse(str("[plugins]\nload = [", load, "]\n"), "2d.toml");
    SlotSet s = resolve_slots(m, loader_with_fixtures(), {}, Device::cpu(), MeshShape{1, 2, 4});
    const SlotProvider& par = s.providers.at(LCX_SLOT_PARALLELISM);
    EXPECT_EQ(par.name, "sp_ulysses") << load;
    ASSERT_EQ(par.beneath.size(), 1u) << load;
    EXPECT_EQ(par.beneath[0].name, "cp_ring") << load;
    ASSERT_NE(s.parallel_inner, nullptr);
    EXPECT_EQ(s.parallel_inner->mesh_axis(), "cp");
    EXPECT_EQ(s.parallel->size(), 8) << load;
  }
  Manifest neither = Manifest::parse("[plugins]\nload = [\"sp_ulysses\", \"second_parallelism\"]\n", "n.toml");
  test::Thrown e =
      test::thrown_by([&] { resolve_slots(neither, loader_with_fixtures(), {}, Device::cpu(), MeshShape{1, 1, 2}); });
  EXPECT_EQ(e.key, "plugins.load");
  EXPECT_NE(e.fix.find("--disable second_parallelism"), std::string::npos) << e.fix;
  EXPECT_NE(e.message.find("'sp_ulysses'"), std::string::npos) << e.message;
  EXPECT_NE(e.message.find("axis none): neither stacks over the other"), std::string::npos) << e.message;
  Manifest three =
      Manifest::parse("[plugins]\nload = [\"cp_ring\", \"sp_ulysses\", \"second_parallelism\"]\n", "3.toml");
  e = test::thrown_by([&] { plan_slots(three, loader_with_fixtures(), {}); });
  EXPECT_EQ(e.key, "plugins.load");
  EXPECT_NE(e.message.find("two providers for slot parallelism: 'cp_ring'"), std::string::npos) << e.message;
}

TEST(PluginLoader, RejectsUnknownKeyNamingValidOnes) {
  Manifest m = Manifest::parse("[plugins]\nload = [\"loss_chunked\"]\n[loss_chunked]\nchunk_row = 64\n", "k.toml");
  const test::Thrown e = test::thrown_by([&] { resolve_slots(m, loader_with_fixtures(), {}, Device::cpu()); });
  EXPECT_EQ(e.key, "loss_chunked.chunk_row");
  EXPECT_EQ(e.fix.rfind("did you mean 'chunk_rows'? valid keys: ", 0), 0u) << e.fix;
  EXPECT_NE(e.message.find("k.toml:4: "), std::string::npos) << e.message;  // where the key stands
}

TEST(PluginLoader, RejectsWrongTypeWithFileAndLine) {
  Manifest m = Manifest::parse("[plugins]\nload = [\"loss_chunked\"]\n\n[loss_chunked]\nchunk_rows = true\n", "t.toml");
  const test::Thrown e = test::thrown_by([&] { resolve_slots(m, loader_with_fixtures(), {}, Device::cpu()); });
  EXPECT_EQ(e.key, "loss_chunked.chunk_rows");
  EXPECT_NE(e.message.find("t.toml:5: loss_chunked.chunk_rows: expected integer, found boolean"), std::string::npos)
      << e.message;
}

TEST(PluginLoader, ThirdPartyProviderFillsASlotWithoutCoreChanges) {
  Manifest m = Manifest::parse("[plugins]\nload = [\"third_party_loss\"]\n[third_party_loss]\nweight = 2.0\n", "3p.toml");
  SlotSet s = resolve_slots(m, loader_with_fixtures(), {}, Device::cpu());
  EXPECT_EQ(s.providers.at(LCX_SLOT_LOSS).name, "third_party_loss");
  EXPECT_EQ(s.providers.at(LCX_SLOT_LOSS).info.version, "9.9.9");
  EXPECT_EQ(s.providers.at(LCX_SLOT_POSITIONAL_ENCODING).origin, "core default");
  ASSERT_NE(s.loss, nullptr);
}

TEST(PluginLoader, ObjectsKeepTheirLibraryLoaded) {
  std::string path = kFixtures + "/lcx_third_party_loss.so";
  ASSERT_EQ(dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD), nullptr) << "library loaded before the test";
  std::shared_ptr<Plugin> obj;
  {
    PluginLoader loader = loader_with_fixtures();
    obj = loader.create("third_party_loss", PluginArgs{"third_party_loss", {}, Device::cpu()});
  }
  // The loader is gone; the object still holds its library.
  void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  ASSERT_NE(h, nullptr);
  auto marker = reinterpret_cast<int (*)()>(dlsym(h, "third_party_marker"));
  ASSERT_NE(marker, nullptr);
  EXPECT_EQ(marker(), 42);
  dlclose(h);
  EXPECT_NE(dynamic_cast<Loss*>(obj.get()), nullptr);
  obj.reset();
  EXPECT_EQ(dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD), nullptr) << "library still loaded after its last object";
}

}  // namespace
}  // namespace lcx
