// What the two halves of the key table (config_keys.cc, config_keys_job.cc)
// share: the key builder, the field landing macro and the predicates that
// say where a section's keys mean something. Internal to train/.
#pragma once

#include <string>
#include <vector>

#include "loom/train/config.h"
#include "loom/train/config_keys.h"

namespace loom::config_table {

using nlohmann::json;

inline constexpr double kMaxInt = 9.0e15;

inline ConfigKey key(std::string path, KeyKind kind) {
  ConfigKey k;
  k.path = std::move(path);
  k.kind = kind;
  return k;
}

// The resolved config writes a section's keys only where they mean something.
inline bool moe(const Config& c) {
  return c.model.moe_experts > 0;
}
inline bool learned_moe(const Config& c) {  // a fixed router has no probabilities to balance
  return moe(c) && c.model.moe_router == 0;
}
inline bool scheduled(const Config& c) {
  return !c.scheduler.type.empty();
}

// A key that lands in one field of Config and is written back from it.
#define LOOM_FIELD(expr, T) \
  [](Config& c, const json& v) { expr = v.get<T>(); }, [](const Config& c) { return json(expr); }

// The keys of the run: batch, optimizer, scheduler, ZeRO, comm, precision
// (config_keys.cc); of the model and the job: model, parallelism,
// checkpointing, data, train, checkpoints, kernels, log (config_keys_job.cc).
std::vector<ConfigKey> run_keys();
std::vector<ConfigKey> model_and_job_keys();

}  // namespace loom::config_table
