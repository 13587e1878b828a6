#include "loom/parallel/zero/comm_wait.h"

#include <chrono>
#include <exception>

#include "loom/core/clock.h"
#include "loom/core/error.h"
#include "loom/core/fault.h"

namespace loom {

void wait_all(const std::vector<WorkPtr>& works, CommStats* stats) {
  const auto t0 = std::chrono::steady_clock::now();
  std::exception_ptr first;
  for (const WorkPtr& w : works) {
    try {
      w->wait();
      if (stats) stats->comm_s += w->seconds();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (stats) stats->exposed_s += seconds_since(t0);
  if (first) std::rethrow_exception(first);
}

void wait_for_use(const WorkPtr& w, const Backend<float>& backend, CommStats* stats) {
  const auto t0 = std::chrono::steady_clock::now();
  w->wait_host();
  if (stats) {
    stats->comm_s += w->seconds();
    stats->exposed_s += seconds_since(t0);
  }
  if (w->event()) backend.order_after(*w->event());
}

void wait_quietly(const WorkPtr& w, const char* what) {
  if (!w) return;
  if (!w->test() && std::uncaught_exceptions() > 0)
    fail_fast(format("{} ({} was still in flight)", last_error(), what));
  try {
    w->wait();
  } catch (...) {  // the failure was reported where it happened
  }
}

}  // namespace loom
