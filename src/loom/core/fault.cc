#include "loom/core/fault.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

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

}  // namespace loom
