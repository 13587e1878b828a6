#include "loom/train/step_engine.h"

#include <algorithm>
#include <chrono>

#include "loom/core/error.h"
#include "loom/parallel/tensor/factory.h"

namespace loom {

namespace {

std::unique_ptr<LayerFactory<float>> layers_for(const tp::Group& g, bool sequence_parallel) {
  if (g.size() == 1) return nullptr;
  return std::make_unique<tp::TensorParallelFactory>(g, sequence_parallel);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

StepEngine::StepEngine(const Config& config, ParallelContext ctx)
    : config_(config),
      ctx_(std::move(ctx)),
      tp_(ctx_.tp),
      layers_(layers_for(tp_, config.parallel.sequence_parallel)),
      // ZeRO decides which full buffers the stage holds and how units pad.
      stage_(config.model, StageSpec{}, ZeroEngine::storage(config.zero, ctx_.dp_size()),
             layers_ ? *layers_ : LayerFactory<float>::single_process()) {
  const int tp = ctx_.tp ? ctx_.tp->size() : 1;
  LOOM_CHECK_KIND(kConfig, config_.parallel.tensor == tp,
                  "the config's parallel.tensor {} differs from the job's tensor-parallel group "
                  "of {}",
                  config_.parallel.tensor, tp);
  LOOM_CHECK_KIND(kConfig, config_.data_parallel == ctx_.dp_size(),
                  "the config's data-parallel size {} differs from the job's {}",
                  config_.data_parallel, ctx_.dp_size());
  const int64_t B = config_.micro_batch, Tn = config_.model.seq_len;
  stage_.set_plan(stage_.plan(config_.checkpointing.policy, B, Tn));
  zero_ = std::make_unique<ZeroEngine>(stage_.store(), ctx_.dp, config_.zero, config_.optimizer);
  // Gradient norms count a tensor split over the tensor-parallel group once.
  zero_->set_tensor_parallel(ctx_.tp);
  acts_ = stage_.make_activations(B, Tn);
  inputs_.resize(static_cast<size_t>(B * Tn));
  targets_.resize(static_cast<size_t>(B * Tn));
}

int64_t StepEngine::first_sample(int64_t micro) const {
  return (micro * ctx_.dp_size() + ctx_.dp_rank()) * config_.micro_batch;
}

void StepEngine::fill(const BatchSource& data, uint64_t step, int64_t sample0) {
  data.fill(step, static_cast<uint64_t>(sample0), config_.micro_batch, config_.model.seq_len,
            inputs_.data(), targets_.data());
}

StepStats StepEngine::step(const BatchSource& data, int64_t step, double lr) {
  using clock = std::chrono::steady_clock;
  StepStats r;
  const int64_t accum = config_.grad_accum;
  zero_->zero_grads();
  stage_.take_recompute_seconds();
  tp_.take_traffic();  // evaluation's does not count
  double loss_sum = 0;
  for (int64_t micro = 0; micro < accum; ++micro) {
    // Samples and dropout masks are keyed on the global sample index, so
    // every layout sees the same samples with the same masks.
    const StepContext ctx{config_.train.seed, static_cast<uint64_t>(step),
                          static_cast<uint64_t>(first_sample(micro)), true};
    fill(data, ctx.step, static_cast<int64_t>(ctx.sample0));
    auto t0 = clock::now();
    zero_->begin_micro_batch(stage_.unit_schedule(true), micro == accum - 1);
    loss_sum += stage_.forward(acts_, inputs_.data(), nullptr, targets_.data(), ctx);
    r.t_forward += seconds_since(t0);
    t0 = clock::now();
    stage_.backward(acts_, 1.0 / static_cast<double>(accum));
    r.t_backward += seconds_since(t0);
    // Waits for what is left of this micro-batch's gradient reduction.
    zero_->end_micro_batch();
  }
  r.t_recompute = stage_.take_recompute_seconds();
  if (ctx_.dp) {
    // The step's loss over the global batch: the mean of the ranks' means.
    float mean = static_cast<float>(loss_sum);
    ctx_.dp->all_reduce(&mean, &mean, 1, DType::kF32, ReduceOp::kAvg)->wait();
    loss_sum = mean;
  }
  r.loss = loss_sum / static_cast<double>(accum);
  const auto t0 = clock::now();
  r.grad_norm = zero_->clip_grad_norm(config_.gradient_clipping);
  zero_->step(lr, step + 1);
  r.t_optimizer = seconds_since(t0);
  r.comm = zero_->take_stats();
  // Tensor-parallel collectives block the layers that issue them: all exposed.
  const tp::Traffic t = tp_.take_traffic();
  r.comm.comm_s += t.seconds;
  r.comm.exposed_s += t.seconds;
  r.comm.bytes += t.bytes;
  return r;
}

double StepEngine::evaluate(const BatchSource& data, int64_t batches) {
  // Each validation batch is split over micro-batches and ranks as a
  // training batch is; at ZeRO stage 3 a forward is collective (it gathers
  // each unit), so every rank runs the same number.
  float sum_count[2] = {0, 0};
  for (int64_t s = 0; s < batches; ++s) {
    for (int64_t micro = 0; micro < config_.grad_accum; ++micro) {
      const int64_t first = s * config_.train_batch_size + first_sample(micro);
      const StepContext ctx{config_.train.seed, 0, static_cast<uint64_t>(first), false};
      fill(data, 0, first);
      zero_->begin_micro_batch(stage_.unit_schedule(false), false);
      sum_count[0] +=
          static_cast<float>(stage_.forward(acts_, inputs_.data(), nullptr, targets_.data(), ctx));
      zero_->end_micro_batch();
      sum_count[1] += 1;
    }
  }
  if (ctx_.dp) ctx_.dp->all_reduce(sum_count, sum_count, 2, DType::kF32, ReduceOp::kSum)->wait();
  return sum_count[0] / sum_count[1];
}

std::vector<float> StepEngine::gather_params() {
  const bool gathered = zero_->full_params_gathered();
  zero_->gather_full_params();
  std::vector<float> out(stage_.params(), stage_.params() + stage_.num_params());
  if (!gathered) zero_->release_full_params(false);
  return out;
}

MemStats StepEngine::peak_memory_over_ranks() {
  MemStats mem = memory_tracker().stats();
  if (!ctx_.world) return mem;
  const std::vector<size_t> all = all_gather_words(*ctx_.world, mem.peak.data(), kNumMemCategories);
  for (int r = 0; r < ctx_.world->size(); ++r)
    for (int c = 0; c < kNumMemCategories; ++c)
      mem.peak[c] = std::max(mem.peak[c], all[static_cast<size_t>(r * kNumMemCategories + c)]);
  return mem;
}

}  // namespace loom
