#include "loom/model/gpt_stage.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <string>
#include <type_traits>

#include "loom/core/clock.h"
#include "loom/core/error.h"
#include "loom/core/fault.h"

namespace loom {

template <typename T>
GptStage<T>::GptStage(const GptConfig& config, StageSpec spec, StoreOptions storage,
                      const LayerFactory<T>& layers, const Backend<T>& backend)
    : config_(config),
      first_(spec.first),
      last_(spec.last < 0 ? config.n_layer : spec.last),
      serial_layers_(layers.serial()),
      split_(layers.sequence_split()) {
  if (const ContextSplit cs = layers.context_split(); cs.size > 1) {
    LOOM_CHECK_KIND(kConfig, config.seq_len % (2 * cs.size) == 0,
                    "model.seq_len {} does not divide into 2 x parallel.context {} chunks",
                    config.seq_len, cs.size);
    positions_ = cs.positions(config.seq_len / cs.size);
  }
  LOOM_CHECK(first_ >= 0 && first_ <= last_ && last_ <= config.n_layer,
             "stage blocks [{}, {}) outside the model's {} layers", first_, last_, config.n_layer);
  ParamLayout layout(storage.unit_multiple);
  if (first_ == 0) {
    emb_unit_ = layout.begin_unit("embeddings");
    embedding_ = layers.embedding(layout, config);
  }
  for (int l = first_; l < last_; ++l) {
    const int unit = layout.begin_unit("h." + std::to_string(l));
    blocks_.push_back({std::make_unique<Block<T>>(layout, config, l, layers), unit});
  }
  if (last_ == config.n_layer) {
    lnf_unit_ = layout.begin_unit("ln_f");
    head_ = layers.head(layout, config);
    if (embedding_) {
      head_->tie(embedding_->wte());
      wte_unit_ = emb_unit_;
    } else {
      wte_unit_ = layout.begin_unit("lm_head");
      head_->declare_wte(layout);
      // Room for wpe as well, so this unit has the first stage's
      // "embeddings" unit's size and wte at the same offset: a ZeRO shard of
      // one then holds the same elements of wte as the matching shard of
      // the other, and the tied gradients add slice by slice.
      layout.reserve(int64_t{config.seq_len} * config.n_embd);
    }
  }
  store_.build(std::move(layout), storage, backend);
  plan_.blocks.assign(blocks_.size(), Recompute::kNone);
  unit_piece_.assign(store_.layout().units().size(), 0);
  if (embedding_) {
    unit_piece_[static_cast<size_t>(emb_unit_)] = static_cast<int>(pieces_.size());
    pieces_.push_back({"embeddings"});
  }
  for (const StageBlock& b : blocks_) {
    unit_piece_[static_cast<size_t>(b.unit)] = static_cast<int>(pieces_.size());
    pieces_.push_back({store_.layout().units()[static_cast<size_t>(b.unit)].name});
  }
  if (head_) {
    unit_piece_[static_cast<size_t>(lnf_unit_)] = static_cast<int>(pieces_.size());
    pieces_.push_back({"ln_f"});
    if (!embedding_) unit_piece_[static_cast<size_t>(wte_unit_)] = static_cast<int>(pieces_.size());
    pieces_.push_back({"lm_head"});
  }
  // A block's experts are part of its piece.
  const std::vector<Unit>& units = store_.layout().units();
  for (size_t u = 0; u < units.size(); ++u)
    if (units[u].expert()) unit_piece_[u] = unit_piece_[static_cast<size_t>(units[u].host)];
  for (size_t u = 0; u < units.size(); ++u)
    pieces_[static_cast<size_t>(unit_piece_[u])].params += units[u].size();
}

template <typename T>
size_t GptStage<T>::piece_of(const UnitStep& st) const {
  switch (st.kind) {
    case UnitStep::kEmbedding:
      return 0;
    case UnitStep::kBlock:
    case UnitStep::kRecompute:
      return (embedding_ ? 1 : 0) + st.block;
    case UnitStep::kNorm:
      return pieces_.size() - 2;
    case UnitStep::kLogits:
      break;
  }
  return pieces_.size() - 1;
}

template <typename T>
void GptStage<T>::add_seconds(size_t piece, Pass pass, double s) {
  PieceSeconds& p = pieces_[piece];
  (pass == Pass::kForward ? p.forward : pass == Pass::kRecompute ? p.recompute : p.backward) += s;
}

template <typename T>
void GptStage<T>::add_span(size_t piece, std::chrono::steady_clock::time_point from) {
  if (!record_spans_) return;
  auto at = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(t.time_since_epoch()).count();
  };
  pieces_[piece].spans.emplace_back(at(from), at(std::chrono::steady_clock::now()));
}

template <typename T>
std::vector<typename GptStage<T>::PieceSeconds> GptStage<T>::take_piece_seconds() {
  std::vector<PieceSeconds> out = pieces_;
  for (PieceSeconds& p : pieces_) {
    p.forward = p.backward = p.recompute = 0;
    p.spans.clear();
  }
  return out;
}

template <typename T>
Rows GptStage<T>::rows(int64_t B, int64_t Tn) const {
  const auto [piece, pieces] = split_;
  const int32_t* pos = nullptr;
  if (!positions_.empty()) {
    LOOM_CHECK(Tn == static_cast<int64_t>(positions_.size()),
               "a context-parallel stage runs sequences of {} local tokens, not {}",
               positions_.size(), Tn);
    pos = positions_.data();
  }
  if (pieces == 1) {
    Rows r = Rows::whole(B, Tn);
    r.pos = pos;
    return r;
  }
  LOOM_CHECK_KIND(kConfig, (B * Tn) % pieces == 0,
                  "a micro-batch of {} x {} = {} tokens does not split into {} sequence-parallel "
                  "pieces",
                  B, Tn, B * Tn, pieces);
  const int64_t n = B * Tn / pieces;
  return Rows{B, Tn, piece * n, n, pos};
}

template <typename T>
std::vector<typename GptStage<T>::UnitStep> GptStage<T>::forward_steps() const {
  std::vector<UnitStep> s;
  if (embedding_) s.push_back({UnitStep::kEmbedding, emb_unit_, 0, Pass::kForward});
  for (size_t i = 0; i < blocks_.size(); ++i)
    s.push_back({UnitStep::kBlock, blocks_[i].unit, i, Pass::kForward});
  if (head_) {
    s.push_back({UnitStep::kNorm, lnf_unit_, 0, Pass::kForward});
    s.push_back({UnitStep::kLogits, wte_unit_, 0, Pass::kForward});  // the tied LM head
  }
  return s;
}

template <typename T>
std::vector<typename GptStage<T>::UnitStep> GptStage<T>::backward_steps(bool deferred) const {
  const Pass pass = deferred ? Pass::kBackwardInput : Pass::kBackward;
  std::vector<UnitStep> s;
  if (head_) {
    s.push_back({UnitStep::kLogits, wte_unit_, 0, pass});
    s.push_back({UnitStep::kNorm, lnf_unit_, 0, pass});
  }
  for (size_t i = blocks_.size(); i-- > 0;) {
    if (mode(i) == Recompute::kFull)
      s.push_back({UnitStep::kRecompute, blocks_[i].unit, i, Pass::kRecompute});
    s.push_back({UnitStep::kBlock, blocks_[i].unit, i, pass});
  }
  // The lookup's backward writes gradients without reading parameters;
  // deferred, it only records them and uses no unit (apply_deferred does).
  if (embedding_)
    s.push_back({UnitStep::kEmbedding, emb_unit_, 0, Pass::kBackwardGradsOnly, !deferred});
  return s;
}

template <typename T>
std::vector<UnitUse> GptStage<T>::uses(const std::vector<UnitStep>& steps) {
  std::vector<UnitUse> u;
  for (const UnitStep& st : steps)
    if (st.hooks) u.push_back({st.unit, st.pass});
  return u;
}

template <typename T>
std::vector<UnitUse> GptStage<T>::unit_schedule(bool backward) const {
  std::vector<UnitUse> s = uses(forward_steps());
  if (!backward) return s;
  const std::vector<UnitUse> b = backward_unit_schedule();
  s.insert(s.end(), b.begin(), b.end());
  return s;
}

template <typename T>
std::vector<UnitUse> GptStage<T>::backward_unit_schedule(bool deferred) const {
  return uses(backward_steps(deferred));
}

template <typename T>
int64_t GptStage<T>::slot_elems(size_t i, const Rows& rw, const RecomputePlan& p) const {
  const Block<T>& b = *blocks_[i].layer;
  return packed(p, i) ? b.packed_elems(rw, p.blocks[i]) : b.record_elems(rw, p.blocks[i]);
}

template <typename T>
size_t GptStage<T>::block_bytes(int64_t B, int64_t Tn, Recompute m, DType records) const {
  // The largest block's (a mixture of experts records more than an MLP).
  RecomputePlan p;
  p.blocks.assign(blocks_.size(), m);
  p.records = records;
  int64_t most = 0;
  for (size_t i = 0; i < blocks_.size(); ++i) most = std::max(most, slot_elems(i, rows(B, Tn), p));
  return static_cast<size_t>(most) * sizeof(T);
}

template <typename T>
RecomputePlan GptStage<T>::plan(const CheckpointPolicy& policy, int64_t B, int64_t Tn,
                                int in_flight) const {
  const size_t n = blocks_.size();
  auto with = [&](auto&& choose) {
    RecomputePlan p;
    for (size_t i = 0; i < n; ++i) p.blocks.push_back(choose(static_cast<int>(i) + first_));
    p.head_logits = head_ != nullptr && p.count(Recompute::kFull) > 0;
    p.records = policy.records;
    return p;
  };
  constexpr bool f32_layers = std::is_same_v<T, float>;
  LOOM_CHECK_KIND(kConfig, policy.records == DType::kF32 || f32_layers,
                  "16-bit activation records need f32 layers");
  switch (policy.kind) {
    case CheckpointPolicy::kNone:
      return with([](int) { return Recompute::kNone; });
    case CheckpointPolicy::kFull:
      return with([](int) { return Recompute::kFull; });
    case CheckpointPolicy::kSelective:
      return with([](int) { return Recompute::kSelective; });
    case CheckpointPolicy::kEveryN:
      LOOM_CHECK_KIND(kConfig, policy.every_n >= 1,
                      "activation_checkpointing.every_n must be >= 1, got {}", policy.every_n);
      return with(
          [&](int l) { return l % policy.every_n == 0 ? Recompute::kFull : Recompute::kNone; });
    case CheckpointPolicy::kBudget:
      break;
  }
  // Budget: keep whole as many blocks as fit (the last ones, whose backward
  // comes first), the rest recomputed in full; the bytes counted are what
  // the activations category will hold at its peak: `in_flight` stores plus
  // the shared room.
  const size_t input = static_cast<size_t>(rows(B, Tn).count * config_.n_embd) * sizeof(T);
  auto bytes_with = [&](size_t whole) {
    RecomputePlan p = with([&](int l) {
      return static_cast<size_t>(l - first_) + whole >= n ? Recompute::kNone : Recompute::kFull;
    });
    const size_t b = in_flight * store_bytes(B, Tn, p) + room_bytes(B, Tn, p);
    return std::make_pair(b, p);
  };
  // Every count of whole blocks is costed: the bytes need not grow with it
  // (with none recomputed the room disappears), so the least over all
  // counts is what "too small" means, and the most whole blocks that fit win.
  const size_t budget = static_cast<size_t>(std::max<int64_t>(0, policy.budget_bytes));
  size_t least = 0;
  std::optional<RecomputePlan> best;
  for (size_t whole = 0; whole <= n; ++whole) {
    auto [b, p] = bytes_with(whole);
    least = whole == 0 ? b : std::min(least, b);
    if (b <= budget && budget >= input) best = p;
  }
  if (!best)
    LOOM_FAIL(kConfig,
              "activation_checkpointing.budget_bytes {} is too small: one block's input is {} "
              "bytes per micro-batch, and this stage needs at least {} bytes of activations "
              "({} micro-batch(es) of {} x {} in flight, every block recomputed)",
              budget, input, least, in_flight, B, Tn);
  return *best;
}

template <typename T>
void GptStage<T>::set_plan(RecomputePlan plan) {
  LOOM_CHECK(plan.blocks.size() == blocks_.size(), "a recompute plan for {} blocks, stage has {}",
             plan.blocks.size(), blocks_.size());
  plan_ = std::move(plan);
  ++plan_id_;  // stores laid out for the previous plan are refused
  // The room's size depends on the plan.
  work_bt_ = 0;
  scratch_ = Buffer();
  room_ = Buffer();
}

template <typename T>
size_t GptStage<T>::store_bytes(int64_t B, int64_t Tn, const RecomputePlan& plan) const {
  const Rows rw = rows(B, Tn);
  int64_t n = rw.count * config_.n_embd;  // input
  for (size_t i = 0; i < blocks_.size(); ++i) n += slot_elems(i, rw, plan);
  if (head_) {
    Arena<T> rec, room;
    head_->bind(rec, room, rw, plan.head_logits);
    n += rec.used();
  }
  return static_cast<size_t>(n) * sizeof(T);
}

template <typename T>
std::vector<size_t> GptStage<T>::piece_record_bytes(int64_t B, int64_t Tn) const {
  const Rows rw = rows(B, Tn);
  std::vector<size_t> out;
  // The stage's input slot: the embeddings' output on the first stage (a
  // later stage's is the message it received, counted with its first block).
  const int64_t input = rw.count * config_.n_embd;
  if (embedding_) out.push_back(static_cast<size_t>(input) * sizeof(T));
  for (size_t i = 0; i < blocks_.size(); ++i)
    out.push_back(
        static_cast<size_t>(slot_elems(i, rw, plan_) + (i == 0 && !embedding_ ? input : 0)) *
        sizeof(T));
  if (head_) {
    Arena<T> rec, room;
    head_->bind(rec, room, rw, plan_.head_logits);
    out.push_back(0);  // ln_f: its statistics are in the head's record
    out.push_back(static_cast<size_t>(rec.used()) * sizeof(T));
  }
  return out;
}

template <typename T>
size_t GptStage<T>::room_bytes(int64_t B, int64_t Tn, const RecomputePlan& plan) const {
  const Rows rw = rows(B, Tn);
  int64_t n = 0;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const Block<T>& b = *blocks_[i].layer;
    const Recompute m = plan.blocks[i];
    // A packed record is computed (forward) and widened (backward) in the
    // room, beside its selective part.
    n = std::max(n, packed(plan, i) ? b.record_elems(rw, m) + b.recompute_elems(rw, m)
                                    : b.recompute_elems(rw, m));
  }
  if (head_ && plan.head_logits) {
    Arena<T> rec, logits;
    head_->bind(rec, logits, rw, true);
    n = std::max(n, logits.used());
  }
  return static_cast<size_t>(n) * sizeof(T);
}

template <typename T>
void GptStage<T>::ensure_work(int64_t B, int64_t Tn) {
  const int64_t BT = B * Tn, C = config_.n_embd;
  if (BT <= work_bt_) return;
  const Rows rw = rows(B, Tn);
  int64_t block_scratch = rw.count * C;  // the head's d_lnf
  for (const StageBlock& b : blocks_)
    block_scratch = std::max(block_scratch, b.layer->scratch_elems(rw));
  const Backend<T>& be = store_.backend();
  scratch_ = be.alloc(static_cast<size_t>(rw.count * C + block_scratch) * sizeof(T),
                      MemCategory::kWorkspace);
  const size_t room = room_bytes(B, Tn);
  room_ = room > 0 ? be.alloc(room, MemCategory::kActivations) : Buffer();
  work_bt_ = BT;
}

template <typename T>
StageActivations<T> GptStage<T>::make_activations(int64_t B, int64_t Tn) const {
  LOOM_CHECK(Tn >= 1 && Tn <= config_.seq_len, "sequence length {} outside [1, {}]", Tn,
             config_.seq_len);
  LOOM_CHECK(B >= 1, "micro-batch size {} must be >= 1", B);
  StageActivations<T> a;
  a.B = B;
  a.Tn = Tn;
  a.plan_id = plan_id_;
  a.buffer = store_.backend().alloc(store_bytes(B, Tn), MemCategory::kActivations);
  Arena<T> rec(a.buffer.template as<T>());
  a.input = rec.take(rows(B, Tn).count * config_.n_embd);
  a.output = a.input;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    a.blocks.push_back(rec.take(0));
    if (packed(plan_, i)) {
      a.output = rec.take(slot_elems(i, rows(B, Tn), plan_));  // the output comes first
      continue;
    }
    Arena<T> room;
    a.output = blocks_[i].layer->bind(rec, room, rows(B, Tn), mode(i)).res3;
  }
  if (head_) {
    a.head = rec.take(0);
    Arena<T> room;
    head_->bind(rec, room, rows(B, Tn), plan_.head_logits);
  }
  LOOM_CHECK(static_cast<size_t>(rec.used()) * sizeof(T) == a.buffer.bytes(),
             "activation layout of {} elements in a buffer of {} bytes", rec.used(),
             a.buffer.bytes());
  return a;
}

template <typename T>
void GptStage<T>::check_store(const StageActivations<T>& a) const {
  LOOM_CHECK(a.plan_id == plan_id_ && a.buffer.data() != nullptr,
             "an activation store made under another recompute plan (or moved from); make "
             "stores after set_plan");
}

template <typename T>
HeadRecord<T> GptStage<T>::head_record(const StageActivations<T>& a, T* room) const {
  Arena<T> rec(a.head), rm(room);
  return head_->bind(rec, rm, rows(a.B, a.Tn), plan_.head_logits);
}

template <typename T>
int64_t GptStage<T>::block_output_offset(const StageActivations<T>& a, size_t i) const {
  if (packed(plan_, i)) return 0;
  Arena<T> rec(a.blocks[i]), room;
  return blocks_[i].layer->bind(rec, room, rows(a.B, a.Tn), mode(i)).res3 - a.blocks[i];
}

template <typename T>
double GptStage<T>::forward(StageActivations<T>& a, const int32_t* tokens, const T* input,
                            const int32_t* targets, const StepContext& ctx) {
  const int64_t B = a.B, Tn = a.Tn, BT = B * Tn, C = config_.n_embd;
  const Rows rw = rows(B, Tn);
  check_store(a);
  a.ctx = ctx;
  a.tokens = tokens;
  a.targets = targets;
  ensure_work(B, Tn);
  for (StageBlock& b : blocks_)
    if (auto* m = dynamic_cast<MoeLayer<T>*>(b.layer->ffn.get())) m->set_tokens(tokens);
  T* room = room_.as<T>();
  const Dropout drop(ctx, config_.dropout);
  if (embedding_) {
    LOOM_CHECK(tokens != nullptr, "the first stage's forward needs tokens");
  } else {
    LOOM_CHECK(input != nullptr, "stage [{}, {}) needs the previous stage's output", first_, last_);
    store_.backend().copy(a.input, input, rw.count * C);
  }
  HeadRecord<T> h{};
  if (head_) h = head_record(a, room);
  // The units in the order forward_steps declares, which unit_schedule
  // publishes to the hooks.
  for (const UnitStep& st : forward_steps()) {
    const auto from = std::chrono::steady_clock::now();  // the span includes the unit's hooks
    store_.before(st.unit, st.pass);
    const auto t0 = std::chrono::steady_clock::now();
    switch (st.kind) {
      case UnitStep::kEmbedding:
        embedding_->forward(store_, a.input, tokens, rw, drop);
        break;
      case UnitStep::kBlock:
        block_forward(a, st.block, drop);
        break;
      case UnitStep::kNorm:
        head_->norm_forward(store_, h, a.output, rw);
        break;
      case UnitStep::kLogits:
        head_->logits_forward(store_, h, rw);
        break;
      case UnitStep::kRecompute:
        LOOM_FAIL(kInternal, "a recompute in forward");
    }
    double s = seconds_since(t0);
    store_.after(st.unit, st.pass);
    if (st.kind == UnitStep::kBlock) {
      const size_t i = st.block;
      if (packed(plan_, i)) {
        const auto t1 = std::chrono::steady_clock::now();
        const Block<T>& block = *blocks_[i].layer;
        block.pack(store_.backend(), room, a.blocks[i], rw, mode(i), plan_.records,
                   uses_twins(i) ? twin_ranges(i, rw) : std::vector<RecordRange>{});
        s += seconds_since(t1);
      }
      if (i == 0) fault_point("forward");
    }
    add_seconds(piece_of(st), Pass::kForward, s);
    add_span(piece_of(st), from);
  }
  if (!head_) return 0.0;
  a.logits = h.logits;
  if (targets == nullptr) return 0.0;
  const auto t0 = std::chrono::steady_clock::now();
  const double loss = head_->loss(store_, h, targets, rw) / static_cast<double>(BT);
  add_seconds(pieces_.size() - 1, Pass::kForward, seconds_since(t0));
  add_span(pieces_.size() - 1, t0);
  return loss;
}

namespace {

// The store's record twins for a scope (cleared however it ends).
template <typename T>
struct TwinsScope {
  ParamStore<T>& store;
  TwinsScope(ParamStore<T>& s, const RecordTwins* t) : store(s) { store.set_twins(t); }
  ~TwinsScope() { store.set_twins(nullptr); }
  TwinsScope(const TwinsScope&) = delete;
  TwinsScope& operator=(const TwinsScope&) = delete;
};

}  // namespace

template <typename T>
RecordTwins GptStage<T>::record_twins(const StageActivations<T>& a, size_t i, const T* room) const {
  RecordTwins tw;
  if constexpr (std::is_same_v<T, float>) {
    const Rows rw = rows(a.B, a.Tn);
    const Block<T>& block = *blocks_[i].layer;
    tw.room = room;
    tw.rounded = block.rounded_part(a.blocks[i], rw, mode(i));
    tw.exact = block.exact_ranges(rw, mode(i));
    tw.twins = twin_ranges(i, rw);
  }
  return tw;
}

template <typename T>
void GptStage<T>::block_forward(StageActivations<T>& a, size_t i, const Dropout& drop) {
  const Rows rw = rows(a.B, a.Tn);
  const T* x = block_input(a, i);
  T* room = room_.as<T>();
  Arena<T> rec(a.blocks[i]), rm(room);
  BlockRecord<T> r;
  const Block<T>& block = *blocks_[i].layer;
  if (mode(i) == Recompute::kFull) {
    // Computed in the shared room; only the output stays.
    Arena<T> whole(room), none;
    r = block.bind(whole, none, rw, Recompute::kNone);
    r.res3 = block.bind(rec, rm, rw, Recompute::kFull).res3;
  } else if (packed(plan_, i)) {
    // Computed in the room, the output straight into the slot, then packed.
    Arena<T> whole(room), part(room + block.record_elems(rw, mode(i)));
    r = block.bind(whole, part, rw, mode(i));
    r.res3 = a.blocks[i];
    if (uses_twins(i)) {
      // The twins' producers (the linears, the LayerNorms, the attention
      // core, GELU) round them straight into the slot (pack then leaves
      // those ranges).
      const RecordTwins tw = record_twins(a, i, room);
      const TwinsScope<T> scope(store_, &tw);
      block.forward(store_, r, x, rw, mode(i) == Recompute::kSelective, drop);
      return;
    }
  } else {
    r = block.bind(rec, rm, rw, mode(i));
  }
  block.forward(store_, r, x, rw, mode(i) == Recompute::kSelective, drop);
}

template <typename T>
void GptStage<T>::backward(StageActivations<T>& a, double loss_scale, const T* d_output, T* d_input,
                           DeferredGrads<T>* defer) {
  const int64_t B = a.B, Tn = a.Tn, C = config_.n_embd;
  const Rows rw = rows(B, Tn);
  const Backend<T>& be = store_.backend();
  check_store(a);
  // Checked before anything accumulates or any reduction starts.
  LOOM_CHECK(head_ || d_output != nullptr, "stage [{}, {}) needs the gradient of its output",
             first_, last_);
  LOOM_CHECK(embedding_ || d_input != nullptr,
             "stage [{}, {}) needs room for the gradient of its input", first_, last_);
  LOOM_CHECK(!head_ || a.targets != nullptr, "backward needs a forward pass with targets");
  ensure_work(B, Tn);
  // The balancing losses' gradients carry the main loss's weight; fixed
  // routers route by this micro-batch's token ids again.
  for (StageBlock& b : blocks_)
    if (auto* m = dynamic_cast<MoeLayer<T>*>(b.layer->ffn.get())) {
      m->set_loss_weight(loss_scale);
      m->set_tokens(a.tokens);
    }
  T* d_resid = scratch_.as<T>();
  T* rest = d_resid + rw.count * C;  // the head's d_lnf, then each block's scratch
  const Dropout drop(a.ctx, config_.dropout);
  // Deferred: the layers record their parameter gradients into `defer`
  // (apply_deferred runs them) and the units are used for reading alone.
  struct Deferral {
    ParamStore<T>& s;
    ~Deferral() { s.set_deferral(nullptr); }
  } restore{store_};
  store_.set_deferral(defer);
  if (!head_) be.copy(d_resid, d_output, rw.count * C);
  // d(mean loss)/d(loss_n) = 1 / BT, times the caller's scale (accumulation, loss scaling).
  std::vector<T> dloss;
  HeadRecord<T> h{};
  if (head_) {
    dloss.assign(static_cast<size_t>(B * Tn), T(loss_scale / static_cast<double>(B * Tn)));
    h = head_record(a, room_.as<T>());
  }
  T* d_lnf = rest;
  // The units in the order backward_steps declares (backward_unit_schedule
  // publishes it to the hooks).
  for (const UnitStep& st : backward_steps(defer != nullptr)) {
    if (defer && st.pass != Pass::kRecompute) defer->begin_unit(st.unit);
    if (st.kind == UnitStep::kLogits) be.fill(d_lnf, rw.count * C, T(0));
    if (st.kind == UnitStep::kNorm) be.fill(d_resid, rw.count * C, T(0));
    const auto from = std::chrono::steady_clock::now();  // the span includes the unit's hooks
    if (st.hooks) store_.before(st.unit, st.pass);
    const auto t0 = std::chrono::steady_clock::now();
    double recomputed = 0;
    switch (st.kind) {
      case UnitStep::kLogits:
        if (plan_.head_logits) {
          head_->logits_forward(store_, h, rw);  // the same GEMM as forward: the same logits
          recomputed = seconds_since(t0);
          recompute_s_ += recomputed;
        }
        head_->logits_backward(store_, h, a.targets, dloss.data(), d_lnf, rw);
        break;
      case UnitStep::kNorm:
        head_->norm_backward(store_, h, d_resid, d_lnf, a.output, rw);
        break;
      case UnitStep::kRecompute:
        block_recompute(a, st.block, drop);
        recomputed = seconds_since(t0);
        recompute_s_ += recomputed;
        break;
      case UnitStep::kBlock:
        block_backward(a, st.block, d_resid, rest, drop);
        break;
      case UnitStep::kEmbedding:
        embedding_->backward(store_, d_resid, a.tokens, rw, drop);
        break;
    }
    const double s = seconds_since(t0);
    add_seconds(piece_of(st), Pass::kRecompute, recomputed);
    add_seconds(piece_of(st), Pass::kBackward, s - recomputed);
    if (st.hooks) store_.after(st.unit, st.pass);
    add_span(piece_of(st), from);
    if (st.kind == UnitStep::kBlock && st.block + 1 == blocks_.size()) fault_point("backward");
  }
  if (!embedding_) be.copy(d_input, d_resid, rw.count * C);
}

template <typename T>
std::vector<UnitUse> GptStage<T>::deferred_unit_schedule(const DeferredGrads<T>& d) const {
  std::vector<UnitUse> s;
  for (int u : d.units()) s.push_back({u, Pass::kBackwardGradsOnly});
  return s;
}

template <typename T>
void GptStage<T>::apply_deferred(DeferredGrads<T>& d) {
  const std::vector<int> units = d.units();
  for (size_t k = 0; k < units.size(); ++k) {
    const auto from = std::chrono::steady_clock::now();
    store_.before(units[k], Pass::kBackwardGradsOnly);
    const auto t0 = std::chrono::steady_clock::now();
    d.run(k, store_);
    const size_t piece = static_cast<size_t>(unit_piece_[static_cast<size_t>(units[k])]);
    add_seconds(piece, Pass::kBackward, seconds_since(t0));
    store_.after(units[k], Pass::kBackwardGradsOnly);
    add_span(piece, from);
  }
  d.clear();
}

// A block recomputed in full: its forward again, into the room, from its
// kept input (record only: backward reads it next, from the room).
template <typename T>
void GptStage<T>::block_recompute(StageActivations<T>& a, size_t i, const Dropout& drop) {
  const Rows rw = rows(a.B, a.Tn);
  const Block<T>& block = *blocks_[i].layer;
  Arena<T> whole(room_.as<T>()), none;
  const BlockRecord<T> r = block.bind(whole, none, rw, Recompute::kNone);
  block.forward(store_, r, block_input(a, i), rw, false, drop, /*record_only=*/true);
}

template <typename T>
void GptStage<T>::block_backward(StageActivations<T>& a, size_t i, T* d_resid, T* scratch,
                                 const Dropout& drop) {
  const Rows rw = rows(a.B, a.Tn);
  const Block<T>& block = *blocks_[i].layer;
  T* room = room_.as<T>();
  BlockRecord<T> r;
  if (mode(i) == Recompute::kFull) {
    // block_recompute left the whole record in the room.
    Arena<T> whole(room), none;
    r = block.bind(whole, none, rw, Recompute::kNone);
  } else if (packed(plan_, i)) {
    // Widened back into the room, where forward computed it, but for the
    // twins read in bf16 alone, in the slot (unless the linears defer: a
    // deferred product keeps its input's f32 values, and the kernels then
    // read the widened values too).
    Arena<T> whole(room), part(room + block.record_elems(rw, mode(i)));
    r = block.bind(whole, part, rw, mode(i));
    if (uses_twins(i) && store_.deferral() == nullptr) {
      const RecordTwins tw = record_twins(a, i, room);
      block.unpack(store_.backend(), a.blocks[i], room, rw, mode(i), plan_.records,
                   twin_ranges(i, rw, false));
      const TwinsScope<T> scope(store_, &tw);
      block.backward(store_, r, block_input(a, i), d_resid, rw, mode(i) == Recompute::kSelective,
                     drop, scratch);
      return;
    }
    block.unpack(store_.backend(), a.blocks[i], room, rw, mode(i), plan_.records);
  } else {
    Arena<T> rec(a.blocks[i]), rm(room);
    r = block.bind(rec, rm, rw, mode(i));
  }
  block.backward(store_, r, block_input(a, i), d_resid, rw, mode(i) == Recompute::kSelective, drop,
                 scratch);
}

template <typename T>
double GptStage<T>::take_recompute_seconds() {
  double s = recompute_s_;
  recompute_s_ = 0;
  return s;
}

template <typename T>
KvCache<T> GptStage<T>::make_kv_cache() const {
  LOOM_CHECK(embedding_ && head_ && serial_layers_,
             "decoding needs a whole single-process model (embedding, head, unsplit layers)");
  const size_t C = static_cast<size_t>(config_.n_embd), L = blocks_.size();
  const size_t Tn = static_cast<size_t>(config_.seq_len);
  KvCache<T> c;
  c.k.resize(L * Tn * C), c.v.resize(L * Tn * C);
  c.x.resize(C), c.ln.resize(C), c.stat.resize(2), c.qkv.resize(3 * C), c.att.resize(C);
  // One row's feed-forward record (the largest of the blocks': an MLP's or
  // a mixture of experts').
  int64_t ffn = 0;
  for (const StageBlock& b : blocks_)
    ffn = std::max(ffn, b.layer->ffn->record_elems(Rows::whole(1, 1), false));
  c.ffn.resize(static_cast<size_t>(ffn));
  c.out.resize(C), c.scores.resize(Tn);
  c.logits.resize(static_cast<size_t>(config_.padded_vocab()));
  return c;
}

template <typename T>
const T* GptStage<T>::decode_step(KvCache<T>& c, int32_t token) {
  const int64_t C = config_.n_embd, NH = config_.n_head, hs = C / NH, Tn = config_.seq_len;
  const int64_t pos = c.len;
  LOOM_CHECK(embedding_ && head_ && serial_layers_,
             "decoding needs a whole single-process model (embedding, head, unsplit layers)");
  LOOM_CHECK(pos < Tn, "KV cache full: position {} of seq_len {}", pos, Tn);
  // Fixed MoE routers route by the token (the tag router by the sequence so far).
  c.tokens.resize(static_cast<size_t>(pos));
  c.tokens.push_back(token);
  for (StageBlock& b : blocks_)
    if (auto* m = dynamic_cast<MoeLayer<T>*>(b.layer->ffn.get()))
      m->set_tokens(c.tokens.data() + pos, pos);
  LOOM_CHECK(token >= 0 && token < config_.vocab_size, "token {} outside the vocabulary {}", token,
             config_.vocab_size);
  const ParamStore<T>& ps = store_;
  const Backend<T>& be = ps.backend();
  const T* wte = ps.param(embedding_->wte());
  const T* wpe = ps.param(embedding_->wpe());
  for (int64_t i = 0; i < C; ++i) c.x[i] = wte[token * C + i] + wpe[pos * C + i];
  for (size_t l = 0; l < blocks_.size(); ++l) {
    const Block<T>& b = *blocks_[l].layer;
    const auto& attn = static_cast<const Attention<T>&>(*b.attn);  // serial, checked above
    T* K = c.k.data() + static_cast<int64_t>(l) * Tn * C;
    T* V = c.v.data() + static_cast<int64_t>(l) * Tn * C;
    b.ln_1->forward(ps, c.ln.data(), &c.stat[0], &c.stat[1], c.x.data(), 1);
    be.matmul_forward(c.qkv.data(), c.ln.data(), ps.param(attn.c_attn_w), ps.param(attn.c_attn_b),
                      1, C, 3 * C);
    be.copy(K + pos * C, c.qkv.data() + C, C);
    be.copy(V + pos * C, c.qkv.data() + 2 * C, C);
    const T scale = T(1) / std::sqrt(T(hs));
    for (int64_t h = 0; h < NH; ++h) {
      const T* q = c.qkv.data() + h * hs;
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j <= pos; ++j) {
        T dot = 0;
        for (int64_t d = 0; d < hs; ++d) dot += q[d] * K[j * C + h * hs + d];
        c.scores[j] = dot * scale;
        mx = std::max(mx, c.scores[j]);
      }
      T sum = 0;
      for (int64_t j = 0; j <= pos; ++j) sum += (c.scores[j] = std::exp(c.scores[j] - mx));
      T* y = c.att.data() + h * hs;
      std::fill(y, y + hs, T(0));
      for (int64_t j = 0; j <= pos; ++j)
        for (int64_t d = 0; d < hs; ++d) y[d] += c.scores[j] / sum * V[j * C + h * hs + d];
    }
    be.matmul_forward(c.out.data(), c.att.data(), ps.param(attn.c_proj_w), ps.param(attn.c_proj_b),
                      1, C, C);
    be.add(c.x.data(), c.out.data(), C);
    b.ln_2->forward(ps, c.ln.data(), &c.stat[0], &c.stat[1], c.x.data(), 1);
    b.ffn->forward(ps, c.ffn.data(), false, c.out.data(), c.ln.data(), Rows::whole(1, 1), nullptr);
    be.add(c.x.data(), c.out.data(), C);
  }
  head_->ln_f->forward(ps, c.ln.data(), &c.stat[0], &c.stat[1], c.x.data(), 1);
  be.matmul_nt_forward(c.logits.data(), c.ln.data(), wte, 1, C, config_.padded_vocab());
  c.len = pos + 1;
  return c.logits.data();
}

template <typename T>
double GptStage<T>::model_params() const {
  // The whole model's parameters as a user counts them (vocabulary padding
  // is matmul work, not parameters; the tied head counts once).
  const double C = config_.n_embd, L = config_.n_layer;
  const double dense =
      L * (12.0 * C * C + 13.0 * C) + config_.vocab_size * C + config_.seq_len * C + 2.0 * C;
  // A mixture-of-experts layer holds E MLPs and the router (a learned one
  // has weights) instead of one MLP.
  const double router = config_.moe_router == 0 ? C * config_.moe_experts : 0.0;
  return dense + moe_layers() * ((config_.moe_experts - 1.0) * (8.0 * C * C + 5.0 * C) + router);
}

template <typename T>
int GptStage<T>::moe_layers() const {
  int n = 0;
  for (int i = 0; i < config_.n_layer; ++i) n += config_.moe_layer(i) ? 1 : 0;
  return n;
}

template <typename T>
double GptStage<T>::active_params() const {
  // A token runs k of a MoE layer's E experts.
  const double C = config_.n_embd;
  return model_params() -
         moe_layers() * double(config_.moe_experts - config_.moe_top_k) * (8.0 * C * C + 5.0 * C);
}

template <typename T>
double GptStage<T>::flops_per_token() const {
  const double C = config_.n_embd, L = config_.n_layer;
  return 6.0 * active_params() + 12.0 * L * static_cast<double>(config_.seq_len) * C;
}

template <typename T>
std::vector<std::pair<int, MoeStats>> GptStage<T>::take_moe_stats() {
  std::vector<std::pair<int, MoeStats>> out;
  for (const StageBlock& b : blocks_)
    if (const auto* m = dynamic_cast<const MoeLayer<T>*>(b.layer->ffn.get()))
      out.emplace_back(b.layer->layer(), m->take_stats());
  return out;
}

template class GptStage<float>;
template class GptStage<double>;

}  // namespace loom
