#include "loom/train/step_engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "loom/core/error.h"
#include "loom/parallel/tensor/factory.h"
#include "loom/train/pipeline_setup.h"

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
      layers_(layers_for(tp_, config.parallel.sequence_parallel)) {
  const int tp = ctx_.tp ? ctx_.tp->size() : 1;
  const int p = ctx_.pp ? ctx_.pp->size() : 1;
  LOOM_CHECK_KIND(kConfig, config_.parallel.tensor == tp,
                  "the config's parallel.tensor {} differs from the job's tensor-parallel group "
                  "of {}",
                  config_.parallel.tensor, tp);
  LOOM_CHECK_KIND(kConfig, config_.parallel.pipeline == p,
                  "the config's parallel.pipeline {} differs from the job's pipeline group of {}",
                  config_.parallel.pipeline, p);
  LOOM_CHECK_KIND(kConfig, config_.data_parallel == ctx_.dp_size(),
                  "the config's data-parallel size {} differs from the job's {}",
                  config_.data_parallel, ctx_.dp_size());
  const int64_t B = config_.micro_batch, Tn = config_.model.seq_len, m = config_.grad_accum;
  const pp::ScheduleKind kind = pp::parse_schedule(config_.parallel.schedule);
  const int v = kind == pp::ScheduleKind::kInterleaved ? config_.parallel.virtual_stages : 1;
  const int stage = ctx_.coord().pp;
  partition_ = resolve_partition(config_, ctx_);
  // Activation stores held at once: one without a pipeline, else the
  // schedule's peak for this stage (the simulator counts it).
  std::optional<pp::Schedule> schedule;
  int in_flight = 1;
  if (p > 1) {
    schedule = pp::make_schedule(kind, p, static_cast<int>(m), v);
    in_flight = pp::simulate(*schedule).peak_in_flight[static_cast<size_t>(stage)];
  }
  // ZeRO decides which full buffers the stage holds and how units pad.
  const StoreOptions storage = ZeroEngine::storage(config_.zero, ctx_.dp_size());
  const LayerFactory<float>& layers = layers_ ? *layers_ : LayerFactory<float>::single_process();
  std::vector<pp::ChunkRef> refs;
  for (int c = 0; c < v; ++c) {
    const int part = c * p + stage;
    int first = 0;
    for (int k = 0; k < part; ++k) first += partition_.counts[static_cast<size_t>(k)];
    Chunk ch;
    ch.stage = std::make_unique<GptStage<float>>(
        config_.model, StageSpec{first, first + partition_.counts[static_cast<size_t>(part)]},
        storage, layers);
    ch.stage->set_plan(ch.stage->plan(config_.checkpointing.policy, B, Tn, in_flight));
    ch.zero =
        std::make_unique<ZeroEngine>(ch.stage->store(), ctx_.dp, config_.zero, config_.optimizer);
    // Gradient norms count a tensor split over the tensor-parallel group once.
    ch.zero->set_tensor_parallel(ctx_.tp);
    refs.push_back({ch.stage.get(), ch.zero.get()});
    chunks_.push_back(std::move(ch));
  }
  if (schedule) {
    executor_ = std::make_unique<pp::Executor>(*schedule, stage, refs, ctx_.pp, B, Tn);
    executor_->set_tracing(config_.log.trace);
    // One time origin for every rank (the bubble's span, the timeline),
    // taken right after a barrier.
    if (ctx_.world) ctx_.world->barrier()->wait();
    executor_->set_time_origin(std::chrono::steady_clock::now());
  } else {
    acts_ = chunks_[0].stage->make_activations(B, Tn);
  }
  const int64_t micro_batches = schedule ? m : 1;
  inputs_.resize(static_cast<size_t>(micro_batches * B * Tn));
  targets_.resize(static_cast<size_t>(micro_batches * B * Tn));
}

const std::vector<pp::TraceSlice>& StepEngine::trace() const {
  static const std::vector<pp::TraceSlice> none;
  return executor_ ? executor_->trace() : none;
}

int64_t StepEngine::first_sample(int64_t micro) const {
  return (micro * ctx_.dp_size() + ctx_.dp_rank()) * config_.micro_batch;
}

void StepEngine::fill(const BatchSource& data, uint64_t step, int64_t sample0, int64_t micro) {
  const size_t at = static_cast<size_t>(micro * config_.micro_batch * config_.model.seq_len);
  data.fill(step, static_cast<uint64_t>(sample0), config_.micro_batch, config_.model.seq_len,
            inputs_.data() + at, targets_.data() + at);
}

StepStats StepEngine::step(const BatchSource& data, int64_t step, double lr) {
  if (executor_) return step_pipelined(data, step, lr);
  using clock = std::chrono::steady_clock;
  StepStats r;
  ZeroEngine& zero = *chunks_[0].zero;
  GptStage<float>& stage = *chunks_[0].stage;
  const int64_t accum = config_.grad_accum;
  zero.zero_grads();
  stage.take_recompute_seconds();
  tp_.take_traffic();  // evaluation's does not count
  double loss_sum = 0;
  for (int64_t micro = 0; micro < accum; ++micro) {
    // Samples and dropout masks are keyed on the global sample index, so
    // every layout sees the same samples with the same masks.
    const StepContext ctx{config_.train.seed, static_cast<uint64_t>(step),
                          static_cast<uint64_t>(first_sample(micro)), true};
    fill(data, ctx.step, static_cast<int64_t>(ctx.sample0));
    auto t0 = clock::now();
    zero.begin_micro_batch(stage.unit_schedule(true), micro == accum - 1);
    loss_sum += stage.forward(acts_, inputs_.data(), nullptr, targets_.data(), ctx);
    r.t_forward += seconds_since(t0);
    t0 = clock::now();
    stage.backward(acts_, 1.0 / static_cast<double>(accum));
    r.t_backward += seconds_since(t0);
    // Waits for what is left of this micro-batch's gradient reduction.
    zero.end_micro_batch();
  }
  r.t_recompute = stage.take_recompute_seconds();
  if (ctx_.dp) {
    // The step's loss over the global batch: the mean of the ranks' means.
    float mean = static_cast<float>(loss_sum);
    ctx_.dp->all_reduce(&mean, &mean, 1, DType::kF32, ReduceOp::kAvg)->wait();
    loss_sum = mean;
  }
  r.loss = loss_sum / static_cast<double>(accum);
  const auto t0 = clock::now();
  r.grad_norm = zero.clip_grad_norm(config_.gradient_clipping);
  zero.step(lr, step + 1);
  r.t_optimizer = seconds_since(t0);
  r.comm = zero.take_stats();
  // Tensor-parallel collectives block the layers that issue them: all exposed.
  const tp::Traffic t = tp_.take_traffic();
  r.comm.comm_s += t.seconds;
  r.comm.exposed_s += t.seconds;
  r.comm.bytes += t.bytes;
  return r;
}

double StepEngine::evaluate(const BatchSource& data, int64_t batches) {
  if (executor_) return evaluate_pipelined(data, batches);
  ZeroEngine& zero = *chunks_[0].zero;
  GptStage<float>& stage = *chunks_[0].stage;
  // Each validation batch is split over micro-batches and ranks as a
  // training batch is; at ZeRO stage 3 a forward is collective (it gathers
  // each unit), so every rank runs the same number.
  float sum_count[2] = {0, 0};
  for (int64_t s = 0; s < batches; ++s) {
    for (int64_t micro = 0; micro < config_.grad_accum; ++micro) {
      const int64_t first = s * config_.train_batch_size + first_sample(micro);
      const StepContext ctx{config_.train.seed, 0, static_cast<uint64_t>(first), false};
      fill(data, 0, first);
      zero.begin_micro_batch(stage.unit_schedule(false), false);
      sum_count[0] +=
          static_cast<float>(stage.forward(acts_, inputs_.data(), nullptr, targets_.data(), ctx));
      zero.end_micro_batch();
      sum_count[1] += 1;
    }
  }
  if (ctx_.dp) ctx_.dp->all_reduce(sum_count, sum_count, 2, DType::kF32, ReduceOp::kSum)->wait();
  return sum_count[0] / sum_count[1];
}

std::vector<float> StepEngine::gather_params() {
  ZeroEngine& zero = *chunks_[0].zero;
  GptStage<float>& stage = *chunks_[0].stage;
  const bool gathered = zero.full_params_gathered();
  zero.gather_full_params();
  std::vector<float> out(stage.params(), stage.params() + stage.num_params());
  if (!gathered) zero.release_full_params(false);
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

StepStats StepEngine::step_pipelined(const BatchSource& data, int64_t step, double lr) {
  using clock = std::chrono::steady_clock;
  StepStats r;
  const int64_t m = config_.grad_accum, BT = config_.micro_batch * config_.model.seq_len;
  for (Chunk& c : chunks_) c.zero->zero_grads();
  tp_.take_traffic();  // evaluation's does not count
  std::vector<pp::MicroBatch> mbs(static_cast<size_t>(m));
  for (int64_t micro = 0; micro < m; ++micro) {
    // Samples and dropout masks are keyed on the global sample index, as
    // without a pipeline.
    const StepContext ctx{config_.train.seed, static_cast<uint64_t>(step),
                          static_cast<uint64_t>(first_sample(micro)), true};
    fill(data, ctx.step, static_cast<int64_t>(ctx.sample0), micro);
    mbs[static_cast<size_t>(micro)] = {inputs_.data() + micro * BT, targets_.data() + micro * BT,
                                       ctx};
  }
  auto on_reduce = [&] { sum_tied_grads(); };
  auto on_step = [&] {
    const auto t0 = clock::now();
    r.grad_norm = clip_pipelined();
    for (Chunk& c : chunks_) c.zero->step(lr, step + 1);
    r.t_optimizer = seconds_since(t0);
  };
  const pp::ExecStats st = executor_->train(mbs, 1.0 / static_cast<double>(m), on_reduce, on_step);
  r.t_forward = st.forward;
  r.t_backward = st.backward;
  r.t_recompute = st.recompute;
  r.t_p2p_wait = st.wait;
  // The loss lives on the last stage: every stage takes it from there, then
  // the mean over the data-parallel replicas as without a pipeline.
  const std::vector<double> losses = all_gather_words(*ctx_.pp, &st.loss, 1);
  double sum = losses.back();
  if (ctx_.dp) {
    float mean = static_cast<float>(sum);
    ctx_.dp->all_reduce(&mean, &mean, 1, DType::kF32, ReduceOp::kAvg)->wait();
    sum = mean;
  }
  r.loss = sum / static_cast<double>(m);
  // The bubble: the pipeline's span is from the first rank's start to the
  // last rank's last compute; a rank's idle time is the span less its own
  // compute. time.bubble is the most idle rank's; bubble_fraction the mean
  // idle share, as the theory and the simulator count it.
  const double mine[3] = {st.start, st.compute_end, st.forward + st.backward};
  const std::vector<double> all =
      ctx_.world ? all_gather_words(*ctx_.world, mine, 3) : std::vector<double>(mine, mine + 3);
  double first = all[0], last = all[1];
  for (size_t k = 0; k < all.size(); k += 3)
    first = std::min(first, all[k]), last = std::max(last, all[k + 1]);
  const double span = last - first;
  double idle_sum = 0;
  for (size_t k = 0; k < all.size(); k += 3) {
    const double idle = std::max(0.0, span - all[k + 2]);
    r.t_bubble = std::max(r.t_bubble, idle);
    idle_sum += idle;
  }
  const double ranks = static_cast<double>(all.size() / 3);
  r.bubble_fraction = span > 0 ? idle_sum / ranks / span : 0;
  for (Chunk& c : chunks_) {
    const CommStats z = c.zero->take_stats();
    r.comm.comm_s += z.comm_s;
    r.comm.exposed_s += z.exposed_s;
    r.comm.bytes += z.bytes;
  }
  const tp::Traffic t = tp_.take_traffic();
  r.comm.comm_s += t.seconds + st.wait;
  r.comm.exposed_s += t.seconds + st.wait;
  r.comm.bytes += t.bytes + st.p2p.bytes;
  return r;
}

void StepEngine::sum_tied_grads() {
  if (!ctx_.embedding) return;
  for (Chunk& c : chunks_) {
    GptStage<float>& s = *c.stage;
    if (!s.has_embedding() && !s.wte_is_copy()) continue;
    const Param& wte = s.layout().find("transformer.wte.weight");
    const int u = s.wte_unit();
    LOOM_CHECK(wte.offset == s.layout().units()[static_cast<size_t>(u)].begin,
               "wte does not open its unit");
    c.zero->sum_unit_grads(u, wte.numel, *ctx_.embedding);
  }
}

double StepEngine::clip_pipelined() {
  double split = 0, whole = 0;
  for (Chunk& c : chunks_) {
    const GptStage<float>& s = *c.stage;
    const auto [a, b] = c.zero->grad_sum_squares(s.wte_is_copy() ? s.wte_unit() : -1);
    split += a;
    whole += b;
  }
  // Slices add over the tensor-parallel group, whole parameters count once;
  // then the stages add, in stage order on every rank.
  double ss = whole;
  if (ctx_.tp) {
    for (double x : all_gather_words(*ctx_.tp, &split, 1)) ss += x;
  } else {
    ss += split;
  }
  double total = 0;
  for (double x : all_gather_words(*ctx_.pp, &ss, 1)) total += x;
  const double norm = std::sqrt(total);
  const double max_norm = config_.gradient_clipping;
  if (max_norm > 0 && norm > max_norm)
    for (Chunk& c : chunks_) c.zero->scale_grads(static_cast<float>(max_norm / (norm + 1e-6)));
  return norm;
}

double StepEngine::evaluate_pipelined(const BatchSource& data, int64_t batches) {
  const int64_t m = config_.grad_accum, BT = config_.micro_batch * config_.model.seq_len;
  double sum = 0;
  std::vector<pp::MicroBatch> mbs(static_cast<size_t>(m));
  for (int64_t s = 0; s < batches; ++s) {
    for (int64_t micro = 0; micro < m; ++micro) {
      const int64_t first = s * config_.train_batch_size + first_sample(micro);
      fill(data, 0, first, micro);
      mbs[static_cast<size_t>(micro)] = {
          inputs_.data() + micro * BT, targets_.data() + micro * BT,
          StepContext{config_.train.seed, 0, static_cast<uint64_t>(first), false}};
    }
    sum += executor_->evaluate(mbs).loss;
  }
  const std::vector<double> losses = all_gather_words(*ctx_.pp, &sum, 1);
  float sum_count[2] = {static_cast<float>(losses.back()), static_cast<float>(batches * m)};
  if (ctx_.dp) ctx_.dp->all_reduce(sum_count, sum_count, 2, DType::kF32, ReduceOp::kSum)->wait();
  return sum_count[0] / sum_count[1];
}

}  // namespace loom
