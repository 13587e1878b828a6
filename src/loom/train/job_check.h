// The start-of-job check that every rank runs the same job: the same loom
// build and the same resolved config. An MPMD launch with a different --set
// on one rank, or ranks started from different binaries, would otherwise
// build different grids or models and hang, or train silently wrong.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "loom/comm/process_group.h"

namespace loom {

// The identity of this process's loom build: the SHA-256 of its executable.
std::string build_identity();

// Collective over `world`. Throws Error(kConfig) on every rank when the ranks
// disagree, naming the ranks that differ from rank 0 and, for configs, the
// first differing key with both values.
void check_same_job(ProcessGroup& world, const nlohmann::json& resolved_config,
                    const std::string& build);

// The first key (dotted path, in sorted order) whose value differs between
// a and b; "" when they are equal. *va and *vb receive the two values ("(absent)").
std::string first_difference(const nlohmann::json& a, const nlohmann::json& b, std::string* va,
                             std::string* vb);

}  // namespace loom
