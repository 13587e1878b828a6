// Test-only fault points. LOOM_TEST_THROW=PHASE:RANK:STEP makes world rank
// RANK throw Error(kInternal) at the fault point named PHASE during
// optimizer step STEP (1-based), so the failure tests can make a rank fail
// at a chosen point of a step with work of every kind in flight. Phases:
//   forward     inside a stage's forward, after its first block
//   backward    inside a stage's backward, after its last block's backward
//               (the gradient reductions of that block are in flight)
//   pipeline    right after a pipeline stage posted a receive ahead
//   zero_gather right after a ZeRO-3 parameter gather was launched
//   zero_reduce right after a ZeRO-2/3 gradient reduce-scatter was launched
//   checkpoint  while a checkpoint is being written (its folder incomplete)
//   eval        inside an evaluation pass
// LOOM_TEST_SLOW=RANK:MS makes world rank RANK sleep MS milliseconds at
// the start of every optimizer step: a straggler, for the tests of the
// straggler report.
// Without the variables every fault point is a load and a compare.
#pragma once

#include <cstdint>

namespace loom {

// Where this process is: its world rank (once) and the current optimizer
// step (0-based, before each step).
void set_fault_rank(int world_rank);
void set_fault_step(int64_t step);
// Throws when LOOM_TEST_THROW names this phase, rank and step.
void fault_point(const char* phase);
// Sleeps when LOOM_TEST_SLOW names this rank.
void fault_delay();

}  // namespace loom
