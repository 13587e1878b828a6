// Waiting on a ZeRO engine's collectives: timings, and waits that never
// leave an operation writing into a buffer about to be freed.
#pragma once

#include <vector>

#include "loom/comm/process_group.h"
#include "loom/kernels/backend.h"

namespace loom {

struct CommStats {
  double comm_s = 0;     // time the collectives took on the communication thread
  double exposed_s = 0;  // time the caller waited for them
};

// Waits for every operation even when one fails, so that none is still
// writing into buffers the caller frees while the error unwinds; then
// rethrows the first failure. Adds the wait to stats->exposed_s and the
// operations' own time to stats->comm_s.
void wait_all(const std::vector<WorkPtr>& works, CommStats* stats = nullptr);

// Waits for one operation whose result `backend` computes with next: the
// host waits until it is issued and its errors known; a device-ordered one
// (Work::event()) is then ordered before the backend's next operations
// (Backend::order_after) instead of blocking the host. Times as wait_all.
void wait_for_use(const WorkPtr& w, const Backend<float>& backend, CommStats* stats = nullptr);

// For destructors: waits for w (null: nothing) and swallows its failure,
// which was reported where it happened. An error unwinding past an
// operation still in flight ends a parallel job here (fail_fast, naming
// `what`) instead of waiting on peers that may be waiting on this rank.
void wait_quietly(const WorkPtr& w, const char* what);

}  // namespace loom
