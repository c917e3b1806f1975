#include <algorithm>
#include <cmath>
#include <charconv>
#include <cstdio>
#include <map>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "config/manifest.h"
#include "lcx/error.h"
#include "util/file.h"
#include "util/text.h"

namespace lcx {

struct ConfigView::Impl {
  std::string name;
  std::string source;
  std::shared_ptr<toml::table> root;  // keeps the table alive
  const toml::table* table = nullptr;
  mutable std::set<std::string> asked;
  // Dotted key -> the --set assignment that gave its value, so errors name the override.
  std::shared_ptr<const std::map<std::string, std::string>> overrides;
  std::shared_ptr<KeyRecords> keys;  // null for a view made without a manifest

  // Records a getter's read: the first getter gives the type and default, the last the value.
  void note(const std::string& key, const char* type, const std::string& def, const std::string& value) const {
    update(key, [&](KeyRecord& r) {
      if (r.type.empty()) r.type = type;
      if (r.default_value.empty()) r.default_value = def;
      r.value = value;
    });
  }
  template <typename F>
  void update(const std::string& key, F&& f) const {
    if (!keys) return;
    std::lock_guard<std::mutex> lock(keys->mutex);
    auto [it, fresh] = keys->index.emplace(std::make_pair(name, key), keys->rows.size());
    if (fresh) {
      keys->rows.emplace_back();
      keys->rows.back().table = name;
      keys->rows.back().key = key;
    }
    KeyRecord& r = keys->rows[it->second];
    r.set = table && table->contains(key);
    f(r);
  }
};

namespace {

// Values as TOML writes them, for the reference and --dry-run.
std::string toml_text(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      char esc[8];
      std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
      out += esc;
    } else {
      out += c;
    }
  }
  return out + "\"";
}
std::string toml_text(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[32];
  const auto end = std::to_chars(buf, buf + sizeof buf, d).ptr;  // the shortest that reads back the same
  std::string out(buf, end);
  if (out.find_first_of(".e") == std::string::npos) out += ".0";
  return out;
}
bool is_toml_value(const std::string& text) {
  try {
    return toml::parse("v = " + text).contains("v");
  } catch (const toml::parse_error&) {
    return false;
  }
}
std::string toml_text(int64_t v) { return std::to_string(v); }
std::string toml_text(bool v) { return v ? "true" : "false"; }
std::string toml_text(const std::vector<std::string>& v) {
  std::string out = "[";
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + toml_text(v[i]);
  return out + "]";
}

const char* node_type_name(const toml::node& n) {
  switch (n.type()) {
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::array: return "array";
    case toml::node_type::table: return "table";
    default: return "date/time";
  }
}

// "a float", "an integer", "an array": the type name with its article.
std::string a_type(const toml::node& n) {
  const std::string name = node_type_name(n);
  return (std::string("aeiou").find(name[0]) != std::string::npos ? "an " : "a ") + name;
}

// The names users of transformers' TrainingArguments and TRL's SFTConfig type, and the key of
// lcx's that means the same; suggested when the key is unknown and its lcx name is valid there.
const std::map<std::string, std::string>& key_aliases() {
  static const std::map<std::string, std::string> aliases = {
      {"learning_rate", "lr"},
      {"max_seq_length", "seq_len"},
      {"max_length", "seq_len"},
      {"per_device_train_batch_size", "grad_accum"},
      {"gradient_accumulation_steps", "grad_accum"},
      {"num_train_epochs", "epochs"},
      {"lr_scheduler_type", "schedule"},
      {"adam_beta1", "beta1"},
      {"adam_beta2", "beta2"},
      {"adam_epsilon", "eps"},
      {"save_total_limit", "keep_checkpoints"},
      {"logging_steps", "log_every"},
      {"gradient_checkpointing", "checkpoint_every"},
      {"model_name_or_path", "path"},
      {"dataset_text_field", "text_field"},
      {"torch_dtype", "dtype"},
  };
  return aliases;
}

std::string location(const std::string& source, const toml::node* n) {
  if (n && n->source().begin.line > 0) return str(source, ":", n->source().begin.line);
  if (n) return "--set";
  return source;
}

}  // namespace

ConfigView::ConfigView() : impl_(std::make_shared<Impl>()) {}
ConfigView::ConfigView(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
ConfigView::~ConfigView() = default;
ConfigView::ConfigView(const ConfigView&) = default;
ConfigView& ConfigView::operator=(const ConfigView&) = default;

const std::string& ConfigView::name() const { return impl_->name; }

const ConfigView& ConfigView::describe(const std::string& key, const std::string& meaning, const std::string& values,
                                       const std::string& shown_default) const {
  impl_->asked.insert(key);
  impl_->update(key, [&](KeyRecord& r) {
    if (!meaning.empty()) r.meaning = meaning;
    if (!values.empty()) r.values = values;
    if (!shown_default.empty()) {
      r.default_value = shown_default;
      r.default_is_text = !is_toml_value(shown_default);
    }
  });
  return *this;
}

bool ConfigView::has(const std::string& key) const {
  impl_->asked.insert(key);
  return impl_->table && impl_->table->contains(key);
}

std::string ConfigView::where(const std::string& key) const {
  if (impl_->overrides) {
    auto it = impl_->overrides->find(impl_->name.empty() ? key : key.empty() ? impl_->name : impl_->name + "." + key);
    if (it != impl_->overrides->end()) return "--set " + it->second;
  }
  if (!impl_->table) return impl_->source;
  if (key.empty()) return location(impl_->source, impl_->table);
  return location(impl_->source, impl_->table->get(key));
}

void ConfigView::fail(const std::string& key, const std::string& message, const std::string& fix) const {
  std::string full_key = impl_->name.empty() ? key : impl_->name + "." + key;
  throw Error(str(where(key), ": ", full_key, ": ", message), full_key, fix);
}

namespace {
template <typename T>
const char* wanted_name() {
  if constexpr (std::is_same_v<T, int64_t>) return "integer";
  if constexpr (std::is_same_v<T, double>) return "float";
  if constexpr (std::is_same_v<T, bool>) return "boolean";
  if constexpr (std::is_same_v<T, std::string>) return "string";
  return "?";
}

template <typename T>
T get_value(const ConfigView& view, const toml::table* table, const std::string& key, const T& def,
            bool required) {
  const toml::node* n = table ? table->get(key) : nullptr;
  if (!n) {
    if (required) view.fail(key, "is required", str("add `", key, " = ...` to [", view.name(), "]"));
    return def;
  }
  if constexpr (std::is_same_v<T, double>) {
    if (auto v = n->value<double>()) return *v;  // toml++ converts integers too
  } else {
    if (auto v = n->value_exact<T>()) return *v;
  }
  view.fail(key, str("expected ", wanted_name<T>(), ", found ", node_type_name(*n)));
}
}  // namespace

int64_t ConfigView::get_int(const std::string& key, int64_t def) const {
  impl_->asked.insert(key);
  const int64_t v = get_value<int64_t>(*this, impl_->table, key, def, false);
  impl_->note(key, "integer", toml_text(def), toml_text(v));
  return v;
}
double ConfigView::get_double(const std::string& key, double def) const {
  impl_->asked.insert(key);
  const double v = get_value<double>(*this, impl_->table, key, def, false);
  impl_->note(key, "float", toml_text(def), toml_text(v));
  return v;
}
bool ConfigView::get_bool(const std::string& key, bool def) const {
  impl_->asked.insert(key);
  const bool v = get_value<bool>(*this, impl_->table, key, def, false);
  impl_->note(key, "boolean", toml_text(def), toml_text(v));
  return v;
}
std::string ConfigView::get_string(const std::string& key, const std::string& def) const {
  impl_->asked.insert(key);
  std::string v = get_value<std::string>(*this, impl_->table, key, def, false);
  impl_->note(key, "string", toml_text(def), toml_text(v));
  return v;
}
std::optional<int64_t> ConfigView::get_int_or_auto(const std::string& key, const std::string& fix) const {
  impl_->asked.insert(key);
  const toml::node* n = impl_->table ? impl_->table->get(key) : nullptr;
  std::optional<int64_t> v;
  if (n) {
    if (const auto* text = n->as_string()) {
      if (text->get() != "auto") fail(key, str("'", text->get(), "' is neither \"auto\" nor an integer"), fix);
    } else {
      v = get_value<int64_t>(*this, impl_->table, key, 0, false);  // its error names the type found
    }
  }
  impl_->note(key, "integer or \"auto\"", toml_text(std::string("auto")), v ? toml_text(*v) : toml_text(std::string("auto")));
  return v;
}
int64_t ConfigView::require_int(const std::string& key) const {
  impl_->asked.insert(key);
  const int64_t v = get_value<int64_t>(*this, impl_->table, key, 0, true);
  impl_->note(key, "integer", "(required)", toml_text(v));
  return v;
}
std::string ConfigView::require_string(const std::string& key) const {
  impl_->asked.insert(key);
  std::string v = get_value<std::string>(*this, impl_->table, key, {}, true);
  impl_->note(key, "string", "(required)", toml_text(v));
  return v;
}

std::vector<std::string> ConfigView::get_strings(const std::string& key,
                                                 const std::vector<std::string>& def) const {
  impl_->asked.insert(key);
  const toml::node* n = impl_->table ? impl_->table->get(key) : nullptr;
  if (!n) {
    impl_->note(key, "array of strings", toml_text(def), toml_text(def));
    return def;
  }
  const toml::array* arr = n->as_array();
  if (!arr) fail(key, str("expected array of strings, found ", node_type_name(*n)));
  std::vector<std::string> out;
  for (const auto& item : *arr) {
    auto s = item.value_exact<std::string>();
    if (!s) fail(key, str("expected array of strings, found an element of type ", node_type_name(item)));
    out.push_back(*s);
  }
  impl_->note(key, "array of strings", toml_text(def), toml_text(out));
  return out;
}

ConfigView ConfigView::table(const std::string& key) const {
  impl_->asked.insert(key);
  auto sub = std::make_shared<Impl>();
  sub->name = impl_->name.empty() ? key : impl_->name + "." + key;
  sub->source = impl_->source;
  sub->root = impl_->root;
  sub->overrides = impl_->overrides;
  sub->keys = impl_->keys;
  impl_->note(key, "table", "{}", {});
  const toml::node* n = impl_->table ? impl_->table->get(key) : nullptr;
  if (n && !n->is_table()) fail(key, str("expected table, found ", node_type_name(*n)));
  sub->table = n ? n->as_table() : nullptr;
  return ConfigView(sub);
}

void ConfigView::check_unknown() const {
  if (!impl_->table) return;
  std::vector<std::string> valid(impl_->asked.begin(), impl_->asked.end());
  for (const auto& [k, v] : *impl_->table) {
    std::string key(k.str());
    if (impl_->asked.count(key)) continue;
    std::string near = closest(key, valid);
    auto alias = key_aliases().find(key);
    if (alias != key_aliases().end() && impl_->asked.count(alias->second)) near = alias->second;
    fail(key, "unknown key",
         str(near.empty() ? "" : str("did you mean '", near, "'? "), "valid keys: ",
             valid.empty() ? std::string("(none)") : join(valid, ", ")));
  }
}

// ---- Manifest ----

Manifest Manifest::parse(const std::string& text, const std::string& source_name) {
  Manifest m;
  m.source_ = source_name;
  try {
    m.root_ = std::make_shared<toml::table>(toml::parse(text, source_name));
  } catch (const toml::parse_error& e) {
    throw Error(str(source_name, ":", e.source().begin.line, ":", e.source().begin.column, ": ",
                    e.description()),
                {}, "fix the TOML syntax at that line");
  }
  return m;
}

Manifest Manifest::load(const std::string& path) {
  return parse(read_file(path, "--config", "give the path of a TOML manifest, e.g. --config configs/quickstart.toml"),
               path);
}

void Manifest::set(const std::string& assignment) {
  auto eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0)
    throw Error(str("--set '", assignment, "': expected section.key=value"), {}, "e.g. --set train.lr=2e-5");
  std::string path = assignment.substr(0, eq);
  std::string value = assignment.substr(eq + 1);
  std::vector<std::string> parts;
  std::stringstream ps(path);
  for (std::string p; std::getline(ps, p, '.');) parts.push_back(p);
  if (parts.size() < 2)
    throw Error(str("--set '", assignment, "': the key needs its section, e.g. train.", path), path);

  // Parse the value as TOML; a bare word that is not TOML is taken as a string.
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    toml::table t;
    t.insert("v", value);
    parsed = std::move(t);
  }
  toml::node& newv = *parsed.get("v");

  toml::table* t = root_.get();
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    toml::node* n = t->get(parts[i]);
    if (!n) {
      t->insert(parts[i], toml::table{});
      n = t->get(parts[i]);
    }
    if (!n->is_table())
      throw Error(str("--set ", path, ": '", parts[i], "' is ", a_type(*n), ", not a table"), path);
    t = n->as_table();
  }
  const std::string& key = parts.back();
  auto overrides = std::make_shared<std::map<std::string, std::string>>(
      overrides_ ? *overrides_ : std::map<std::string, std::string>{});
  (*overrides)[path] = assignment;
  overrides_ = std::move(overrides);
  if (toml::node* old = t->get(key)) {
    // Numbers are numbers here: the file's `alpha = 16` takes --set alpha=2.5, and a key its
    // reader wants whole refuses a fraction by its own name when read.
    const auto number = [](const toml::node& n) {
      return n.type() == toml::node_type::integer || n.type() == toml::node_type::floating_point;
    };
    bool same = old->type() == newv.type() || (number(*old) && number(newv));
    if (!same)
      throw Error(str("--set ", path, "=", value, ": ", path, " wants ", a_type(*old), " (as ", location(source_, old),
                      " gives it), got ", a_type(newv)),
                  path, str("give ", a_type(*old), " value"));
    if (old->type() == toml::node_type::floating_point && newv.type() == toml::node_type::integer) {
      t->insert_or_assign(key, static_cast<double>(*newv.value<int64_t>()));
      return;
    }
  }
  newv.visit([&](auto& v) { t->insert_or_assign(key, std::move(v)); });
}

ConfigView Manifest::section(const std::string& name) const {
  auto impl = std::make_shared<ConfigView::Impl>();
  impl->name = name;
  impl->source = source_;
  impl->root = root_;
  impl->overrides = overrides_;
  impl->keys = keys_;
  const toml::node* n = root_->get(name);
  if (n && !n->is_table())
    throw Error(str(location(source_, n), ": ", name, ": expected a table [", name, "], found ",
                    node_type_name(*n)),
                name);
  impl->table = n ? n->as_table() : nullptr;
  return ConfigView(impl);
}

std::vector<std::string> Manifest::table_names() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : *root_) out.emplace_back(k.str());
  return out;
}

std::vector<KeyRecord> Manifest::keys() const {
  std::lock_guard<std::mutex> lock(keys_->mutex);
  return keys_->rows;
}

std::string Manifest::to_toml() const {
  std::stringstream ss;
  ss << *root_;
  return ss.str();
}

std::string Manifest::to_json() const {
  std::stringstream ss;
  ss << toml::json_formatter{*root_};
  return ss.str();
}

}  // namespace lcx
