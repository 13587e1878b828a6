// Expert parallelism's dispatcher: the E experts of each MoE layer split
// over the expert-parallel group (rank r holds experts [r E/P, (r+1) E/P)),
// and the rows of every assignment travel to the rank holding their expert
// with one all-to-all(v) and come back with another, forward and backward
// (the backward of a dispatch is a combine of the gradients, and the other
// way round). Each plan first shares every rank's rows per expert (an
// all-gather of E words), so every rank knows what it sends and receives.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/kernels/backend.h"
#include "loom/nn/moe.h"

namespace loom::ep {

// What the all-to-alls cost since the last take_stats().
struct AllToAllStats {
  double seconds = 0;  // waiting for them (they block the layer)
  int64_t calls = 0;
};

class AllToAllDispatcher final : public ExpertDispatcher<float> {
 public:
  // group: the expert-parallel group (ParallelContext::ep), more than one
  // rank. payload: the type rows travel in (kF32, or a bf16 run's bf16:
  // rounded before each all-to-all, widened after). Staging buffers and
  // conversions run on `backend` (null: default_backend<float>()).
  explicit AllToAllDispatcher(std::shared_ptr<ProcessGroup> group, DType payload = DType::kF32,
                              const Backend<float>* backend = nullptr);
  int rank() const override { return group_->rank(); }
  int ranks() const override { return group_->size(); }
  ExpertPlan plan(const std::vector<int64_t>& rows_per_expert, int experts) override;
  void dispatch(const ExpertPlan& p, const float* rows, int64_t C, float* expert_rows) override;
  void combine(const ExpertPlan& p, const float* expert_rows, int64_t C, float* rows) override;
  AllToAllStats take_stats();

 private:
  // Rows this rank sends to each rank, and receives from each.
  std::vector<size_t> sent(const ExpertPlan& p) const;
  std::vector<size_t> received(const ExpertPlan& p) const;
  // One all-to-all of rows of C floats: send[j] rows of `in` to rank j,
  // recv[s] rows from rank s into `out`, each block after the last.
  void exchange(const float* in, const std::vector<size_t>& send, float* out,
                const std::vector<size_t>& recv, int64_t C);

  std::shared_ptr<ProcessGroup> group_;
  DType payload_;
  const Backend<float>* be_;
  AllToAllStats stats_;
};

}  // namespace loom::ep
