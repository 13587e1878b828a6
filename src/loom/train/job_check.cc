#include "loom/train/job_check.h"

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "loom/core/error.h"
#include "loom/io/sha256.h"

namespace loom {

namespace {

// The first 8 bytes of a hex digest as a number, to gather cheaply.
uint64_t digest_word(const std::string& hex) {
  return std::stoull(hex.substr(0, 16), nullptr, 16);
}

std::string hex_word(uint64_t w) {
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(w));
  return buf;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) s += format("{}{}", s.empty() ? "" : ", ", r);
  return s;
}

// Rank `root`'s text on every rank (collective over the group).
std::string broadcast_text(ProcessGroup& g, const std::string& mine, int root) {
  uint64_t n[1] = {mine.size()};
  std::vector<uint64_t> sizes = all_gather_words(g, n, 1);
  const size_t len = static_cast<size_t>(sizes[static_cast<size_t>(root)]);
  // Carried as raw 4-byte words: a broadcast copies them unchanged.
  std::vector<float> words((len + 3) / 4);
  if (g.rank() == root && len > 0) std::memcpy(words.data(), mine.data(), len);
  if (!words.empty()) g.broadcast(words.data(), words.size(), DType::kF32, root)->wait();
  std::string out(len, '\0');
  if (len > 0) std::memcpy(out.data(), words.data(), len);
  return out;
}

void flatten(const nlohmann::json& j, const std::string& prefix,
             std::vector<std::pair<std::string, std::string>>* out) {
  if (j.is_object() && !j.empty()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      flatten(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), out);
    return;
  }
  out->emplace_back(prefix, j.dump());
}

}  // namespace

std::string build_identity() {
  size_t bytes = 0;
  return sha256_file("/proc/self/exe", &bytes);
}

std::string first_difference(const nlohmann::json& a, const nlohmann::json& b, std::string* va,
                             std::string* vb) {
  std::vector<std::pair<std::string, std::string>> fa, fb;
  flatten(a, "", &fa);
  flatten(b, "", &fb);
  // Both lists are in sorted key order (nlohmann's objects are sorted maps).
  size_t i = 0, k = 0;
  while (i < fa.size() || k < fb.size()) {
    if (k == fb.size() || (i < fa.size() && fa[i].first < fb[k].first)) {
      *va = fa[i].second, *vb = "(absent)";
      return fa[i].first;
    }
    if (i == fa.size() || fb[k].first < fa[i].first) {
      *va = "(absent)", *vb = fb[k].second;
      return fb[k].first;
    }
    if (fa[i].second != fb[k].second) {
      *va = fa[i].second, *vb = fb[k].second;
      return fa[i].first;
    }
    ++i, ++k;
  }
  return {};
}

void check_same_job(ProcessGroup& world, const nlohmann::json& resolved_config,
                    const std::string& build) {
  const std::string text = resolved_config.dump();
  const uint64_t mine[2] = {digest_word(build), digest_word(sha256_hex(text))};
  const std::vector<uint64_t> all = all_gather_words(world, mine, 2);
  std::vector<int> other_build, other_config;
  for (int r = 1; r < world.size(); ++r) {
    if (all[2 * static_cast<size_t>(r)] != all[0]) other_build.push_back(r);
    if (all[2 * static_cast<size_t>(r) + 1] != all[1]) other_config.push_back(r);
  }
  // Every rank reaches the same verdict from the same gathered words, so
  // they all fail together with the same message.
  if (!other_build.empty()) {
    const size_t r = static_cast<size_t>(other_build.front());
    LOOM_FAIL(kConfig,
              "the ranks run different loom builds: rank(s) {} run an executable other than rank "
              "0's (executable sha256 {}... on rank {}, {}... on rank 0); launch the same build "
              "on every rank",
              rank_list(other_build), hex_word(all[2 * r]), r, hex_word(all[0]));
  }
  if (other_config.empty()) return;
  const int first = other_config.front();
  const std::string at0 = broadcast_text(world, text, 0);
  const std::string atf = broadcast_text(world, text, first);
  std::string v0, vf;
  const std::string key =
      first_difference(nlohmann::json::parse(at0), nlohmann::json::parse(atf), &v0, &vf);
  LOOM_FAIL(kConfig,
            "the ranks loaded different configs: rank(s) {} differ from rank 0; the first "
            "differing key is '{}': {} on rank 0, {} on rank {} (every rank must get the same "
            "config file and --set overrides)",
            rank_list(other_config), key, v0, vf, first);
}

}  // namespace loom
