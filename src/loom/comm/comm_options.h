// comm.* keys from "--set comm.key=value" items, validated with the key named.
#pragma once

#include <string>
#include <vector>

#include "loom/comm/mpi/mpi_process_group.h"

namespace loom {

// Applies "comm.timeout_s=30"-style items to `options`; throws Error(kConfig).
void apply_comm_overrides(CommOptions& options, const std::vector<std::string>& items);

}  // namespace loom
