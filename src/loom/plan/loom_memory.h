// What loom's executor keeps on a rank for a layout, by its own sizes rather
// than a published count: each micro-batch's activation record (the layers'
// record_elems, with 16-bit runs packing a record into 16 bits beside its
// exact parts), the room a recomputed or packed block is rebuilt in, the
// backward scratch, the stores a pipeline schedule holds at once (walked
// from the very schedule the executor runs, per chunk, with zero-bubble's
// deferred weight-gradient inputs), and the communication buffers (the
// ZeRO buckets and gathered units, 16-bit reduction buffers, pipeline
// messages). Every figure is in bytes of the most loaded rank (a
// pipeline's stages are each computed and the largest kept).
//
// The formulas mirror nn/ and model/ (Block::bind, Attention, Mlp, MoeLayer,
// Head, the tensor-parallel layers, GptStage::store_bytes / room_bytes /
// ensure_work); tests/unit/test_plan.cc holds them to GptStage's own sizes,
// and bench/plan_validate.sh to the peaks measured in training.
#pragma once

#include <cstdint>
#include <string>

#include "loom/plan/planner.h"

namespace loom::plan {

struct LoomMemory {
  double activations = 0;  // stores in flight, rooms, deferred weight-gradient inputs
  double workspace = 0;    // backward scratch (one per chunk)
  double comm = 0;         // communication buffers at their peak
};

// The activations, scratch and communication buffers of `l` running `m`
// with `micro_batches` micro-batches a step, on its most loaded stage.
LoomMemory loom_memory(const ModelShape& m, const Layout& l, int64_t micro_batches);

// One micro-batch's store of blocks [first, last) (with the embedding's
// input slot, and the head when `head`), in bytes; and that chunk's room
// and scratch (exposed for the unit test against GptStage).
struct ChunkBytes {
  double store = 0, room = 0, scratch = 0, deferred = 0;
};
ChunkBytes loom_chunk_bytes(const ModelShape& m, const Layout& l, int first, int last,
                            bool embedding, bool head);

// The rows a MoE layer routes on a rank: this rank's `count`, split over
// the tensor group when the micro-batch's sequences divide over it and the
// sequence is not already split.
double moe_rows(const ModelShape& m, const Layout& l, double count);

// Block `layer`'s whole record in f32 bytes (nothing recomputed, nothing
// packed): what the time model charges loom's non-GEMM work by.
double loom_block_record_bytes(const ModelShape& m, const Layout& l, int64_t layer);

}  // namespace loom::plan
