#include "loom/parallel/pipeline/executor.h"

#include <exception>

#include "loom/comm/algorithms/allreduce.h"
#include "loom/core/clock.h"
#include "loom/core/error.h"
#include "loom/core/fault.h"

namespace loom::pp {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

Executor::Executor(Schedule schedule, int stage, std::vector<ChunkRef> chunks,
                   std::shared_ptr<ProcessGroup> group, int64_t B, int64_t Tn, DType payload)
    : schedule_(std::move(schedule)),
      stage_(stage),
      group_(std::move(group)),
      B_(B),
      Tn_(Tn),
      payload_(payload),
      be_(chunks.empty() ? nullptr : &chunks[0].stage->store().backend()) {
  LOOM_CHECK(payload_ == DType::kF32 || payload_ == DType::kBF16 || payload_ == DType::kF16,
             "pipeline messages travel in f32, bf16 or f16");
  LOOM_CHECK(static_cast<int>(chunks.size()) == schedule_.chunks,
             "stage {} holds {} chunks, the schedule {}", stage, chunks.size(), schedule_.chunks);
  LOOM_CHECK(!group_ || group_->size() == schedule_.stages,
             "a pipeline group of {} ranks for {} stages", group_ ? group_->size() : 1,
             schedule_.stages);
  // Point-to-point tags stay below the ones loom's collectives use.
  LOOM_CHECK_KIND(kConfig, 2 * schedule_.micro_batches * schedule_.chunks < algo::kAlgoTagBase,
                  "{} micro-batches x {} chunks exceed the pipeline's message tags",
                  schedule_.micro_batches, schedule_.chunks);
  for (ChunkRef& r : chunks) {
    Chunk c;
    c.ref = r;
    chunks_.push_back(std::move(c));
  }
  rows_ = chunks_[0].ref.stage->rows(B, Tn).count;
  C_ = chunks_[0].ref.stage->config().n_embd;
  const std::vector<Instr>& list = schedule_.per_stage[static_cast<size_t>(stage_)];
  for (size_t i = 0; i < list.size(); ++i) {
    const Op op = list[i].op;
    if (op == Op::kForward || op == Op::kRecvAct || op == Op::kSendAct)
      eval_list_.push_back(list[i]);
    // The final instruction writing a chunk's gradients: data-parallel
    // reductions of stages 0-1 run with it.
    if (op == Op::kBackward || op == Op::kBackwardWeight)
      chunks_[static_cast<size_t>(list[i].chunk)].last_backward = static_cast<int>(i);
  }
}

int Executor::tag(int micro, int receiving_chunk, bool gradient) const {
  return (micro * schedule_.chunks + receiving_chunk) * 2 + (gradient ? 1 : 0);
}

std::string Executor::describe(const Instr& in, bool gradient, bool sending) const {
  const int peer =
      gradient == sending ? schedule_.prev_stage(stage_) : schedule_.next_stage(stage_);
  return format("pipeline {} of the {} of micro-batch {} (chunk {}) {} stage {}",
                sending ? "send" : "receive", gradient ? "input gradient" : "activation", in.micro,
                in.chunk, sending ? "to" : "from", peer);
}

void Executor::wait(const WorkPtr& w, ExecStats& st) {
  if (!w) return;
  const auto t = Clock::now();
  w->wait();
  st.wait += seconds_between(t, Clock::now());
}

const float* Executor::received(int idx, ExecStats& st) {
  Pooled& p = pool_[static_cast<size_t>(idx)];
  wait(p.pending, st);
  p.pending = nullptr;
  if (payload_ != DType::kF32)
    be_->widen_16(p.wire.as<uint16_t>(), p.buf.as<float>(), rows_ * C_, payload_);
  return p.buf.as<float>();
}

const void* Executor::outgoing(const float* x, size_t n, Buffer& wire) const {
  if (payload_ == DType::kF32) return x;
  if (!wire.data()) wire = be_->alloc(n * dtype_size(payload_), MemCategory::kComm, false);
  be_->round_16(x, wire.as<uint16_t>(), static_cast<int64_t>(n), payload_);
  return wire.data();
}

int Executor::take_buffer() {
  // A free buffer whose send has completed; else a new one (a send still
  // in flight is never waited for here, so sends never block the schedule,
  // as the simulator assumes).
  for (size_t i = 0; i < pool_.size(); ++i) {
    if (in_use_[i] || (pool_[i].pending && !pool_[i].pending->test())) continue;
    if (pool_[i].pending) pool_[i].pending->wait();  // completed: collects its status
    pool_[i].pending = nullptr;
    in_use_[i] = true;
    return static_cast<int>(i);
  }
  const size_t n = static_cast<size_t>(rows_ * C_);
  pool_.push_back({be_->alloc(n * sizeof(float), MemCategory::kComm),
                   payload_ == DType::kF32
                       ? Buffer()
                       : be_->alloc(n * dtype_size(payload_), MemCategory::kComm, false),
                   {}});
  in_use_.push_back(true);
  return static_cast<int>(pool_.size()) - 1;
}

int Executor::take_slot(Chunk& c) {
  for (size_t i = 0; i < c.slots.size(); ++i) {
    Slot& s = *c.slots[i];
    if (s.busy || (s.pending_send && !s.pending_send->test())) continue;
    if (s.pending_send) s.pending_send->wait();
    s.pending_send = nullptr;
    s.busy = true;
    return static_cast<int>(i);
  }
  auto s = std::make_unique<Slot>();
  s->acts = c.ref.stage->make_activations(B_, Tn_);
  s->busy = true;
  c.slots.push_back(std::move(s));
  return static_cast<int>(c.slots.size()) - 1;
}

Executor::~Executor() {
  std::vector<WorkPtr> open;
  for (const Pooled& p : pool_)
    if (p.pending) open.push_back(p.pending);
  for (const Chunk& c : chunks_)
    for (const auto& s : c.slots)
      if (s && s->pending_send) open.push_back(s->pending_send);
  for (const WorkPtr& w : open) {
    if (!w->test() && std::uncaught_exceptions() > 0)
      fail_fast(format("{} (a pipeline message was still in flight)", last_error()));
    try {
      w->wait();
    } catch (...) {  // reported where it failed
    }
  }
}

void Executor::post_recv(const Instr& in) {
  Chunk& c = chunks_[static_cast<size_t>(in.chunk)];
  const bool gradient = in.op == Op::kRecvGrad;
  const int idx = take_buffer();
  (gradient ? c.grad_in : c.act_in)[static_cast<size_t>(in.micro)] = idx;
  const int peer = gradient ? schedule_.next_stage(stage_) : schedule_.prev_stage(stage_);
  Pooled& p = pool_[static_cast<size_t>(idx)];
  p.pending = group_->recv(payload_ == DType::kF32 ? p.buf.data() : p.wire.data(),
                           static_cast<size_t>(rows_ * C_), payload_, peer,
                           tag(in.micro, in.chunk, gradient), describe(in, gradient, false));
}

void Executor::send(const Instr& in) {
  Chunk& c = chunks_[static_cast<size_t>(in.chunk)];
  const bool gradient = in.op == Op::kSendGrad;
  const size_t n = static_cast<size_t>(rows_ * C_);
  const int peer = gradient ? schedule_.prev_stage(stage_) : schedule_.next_stage(stage_);
  const std::string what = describe(in, gradient, true);
  // Tagged with the chunk that receives it (the next part's for an
  // activation, the previous part's for a gradient).
  const int to =
      gradient ? schedule_.prev_chunk(stage_, in.chunk) : schedule_.next_chunk(stage_, in.chunk);
  if (gradient) {
    const size_t idx = static_cast<size_t>(c.grad_out[static_cast<size_t>(in.micro)]);
    Pooled& p = pool_[idx];
    p.pending = group_->send(outgoing(p.buf.as<float>(), n, p.wire), n, payload_, peer,
                             tag(in.micro, to, true), what);
    in_use_[idx] = false;  // reusable once the send completes
  } else {
    Slot& s = *c.slots[static_cast<size_t>(c.slot_of[static_cast<size_t>(in.micro)])];
    s.pending_send = group_->send(outgoing(s.acts.output, n, s.wire), n, payload_, peer,
                                  tag(in.micro, to, false), what);
  }
}

void Executor::forward(const Instr& in, const MicroBatch& mb, bool training, ExecStats& st) {
  Chunk& c = chunks_[static_cast<size_t>(in.chunk)];
  const size_t m = static_cast<size_t>(in.micro);
  const int slot = take_slot(c);
  c.slot_of[m] = slot;
  const float* input = nullptr;
  if (!schedule_.first_part(stage_, in.chunk)) {
    input = received(c.act_in[m], st);
  }
  const bool last = schedule_.last_part(stage_, in.chunk);
  const auto t = Clock::now();
  GptStage<float>& stage = *c.ref.stage;
  c.ref.zero->begin_micro_batch(stage.unit_schedule(false), false);
  const double loss = stage.forward(c.slots[static_cast<size_t>(slot)]->acts, mb.tokens, input,
                                    last ? mb.targets : nullptr, mb.ctx);
  c.ref.zero->end_micro_batch();
  st.forward += seconds_between(t, Clock::now());
  if (last) st.loss += loss;
  if (input) in_use_[static_cast<size_t>(c.act_in[m])] = false;
  // Evaluation keeps nothing for backward: the store is free once its
  // output has been sent (take_slot waits for that).
  if (!training) {
    c.slots[static_cast<size_t>(slot)]->busy = false;
    if (last) c.slot_of[m] = -1;
  }
}

void Executor::backward(const Instr& in, size_t pos, double loss_scale, ExecStats& st) {
  Chunk& c = chunks_[static_cast<size_t>(in.chunk)];
  const size_t m = static_cast<size_t>(in.micro);
  LOOM_CHECK(c.slot_of[m] >= 0, "backward of micro-batch {} chunk {} without its forward", in.micro,
             in.chunk);
  Slot& s = *c.slots[static_cast<size_t>(c.slot_of[m])];
  // Backward may reuse the record's memory; the activation sent from it
  // has been received (the gradient that comes back depends on it).
  wait(s.pending_send, st);
  s.pending_send = nullptr;
  const float* d_output = nullptr;
  if (!schedule_.last_part(stage_, in.chunk)) {
    d_output = received(c.grad_in[m], st);
  }
  float* d_input = nullptr;
  if (!schedule_.first_part(stage_, in.chunk)) {
    c.grad_out[m] = take_buffer();
    d_input = pool_[static_cast<size_t>(c.grad_out[m])].buf.as<float>();
  }
  const auto t = Clock::now();
  GptStage<float>& stage = *c.ref.stage;
  // Zero-bubble's B: the parameter gradients wait in this micro-batch's
  // record for its W; the activation store is free after B either way.
  DeferredGrads<float>* defer = nullptr;
  if (in.op == Op::kBackwardInput) {
    auto& d = c.deferred[m];
    if (!d) d = std::make_unique<DeferredGrads<float>>();
    defer = d.get();
  }
  c.ref.zero->begin_micro_batch(stage.backward_unit_schedule(defer != nullptr),
                                static_cast<int>(pos) == c.last_backward);
  stage.backward(s.acts, loss_scale, d_output, d_input, defer);
  c.ref.zero->end_micro_batch();
  st.backward += seconds_between(t, Clock::now());
  if (d_output) in_use_[static_cast<size_t>(c.grad_in[m])] = false;
  s.busy = false;
  c.slot_of[m] = -1;
}

void Executor::backward_weights(const Instr& in, size_t pos, ExecStats& st) {
  Chunk& c = chunks_[static_cast<size_t>(in.chunk)];
  auto& d = c.deferred[static_cast<size_t>(in.micro)];
  LOOM_CHECK(d && !d->empty(), "W of micro-batch {} chunk {} before its B", in.micro, in.chunk);
  const auto t = Clock::now();
  GptStage<float>& stage = *c.ref.stage;
  c.ref.zero->begin_micro_batch(stage.deferred_unit_schedule(*d),
                                static_cast<int>(pos) == c.last_backward);
  stage.apply_deferred(*d);
  c.ref.zero->end_micro_batch();
  st.backward += seconds_between(t, Clock::now());
}

ExecStats Executor::run(const std::vector<Instr>& list, const std::vector<MicroBatch>& mbs,
                        double loss_scale, bool training, const std::function<void()>& on_reduce,
                        const std::function<void()>& on_step) {
  LOOM_CHECK(static_cast<int>(mbs.size()) == schedule_.micro_batches,
             "{} micro-batches for a schedule of {}", mbs.size(), schedule_.micro_batches);
  for (Chunk& c : chunks_) {
    const size_t m = mbs.size();
    c.slot_of.assign(m, -1);
    c.act_in.assign(m, -1);
    c.grad_in.assign(m, -1);
    c.grad_out.assign(m, -1);
    c.deferred.resize(m);
  }
  ExecStats st;
  trace_.clear();
  t0_ = Clock::now();
  st.start = st.compute_end = seconds_between(origin_, t0_);
  for (size_t pos = 0; pos < list.size(); ++pos) {
    const Instr& in = list[pos];
    const auto t = Clock::now();
    switch (in.op) {
      case Op::kRecvAct:
      case Op::kRecvGrad:
        post_recv(in);
        fault_point("pipeline");
        break;
      case Op::kSendAct:
      case Op::kSendGrad:
        send(in);
        break;
      case Op::kForward:
        forward(in, mbs[static_cast<size_t>(in.micro)], training, st);
        break;
      case Op::kBackward:
      case Op::kBackwardInput:
        backward(in, pos, loss_scale, st);
        break;
      case Op::kBackwardWeight:
        backward_weights(in, pos, st);
        break;
      case Op::kReduceGrads:
        if (on_reduce) on_reduce();
        break;
      case Op::kOptimizerStep:
        if (on_step) on_step();
        break;
    }
    const auto done = Clock::now();
    if (is_compute(in.op)) st.compute_end = seconds_between(origin_, done);
    if (tracing_ && (is_compute(in.op) || in.op == Op::kReduceGrads || in.op == Op::kOptimizerStep))
      trace_.push_back({in, seconds_between(origin_, t), seconds_between(origin_, done)});
  }
  // Every buffer is quiet before the caller touches the model again.
  for (Pooled& p : pool_) {
    wait(p.pending, st);
    p.pending = nullptr;
  }
  for (Chunk& c : chunks_) {
    for (auto& s : c.slots) {
      wait(s->pending_send, st);
      s->pending_send = nullptr;
      s->busy = false;
    }
    st.recompute += c.ref.stage->take_recompute_seconds();
  }
  std::fill(in_use_.begin(), in_use_.end(), false);
  st.total = seconds_between(t0_, Clock::now());
  return st;
}

ExecStats Executor::train(const std::vector<MicroBatch>& mbs, double loss_scale,
                          const std::function<void()>& on_reduce,
                          const std::function<void()>& on_step) {
  return run(schedule_.per_stage[static_cast<size_t>(stage_)], mbs, loss_scale, true, on_reduce,
             on_step);
}

ExecStats Executor::evaluate(const std::vector<MicroBatch>& mbs) {
  return run(eval_list_, mbs, 0, false, {}, {});
}

}  // namespace loom::pp
