#include "loom/comm/grid.h"

#include <algorithm>
#include <set>

#include "loom/core/error.h"

namespace loom {

namespace {
std::string divisors(int n) {
  std::string s;
  for (int d = 1; d <= n; ++d)
    if (n % d == 0) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}

// The divisors of n nearest to x, below and above.
std::string nearest_divisors(int n, int x) {
  int below = 1, above = n;
  for (int d = 1; d <= n; ++d) {
    if (n % d != 0) continue;
    if (d <= x) below = d;
    if (d >= x) {
      above = d;
      break;
    }
  }
  return below == above ? std::to_string(below)
                        : std::to_string(below) + " or " + std::to_string(above);
}
}  // namespace

Grid::Grid(GridShape s) : shape_(s) {
  LOOM_CHECK_KIND(kConfig, s.world >= 1 && s.tp >= 1 && s.pp >= 1 && s.ep >= 1 && s.cp >= 1,
                  "grid sizes must be positive (world {}, tp {}, cp {}, pp {}, ep {})", s.world,
                  s.tp, s.cp, s.pp, s.ep);
  if (s.world % (s.tp * s.pp) != 0) {
    std::string hint =
        s.world % s.pp == 0
            ? format("with parallel.pipeline {}, parallel.tensor must divide {}: {} (nearest: {})",
                     s.pp, s.world / s.pp, divisors(s.world / s.pp),
                     nearest_divisors(s.world / s.pp, s.tp))
            : format("parallel.pipeline must divide the world size: {} (nearest: {})",
                     divisors(s.world), nearest_divisors(s.world, s.pp));
    LOOM_FAIL(
        kConfig,
        "world size {} is not divisible by parallel.tensor {} x parallel.pipeline {} = {}; {}",
        s.world, s.tp, s.pp, s.tp * s.pp, hint);
  }
  const int rest = s.world / (s.tp * s.pp);  // dp x cp
  LOOM_CHECK_KIND(kConfig, rest % s.cp == 0,
                  "parallel.context {} does not divide world {} / (tp {} x pp {}) = {}; valid "
                  "context sizes: {}; nearest: {}",
                  s.cp, s.world, s.tp, s.pp, rest, divisors(rest), nearest_divisors(rest, s.cp));
  LOOM_CHECK_KIND(kConfig, rest % s.ep == 0,
                  "parallel.expert {} does not divide the {} size {} (world {} / (tp {} x pp {})); "
                  "valid expert sizes: {}; nearest: {}",
                  s.ep, s.cp > 1 ? "data-parallel x context-parallel" : "data-parallel", rest,
                  s.world, s.tp, s.pp, divisors(rest), nearest_divisors(rest, s.ep));
}

GridCoord Grid::coord(int rank) const {
  LOOM_CHECK(rank >= 0 && rank < shape_.world, "rank {} outside world {}", rank, shape_.world);
  GridCoord c;
  c.tp = rank % shape_.tp;
  c.cp = (rank / shape_.tp) % shape_.cp;
  c.dp = (rank / (shape_.tp * shape_.cp)) % shape_.dp();
  c.pp = rank / (shape_.tp * shape_.cp * shape_.dp());
  const int d = c.dp_cp(shape_.cp);
  c.ep = d % shape_.ep;
  c.ep_dp = d / shape_.ep;
  return c;
}

std::vector<int> Grid::tp_group(int rank) const {
  GridCoord c = coord(rank);
  std::vector<int> g;
  for (int t = 0; t < shape_.tp; ++t) g.push_back(rank_of(t, c.dp, c.pp, c.cp));
  return g;
}

std::vector<int> Grid::cp_group(int rank) const {
  GridCoord c = coord(rank);
  std::vector<int> g;
  for (int k = 0; k < shape_.cp; ++k) g.push_back(rank_of(c.tp, c.dp, c.pp, k));
  return g;
}

std::vector<int> Grid::dp_group(int rank) const {
  GridCoord c = coord(rank);
  std::vector<int> g;
  for (int d = 0; d < shape_.dp(); ++d) g.push_back(rank_of(c.tp, d, c.pp, c.cp));
  return g;
}

// The dp x cp index d is (dp d / cp, cp d % cp).
std::vector<int> Grid::dp_cp_group(int rank) const {
  GridCoord c = coord(rank);
  std::vector<int> g;
  for (int d = 0; d < shape_.dp() * shape_.cp; ++d)
    g.push_back(rank_of(c.tp, d / shape_.cp, c.pp, d % shape_.cp));
  return g;
}

std::vector<int> Grid::pp_group(int rank) const {
  GridCoord c = coord(rank);
  std::vector<int> g;
  for (int p = 0; p < shape_.pp; ++p) g.push_back(rank_of(c.tp, c.dp, p, c.cp));
  return g;
}

std::vector<int> Grid::model_parallel_group(int rank) const {
  GridCoord c = coord(rank);
  std::vector<int> g;
  for (int p = 0; p < shape_.pp; ++p)
    for (int t = 0; t < shape_.tp; ++t) g.push_back(rank_of(t, c.dp, p, c.cp));
  std::sort(g.begin(), g.end());
  return g;
}

std::vector<int> Grid::embedding_group(int rank) const {
  GridCoord c = coord(rank);
  std::set<int> g = {rank_of(c.tp, c.dp, 0, c.cp), rank_of(c.tp, c.dp, shape_.pp - 1, c.cp)};
  return {g.begin(), g.end()};
}

std::vector<int> Grid::ep_group(int rank) const {
  GridCoord c = coord(rank);
  std::vector<int> g;
  const int first = c.dp_cp(shape_.cp) - c.ep;
  for (int e = 0; e < shape_.ep; ++e) {
    const int d = first + e;
    g.push_back(rank_of(c.tp, d / shape_.cp, c.pp, d % shape_.cp));
  }
  return g;
}

std::vector<int> Grid::ep_dp_group(int rank) const {
  GridCoord c = coord(rank);
  std::vector<int> g;
  for (int k = 0; k < shape_.dp() * shape_.cp / shape_.ep; ++k) {
    const int d = k * shape_.ep + c.ep;
    g.push_back(rank_of(c.tp, d / shape_.cp, c.pp, d % shape_.cp));
  }
  return g;
}

std::vector<std::vector<int>> Grid::all_groups(const std::string& kind) const {
  std::set<std::vector<int>> seen;
  std::vector<std::vector<int>> out;
  for (int r = 0; r < shape_.world; ++r) {
    std::vector<int> g;
    if (kind == "tp")
      g = tp_group(r);
    else if (kind == "cp")
      g = cp_group(r);
    else if (kind == "dp")
      g = dp_group(r);
    else if (kind == "dp_cp")
      g = dp_cp_group(r);
    else if (kind == "pp")
      g = pp_group(r);
    else if (kind == "mp")
      g = model_parallel_group(r);
    else if (kind == "embedding")
      g = embedding_group(r);
    else if (kind == "ep")
      g = ep_group(r);
    else if (kind == "ep_dp")
      g = ep_dp_group(r);
    else
      LOOM_FAIL(kInternal, "unknown group kind '{}'", kind);
    if (seen.insert(g).second) out.push_back(g);
  }
  return out;
}

std::string Grid::describe() const {
  if (shape_.cp > 1)
    return format("world {} = tp {} x cp {} x dp {} x pp {} (ep {})", shape_.world, shape_.tp,
                  shape_.cp, shape_.dp(), shape_.pp, shape_.ep);
  return format("world {} = tp {} x dp {} x pp {} (ep {})", shape_.world, shape_.tp, shape_.dp(),
                shape_.pp, shape_.ep);
}

}  // namespace loom
