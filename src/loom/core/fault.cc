#include "loom/core/fault.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "loom/core/error.h"

namespace loom {

namespace {
struct FaultSpec {
  bool armed = false;
  std::string phase;
  int rank = -1;
  int64_t step = 0;  // 1-based
};

const FaultSpec& spec() {
  static const FaultSpec s = [] {
    FaultSpec f;
    const char* v = std::getenv("LOOM_TEST_THROW");
    if (v == nullptr || *v == '\0') return f;
    const std::string text(v);
    const size_t a = text.find(':'), b = text.rfind(':');
    LOOM_CHECK(a != std::string::npos && b != a, "LOOM_TEST_THROW='{}': expected PHASE:RANK:STEP",
               text);
    f.phase = text.substr(0, a);
    f.rank = std::stoi(text.substr(a + 1, b - a - 1));
    f.step = std::stoll(text.substr(b + 1));
    f.armed = true;
    return f;
  }();
  return s;
}

// LOOM_TEST_SLOW=RANK:MS: {rank, ms}; rank -1 when unset.
std::pair<int, int> slow_spec() {
  static const std::pair<int, int> s = [] {
    const char* v = std::getenv("LOOM_TEST_SLOW");
    if (v == nullptr || *v == '\0') return std::pair<int, int>{-1, 0};
    const std::string text(v);
    const size_t a = text.find(':');
    LOOM_CHECK(a != std::string::npos, "LOOM_TEST_SLOW='{}': expected RANK:MS", text);
    return std::pair<int, int>{std::stoi(text.substr(0, a)), std::stoi(text.substr(a + 1))};
  }();
  return s;
}

std::atomic<int> g_rank{0};
std::atomic<int64_t> g_step{0};
}  // namespace

void set_fault_rank(int world_rank) {
  g_rank = world_rank;
}

void set_fault_step(int64_t step) {
  g_step = step;
}

void fault_point(const char* phase) {
  const FaultSpec& f = spec();
  if (!f.armed || f.rank != g_rank.load() || f.step != g_step.load() + 1 ||
      std::strcmp(f.phase.c_str(), phase) != 0)
    return;
  throw Error(ErrorKind::kInternal,
              format("test fault: {} at step {} (LOOM_TEST_THROW)", phase, f.step));
}

void fault_delay() {
  const auto [rank, ms] = slow_spec();
  if (rank == g_rank.load() && ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms));
}

}  // namespace loom
