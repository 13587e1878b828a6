#include "loom/parallel/pipeline/schedule.h"

#include <algorithm>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "loom/core/error.h"

namespace loom::pp {

const char* op_name(Op op) {
  switch (op) {
    case Op::kRecvAct:
      return "recv_act";
    case Op::kForward:
      return "forward";
    case Op::kSendAct:
      return "send_act";
    case Op::kRecvGrad:
      return "recv_grad";
    case Op::kBackward:
      return "backward";
    case Op::kBackwardInput:
      return "backward_input";
    case Op::kBackwardWeight:
      return "backward_weight";
    case Op::kSendGrad:
      return "send_grad";
    case Op::kReduceGrads:
      return "reduce_grads";
    case Op::kOptimizerStep:
      return "optimizer_step";
  }
  return "?";
}

bool is_compute(Op op) {
  return op == Op::kForward || op == Op::kBackward || op == Op::kBackwardInput ||
         op == Op::kBackwardWeight;
}

std::string Instr::describe() const {
  const char* letter = "";
  switch (op) {
    case Op::kForward:
      letter = "F";
      break;
    case Op::kBackward:
      letter = "B";
      break;
    case Op::kBackwardInput:
      letter = "B";
      break;
    case Op::kBackwardWeight:
      letter = "W";
      break;
    default:
      return micro < 0 ? op_name(op) : format("{} {}.{}", op_name(op), micro, chunk);
  }
  return format("{}{}.{}", letter, micro, chunk);
}

const char* schedule_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::kGpipe:
      return "gpipe";
    case ScheduleKind::k1F1B:
      return "1f1b";
    case ScheduleKind::kInterleaved:
      return "interleaved";
    case ScheduleKind::kZeroBubble:
      return "zero_bubble";
  }
  return "?";
}

ScheduleKind parse_schedule(const std::string& name) {
  for (ScheduleKind k : {ScheduleKind::kGpipe, ScheduleKind::k1F1B, ScheduleKind::kInterleaved,
                         ScheduleKind::kZeroBubble})
    if (name == schedule_name(k)) return k;
  LOOM_FAIL(kConfig,
            "parallel.schedule: unknown schedule '{}' (gpipe, 1f1b, interleaved, "
            "zero_bubble)",
            name);
}

namespace {

struct Compute {
  Op op;
  int micro, chunk;
};
using Order = std::vector<Compute>;

// GPipe: every forward, then every backward.
Order gpipe_order(int m) {
  Order o;
  for (int i = 0; i < m; ++i) o.push_back({Op::kForward, i, 0});
  for (int i = 0; i < m; ++i) o.push_back({Op::kBackward, i, 0});
  return o;
}

// 1F1B on stage s of p.
Order one_f_one_b_order(int s, int p, int m) {
  Order o;
  // Warm-up: the forwards that fill the pipeline below this stage; stage s
  // holds p - s micro-batches at the peak.
  const int warmup = std::min(p - s - 1, m);
  for (int i = 0; i < warmup; ++i) o.push_back({Op::kForward, i, 0});
  // Steady state: one forward, then the backward of the oldest micro-batch.
  for (int i = 0; i < m - warmup; ++i) {
    o.push_back({Op::kForward, warmup + i, 0});
    o.push_back({Op::kBackward, i, 0});
  }
  // Cool-down: the backwards of the micro-batches still in flight.
  for (int i = m - warmup; i < m; ++i) o.push_back({Op::kBackward, i, 0});
  return o;
}

// Interleaved 1F1B on stage s: micro-batches go through the chunks in groups
// of p, so the k-th forward of the stage is micro-batch (k / pv) p + k % p of
// chunk (k / p) % v; backwards visit the chunks in reverse.
Order interleaved_order(int s, int p, int m, int v) {
  const int total = m * v;
  auto micro = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto fwd = [&](int k) { return Compute{Op::kForward, micro(k), (k / p) % v}; };
  auto bwd = [&](int k) { return Compute{Op::kBackward, micro(k), v - 1 - (k / p) % v}; };
  Order o;
  // Warm-up: enough forwards that the first backward of the last chunk can
  // start on the last stage, and the stages below it stay busy meanwhile.
  const int warmup = std::min((p - s - 1) * 2 + (v - 1) * p, total);
  for (int k = 0; k < warmup; ++k) o.push_back(fwd(k));
  // Steady state: one forward, one backward.
  for (int k = 0; k < total - warmup; ++k) {
    o.push_back(fwd(warmup + k));
    o.push_back(bwd(k));
  }
  // Cool-down: the remaining backwards.
  for (int k = total - warmup; k < total; ++k) o.push_back(bwd(k));
  return o;
}

// Zero-bubble (ZB-H1): 1F1B's forwards and input-gradient backwards B, with
// each weight-gradient part W delayed behind s further Bs on stage s. The Bs
// form the critical path (each gradient travels down through every stage),
// so the later stages put theirs first and do the Ws in the gaps; stage 0,
// at the end of that path, runs each W at once. With F, B and W of equal
// cost the idle time falls to about a third of 1F1B's, with the same
// micro-batches in flight.
Order zero_bubble_order(int s, int p, int m) {
  Order o;
  const int warmup = std::min(p - s - 1, m);
  const size_t delay = static_cast<size_t>(s);
  std::deque<int> pending;
  auto backward = [&](int i) {
    o.push_back({Op::kBackwardInput, i, 0});
    pending.push_back(i);
    if (pending.size() > delay) {
      o.push_back({Op::kBackwardWeight, pending.front(), 0});
      pending.pop_front();
    }
  };
  // Warm-up, as 1F1B.
  for (int i = 0; i < warmup; ++i) o.push_back({Op::kForward, i, 0});
  // Steady state: F, B, and a W once more than `delay` of them wait.
  for (int i = 0; i < m - warmup; ++i) {
    o.push_back({Op::kForward, warmup + i, 0});
    backward(i);
  }
  // Cool-down: the remaining B (each with its W once the delay is covered),
  // then the delayed Ws fill the tail.
  for (int i = m - warmup; i < m; ++i) backward(i);
  for (int i : pending) o.push_back({Op::kBackwardWeight, i, 0});
  return o;
}

// Adds the communication around a stage's compute order: each receive one
// compute instruction ahead of its consumer, each send right after its
// producer, and the step's closing instructions.
std::vector<Instr> with_communication(const Schedule& s, int stage, const Order& order) {
  auto recv_for = [&](const Compute& c) -> std::optional<Instr> {
    if (c.op == Op::kForward && !s.first_part(stage, c.chunk))
      return Instr{Op::kRecvAct, c.micro, c.chunk};
    if ((c.op == Op::kBackward || c.op == Op::kBackwardInput) && !s.last_part(stage, c.chunk))
      return Instr{Op::kRecvGrad, c.micro, c.chunk};
    return std::nullopt;
  };
  std::vector<Instr> out;
  if (!order.empty())
    if (auto r = recv_for(order[0])) out.push_back(*r);
  for (size_t i = 0; i < order.size(); ++i) {
    if (i + 1 < order.size())
      if (auto r = recv_for(order[i + 1])) out.push_back(*r);
    const Compute& c = order[i];
    out.push_back({c.op, c.micro, c.chunk});
    if (c.op == Op::kForward && !s.last_part(stage, c.chunk))
      out.push_back({Op::kSendAct, c.micro, c.chunk});
    if ((c.op == Op::kBackward || c.op == Op::kBackwardInput) && !s.first_part(stage, c.chunk))
      out.push_back({Op::kSendGrad, c.micro, c.chunk});
  }
  out.push_back({Op::kReduceGrads, -1, 0});
  out.push_back({Op::kOptimizerStep, -1, 0});
  return out;
}

}  // namespace

void check_schedule(ScheduleKind kind, int p, int m, int v) {
  LOOM_CHECK_KIND(kConfig, p >= 1 && m >= 1, "a pipeline of {} stages and {} micro-batches", p, m);
  if (kind != ScheduleKind::kInterleaved) return;
  LOOM_CHECK_KIND(kConfig, v >= 1, "parallel.virtual_stages must be >= 1, got {}", v);
  if (v > 1)
    LOOM_CHECK_KIND(kConfig, m % p == 0,
                    "the interleaved schedule sends micro-batches through the chunks in groups of "
                    "parallel.pipeline = {}, so the {} micro-batches (gradient_accumulation_steps) "
                    "must be a multiple of it",
                    p, m);
}

Schedule make_schedule(ScheduleKind kind, int p, int m, int v) {
  check_schedule(kind, p, m, v);
  if (kind != ScheduleKind::kInterleaved) v = 1;
  Schedule s;
  s.kind = kind;
  s.stages = p;
  s.micro_batches = m;
  s.chunks = v;
  for (int st = 0; st < p; ++st) {
    Order o;
    switch (kind) {
      case ScheduleKind::kGpipe:
        o = gpipe_order(m);
        break;
      case ScheduleKind::k1F1B:
        o = one_f_one_b_order(st, p, m);
        break;
      case ScheduleKind::kInterleaved:
        o = v == 1 ? one_f_one_b_order(st, p, m) : interleaved_order(st, p, m, v);
        break;
      case ScheduleKind::kZeroBubble:
        o = zero_bubble_order(st, p, m);
        break;
    }
    s.per_stage.push_back(with_communication(s, st, o));
  }
  return s;
}

double SimResult::bubble_fraction() const {
  if (makespan <= 0 || busy.empty()) return 0;
  double b = 0;
  for (double x : busy) b += x;
  return 1.0 - b / (makespan * static_cast<double>(busy.size()));
}

namespace {

// A message in flight: (activation or gradient, micro-batch, receiving part).
using MsgKey = std::tuple<int, int, int>;

struct SimState {
  const Schedule& s;
  const SimCosts& costs;
  SimResult r;
  std::vector<size_t> pc;
  std::vector<double> clock;
  std::map<MsgKey, double> sent;                  // available at
  std::vector<std::set<MsgKey>> posted;           // receives posted, per stage
  std::map<std::tuple<int, int, int>, int> done;  // (op kind, micro, part) -> count
  std::vector<int> in_flight;

  int count(Op op, int micro, int part) const {
    auto it = done.find({static_cast<int>(op), micro, part});
    return it == done.end() ? 0 : it->second;
  }
  [[noreturn]] void violation(int stage, const Instr& in, const std::string& why) const {
    LOOM_FAIL(kInternal, "schedule {} (p {}, m {}, v {}): stage {} instruction {} ({}): {}",
              schedule_name(s.kind), s.stages, s.micro_batches, s.chunks, stage, pc[stage],
              in.describe(), why);
  }
  // The message a compute instruction consumes, if any.
  std::optional<MsgKey> needs(int stage, const Instr& in) const {
    const int part = s.part(stage, in.chunk);
    if (in.op == Op::kForward && part > 0) return MsgKey{0, in.micro, part};
    if ((in.op == Op::kBackward || in.op == Op::kBackwardInput) && part < s.parts() - 1)
      return MsgKey{1, in.micro, part};
    return std::nullopt;
  }
  double cost(Op op) const {
    switch (op) {
      case Op::kForward:
        return costs.forward;
      case Op::kBackward:
        return costs.backward;
      case Op::kBackwardInput:
        return costs.backward_input;
      case Op::kBackwardWeight:
        return costs.backward_weight;
      default:
        return 0;
    }
  }
  // Runs stage `st`'s next instruction if it can; false when it must wait.
  bool advance(int st);
};

bool SimState::advance(int st) {
  const Instr& in = s.per_stage[st][pc[st]];
  const bool zb = s.kind == ScheduleKind::kZeroBubble;
  if (in.micro >= s.micro_batches || in.chunk < 0 || in.chunk >= s.chunks)
    violation(st, in, "micro-batch or chunk out of range");
  const int part = in.micro >= 0 ? s.part(st, in.chunk) : -1;
  switch (in.op) {
    case Op::kRecvAct:
    case Op::kRecvGrad: {
      const MsgKey k{in.op == Op::kRecvAct ? 0 : 1, in.micro, part};
      if (!posted[st].insert(k).second) violation(st, in, "the same receive posted twice");
      break;
    }
    case Op::kSendAct:
    case Op::kSendGrad: {
      const bool act = in.op == Op::kSendAct;
      if (count(act ? Op::kForward : (zb ? Op::kBackwardInput : Op::kBackward), in.micro, part) !=
          1)
        violation(st, in, "sends what this stage has not computed");
      const int to = act ? part + 1 : part - 1;
      if (to < 0 || to >= s.parts()) violation(st, in, "sends past the end of the model");
      const MsgKey k{act ? 0 : 1, in.micro, to};
      if (!sent.emplace(k, clock[st] + costs.p2p).second) violation(st, in, "sent twice");
      break;
    }
    case Op::kReduceGrads:
    case Op::kOptimizerStep:
      break;
    default: {
      const bool split = in.op == Op::kBackwardInput || in.op == Op::kBackwardWeight;
      if ((zb && in.op == Op::kBackward) || (!zb && split))
        violation(st, in,
                  zb ? "a whole backward in a zero-bubble schedule"
                     : "a split backward outside the zero-bubble schedule");
      if (count(in.op, in.micro, part) != 0) violation(st, in, "computed twice");
      if (in.op != Op::kForward && count(Op::kForward, in.micro, part) != 1)
        violation(st, in, "backward before its forward");
      if (in.op == Op::kBackwardWeight && count(Op::kBackwardInput, in.micro, part) != 1)
        violation(st, in, "weight gradient before the input gradient");
      double start = clock[st];
      if (auto k = needs(st, in)) {
        if (!posted[st].count(*k)) violation(st, in, "computes without posting its receive");
        auto it = sent.find(*k);
        if (it == sent.end()) return false;  // waits for the peer
        start = std::max(start, it->second);
        sent.erase(it);
        posted[st].erase(*k);
      }
      const double end = start + cost(in.op);
      r.slices[st].push_back({in, start, end});
      r.busy[st] += end - start;
      clock[st] = end;
      ++done[{static_cast<int>(in.op), in.micro, part}];
      if (in.op == Op::kForward) ++in_flight[st];
      if (in.op == Op::kBackward || in.op == Op::kBackwardInput) --in_flight[st];
      r.peak_in_flight[st] = std::max(r.peak_in_flight[st], in_flight[st]);
    }
  }
  ++pc[st];
  return true;
}

}  // namespace

SimResult simulate(const Schedule& s, const SimCosts& costs) {
  const int p = s.stages;
  LOOM_CHECK(static_cast<int>(s.per_stage.size()) == p, "schedule with {} lists for {} stages",
             s.per_stage.size(), p);
  SimState st{s,
              costs,
              {},
              std::vector<size_t>(p, 0),
              std::vector<double>(p, 0),
              {},
              std::vector<std::set<MsgKey>>(p),
              {},
              std::vector<int>(p, 0)};
  st.r.busy.assign(p, 0);
  st.r.peak_in_flight.assign(p, 0);
  st.r.slices.resize(p);
  for (;;) {
    bool moved = false, finished = true;
    for (int k = 0; k < p; ++k) {
      while (st.pc[k] < s.per_stage[k].size() && st.advance(k)) moved = true;
      finished = finished && st.pc[k] == s.per_stage[k].size();
    }
    if (finished) break;
    if (!moved) {
      std::string waits;
      for (int k = 0; k < p; ++k)
        if (st.pc[k] < s.per_stage[k].size())
          waits += format("{}stage {} at {}", waits.empty() ? "" : "; ", k,
                          s.per_stage[k][st.pc[k]].describe());
      LOOM_FAIL(kInternal, "schedule {} (p {}, m {}, v {}) deadlocks: {}", schedule_name(s.kind), p,
                s.micro_batches, s.chunks, waits);
    }
  }
  // Everything computed once, every message received.
  const bool zb = s.kind == ScheduleKind::kZeroBubble;
  for (int part = 0; part < s.parts(); ++part)
    for (int mb = 0; mb < s.micro_batches; ++mb) {
      const std::vector<Op> ops =
          zb ? std::vector<Op>{Op::kForward, Op::kBackwardInput, Op::kBackwardWeight}
             : std::vector<Op>{Op::kForward, Op::kBackward};
      for (Op op : ops)
        LOOM_CHECK_KIND(kInternal, st.count(op, mb, part) == 1,
                        "schedule {}: {} of micro-batch {} on part {} ran {} times",
                        schedule_name(s.kind), op_name(op), mb, part, st.count(op, mb, part));
    }
  LOOM_CHECK_KIND(kInternal, st.sent.empty(), "schedule {}: {} message(s) never received",
                  schedule_name(s.kind), st.sent.size());
  for (double c : st.clock) st.r.makespan = std::max(st.r.makespan, c);
  return st.r;
}

double theoretical_bubble(ScheduleKind kind, int p, int m, int v) {
  // Idle time over the whole: (p - 1) units of one micro-batch's work
  // against m of them, divided by v when each stage holds v chunks.
  // Zero-bubble (ZB-H1) removes about two thirds of it when forward,
  // input-gradient and weight-gradient parts take equal time.
  double idle = p - 1.0;
  if (kind == ScheduleKind::kInterleaved) idle /= v;
  if (kind == ScheduleKind::kZeroBubble) idle /= 3.0;
  return idle / (m + idle);
}

}  // namespace loom::pp
