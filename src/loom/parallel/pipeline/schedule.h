// Pipeline schedules: one representation that the executor runs, the
// simulator costs and the tracer draws (DESIGN.md).
//
// A schedule is, per pipeline stage, an ordered list of instructions. The
// model is cut into stages x chunks parts ("virtual stages"); part
// chunk * stages + stage lives on `stage` as its chunk `chunk`, so a
// micro-batch's forward visits stage 0 .. p-1 for chunk 0, then again for
// chunk 1, and so on (interleaving; one chunk otherwise).
//
// Communication semantics the executor implements and the simulator checks:
// a send is posted and never blocks (its buffer stays untouched until it
// completes); a receive is posted where it stands and the compute
// instruction that consumes it waits for it. Receives are placed one compute
// instruction ahead of their consumer, so a message arrives while the stage
// computes something else.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace loom::pp {

enum class Op : uint8_t {
  kRecvAct,         // post the receive of the previous part's output
  kForward,         // forward of (micro, chunk)
  kSendAct,         // send the output to the next part
  kRecvGrad,        // post the receive of the gradient of the output
  kBackward,        // backward of (micro, chunk): input and parameter gradients
  kBackwardInput,   // zero-bubble: the input gradient alone (B)
  kBackwardWeight,  // zero-bubble: the parameter gradients (W), deferred
  kSendGrad,        // send the gradient of the input to the previous part
  kReduceGrads,     // tied embedding sum, data-parallel reductions finish
  kOptimizerStep,
};
const char* op_name(Op op);
bool is_compute(Op op);

struct Instr {
  Op op;
  int micro = -1;  // -1 for the step-wide instructions
  int chunk = 0;
  std::string describe() const;  // "F3.1" style, as the timeline labels slices
};

enum class ScheduleKind { kGpipe, k1F1B, kInterleaved, kZeroBubble };
const char* schedule_name(ScheduleKind k);
// "gpipe", "1f1b", "interleaved", "zero_bubble"; throws Error(kConfig) naming
// the choices otherwise.
ScheduleKind parse_schedule(const std::string& name);

struct Schedule {
  ScheduleKind kind = ScheduleKind::k1F1B;
  int stages = 1, micro_batches = 1, chunks = 1;
  std::vector<std::vector<Instr>> per_stage;

  int parts() const { return stages * chunks; }
  int part(int stage, int chunk) const { return chunk * stages + stage; }
  bool first_part(int stage, int chunk) const { return part(stage, chunk) == 0; }
  bool last_part(int stage, int chunk) const { return part(stage, chunk) == parts() - 1; }
  // The stage holding the next (previous) part after (stage, chunk).
  int next_stage(int stage) const { return (stage + 1) % stages; }
  int prev_stage(int stage) const { return (stage + stages - 1) % stages; }
  int next_chunk(int stage, int chunk) const { return stage == stages - 1 ? chunk + 1 : chunk; }
  int prev_chunk(int stage, int chunk) const { return stage == 0 ? chunk - 1 : chunk; }
};

// p stages, m micro-batches, v chunks per stage (interleaved only; 1 for
// the others). Throws Error(kConfig) with the numbers when the combination
// cannot be scheduled (interleaving needs m a multiple of p).
Schedule make_schedule(ScheduleKind kind, int p, int m, int v = 1);
// The checks make_schedule makes of its arguments (Error(kConfig) naming the
// key), without building it: a config is validated before any run builds
// its one schedule.
void check_schedule(ScheduleKind kind, int p, int m, int v = 1);

// Costs for the simulator, in any unit of time: forward, backward (whole),
// and for zero-bubble its input and weight parts; per message latency.
struct SimCosts {
  double forward = 1, backward = 2, backward_input = 1, backward_weight = 1, p2p = 0;
};

struct SimSlice {
  Instr instr;
  double start = 0, end = 0;
};

struct SimResult {
  double makespan = 0;
  std::vector<double> busy;                   // per stage: compute time
  std::vector<int> peak_in_flight;            // per stage: forwards without their backward
  std::vector<std::vector<SimSlice>> slices;  // per stage: compute instructions in time
  double bubble_fraction() const;             // idle share of stages x makespan
};

// Runs the lists against each other. Checks, throwing Error(kInternal) with
// the stage and instruction on the first violation: every (micro, chunk)
// forwarded and backwarded (B and W under zero-bubble) exactly once on its
// stage, in dependency order; every send matched by one receive; no
// deadlock (a state where no stage can move names what each waits for).
SimResult simulate(const Schedule& s, const SimCosts& costs = {});

// The classical bubble fraction (p-1)/(m+p-1), divided by v when interleaved.
double theoretical_bubble(ScheduleKind kind, int p, int m, int v);

}  // namespace loom::pp
