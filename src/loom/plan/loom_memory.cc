#include "loom/plan/loom_memory.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>
#include <vector>

#include "loom/parallel/pipeline/schedule.h"

namespace loom::plan {

namespace {

constexpr double kF32 = 4;               // the CPU stages compute in f32
constexpr double kBucketElems = 1e6;     // comm.bucket_elements' default
constexpr int64_t kVocabMultiple = 128;  // the padded vocabulary, times tp

// Rows of a micro-batch as the layers see them: `all` = B x T (T this
// rank's part of the sequence under cp), `count` the rows this rank holds
// between the tensor-parallel regions (a 1/tp slice with sequence
// parallelism).
struct Rows {
  double B = 0, T = 0, all = 0, count = 0;
};

// One layer's figures in f32 elements.
struct Elems {
  double record = 0, room = 0, scratch = 0, exact = 0, deferred = 0;
};

bool moe_layer(const ModelShape& m, int64_t layer) {
  return m.experts > 0 && (layer + 1) % m.moe_every == 0;
}

}  // namespace

double moe_rows(const ModelShape&, const Layout& l, double count) {
  // Without sequence parallelism the tensor ranks split a micro-batch's
  // sequences when they divide evenly (StepEngine's moe_split_); else
  // each routes them all.
  return l.tp > 1 && !l.sp && l.micro % l.tp == 0 ? count / l.tp : count;
}

namespace {

// Attention (nn/attention.cc; parallel/tensor/parallel_layers.cc with tp).
Elems attention(const ModelShape& m, const Layout& l, const Rows& r, bool selective) {
  const double t = l.tp, C = double(m.hidden), NH = double(m.heads), N = r.all;
  Elems e;
  e.record = N * 3 * C / t + (selective ? 0 : N * C / t + r.B * NH / t * r.T);
  e.room = selective ? N * C / t + r.B * NH / t * r.T : 0;
  e.exact = selective ? 0 : r.B * NH / t * r.T;  // the log-sum-exp
  e.scratch = l.tp == 1 ? 4 * N * C : N * (4 * C / t + C) + (l.sp ? 2 * N * C : 0);
  // Deferred (zero-bubble W): c_attn's input and output gradient, c_proj's.
  e.deferred = N * C + N * 3 * C / t + N * C / t + N * C;
  return e;
}

// The MLP over `rows` rows (nn/mlp.cc; ParallelMlp with tp).
Elems mlp(const ModelShape& m, double t, bool split, bool sp, double rows, bool selective) {
  const double C = double(m.hidden), H = 4 * C / t;
  Elems e;
  e.record = rows * H * (selective ? 1 : 2);
  e.room = selective ? rows * H : 0;
  e.scratch = !split ? 2 * rows * H : rows * (2 * H + C) + (sp ? 2 * rows * C : 0);
  e.deferred = rows * C + rows * H + rows * H + rows * C;  // c_fc's and c_proj's
  return e;
}

// A mixture of experts (nn/moe.cc): the router's logits, the dispatched
// rows and the experts' outputs for them, the rows received from the
// expert group, and the experts' records sized for the most rows they can
// receive.
Elems moe(const ModelShape& m, const Layout& l, const Rows& r, bool selective,
          bool expected = false) {
  const double C = double(m.hidden), E = double(m.experts), k = double(m.top_k);
  const double lc = moe_rows(m, l, r.count);
  const double n = lc * k, logits = m.learned_router ? lc * E : 0;
  const double local = E / l.ep;
  double R = n;
  if (l.ep > 1 && !expected) {
    double most = lc * std::min(k, local);
    if (m.capacity > 0) {
      const double cap = std::ceil(m.capacity * r.T * l.cp * k / E);
      most = std::min(most, local * cap * (lc / r.T));
    }
    R = most * l.ep;
  }
  const Elems ex = mlp(m, 1, false, false, R, selective);
  Elems e;
  e.record = logits + 2 * n * C + (l.ep > 1 ? R * C : 0) + ex.record;
  e.room = ex.room;
  e.exact = logits;  // backward routes again from them: kept in f32
  e.scratch = 2 * n * C + n + logits + (l.ep > 1 ? 2 * R * C : 0) + ex.scratch;
  e.deferred = ex.deferred + (m.learned_router ? lc * E + lc * C : 0);  // the router's linear
  return e;
}

// Block `layer` (nn/block.cc): ln1 and its statistics, the attention,
// the residual, ln2 and its statistics, the feed-forward, the output.
Elems block(const ModelShape& m, const Layout& l, const Rows& r, int64_t layer,
            bool expected = false) {
  const double C = double(m.hidden);
  const bool full = l.recompute == "full";
  const bool sel = l.recompute == "selective";
  const Elems a = attention(m, l, r, sel);
  const Elems f =
      moe_layer(m, layer) ? moe(m, l, r, sel, expected) : mlp(m, l.tp, l.tp > 1, l.sp, r.all, sel);
  Elems b;
  const double whole = r.count * (4 * C + 4) + a.record + f.record;
  b.exact = 4 * r.count + a.exact + f.exact;
  b.scratch = 2 * r.count * C + std::max(a.scratch, f.scratch);
  b.deferred = a.deferred + f.deferred + 2 * (2 * r.count * C + 2 * r.count);  // + the norms
  if (full) {
    b.record = r.count * C;  // the output; the rest rebuilt in the room
    const Elems an = attention(m, l, r, false);
    const Elems fn =
        moe_layer(m, layer) ? moe(m, l, r, false) : mlp(m, l.tp, l.tp > 1, l.sp, r.all, false);
    b.room = r.count * (4 * C + 4) + an.record + fn.record;
    return b;
  }
  b.record = whole;
  b.room = a.room + f.room;
  if (l.precision != "f32") {
    // Packed into 16 bits beside the output and the exact ranges; the
    // whole record is computed (and widened for backward) in the room.
    const double rest = whole - r.count * C - b.exact;
    b.room = whole + b.room;
    b.record = r.count * C + b.exact + std::ceil(rest / 2);
  }
  return b;
}

// Per micro-batch: {micro-batches whose store a chunk holds at its peak,
// and the deferred weight-gradient inputs held at the stage's peak (in
// units of one micro-batch's of that chunk)}, by walking the schedule.
struct ChunkLive {
  std::vector<int> stores;       // per chunk: the executor's slots
  std::vector<double> deferred;  // per chunk: B done and W not yet, at the stage's peak
};

// Every stage's, walked once per schedule (a planner's search meets the
// same few schedules many times).
const std::vector<ChunkLive>& walk(pp::ScheduleKind kind, int p, int m, int v) {
  // The planner searches on one thread; the cache is not locked.
  static std::map<std::tuple<int, int, int, int>, std::vector<ChunkLive>> cache;
  const auto key = std::make_tuple(int(kind), p, m, v);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  const pp::Schedule s = pp::make_schedule(kind, p, m, v);
  std::vector<ChunkLive> all;
  for (int stage = 0; stage < p; ++stage) {
    ChunkLive out;
    out.stores.assign(size_t(v), 0);
    out.deferred.assign(size_t(v), 0);
    std::vector<int> live(size_t(v), 0), waiting(size_t(v), 0);
    int most_waiting = -1;
    for (const pp::Instr& in : s.per_stage[size_t(stage)]) {
      const size_t c = size_t(in.chunk);
      if (in.op == pp::Op::kForward) {
        out.stores[c] = std::max(out.stores[c], ++live[c]);
      } else if (in.op == pp::Op::kBackward) {
        --live[c];
      } else if (in.op == pp::Op::kBackwardInput) {
        --live[c];
        ++waiting[c];
        int total = 0;
        for (int w : waiting) total += w;
        if (total > most_waiting) {
          most_waiting = total;
          for (size_t k = 0; k < waiting.size(); ++k) out.deferred[k] = waiting[k];
        }
      } else if (in.op == pp::Op::kBackwardWeight) {
        --waiting[c];
      }
    }
    all.push_back(out);
  }
  return cache.emplace(key, std::move(all)).first->second;
}

}  // namespace

ChunkBytes loom_chunk_bytes(const ModelShape& m, const Layout& l, int first, int last,
                            bool embedding, bool head) {
  const double C = double(m.hidden), t = l.tp;
  Rows r;
  r.B = double(l.micro);
  r.T = double(m.seq) / l.cp;
  r.all = r.B * r.T;
  r.count = l.sp ? r.all / t : r.all;
  double store = r.count * C, room = 0, scratch = r.count * C, deferred = 0;
  for (int k = first; k < last; ++k) {
    const Elems b = block(m, l, r, k);
    store += b.record;
    room = std::max(room, b.room);
    scratch = std::max(scratch, b.scratch);
    deferred += b.deferred;
  }
  if (embedding) deferred += r.all * C + r.all;  // the output gradient and the tokens
  if (head) {
    const int64_t mult = kVocabMultiple * l.tp;
    const double Vl = double((m.vocab + mult - 1) / mult * mult) / t;
    const bool logits_in_room = l.recompute == "full";
    store += r.count * (C + 2) + (l.tp > 1 && l.sp ? r.all * C : 0) +
             (logits_in_room ? 0 : r.all * Vl) + 2 * r.all;
    if (logits_in_room) room = std::max(room, r.all * Vl);
    deferred += r.all * Vl + r.all * C + 2 * r.count * C + 2 * r.count;
  }
  ChunkBytes out;
  out.store = store * kF32;
  out.room = room * kF32;
  out.scratch = (r.count * C + scratch) * kF32;
  out.deferred = deferred * kF32;
  return out;
}

double loom_block_record_bytes(const ModelShape& m, const Layout& l, int64_t layer) {
  Layout whole = l;
  whole.recompute = "none";
  whole.precision = "f32";
  Rows r;
  r.B = double(l.micro);
  r.T = double(m.seq) / l.cp;
  r.all = r.B * r.T;
  r.count = l.sp ? r.all / l.tp : r.all;
  // A mixture of experts by the rows its experts receive on average, not
  // the most its record is sized for.
  return block(m, whole, r, layer, true).record * kF32;
}

namespace {

// The largest unit (parameters ZeRO gathers, reduces and widens together)
// of blocks [first, last), with the embeddings or the head's copy of wte.
double largest_unit(const ModelShape& m, const Layout& l, int first, int last, bool embedding,
                    bool head) {
  const double C = double(m.hidden), t = l.tp;
  const int64_t mult = kVocabMultiple * l.tp;
  const double Vp = double((m.vocab + mult - 1) / mult * mult);
  double u = 0;
  for (int k = first; k < last; ++k) {
    const bool moe = moe_layer(m, k);
    // A MoE block's experts are gathered and widened with it.
    u = std::max(u,
                 4 * C * C / t + 8 * C +
                     (moe ? C * double(m.experts) + double(m.experts) / l.ep * (8 * C * C + 5 * C)
                          : 8 * C * C / t + 5 * C));
  }
  // The embeddings; a last stage's copy of wte keeps room for wpe too.
  if (embedding || (head && l.pp > 1)) u = std::max(u, Vp * C / t + double(m.seq) * C);
  return u;
}

}  // namespace

LoomMemory loom_memory(const ModelShape& m, const Layout& l, int64_t micro_batches) {
  LoomMemory out;
  const int parts = l.pp * l.v;
  const int per_part = int(m.n_layer / parts);
  const double C = double(m.hidden);
  const double rows = double(l.micro) * double(m.seq) / l.cp / (l.sp ? l.tp : 1);
  const bool half = l.precision != "f32";
  const int dp = l.dp * l.cp;
  // Each pipeline stage's chunks: part chunk x pp + stage holds blocks
  // [part x per_part, (part + 1) x per_part). The most loaded stage is
  // the one with the largest total.
  for (int stage = 0; stage < l.pp; ++stage) {
    static const ChunkLive one{{1}, {0}};  // no pipeline: one store, reused
    const ChunkLive& live = l.pp == 1 ? one
                                      : walk(pp::parse_schedule(l.schedule), l.pp,
                                             int(micro_batches), l.v)[size_t(stage)];
    LoomMemory here;
    double unit = 0;
    bool has_head = false;
    for (int c = 0; c < l.v; ++c) {
      const int part = c * l.pp + stage;
      const bool emb = part == 0, head = part == parts - 1;
      has_head = has_head || head;
      const ChunkBytes b =
          loom_chunk_bytes(m, l, part * per_part, (part + 1) * per_part, emb, head);
      here.activations +=
          live.stores[size_t(c)] * b.store + b.room + live.deferred[size_t(c)] * b.deferred;
      here.workspace += b.scratch;
      unit = std::max(unit, largest_unit(m, l, part * per_part, (part + 1) * per_part, emb, head));
    }
    // Tensor parallelism: the gathered input (B x T x C) of a region with
    // the sequence split, or of the vocabulary-parallel head, beside the
    // scratch while it runs.
    if (l.tp > 1 && (l.sp || has_head))
      here.workspace += double(l.micro) * double(m.seq) / l.cp * C * kF32;
    if (l.pp > 1) {
      // The executor's message buffers (rows x C in f32, and bf16's 16-bit
      // payload): one each way per chunk in flight.
      const double msg = rows * C * (kF32 + (l.precision == "bf16" ? 2 : 0));
      here.comm += 2 * l.v * msg;
    }
    // 16-bit runs widen the unit in use to f32.
    if (half) here.comm += unit * kF32;
    if (dp > 1 && l.zero >= 2) {
      // The reduce-scatter: two units' f32 gradients in flight and this
      // rank's slice of the one being reduced; at stage 3, two units
      // gathered (the one in use and the next).
      here.comm += (2 * unit + unit / dp) * kF32;
      if (l.zero >= 3) here.comm += 2 * unit * (half ? 2 : kF32);
    } else if (dp > 1 && half) {
      // 16-bit gradients reduced unit by unit from f32 buffers (the newest
      // in flight beside the one being written), each reduction's blocks
      // in 16 bits and widened to f32.
      here.comm += 2 * unit * kF32 + unit * (2 + kF32);
    }
    const double total = here.activations + here.workspace + here.comm;
    if (total > out.activations + out.workspace + out.comm) out = here;
  }
  return out;
}

}  // namespace loom::plan
