#include "loom/train/step_engine.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>

#include "loom/core/clock.h"
#include "loom/core/error.h"
#include "loom/core/fault.h"
#include "loom/core/range.h"
#include "loom/core/rng.h"
#include "loom/parallel/expert/all_to_all.h"
#include "loom/parallel/tensor/factory.h"
#include "loom/train/pipeline_setup.h"

namespace loom {

namespace {

// The layers of this rank: tensor-parallel ones over a group of more than
// one rank, MoE experts split over an expert-parallel group; null: the
// single-process layers.
std::unique_ptr<LayerFactory<float>> layers_for(
    const tp::Group& g, bool sequence_parallel, bool moe_split,
    const std::shared_ptr<ep::AllToAllDispatcher>& experts,
    const std::shared_ptr<context::ContextAttention>& context) {
  std::unique_ptr<LayerFactory<float>> f;
  if (g.size() > 1)
    f = std::make_unique<tp::TensorParallelFactory>(g, sequence_parallel, moe_split);
  else if (experts || context)
    f = std::make_unique<LayerFactory<float>>();
  if (f && experts) f->set_expert_dispatcher(experts);
  if (f && context)
    f->set_attention_core(context, context->split(),
                          std::make_shared<context::ContextGather>(context));
  return f;
}

std::shared_ptr<context::ContextAttention> context_for(const Config& c,
                                                       const ParallelContext& ctx) {
  if (!ctx.cp || ctx.cp->size() == 1) return nullptr;
  return std::make_shared<context::ContextAttention>(
      ctx.cp, context::parse_context_comm(c.parallel.context_comm), c.parallel.context_balance);
}

// The type the layers' tensors cross ranks in (comm.payloads): a bf16
// run's bf16 unless f32 is asked for; fp16 runs keep f32, whose range the
// loss-scaled gradients may need.
DType payload_type(const Config& c) {
  return c.precision == DType::kBF16 && c.comm.payloads == "auto" ? DType::kBF16 : DType::kF32;
}

std::shared_ptr<ep::AllToAllDispatcher> experts_for(const Config& c, const ParallelContext& ctx,
                                                    const Backend<float>& backend) {
  if (c.model.moe_experts == 0 || !ctx.ep || ctx.ep->size() == 1) return nullptr;
  return std::make_shared<ep::AllToAllDispatcher>(ctx.ep, payload_type(c), &backend);
}

}  // namespace

StepEngine::StepEngine(const Config& config, ParallelContext ctx, const Backend<float>& backend)
    : config_(config),
      ctx_(std::move(ctx)),
      backend_(backend),
      tp_(ctx_.tp, payload_type(config), &backend),
      experts_(experts_for(config, ctx_, backend)),
      context_(context_for(config, ctx_)),
      // Under tensor parallelism the MoE layers split a micro-batch's
      // sequences over the group when they divide evenly.
      moe_split_(tp_.size() > 1 && config.model.moe_experts > 0 &&
                 config.micro_batch % tp_.size() == 0),
      layers_(layers_for(tp_, config.parallel.sequence_parallel, moe_split_, experts_, context_)) {
  if (config_.precision == DType::kF16)
    scaler_ = std::make_unique<LossScaler>(config_.loss_scaling);
  set_fault_rank(ctx_.launch_rank);
  const int tp = ctx_.tp ? ctx_.tp->size() : 1;
  const int p = ctx_.pp ? ctx_.pp->size() : 1;
  LOOM_CHECK_KIND(kConfig, config_.parallel.tensor == tp,
                  "the config's parallel.tensor {} differs from the job's tensor-parallel group "
                  "of {}",
                  config_.parallel.tensor, tp);
  LOOM_CHECK_KIND(kConfig, config_.parallel.pipeline == p,
                  "the config's parallel.pipeline {} differs from the job's pipeline group of {}",
                  config_.parallel.pipeline, p);
  LOOM_CHECK_KIND(kConfig, config_.parallel.context == ctx_.cp_size(),
                  "the config's parallel.context {} differs from the job's context-parallel group "
                  "of {}",
                  config_.parallel.context, ctx_.cp_size());
  LOOM_CHECK_KIND(kConfig, config_.data_parallel == ctx_.replicas(),
                  "the config's data-parallel size {} differs from the job's {}",
                  config_.data_parallel, ctx_.replicas());
  const int ep = ctx_.ep ? ctx_.ep->size() : 1;
  LOOM_CHECK_KIND(kConfig, config_.parallel.expert == ep,
                  "the config's parallel.expert {} differs from the job's expert-parallel group "
                  "of {}",
                  config_.parallel.expert, ep);
  const int64_t B = config_.micro_batch, Tn = config_.local_seq_len(), m = config_.grad_accum;
  const pp::ScheduleKind kind = pp::parse_schedule(config_.parallel.schedule);
  const int v = kind == pp::ScheduleKind::kInterleaved ? config_.parallel.virtual_stages : 1;
  const int stage = ctx_.coord().pp;
  // The run's one schedule, simulated once: activation stores held at once
  // per stage (one without a pipeline), which the partition weighs too.
  std::optional<pp::Schedule> schedule;
  std::optional<pp::SimResult> sim;
  if (p > 1) {
    schedule = pp::make_schedule(kind, p, static_cast<int>(m), v);
    sim = pp::simulate(*schedule);
  }
  const int in_flight = sim ? sim->peak_in_flight[static_cast<size_t>(stage)] : 1;
  partition_ = resolve_partition(config_, ctx_, backend_, sim ? &*sim : nullptr);
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
        storage, layers, backend_);
    ch.stage->set_plan(ch.stage->plan(config_.checkpointing.policy, B, Tn, in_flight));
    ch.zero =
        std::make_unique<ZeroEngine>(ch.stage->store(), ctx_.dp, config_.zero, config_.optimizer,
                                     experts_ ? ExpertGroups{ctx_.ep, ctx_.ep_dp} : ExpertGroups{});
    refs.push_back({ch.stage.get(), ch.zero.get()});
    chunks_.push_back(std::move(ch));
  }
  if (schedule) {
    executor_ = std::make_unique<pp::Executor>(*schedule, stage, refs, ctx_.pp, B, Tn,
                                               payload_type(config_));
    executor_->set_tracing(config_.log.trace);
  } else {
    acts_ = chunks_[0].stage->make_activations(B, Tn);
  }
  // One time origin for every rank (the bubble's span, the timeline),
  // taken right after a barrier.
  if (ctx_.world) ctx_.world->barrier()->wait();
  const auto origin = std::chrono::steady_clock::now();
  origin_s_ = std::chrono::duration<double>(origin.time_since_epoch()).count();
  if (executor_) executor_->set_time_origin(origin);
  const int64_t micro_batches = schedule ? m : 1;
  inputs_.resize(static_cast<size_t>(micro_batches * B * Tn));
  targets_.resize(static_cast<size_t>(micro_batches * B * Tn));
}

const std::vector<pp::TraceSlice>& StepEngine::trace() const {
  static const std::vector<pp::TraceSlice> none;
  return executor_ ? executor_->trace() : none;
}

int64_t StepEngine::first_sample(int64_t micro) const {
  return (micro * ctx_.replicas() + ctx_.replica()) * config_.micro_batch;
}

void StepEngine::fill(const BatchSource& data, uint64_t step, int64_t sample0, int64_t micro) {
  const int64_t B = config_.micro_batch, T = config_.model.seq_len, Tl = config_.local_seq_len();
  const size_t at = static_cast<size_t>(micro * B * Tl);
  if (!context_) {
    data.fill(step, static_cast<uint64_t>(sample0), B, T, inputs_.data() + at,
              targets_.data() + at);
    return;
  }
  // Context parallelism: the whole sequences, then this rank's two chunks
  // of each (inputs and targets alike; positions follow from the split).
  std::vector<int32_t> in(static_cast<size_t>(B * T)), tg(in.size());
  data.fill(step, static_cast<uint64_t>(sample0), B, T, in.data(), tg.data());
  const ContextSplit cs = context_->split();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tl; ++t) {
      const size_t from = static_cast<size_t>(b * T + cs.position(t, Tl));
      const size_t to = at + static_cast<size_t>(b * Tl + t);
      inputs_[to] = in[from], targets_[to] = tg[from];
    }
}

StepStats StepEngine::step(const BatchSource& data, int64_t step, double lr) {
  if (executor_) return step_pipelined(data, step, lr);
  using clock = std::chrono::steady_clock;
  StepStats r;
  r.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  ZeroEngine& zero = *chunks_[0].zero;
  GptStage<float>& stage = *chunks_[0].stage;
  const int64_t accum = config_.grad_accum;
  drop_moe_stats();
  zero.zero_grads();
  stage.take_recompute_seconds();
  tp_.take_traffic();  // evaluation's does not count
  if (context_) context_->take_stats();
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
    stage.backward(acts_, r.loss_scale / static_cast<double>(accum));
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
  sum_split_moe_grads();
  inject_nonfinite(step);
  inject_grad_scale();
  if (scaler_) zero.scale_grads(static_cast<float>(1.0 / r.loss_scale));
  r.grad_norm = clip_global();
  r.skipped = !accept_update(step, r.grad_norm, &r.nonfinite);
  r.moe = moe_stats(!r.skipped);
  if (!r.skipped)
    zero.step(lr, step + 1 - skipped_, settles(step + 1));
  else if (settles(step + 1))
    zero.settle();
  r.t_optimizer = seconds_since(t0);
  r.comm = zero.take_stats();
  take_compression(r);
  // Tensor-parallel collectives block the layers that issue them: all exposed.
  const tp::Traffic t = tp_.take_traffic();
  r.comm.comm_s += t.seconds;
  r.comm.exposed_s += t.seconds;
  take_all_to_all(r);
  take_context(r);
  return r;
}

void StepEngine::take_context(StepStats& r) {
  if (!context_) return;
  const context::ContextStats s = context_->take_stats();
  r.t_context_attention = s.attention_s;
  r.t_context_comm = s.comm_s;
  r.t_context_exposed = s.exposed_s;
  r.context_sent_bytes = s.sent_bytes;
  r.comm.comm_s += s.comm_s;
  r.comm.exposed_s += s.exposed_s;
}

bool StepEngine::settles(int64_t step) const {
  // Where the trainer evaluates, saves or stops (trainer.cc's run loop).
  const TrainConfig& t = config_.train;
  const int64_t every = config_.checkpoint.every;
  return step >= t.steps || (t.eval_every > 0 && step % t.eval_every == 0) ||
         (every > 0 && step % every == 0);
}

void StepEngine::take_compression(StepStats& r) {
  for (Chunk& c : chunks_) {
    const CompressionStats z = c.zero->take_compression();
    r.compression.compressed = r.compression.compressed || z.compressed;
    r.compression.local = r.compression.local || z.local;
    r.compression.sent_bytes += z.sent_bytes;
    r.compression.plain_bytes += z.plain_bytes;
    r.compression.error_sum_squares += z.error_sum_squares;
  }
}

void StepEngine::take_all_to_all(StepStats& r) {
  if (!experts_) return;
  const ep::AllToAllStats a = experts_->take_stats();
  r.t_all_to_all = a.seconds;
  r.comm.comm_s += a.seconds;
  r.comm.exposed_s += a.seconds;
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
      fault_point("eval");
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
  // One small reduction of counters, whatever the world's size.
  std::array<int64_t, kNumMemCategories> peak{};
  for (int c = 0; c < kNumMemCategories; ++c) peak[c] = static_cast<int64_t>(mem.peak[c]);
  ctx_.world->all_reduce(peak.data(), peak.data(), peak.size(), DType::kI64, ReduceOp::kMax)
      ->wait();
  for (int c = 0; c < kNumMemCategories; ++c) mem.peak[c] = static_cast<size_t>(peak[c]);
  return mem;
}

StepStats StepEngine::step_pipelined(const BatchSource& data, int64_t step, double lr) {
  using clock = std::chrono::steady_clock;
  StepStats r;
  r.loss_scale = scaler_ ? scaler_->scale() : 1.0;
  const int64_t m = config_.grad_accum, BT = config_.micro_batch * config_.local_seq_len();
  for (Chunk& c : chunks_) c.zero->zero_grads();
  drop_moe_stats();
  tp_.take_traffic();  // evaluation's does not count
  if (context_) context_->take_stats();
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
  auto on_reduce = [&] {
    sum_tied_grads();
    sum_split_moe_grads();
  };
  auto on_step = [&] {
    const auto t0 = clock::now();
    inject_nonfinite(step);
    inject_grad_scale();
    if (scaler_)
      for (Chunk& c : chunks_) c.zero->scale_grads(static_cast<float>(1.0 / r.loss_scale));
    r.grad_norm = clip_global();
    r.skipped = !accept_update(step, r.grad_norm, &r.nonfinite);
    r.moe = moe_stats(!r.skipped);
    for (Chunk& c : chunks_) {
      if (!r.skipped)
        c.zero->step(lr, step + 1 - skipped_, settles(step + 1));
      else if (settles(step + 1))
        c.zero->settle();
    }
    r.t_optimizer = seconds_since(t0);
  };
  const pp::ExecStats st =
      executor_->train(mbs, r.loss_scale / static_cast<double>(m), on_reduce, on_step);
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
  }
  take_compression(r);
  const tp::Traffic t = tp_.take_traffic();
  r.comm.comm_s += t.seconds + st.wait;
  r.comm.exposed_s += t.seconds + st.wait;
  take_all_to_all(r);
  take_context(r);
  return r;
}

void StepEngine::drop_moe_stats() {
  for (Chunk& c : chunks_) c.stage->take_moe_stats();
  if (experts_) experts_->take_stats();
}

std::vector<MoeLayerStats> StepEngine::moe_stats(bool update) {
  const GptConfig& m = config_.model;
  if (m.moe_experts == 0) return {};
  // Per block: E loads, assignments, dropped, aux sum, z sum, forwards;
  // summed over the ranks (replicas add, stages hold different blocks).
  const size_t E = static_cast<size_t>(m.moe_experts), width = E + 5;
  std::vector<double> mine(static_cast<size_t>(m.n_layer) * width, 0.0);
  for (Chunk& c : chunks_)
    for (const auto& [layer, st] : c.stage->take_moe_stats()) {
      double* row = mine.data() + static_cast<size_t>(layer) * width;
      for (size_t e = 0; e < E; ++e) row[e] += double(st.load[e]);
      row[E] += double(st.assignments), row[E + 1] += double(st.dropped);
      row[E + 2] += st.aux, row[E + 3] += st.z, row[E + 4] += double(st.forwards);
    }
  std::vector<double> sum = mine;
  if (ctx_.world) {
    const std::vector<double> all = all_gather_words(*ctx_.world, mine.data(), mine.size());
    std::fill(sum.begin(), sum.end(), 0.0);
    for (size_t i = 0; i < all.size(); ++i) sum[i % mine.size()] += all[i];
  }
  if (update && m.moe_bias_balancing)
    for (Chunk& c : chunks_) {
      const std::vector<ZeroEngine::StateRange> held = c.zero->held(ZeroEngine::State::kParams);
      for (int l = c.stage->first(); l < c.stage->last(); ++l) {
        const Param* b = c.stage->layout().find_or_null("transformer.h." + std::to_string(l) +
                                                        ".mlp.router.bias");
        if (b == nullptr) continue;
        const double* row = sum.data() + static_cast<size_t>(l) * width;
        double mean = 0;
        for (size_t e = 0; e < E; ++e) mean += row[e] / double(E);
        const ZeroEngine::StateRange r = held[static_cast<size_t>(b->unit)];
        for (int64_t e = std::max(r.begin, b->offset); e < std::min(r.end, b->offset + b->numel);
             ++e) {
          const double load = row[static_cast<size_t>(e - b->offset)];
          const double dir = load < mean ? 1.0 : load > mean ? -1.0 : 0.0;
          r.data[e - r.begin] += static_cast<float>(m.moe_bias_update_rate * dir);
        }
      }
    }
  std::vector<MoeLayerStats> out;
  for (int l = 0; l < m.n_layer; ++l) {
    if (!m.moe_layer(l)) continue;
    const double* row = sum.data() + static_cast<size_t>(l) * width;
    MoeLayerStats s;
    s.layer = l;
    double mean = 0, most = 0, var = 0;
    for (size_t e = 0; e < E; ++e) mean += row[e] / double(E), most = std::max(most, row[e]);
    for (size_t e = 0; e < E; ++e) var += (row[e] - mean) * (row[e] - mean) / double(E);
    s.imbalance = mean > 0 ? most / mean : 0;
    s.cv = mean > 0 ? std::sqrt(var) / mean : 0;
    s.dropped = row[E] > 0 ? row[E + 1] / row[E] : 0;
    s.aux = row[E + 4] > 0 ? row[E + 2] / row[E + 4] : 0;
    s.z = row[E + 4] > 0 ? row[E + 3] / row[E + 4] : 0;
    for (size_t e = 0; e < E; ++e) s.load.push_back(mean > 0 ? row[e] / (mean * double(E)) : 0);
    out.push_back(s);
  }
  return out;
}

void StepEngine::sum_split_moe_grads() {
  if (!moe_split_) return;
  for (Chunk& c : chunks_) {
    const ParamLayout& layout = c.stage->layout();
    for (const Unit& u : layout.units())
      if (u.expert()) c.zero->sum_grads(u.begin, u.end, *ctx_.tp);
    for (const Param& p : layout.params())
      if (p.name.ends_with(".mlp.router.weight"))
        c.zero->sum_grads(p.offset, p.offset + p.numel, *ctx_.tp);
  }
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

double StepEngine::clip_global() {
  // Every chunk of this rank's stage; a tied wte copy counts on the first stage only.
  std::vector<NormPart> parts;
  for (Chunk& c : chunks_)
    parts.push_back({c.zero.get(), c.stage->wte_is_copy() ? c.stage->wte_unit() : -1});
  const double norm = agree_norm(global_grad_norm(parts, ctx_.tp.get(), ctx_.pp.get()));
  for (Chunk& c : chunks_) c.zero->clip_grads(norm, config_.gradient_clipping);
  return norm;
}

double StepEngine::agree_norm(double norm) const {
  if (!ctx_.world || ctx_.world->size() == 1) return norm;
  // One verdict for the whole job: every rank takes world rank 0's norm
  // (its clipping factor, its skip decision, the loss scaler's move), and
  // any rank's non-finite norm makes the step non-finite everywhere. The
  // ranks' norms agree in exact arithmetic; this makes them agree in bits.
  const std::vector<double> all = all_gather_words(*ctx_.world, &norm, 1);
  for (double x : all)
    if (!std::isfinite(x)) return x;
  return all[0];
}

double StepEngine::evaluate_pipelined(const BatchSource& data, int64_t batches) {
  const int64_t m = config_.grad_accum, BT = config_.micro_batch * config_.local_seq_len();
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
    fault_point("eval");
  }
  const std::vector<double> losses = all_gather_words(*ctx_.pp, &sum, 1);
  float sum_count[2] = {static_cast<float>(losses.back()), static_cast<float>(batches * m)};
  if (ctx_.dp) ctx_.dp->all_reduce(sum_count, sum_count, 2, DType::kF32, ReduceOp::kSum)->wait();
  return sum_count[0] / sum_count[1];
}

bool StepEngine::accept_update(int64_t step, double norm, std::string* skipped_in) {
  if (scaler_) {
    // An overflow anywhere makes the global norm non-finite on every rank:
    // all agree to skip, and the scale moves the same way everywhere.
    const bool overflow = !std::isfinite(norm);
    const double scale = scaler_->scale();
    const bool can_go_on = scaler_->update(overflow);
    if (!overflow) return true;
    const std::string name = first_nonfinite_param();
    if (!can_go_on)
      LOOM_FAIL(kData,
                "step {}: fp16 gradients overflow at the minimum loss scale {} "
                "(fp16.min_loss_scale){}; the values outgrow fp16: lower the learning rate, clip "
                "gradients (gradient_clipping) or train in bf16",
                step + 1, scale,
                name.empty() ? std::string() : ", first in '" + name + "' (in model order)");
    ++skipped_;
    *skipped_in = name;
    return false;
  }
  if (std::isfinite(norm)) return true;
  const std::string name = first_nonfinite_param();
  if (config_.train.on_nonfinite == "skip") {
    ++skipped_;
    *skipped_in = name;
    return false;
  }
  LOOM_FAIL(
      kData,
      "step {}: non-finite gradient (norm {}){}; stopping here (train.on_nonfinite: skip "
      "would skip such steps and go on)",
      step + 1, norm,
      name.empty() ? std::string() : " first in '" + name + "' (in the model's parameter order)");
}

std::string StepEngine::first_nonfinite_param() {
  // The whole model's parameter order, by name.
  const GptStage<float> whole(config_.model, StageSpec{}, StoreOptions{1, false, false});
  const std::vector<Param>& order = whole.layout().params();
  float first = static_cast<float>(order.size());  // none
  for (Chunk& c : chunks_) {
    const std::vector<ZeroEngine::StateRange> held = c.zero->held(ZeroEngine::State::kGrads);
    for (const Param& p : c.stage->layout().params()) {
      const ZeroEngine::StateRange& r = held[static_cast<size_t>(p.unit)];
      const auto [lo, hi] = intersect({r.begin, r.end}, {p.offset, p.offset + p.numel});
      if (lo >= hi) continue;
      bool bad = false;
      if (r.data16)
        bad = backend_.nonfinite_16(r.data16 + (lo - r.begin), hi - lo, c.zero->dtype());
      for (int64_t i = lo; i < hi && !bad && r.data; ++i) bad = !std::isfinite(r.data[i - r.begin]);
      if (!bad) continue;
      for (size_t k = 0; k < order.size(); ++k)
        if (order[k].name == p.name) first = std::min(first, static_cast<float>(k));
    }
  }
  // The smallest index over the world (exact in f32 below 2^24 parameters).
  float neg = -first;
  if (ctx_.world) ctx_.world->all_reduce(&neg, &neg, 1, DType::kF32, ReduceOp::kMax)->wait();
  const size_t k = static_cast<size_t>(-neg);
  return k < order.size() ? order[k].name : std::string();
}

void StepEngine::inject_nonfinite(int64_t step) {
  const char* spec = std::getenv("LOOM_TEST_NONFINITE");
  if (spec == nullptr) return;
  const std::string s(spec);
  const size_t colon = s.find(':');
  if (colon == std::string::npos) return;
  // STEPS is one step or a comma-separated list.
  // (Built by appending: GCC 12 warns falsely on "," + string + ",".)
  std::string steps = ",", want = ",";
  steps.append(s, 0, colon).append(",");
  want.append(std::to_string(step + 1)).append(",");
  if (steps.find(want) == std::string::npos) return;
  const std::string name = s.substr(colon + 1);
  for (Chunk& c : chunks_) {
    const Param* p = c.stage->layout().find_or_null(name);
    if (p == nullptr) continue;
    const ZeroEngine::StateRange r =
        c.zero->held(ZeroEngine::State::kGrads)[static_cast<size_t>(p->unit)];
    const auto [lo, hi] = intersect({r.begin, r.end}, {p->offset, p->offset + p->numel});
    if (lo >= hi) continue;
    if (r.data16)
      r.data16[lo - r.begin] = c.zero->dtype() == DType::kBF16 ? 0x7fc0 : 0x7e00;  // NaN
    else
      r.data[lo - r.begin] = std::numeric_limits<float>::quiet_NaN();
  }
}

void StepEngine::inject_grad_scale() {
  const char* spec = std::getenv("LOOM_TEST_GRAD_SCALE");
  if (spec == nullptr) return;
  const std::string text(spec);
  const size_t colon = text.rfind(':');
  if (colon == std::string::npos) return;
  const std::string name = text.substr(0, colon);
  const float factor = std::stof(text.substr(colon + 1));
  for (Chunk& c : chunks_) {
    const Param* p = c.stage->layout().find_or_null(name);
    // The tied wte's copy on the last stage is summed into the first's.
    if (p == nullptr || (name == "transformer.wte.weight" && c.stage->wte_is_copy())) continue;
    const ZeroEngine::StateRange r =
        c.zero->held(ZeroEngine::State::kGrads)[static_cast<size_t>(p->unit)];
    const auto [lo, hi] = intersect({r.begin, r.end}, {p->offset, p->offset + p->numel});
    if (lo >= hi) continue;
    if (r.data16)
      backend_.scale_16(r.data16 + (lo - r.begin), hi - lo, factor, c.zero->dtype());
    else
      for (int64_t i = lo; i < hi; ++i) r.data[i - r.begin] *= factor;
  }
}

void StepEngine::check_replicas() {
  if (!ctx_.tp || ctx_.tp->size() == 1) return;
  // A digest of each replicated parameter's master elements this rank
  // holds. The tensor-parallel ranks' layouts are alike (equal slices), so
  // the same dp rank holds the same elements of every replica.
  std::vector<uint64_t> digests;
  std::vector<const Param*> params;
  for (Chunk& c : chunks_) {
    const std::vector<ZeroEngine::StateRange> held = c.zero->held(ZeroEngine::State::kParams);
    for (const Param& p : c.stage->layout().params()) {
      if (p.shard.sharded()) continue;
      const ZeroEngine::StateRange& r = held[static_cast<size_t>(p.unit)];
      const auto [lo, hi] = intersect({r.begin, r.end}, {p.offset, p.offset + p.numel});
      // FNV-1a over the elements' bytes (empty when this rank holds none).
      const bool held = lo < hi;
      const char* x = held ? reinterpret_cast<const char*>(r.data + (lo - r.begin)) : "";
      digests.push_back(name_hash({x, held ? static_cast<size_t>(hi - lo) * sizeof(float) : 0}));
      params.push_back(&p);
    }
  }
  if (digests.empty()) return;
  const size_t n = digests.size();
  const std::vector<uint64_t> all = all_gather_words(*ctx_.tp, digests.data(), n);
  for (size_t k = 0; k < n; ++k)
    for (int r = 1; r < ctx_.tp->size(); ++r)
      if (all[static_cast<size_t>(r) * n + k] != all[k])
        LOOM_FAIL(kData,
                  "replicated parameter '{}' differs between tensor-parallel ranks 0 and {} of "
                  "this group: its copies must stay bitwise equal (they are computed from the "
                  "same inputs on every rank; a difference means the ranks diverged, e.g. "
                  "different thread counts or GEMM paths for replicated work)",
                  params[k]->name, r);
}

}  // namespace loom
