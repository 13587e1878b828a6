// loom launch --hosts H:N,... [--np N] [--max-restarts N] [--min-hosts M]
//             [--mpirun-args "..."] -- train ARGS...
#include <unistd.h>

#include <climits>
#include <memory>
#include <string>

#include "commands.h"
#include "loom/train/launch.h"

namespace loom::app {

namespace {
std::string this_executable() {
  char buf[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("loom");
}
}  // namespace

void add_launch_command(CLI::App& app) {
  auto o = std::make_shared<LaunchOptions>();
  CLI::App* cmd = app.add_subcommand(
      "launch", "Run `train` under mpirun on a list of hosts, restarting it when it fails");
  cmd->add_option("--hosts", o->hosts, "Hosts and their slots: node0:2,node1:2")->required();
  cmd->add_option("--np", o->np, "Ranks (default: every slot)")->check(CLI::PositiveNumber);
  cmd->add_option("--max-restarts", o->max_restarts,
                  "Restarts from the latest checkpoint after a failure")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--min-hosts", o->min_hosts, "Give up when fewer hosts remain")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--mpirun", o->mpirun, "The mpirun to run");
  cmd->add_option("--mpirun-args", o->mpirun_args,
                  "More mpirun options, as shell words (\"--mca btl self,vader,tcp -x PATH\")");
  cmd->add_option("--probe-timeout", o->probe_timeout_s,
                  "Seconds a one-rank job on a host may take before the host counts as lost")
      ->check(CLI::PositiveNumber);
  cmd->add_option("command", o->command, "-- train ARGS...")->required();
  cmd->callback([o] {
    o->loom = this_executable();
    int rc = run_launch(*o);
    if (rc != 0) std::exit(rc);
  });
}

}  // namespace loom::app
