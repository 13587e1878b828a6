#include "loom/comm/comm_options.h"

#include <cstdlib>

#include "loom/core/error.h"

namespace loom {

void apply_comm_overrides(CommOptions& o, const std::vector<std::string>& items) {
  for (const std::string& item : items) {
    size_t eq = item.find('=');
    LOOM_CHECK_KIND(kConfig, eq != std::string::npos, "--set {}: expected comm.key=value", item);
    std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    char* end = nullptr;
    if (key == "comm.timeout_s") {
      double v = std::strtod(value.c_str(), &end);
      LOOM_CHECK_KIND(kConfig, end != value.c_str() && *end == '\0' && v > 0,
                      "comm.timeout_s: expected a number > 0, got '{}'", value);
      o.timeout_s = v;
    } else if (key == "comm.allreduce") {
      LOOM_CHECK_KIND(kConfig,
                      value == "mpi" || value == "ring" || value == "rhd" ||
                          value == "hierarchical" || value == "auto",
                      "comm.allreduce: unknown value '{}' (expected one of mpi, ring, rhd, "
                      "hierarchical, auto)",
                      value);
      o.allreduce = value;
    } else if (key == "comm.ranks_per_node") {
      long v = std::strtol(value.c_str(), &end, 10);
      LOOM_CHECK_KIND(kConfig, end != value.c_str() && *end == '\0' && v >= 0,
                      "comm.ranks_per_node: expected an integer >= 0, got '{}'", value);
      o.ranks_per_node = static_cast<int>(v);
    } else if (key == "comm.placement") {
      LOOM_CHECK_KIND(kConfig, value == "topology" || value == "launcher",
                      "comm.placement: unknown value '{}' (expected topology or launcher)", value);
      o.placement = value;
    } else if (key == "comm.debug") {
      LOOM_CHECK_KIND(kConfig, value == "true" || value == "false",
                      "comm.debug: expected true or false, got '{}'", value);
      o.debug = value == "true";
    } else {
      LOOM_FAIL(kConfig,
                "unknown key '{}' (comm keys: timeout_s, allreduce, ranks_per_node, "
                "placement, debug)",
                key);
    }
  }
}

}  // namespace loom
