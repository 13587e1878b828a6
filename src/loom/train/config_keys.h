// The config as one table: every key loom reads, declared once with its type
// and range (what validation checks), its default, where it lands in Config
// and what config.resolved.json says of it, and its documentation. Parsing,
// --set, config.resolved.json and the key table of docs/config.md (`loom
// config keys`; a test fails when they disagree) all come from it. What
// spans several keys (the batch identity, the parallel sizes against the
// job, the mixture-of-experts router's rules, derived defaults such as
// scheduler.params.total_num_steps = train.steps) is in config.cc's rules.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace loom {

struct Config;

enum class KeyKind { kInt, kNumber, kBool, kString, kNumberPair, kPartition, kIntList };

struct ConfigKey {
  std::string path;  // "model.n_layer"
  KeyKind kind = KeyKind::kInt;
  double lo = -1e300, hi = 1e300;  // inclusive range of a number (lo exclusive when `above`)
  bool lo_exclusive = false;
  std::vector<std::string> choices;  // a string's values; empty: any
  // The value when the key is absent; null: none (a rule decides, or the
  // key is optional).
  nlohmann::json fallback;
  // Puts a value (given or the fallback) into the config; null: a rule of
  // config.cc reads the key.
  std::function<void(Config&, const nlohmann::json&)> land;
  // What config.resolved.json holds for it; null: not written.
  std::function<nlohmann::json(const Config&)> value;
  // Whether config.resolved.json writes it for this config; null: always.
  std::function<bool(const Config&)> shown;
  // docs/config.md's row: the type, the default and the meaning, as text.
  std::string doc_type, doc_default, doc_meaning;

  ConfigKey& range(double l, double h) {
    lo = l, hi = h;
    return *this;
  }
  ConfigKey& above() {  // lo itself is out of range
    lo_exclusive = true;
    return *this;
  }
  ConfigKey& one_of(std::vector<std::string> c) {
    choices = std::move(c);
    return *this;
  }
  ConfigKey& or_else(nlohmann::json f) {
    fallback = std::move(f);
    return *this;
  }
  ConfigKey& lands(std::function<void(Config&, const nlohmann::json&)> l,
                   std::function<nlohmann::json(const Config&)> v) {
    land = std::move(l), value = std::move(v);
    return *this;
  }
  ConfigKey& resolved(std::function<nlohmann::json(const Config&)> v) {
    value = std::move(v);
    return *this;
  }
  ConfigKey& when(std::function<bool(const Config&)> s) {
    shown = std::move(s);
    return *this;
  }
  ConfigKey& doc(std::string type, std::string fallback_text, std::string meaning) {
    doc_type = std::move(type), doc_default = std::move(fallback_text);
    doc_meaning = std::move(meaning);
    return *this;
  }
};

// Every key, in docs/config.md's order.
const std::vector<ConfigKey>& config_keys();
const ConfigKey* find_config_key(const std::string& path);
// The rows of docs/config.md's key table (after its two header lines).
std::string config_keys_markdown();
// config.resolved.json: every key written for `c`.
nlohmann::json resolved_config(const Config& c);

}  // namespace loom
