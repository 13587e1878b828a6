// Stage 3's parameter gathering: each use of a unit gathers its full
// parameters from the ranks' slices (prefetched ahead along the model's unit
// schedule, within stage3_prefetch_bucket_size elements) and releases them
// after; units of at most stage3_param_persistence_threshold elements stay
// gathered between uses until the next update. Gathered copies are counted
// under the memory category `comm`. In 16-bit mode the 16-bit slices are
// gathered.
#pragma once

#include <cstddef>
#include <vector>

#include "loom/nn/param_store.h"
#include "loom/parallel/zero/comm_wait.h"
#include "loom/parallel/zero/shard_layout.h"
#include "loom/parallel/zero/zero_config.h"

namespace loom {

class ParamGatherer {
 public:
  // shard: this rank's parameter shard in the storage type (config.dtype).
  ParamGatherer(ParamStore<float>& store, const ShardLayout& shards, const ZeroConfig& config,
                const void* shard);
  ~ParamGatherer();
  ParamGatherer(const ParamGatherer&) = delete;
  ParamGatherer& operator=(const ParamGatherer&) = delete;

  // Starts gathering unit u unless it is gathered or on its way.
  void launch(int u);
  // Unit u's full parameters in the storage type, gathered and waited for.
  const void* wait(int u, CommStats* stats);
  // The gathered copy is not needed past this point (it was widened);
  // persistent units keep theirs.
  void drop(int u);
  // After a use: unbinds unit u and frees its copy unless it is persistent.
  void release(int u);
  // The micro-batch's first gather: the first use in `plan` that reads
  // parameters (a pipeline's weight-gradient pass reads none).
  void start(const std::vector<UnitUse>& plan);
  // During use `pos` of `plan` (of unit u): gathers the next units ahead,
  // at least one, then more while the elements in flight stay within
  // stage3_prefetch_bucket_size.
  void prefetch(const std::vector<UnitUse>& plan, size_t pos, int u);
  // After a micro-batch: only persistent units may still be gathered.
  void check_released() const;
  // Drops the persistent copies (stale after an update), or every copy.
  void drop_resident();
  void drop_all();
  size_t peak_elements() const { return peak_; }

 private:
  struct Gathered {
    Buffer buf;
    WorkPtr work;
  };
  void forget(int u);

  ParamStore<float>& store_;
  const ShardLayout& shards_;
  const ZeroConfig& config_;
  const char* shard_;
  std::vector<Gathered> gathered_;  // per unit
  std::vector<bool> persistent_;
  size_t elements_ = 0, peak_ = 0;
};

}  // namespace loom
