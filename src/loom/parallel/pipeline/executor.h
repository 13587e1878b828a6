// The pipeline executor: runs one stage's instruction list (schedule.h) for
// one optimizer step or one evaluation pass.
//
// Each chunk of the stage is a GptStage with its ZeRO engine. Activations and
// their gradients travel over the pipeline-parallel group by asynchronous
// point-to-point messages whose shapes are known in advance ((B,T,C) rows of
// this rank, the same on both sides): a receive is posted where the list
// places it (one compute instruction ahead) and waited for by the compute
// that consumes it; a send is posted after its producer and waited for only
// before its buffer is used again. Every message carries a tag naming the
// micro-batch, chunk and direction, so messages cannot be confused whatever
// order the peers post them in.
//
// The caller owns the reduction and the optimizer: the list's
// reduce_grads and optimizer_step instructions call back into it, so the
// timeline shows them where they run.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/model/gpt_stage.h"
#include "loom/parallel/pipeline/schedule.h"
#include "loom/parallel/zero/zero.h"

namespace loom::pp {

struct ChunkRef {
  GptStage<float>* stage = nullptr;
  ZeroEngine* zero = nullptr;
};

// One micro-batch's data, the same on every stage (each reads what it needs).
struct MicroBatch {
  const int32_t* tokens = nullptr;   // (B,T): the first part's input
  const int32_t* targets = nullptr;  // (B,T): the last part's loss
  StepContext ctx;
};

// Where a stage's time went in one run (seconds).
struct ExecStats {
  double forward = 0, backward = 0, recompute = 0;
  double wait = 0;   // blocked on receives (and on sends before reusing a buffer)
  double total = 0;  // the run, first instruction to last
  // From the time origin (set_time_origin): the run's start and the end of
  // its last compute instruction, so the caller can find the pipeline's
  // span over every rank.
  double start = 0, compute_end = 0;
  double loss = 0;  // sum of the last part's micro-batch losses (0 elsewhere)
  double idle() const { return total - forward - backward; }
};

// One instruction as it ran, for the timeline (seconds from the tracing
// origin; ranks on one machine share the monotonic clock, and the caller
// takes the origin right after a barrier).
struct TraceSlice {
  Instr instr;
  double start = 0, end = 0;
};

class Executor {
 public:
  // `stage`: this rank's pipeline stage; chunks[c] holds its chunk c;
  // `group`: the pipeline-parallel group (rank = stage). B and Tn: the
  // micro-batch shape. payload: the type messages travel in (kF32, or a
  // bf16 run's bf16: rounded before each send, widened after each receive,
  // on the chunks' backend).
  Executor(Schedule schedule, int stage, std::vector<ChunkRef> chunks,
           std::shared_ptr<ProcessGroup> group, int64_t B, int64_t Tn, DType payload = DType::kF32);
  // An error unwinding past messages still in flight (a receive posted
  // ahead writes into the pool) ends a parallel job here, while the buffers
  // are alive (fail_fast); otherwise waits for them.
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  const Schedule& schedule() const { return schedule_; }
  // Runs the step's list. loss_scale multiplies each micro-batch's mean
  // loss in backward (1/m for the mean over the step's micro-batches).
  // on_reduce and on_step run at the list's reduce_grads and optimizer_step.
  ExecStats train(const std::vector<MicroBatch>& mbs, double loss_scale,
                  const std::function<void()>& on_reduce, const std::function<void()>& on_step);
  // Forwards alone, every micro-batch through every part, for evaluation.
  ExecStats evaluate(const std::vector<MicroBatch>& mbs);
  // The last run's instructions as they ran (kept when tracing is on).
  void set_tracing(bool on) { tracing_ = on; }
  // Where the trace's and ExecStats' times count from (take it right after
  // a barrier so the ranks agree).
  void set_time_origin(std::chrono::steady_clock::time_point origin) { origin_ = origin; }
  const std::vector<TraceSlice>& trace() const { return trace_; }

 private:
  struct Pooled {
    Buffer buf;
    Buffer wire;      // 16-bit payloads: what travels (buf rounded, or received)
    WorkPtr pending;  // a send still reading it, or a receive writing it
  };
  struct Slot {
    StageActivations<float> acts;
    Buffer wire;           // 16-bit payloads: acts.output rounded, as sent
    WorkPtr pending_send;  // the activation sent from acts.output (or wire)
    bool busy = false;     // holds a micro-batch between its forward and backward
  };
  struct Chunk {
    ChunkRef ref;
    std::vector<std::unique_ptr<Slot>> slots;    // activation stores, reused
    std::vector<int> slot_of;                    // per micro-batch, -1 when none
    std::vector<int> act_in, grad_in, grad_out;  // pool entries per micro-batch
    int last_backward = -1;                      // the list position of its final backward
    std::vector<std::unique_ptr<DeferredGrads<float>>> deferred;  // zero-bubble: per micro-batch
  };

  ExecStats run(const std::vector<Instr>& list, const std::vector<MicroBatch>& mbs,
                double loss_scale, bool training, const std::function<void()>& on_reduce,
                const std::function<void()>& on_step);
  void post_recv(const Instr& in);
  void forward(const Instr& in, const MicroBatch& mb, bool training, ExecStats& st);
  void backward(const Instr& in, size_t pos, double loss_scale, ExecStats& st);
  void backward_weights(const Instr& in, size_t pos, ExecStats& st);
  void send(const Instr& in);
  int take_slot(Chunk& c);
  int take_buffer();
  void wait(const WorkPtr& w, ExecStats& st);
  // A received message, waited for (and widened from the wire type).
  const float* received(int idx, ExecStats& st);
  // What to send of n f32 elements at x: x itself, or x rounded into `wire`.
  const void* outgoing(const float* x, size_t n, Buffer& wire) const;
  int tag(int micro, int receiving_chunk, bool gradient) const;
  std::string describe(const Instr& in, bool gradient, bool sending) const;

  Schedule schedule_;
  int stage_;
  std::vector<Chunk> chunks_;
  std::shared_ptr<ProcessGroup> group_;
  int64_t B_, Tn_, rows_, C_;
  DType payload_;
  const Backend<float>* be_;
  std::vector<Pooled> pool_;  // (rows, C) message buffers
  std::vector<bool> in_use_;
  std::vector<Instr> eval_list_;
  bool tracing_ = false;
  std::vector<TraceSlice> trace_;
  std::chrono::steady_clock::time_point t0_, origin_ = std::chrono::steady_clock::now();
};

}  // namespace loom::pp
