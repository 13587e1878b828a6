#include "loom/plan/cluster.h"

#include "loom/core/error.h"
#include "loom/io/fs.h"

namespace loom::plan {

using json = nlohmann::json;

namespace {

// The number at `key` (a JSON pointer below the root), > 0 unless zero_ok.
double figure(const json& j, const std::string& source, const std::string& pointer, bool zero_ok,
              const double* fallback = nullptr) {
  const json::json_pointer ptr(pointer);
  std::string key = pointer;  // "/gpu/memory_bytes" as "gpu.memory_bytes" (with a lead to drop)
  for (char& ch : key)
    if (ch == '/') ch = '.';
  if (!j.contains(ptr)) {
    if (fallback) return *fallback;
    LOOM_FAIL(kConfig, "{}: {} is missing", source, key.substr(1));
  }
  const json& v = j.at(ptr);
  LOOM_CHECK_KIND(kConfig, v.is_number(), "{}: {} must be a number, not {}", source, key.substr(1),
                  v.dump());
  const double x = v.get<double>();
  LOOM_CHECK_KIND(kConfig, zero_ok ? x >= 0 : x > 0, "{}: {} must be {} 0, not {}", source,
                  key.substr(1), zero_ok ? ">=" : ">", x);
  return x;
}

}  // namespace

ClusterSpec parse_cluster(const json& j, const std::string& source) {
  LOOM_CHECK_KIND(kConfig, j.is_object(), "{}: a cluster file is a JSON object", source);
  for (const char* section :
       {"gpu", "gpu.gemm_efficiency", "links", "links.node", "links.cluster"}) {
    std::string pointer = std::string("/") + section;
    for (char& ch : pointer)
      if (ch == '.') ch = '/';
    const json::json_pointer ptr(pointer);
    LOOM_CHECK_KIND(kConfig, !j.contains(ptr) || j.at(ptr).is_object(),
                    "{}: {} is a JSON object, not {}", source, section, j.at(ptr).dump());
  }
  ClusterSpec c;
  c.name = j.value("name", source);
  c.device = j.contains("gpu") ? j["gpu"].value("name", "") : "";
  const double gpus = figure(j, source, "/gpus_per_node", false);
  LOOM_CHECK_KIND(kConfig, gpus == double(int(gpus)), "{}: gpus_per_node must be a whole number",
                  source);
  c.gpus_per_node = int(gpus);
  c.memory_bytes = figure(j, source, "/gpu/memory_bytes", false);
  const double zero = 0;
  c.reserved_bytes = figure(j, source, "/gpu/reserved_bytes", true, &zero);
  LOOM_CHECK_KIND(kConfig, c.reserved_bytes < c.memory_bytes,
                  "{}: gpu.reserved_bytes ({}) leaves nothing of gpu.memory_bytes ({})", source,
                  c.reserved_bytes, c.memory_bytes);
  c.peak_flops_16 = 1e12 * figure(j, source, "/gpu/peak_tflops_16bit", false);
  c.peak_flops_32 = 1e12 * figure(j, source, "/gpu/peak_tflops_32bit", false);
  c.memory_bandwidth = 1e9 * figure(j, source, "/gpu/memory_bandwidth_GBps", false);
  const double memory_gbps = c.memory_bandwidth / 1e9;
  c.elementwise_bandwidth = 1e9 * figure(j, source, "/gpu/elementwise_GBps", false, &memory_gbps);
  c.gemm_max = figure(j, source, "/gpu/gemm_efficiency/max", false);
  LOOM_CHECK_KIND(kConfig, c.gemm_max <= 1, "{}: gpu.gemm_efficiency.max must be <= 1, not {}",
                  source, c.gemm_max);
  c.gemm_half_flops = 1e9 * figure(j, source, "/gpu/gemm_efficiency/half_at_gflop", false);
  c.node = {1e9 * figure(j, source, "/links/node/bandwidth_GBps", false),
            1e-6 * figure(j, source, "/links/node/latency_us", true)};
  c.cluster = {1e9 * figure(j, source, "/links/cluster/bandwidth_GBps", false),
               1e-6 * figure(j, source, "/links/cluster/latency_us", true)};
  return c;
}

ClusterSpec read_cluster(const std::string& path) {
  const json j = json::parse(read_file(path), nullptr, false);
  LOOM_CHECK_KIND(kConfig, !j.is_discarded(), "{}: not JSON", path);
  return parse_cluster(j, path);
}

}  // namespace loom::plan
