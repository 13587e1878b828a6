// loom launch: runs a training job under mpirun on a list of hosts and, when
// it fails, restarts it from the latest checkpoint on the hosts that can
// still be reached, with the data-parallel size fitted to the ranks that
// remain and the global batch kept (accumulation raised). torchrun's
// --max-restarts, for MPI jobs across hosts.
//
// The supervisor is an ordinary process beside mpirun: it starts mpirun,
// passes its output through (noting the first failure report), waits for
// it, probes each host with a one-rank mpirun of its own, and decides.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace loom {

struct HostSlots {
  std::string name;
  int slots = 1;
};

// "node0:2,node1:2" (":N" optional, 1 slot). Throws Error(kConfig) naming
// the item that is malformed or repeated.
std::vector<HostSlots> parse_hosts(const std::string& spec);
std::string hosts_arg(const std::vector<HostSlots>& hosts);  // back to "node0:2,node1:2"
int total_slots(const std::vector<HostSlots>& hosts);

// What a restart must keep: from the run's config.resolved.json.
struct BatchLayout {
  int64_t train_batch_size = 1, micro_batch = 1;
  int tp = 1, pp = 1, ep = 1;
  bool interleaved = false;  // the interleaved schedule: accumulation a multiple of pp
  int cp = 1;                // context parallel
};

struct RestartLayout {
  int world = 1, dp = 1;
  int64_t accumulation = 1;
};

// The largest job of at most `slots` ranks that keeps the global batch and
// the micro-batch: world a multiple of tp x cp x pp, dp x cp a multiple of ep,
// train_batch_size divisible by micro-batch x dp (and, interleaved, the
// accumulation a multiple of pp). None when no such job exists.
std::optional<RestartLayout> fit_layout(const BatchLayout& b, int slots);

struct LaunchOptions {
  std::string hosts;     // --hosts
  int np = 0;            // --np (0: every slot)
  int max_restarts = 0;  // --max-restarts
  int min_hosts = 1;     // --min-hosts
  std::string mpirun = "mpirun";
  std::string mpirun_args;           // shell words, passed to every mpirun
  double probe_timeout_s = 15;       // --probe-timeout
  std::string loom;                  // this executable (the ranks run it)
  std::vector<std::string> command;  // "train" ARGS...
};

// Runs the job; returns the exit status of the last attempt (0: trained).
// Bad input (hosts, slots, --min-hosts, a host that cannot be reached, a
// command that is not `train ... --out DIR`) throws Error(kConfig) before
// anything is started.
int run_launch(const LaunchOptions& options);

}  // namespace loom
