// A cluster as the planner sees it (configs/clusters/*.json): nodes of
// `gpus_per_node` devices, each device's memory, peak FLOP/s by precision
// and memory bandwidth, the GEMM efficiency curve, and two links (inside a
// node, between nodes) by bandwidth and latency. Every figure is checked
// when the file is read: a missing, non-numeric or non-positive one is an
// error naming the file and the key.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

namespace loom::plan {

struct Link {
  double bandwidth = 0;  // bytes/s one device sends into the link (one direction)
  double latency = 0;    // seconds per message
};

struct ClusterSpec {
  std::string name, device;
  int gpus_per_node = 1;
  double memory_bytes = 0;      // per device
  double reserved_bytes = 0;    // per device, not for the model (runtime, allocator, buffers)
  double peak_flops_16 = 0;     // bf16/fp16 matrix peak, FLOP/s
  double peak_flops_32 = 0;     // f32 (or TF32 when the cluster file says so)
  double memory_bandwidth = 0;  // bytes/s
  // The rate of loom's non-GEMM work (norms, GELU, softmax, residuals, the
  // record's packing), as bytes of a block's f32 record a second: measured
  // by --calibrate on a block of the model; memory_bandwidth where a file
  // does not say (gpu.elementwise_GBps).
  double elementwise_bandwidth = 0;
  // A GEMM of F FLOPs runs at peak x gemm_max x F / (F + gemm_half_flops).
  double gemm_max = 0.8, gemm_half_flops = 1e9;
  Link node, cluster;  // inside a node, between nodes (per device)
};

// Reads and checks a cluster file; `source` names it in messages.
ClusterSpec parse_cluster(const nlohmann::json& j, const std::string& source);
ClusterSpec read_cluster(const std::string& path);

}  // namespace loom::plan
