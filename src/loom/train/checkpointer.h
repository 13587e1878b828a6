// Sharded checkpoints of a run, for the Trainer: every rank writes the part
// of the model state it holds (its ZeRO shard of its tensor-parallel slices
// of its pipeline stages' parameters and AdamW moments) to its own file, at
// once or in the background, and world rank 0 completes the folder once
// every file is durable. Loading fills whatever this rank holds from a
// checkpoint of either format saved under any layout, reading only the
// pieces it needs.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "loom/checkpoint/checkpoint.h"
#include "loom/checkpoint/sharded.h"
#include "loom/train/step_engine.h"

namespace loom {

// A completed save, as world rank 0 reports it.
struct SaveReport {
  std::string dir;
  size_t bytes = 0;     // every rank's file
  double seconds = 0;   // from the start of the save to the checkpoint in place
  double paused_s = 0;  // of which training waited (all of it unless async)
  bool async = false;
};

class Checkpointer {
 public:
  // Saves go under `root`; `on_saved` runs on world rank 0 with each
  // completed checkpoint.
  Checkpointer(StepEngine& engine, std::string root,
               std::function<void(const SaveReport&)> on_saved);
  // A background save still running is waited for, not completed: its
  // folder stays temporary and `latest` keeps naming the previous one.
  ~Checkpointer();

  // Saves step `state.step` (collective over the world). With
  // checkpoint.async the state is copied and written in the background;
  // else the checkpoint is complete on disk when save returns on any rank.
  void save(const TrainerState& state, const nlohmann::json& config);
  // After a step: completes a background save once every rank's file is
  // durable (collective: one small all-reduce while a save is pending).
  void poll();
  // Waits for a background save and completes it (collective).
  void finish();
  bool pending() const { return pending_ != nullptr; }

  // Fills the parameters this rank holds (and the moments, when `moments`)
  // of every chunk from `reader`. Not collective, but in a 16-bit run at
  // ZeRO stage 1 or 2, where the loaded masters are rounded into parameters
  // gathered over the data-parallel group (every rank loads).
  static void load(StepEngine& engine, const CheckpointReader& reader, bool moments);
  // With the moments, chunk c's comm.compression state (docs/comm.md).
  static void load_compression(StepEngine& engine, int chunk, const CheckpointReader& reader);

 private:
  struct Pending;
  // What this rank writes: its share of the parameters and moments, and
  // its comm.compression state (whose Q tensors are described by Params
  // kept in `extra`).
  std::vector<PieceOut> pieces(std::deque<Param>& extra) const;
  void complete();

  StepEngine& engine_;
  std::string root_;
  std::function<void(const SaveReport&)> on_saved_;
  std::unique_ptr<Pending> pending_;
};

}  // namespace loom
