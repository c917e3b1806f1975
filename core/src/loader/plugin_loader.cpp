#include "loader/plugin_loader.h"

#include <algorithm>
#include <boost/dll/import.hpp>
#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <elf.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lcx/error.h"
#include "lcx/slots.h"
#include "util/sha256.h"
#include "util/text.h"

namespace fs = std::filesystem;

namespace lcx {

const char* slot_name(uint32_t slot) {
  const char* name = "unknown";
  for_each_slot([&](const auto& row) {
    if (row.id == slot) name = row.name;
  });
  return name;
}

namespace {

constexpr const char* kPrefix = "lcx_";
constexpr const char* kSuffix = ".so";

bool looks_like_path(const std::string& s) {
  return s.find('/') != std::string::npos || (s.size() > 3 && s.ends_with(kSuffix));
}

// A plugin runs with the trainer's rights, so whoever may replace its file or folder may run code
// as the trainer's user: refused as ssh and sudo refuse their files. The owner must be this user or
// root, and neither group nor others may write.
void check_trusted(const fs::path& p, const std::string& plugin) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return;  // a missing file is find()'s and open_library's to report
  const bool folder = S_ISDIR(st.st_mode);
  const std::string what = folder ? str("the folder of plugin '", plugin, "', ", p.string())
                                  : str("plugin library '", p.string(), "'");
  if (st.st_uid != ::geteuid() && st.st_uid != 0)
    throw Error(str(what, " is owned by user ", st.st_uid, ", not by this user (", ::geteuid(),
                    ") or root; a plugin runs with the trainer's rights"),
                {}, str("chown ", ::geteuid(), " ", p.string(), ", or use a plugin folder of your own"));
  // A shared folder such as /tmp (sticky, writable by all) is not made private by a chmod: the
  // plugin moves to a folder of its user's own.
  if (folder && (st.st_mode & S_IWOTH) && (st.st_mode & S_ISVTX))
    throw Error(str(what, " is a shared folder anyone may write; a plugin runs with the trainer's rights"), {},
                str("move the plugin into a folder only you can write (mkdir -p ~/.local/lib/lcx/plugins; mv ",
                    (p / plugin).string(), " ~/.local/lib/lcx/plugins/) and name it there, or load it by name from a "
                    "plugin folder (lcx-train --list-plugins names them)"));
  if (st.st_mode & (S_IWGRP | S_IWOTH))
    throw Error(str(what, " is writable by ", (st.st_mode & S_IWOTH) ? "others" : "its group",
                    "; a plugin runs with the trainer's rights"),
                {}, str("chmod go-w ", p.string()));
}

#if defined(__x86_64__)
constexpr uint16_t kMachine = EM_X86_64;
#elif defined(__aarch64__)
constexpr uint16_t kMachine = EM_AARCH64;
#endif

// dlopen maps a library's segments where its headers say they lie in the file: in a file cut
// short (an interrupted copy or link) they lie past its end, and the first touch of those pages
// is a bus error rather than an error dlopen returns. The headers are checked against the file's
// size before it is opened.
void check_elf(const std::string& path) {
  const std::string fix = "rebuild or reinstall the plugin, or remove the file from the plugin folder";
  std::error_code ec;
  const uintmax_t size = fs::file_size(path, ec);
  std::ifstream in(path, std::ios::binary);
  Elf64_Ehdr eh{};
  if (ec || !in.read(reinterpret_cast<char*>(&eh), sizeof eh) || std::memcmp(eh.e_ident, ELFMAG, SELFMAG) != 0)
    throw Error(str("plugin library '", path, "' is not a shared library (no ELF header",
                    ec ? ": " + ec.message() : str(" in its ", size, " bytes"), ")"),
                {}, fix);
  if (eh.e_ident[EI_CLASS] != ELFCLASS64 || eh.e_type != ET_DYN || eh.e_machine != kMachine)
    throw Error(str("plugin library '", path, "' is an ELF file, but not a 64-bit shared library for this machine"), {}, fix);
  auto cut_short = [&](const char* what, uint64_t end) {
    return Error(str("plugin library '", path, "' is cut short: it has ", size, " bytes, but its ", what, " reach byte ", end),
                 {}, fix);
  };
  const uint64_t ph_end = eh.e_phoff + uint64_t{eh.e_phnum} * sizeof(Elf64_Phdr);
  if (eh.e_phentsize != sizeof(Elf64_Phdr) || ph_end > size) throw cut_short("program headers", ph_end);
  const uint64_t sh_end = eh.e_shoff + uint64_t{eh.e_shnum} * eh.e_shentsize;
  if (eh.e_shoff != 0 && sh_end > size) throw cut_short("section headers", sh_end);
  std::vector<Elf64_Phdr> ph(eh.e_phnum);
  in.seekg(static_cast<std::streamoff>(eh.e_phoff));
  if (!in.read(reinterpret_cast<char*>(ph.data()), static_cast<std::streamsize>(ph.size() * sizeof(Elf64_Phdr))))
    throw cut_short("program headers", ph_end);
  for (const Elf64_Phdr& p : ph)
    if ((p.p_type == PT_LOAD || p.p_type == PT_DYNAMIC) && p.p_offset + p.p_filesz > size)
      throw cut_short("segments", p.p_offset + p.p_filesz);
}

std::shared_ptr<boost::dll::shared_library> open_library(const std::string& path) {
  std::error_code real_ec;
  const fs::path real = fs::canonical(path, real_ec);
  if (!real_ec) {
    check_trusted(real.parent_path(), real.filename().string());
    check_trusted(real, real.filename().string());
  }
  check_elf(path);
  boost::dll::fs::error_code ec;
  // RTLD_LOCAL keeps two plugins' internal symbols apart; lazy binding keeps start-up short.
  auto lib = std::make_shared<boost::dll::shared_library>();
  lib->load(path, boost::dll::load_mode::rtld_lazy | boost::dll::load_mode::rtld_local, ec);
  if (ec)
    throw Error(str("plugin library '", path, "' cannot be loaded: ", ec.message(),
                    " (is it a shared library built for this machine?)"));
  return lib;
}

PluginInfo read_description(const boost::dll::shared_library& lib, const std::string& path) {
  if (!lib.has(LCX_DESCRIPTION_SYMBOL))
    throw Error(str("'", path, "' is not an lcx plugin: it has no '", LCX_DESCRIPTION_SYMBOL, "' symbol"), {},
                "build it with the LCX_PLUGIN macro of <lcx/plugin.h>");
  const auto& d = lib.get<const lcx_plugin_description>(LCX_DESCRIPTION_SYMBOL);
  if (d.magic != LCX_PLUGIN_MAGIC)
    throw Error(str("'", path, "' is not an lcx plugin: its description has the wrong magic number"));
  PluginInfo info;
  info.abi_major = d.abi_major;
  info.abi_minor = d.abi_minor;
  info.path = path;
  info.name = d.name ? d.name : "";
  if (d.abi_major != LCX_ABI_MAJOR || d.abi_minor > LCX_ABI_MINOR)
    throw Error(str("plugin '", info.name, "' (", path, ") was built for lcx plugin ABI ", d.abi_major, ".",
                    d.abi_minor, ", but this lcx has ABI ", LCX_ABI_MAJOR, ".", LCX_ABI_MINOR),
                {}, "rebuild the plugin against this lcx's SDK headers");
  info.version = d.version ? d.version : "";
  info.summary = d.summary ? d.summary : "";
  info.status = d.status ? d.status : "";
  info.compiler = d.compiler ? d.compiler : "";
  info.sdk_build = d.sdk_build ? d.sdk_build : "";
  info.slot = d.slot;
  if (std::string(slot_name(d.slot)) == "unknown")
    throw Error(str("plugin '", info.name, "' (", path, ") names slot ", d.slot, ", which this lcx does not have"));
  return info;
}

// Keeps the library alive as long as the object: the deleter owns the library handle, and it
// destroys the object before letting go of the code that holds the object's destructor.
template <typename T>
std::shared_ptr<T> keep_loaded(std::unique_ptr<T> obj, std::shared_ptr<boost::dll::shared_library> lib) {
  return std::shared_ptr<T>(obj.release(), [lib](T* p) { delete p; });
}

// The library at `path`, opened, with its description read (before any C++ symbol is touched) and
// its file's hash.
struct Described {
  std::shared_ptr<boost::dll::shared_library> lib;
  PluginInfo info;
};
Described open_described(const std::string& path) {
  Described d{open_library(path), {}};
  d.info = read_description(*d.lib, path);
  d.info.sha256 = sha256_file(path);
  return d;
}

}  // namespace

PluginLoader::PluginLoader(std::vector<std::string> search_dirs) : dirs_(std::move(search_dirs)) {}

std::string PluginLoader::install_plugin_dir() {
  fs::path exe = boost::dll::program_location().string();
  return (exe.parent_path().parent_path() / "lib" / "lcx" / "plugins").string();
}

std::vector<std::string> PluginLoader::default_search_dirs(const std::string& manifest_dir_entry) {
  std::vector<std::string> dirs;
  if (!manifest_dir_entry.empty()) dirs.push_back(manifest_dir_entry);
  dirs.push_back(install_plugin_dir());
  if (const char* env = std::getenv("LCX_PLUGIN_PATH")) {
    std::stringstream ss(env);
    for (std::string d; std::getline(ss, d, ':');)
      if (!d.empty()) dirs.push_back(d);
  }
  return dirs;
}

std::string PluginLoader::find(const std::string& name_or_path) const {
  if (looks_like_path(name_or_path)) {
    if (!fs::exists(name_or_path))
      throw Error(str("plugin library missing: '", name_or_path, "' does not exist"), {},
                  "check the path, or name the plugin without a path to search the plugin folders");
    return name_or_path;
  }
  std::vector<std::string> tried;
  for (const auto& dir : dirs_) {
    fs::path p = fs::path(dir) / (kPrefix + name_or_path + kSuffix);
    tried.push_back(p.string());
    if (fs::exists(p)) return p.string();
  }
  // Suggestions come from file names: a typo must not run the code of every plugin in the folders.
  std::vector<std::string> known;
  for (const auto& dir : dirs_) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      const std::string f = e.path().filename().string();
      if (f.starts_with(kPrefix) && f.ends_with(kSuffix) && f.size() > 7)
        known.push_back(f.substr(4, f.size() - 7));
    }
  }
  std::sort(known.begin(), known.end());
  known.erase(std::unique(known.begin(), known.end()), known.end());
  std::string near = closest(name_or_path, known);
  throw Error(str("unknown plugin '", name_or_path, "'", near.empty() ? "" : str(": did you mean '", near, "'?"),
                  " Searched: ", join(tried, ", ")),
              {},
              str("known plugins: ", known.empty() ? std::string("(none found)") : join(known, ", "),
                  "; add a folder with [plugins] dir or LCX_PLUGIN_PATH"));
}

bool PluginLoader::installed(const std::string& name) const {
  std::error_code ec;
  for (const auto& dir : dirs_)
    if (fs::exists(fs::path(dir) / (kPrefix + name + kSuffix), ec)) return true;
  return false;
}

PluginInfo PluginLoader::describe(const std::string& name_or_path) const {
  return open_described(find(name_or_path)).info;
}

std::vector<PluginInfo> PluginLoader::discover(std::vector<std::string>* problems) const {
  std::map<std::string, PluginInfo> found;
  std::vector<std::string> order;
  for (const auto& dir : dirs_) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) continue;
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      std::string fname = e.path().filename().string();
      if (fname.starts_with(kPrefix) && fname.ends_with(kSuffix)) files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      try {
        PluginInfo info = open_described(f.string()).info;
        if (!found.count(info.name)) {
          order.push_back(info.name);
          found[info.name] = info;
        }
      } catch (const Error& e) {
        if (problems) problems->push_back(e.what());
      }
    }
  }
  std::vector<PluginInfo> out;
  for (const auto& n : order) out.push_back(found[n]);
  return out;
}

std::shared_ptr<Plugin> PluginLoader::create(const std::string& name_or_path, const PluginArgs& args,
                                             PluginInfo* info_out) const {
  const std::string path = find(name_or_path);
  auto [lib, info] = open_described(path);
  if (!lib->has(LCX_FACTORY_SYMBOL))
    throw Error(str("'", path, "' describes plugin '", info.name, "' but exports no factory ('",
                    LCX_FACTORY_SYMBOL, "')"),
                {}, "build it with the LCX_PLUGIN macro of <lcx/plugin.h>");
  auto factory = boost::dll::import_alias<PluginFactory>(*lib, LCX_FACTORY_SYMBOL);
  std::unique_ptr<Plugin> obj = factory(args);
  if (!obj) throw Error(str("plugin '", info.name, "' (", path, ") returned no object"));
  args.config.check_unknown();
  if (info_out) *info_out = info;
  return keep_loaded(std::move(obj), lib);
}

}  // namespace lcx
