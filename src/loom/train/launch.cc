#include "loom/train/launch.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/io/fs.h"

namespace loom {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

std::vector<HostSlots> parse_hosts(const std::string& spec) {
  std::vector<HostSlots> hosts;
  std::set<std::string> seen;
  size_t begin = 0;
  while (begin <= spec.size()) {
    size_t end = spec.find(',', begin);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(begin, end - begin);
    begin = end + 1;
    HostSlots h;
    size_t colon = item.find(':');
    h.name = item.substr(0, colon);
    LOOM_CHECK_KIND(kConfig, !h.name.empty(), "--hosts {}: empty host name in '{}'", spec, item);
    if (colon != std::string::npos) {
      const std::string n = item.substr(colon + 1);
      char* e = nullptr;
      long v = std::strtol(n.c_str(), &e, 10);
      LOOM_CHECK_KIND(kConfig, !n.empty() && *e == '\0' && v >= 1 && v <= 1 << 16,
                      "--hosts {}: '{}' has slots '{}' (expected HOST or HOST:N, N >= 1)", spec,
                      item, n);
      h.slots = static_cast<int>(v);
    }
    LOOM_CHECK_KIND(kConfig, seen.insert(h.name).second, "--hosts {}: host {} is listed twice",
                    spec, h.name);
    hosts.push_back(h);
  }
  return hosts;
}

std::string hosts_arg(const std::vector<HostSlots>& hosts) {
  std::string s;
  for (const auto& h : hosts) s += format("{}{}:{}", s.empty() ? "" : ",", h.name, h.slots);
  return s;
}

int total_slots(const std::vector<HostSlots>& hosts) {
  int n = 0;
  for (const auto& h : hosts) n += h.slots;
  return n;
}

std::optional<RestartLayout> fit_layout(const BatchLayout& b, int slots) {
  const int mp = b.tp * b.pp * b.cp;
  for (int world = slots; world >= mp; --world) {
    if (world % mp != 0) continue;
    const int dp = world / mp;  // experts come out of the dp x cp ranks
    if ((dp * b.cp) % b.ep != 0 || b.train_batch_size % (b.micro_batch * dp) != 0) continue;
    const int64_t accumulation = b.train_batch_size / (b.micro_batch * dp);
    if (b.interleaved && accumulation % b.pp != 0) continue;
    return RestartLayout{world, dp, accumulation};
  }
  return std::nullopt;
}

namespace {

std::string sh_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

std::string seconds(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", s);
  return b;
}

void say(const std::string& line) {
  std::fprintf(stderr, "loom launch: %s\n", line.c_str());
  std::fflush(stderr);
}

// The process group of the child running now: a signal to the launcher
// goes to it (mpirun then ends its ranks).
volatile sig_atomic_t g_child_group = 0;
volatile sig_atomic_t g_stop_signal = 0;  // a signal asked the launcher to stop
void forward_signal(int sig) {
  const int saved = errno;
  g_stop_signal = sig;
  if (g_child_group > 0) kill(-g_child_group, sig);
  errno = saved;
}

struct Outcome {
  int status = 0;  // exit code; 128 + signal when killed
  // Its stderr: the first lines and the last (a failure report may come
  // after many warnings), and the first loom report wherever it came.
  std::vector<std::string> head;
  std::deque<std::string> tail;
  std::string loom_report;
  std::string first_lost_agent;  // the host whose daemon's agent ended first (AgentWatch)
  double seconds = 0;
  std::vector<std::string> lines() const {
    std::vector<std::string> all = head;
    all.insert(all.end(), tail.begin(), tail.end());
    return all;
  }
};

constexpr size_t kKeepLines = 400;

void keep_line(Outcome& out, std::string line) {
  if (out.loom_report.empty() && line.find("loom: rank ") != std::string::npos)
    out.loom_report = line.substr(line.find("loom: rank "));
  if (out.head.size() < kKeepLines) {
    out.head.push_back(std::move(line));
    return;
  }
  out.tail.push_back(std::move(line));
  if (out.tail.size() > kKeepLines) out.tail.pop_front();
}

// The agents mpirun started to launch its daemons (ssh, or the
// plm_rsh_agent): one per host it reaches directly, its host among its
// arguments. A whole host lost (every process killed, the machine gone)
// ends its agent first, before mpirun tears the job down; mpirun's own
// account of that ("unable to reliably start one or more daemons") names
// no host, so the first agent to end names it.
class AgentWatch {
 public:
  AgentWatch(pid_t mpirun, std::vector<std::string> hosts)
      : mpirun_(mpirun), hosts_(std::move(hosts)) {}

  // Call while mpirun runs.
  void poll() {
    // Once mpirun has ended (a zombie until it is reaped), its agents are
    // handed to another parent and would all look lost: nothing more can
    // be told from them.
    const char state = stat_of(mpirun_).state;
    if (state == 'Z' || state == 'X' || state == '?') return;
    std::set<pid_t> seen;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator("/proc", ec)) {
      const std::string name = e.path().filename().string();
      if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
      const pid_t pid = std::stoi(name);
      if (parent_of(pid) != mpirun_) continue;
      seen.insert(pid);
      // Read again until it names a host: a child seen between mpirun's
      // fork and its exec still shows mpirun's own arguments.
      auto it = live_.find(pid);
      if (it == live_.end() || it->second.empty()) live_[pid] = host_in_cmdline(pid);
    }
    for (auto it = live_.begin(); it != live_.end();) {
      if (seen.count(it->first) == 0) {
        if (first_lost_.empty()) first_lost_ = it->second;
        it = live_.erase(it);
      } else {
        ++it;
      }
    }
  }
  const std::string& first_lost() const { return first_lost_; }

 private:
  struct Stat {
    char state = '?';  // R, S, D, Z, ...; '?' when the process is gone
    pid_t ppid = -1;
  };
  static Stat stat_of(pid_t pid) {
    std::ifstream f(format("/proc/{}/stat", pid));
    std::string stat;
    std::getline(f, stat);
    const size_t close = stat.rfind(')');  // the command name may hold spaces
    Stat s;
    if (close == std::string::npos) return s;
    std::istringstream rest(stat.substr(close + 1));
    std::string state;
    rest >> state >> s.ppid;
    if (!state.empty()) s.state = state[0];
    return s;
  }
  static pid_t parent_of(pid_t pid) { return stat_of(pid).ppid; }
  std::string host_in_cmdline(pid_t pid) const {
    std::ifstream f(format("/proc/{}/cmdline", pid), std::ios::binary);
    std::string arg;
    while (std::getline(f, arg, '\0'))
      for (const std::string& h : hosts_)
        if (arg == h) return h;
    return {};
  }

  pid_t mpirun_;
  std::vector<std::string> hosts_;
  std::map<pid_t, std::string> live_;  // agent pid -> its host ("" when none is named)
  std::string first_lost_;
};

// Runs `cmd` with /bin/sh in a process group of its own, its stderr read
// line by line (passed through unless `quiet`), for at most `limit_s`
// seconds (0: no limit; then the group is killed).
Outcome run_shell(const std::string& cmd, bool quiet, double limit_s,
                  const std::vector<std::string>& watch_hosts = {}) {
  int fds[2];
  LOOM_CHECK_KIND(kIo, pipe(fds) == 0, "loom launch: pipe: {}", std::strerror(errno));
  // No signal between fork and the child's group being known here.
  sigset_t block, old_mask;
  sigemptyset(&block);
  sigaddset(&block, SIGINT);
  sigaddset(&block, SIGTERM);
  sigprocmask(SIG_BLOCK, &block, &old_mask);
  const auto t0 = Clock::now();
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    // The job goes when the launcher does, however it ends (also when it
    // ended before the request was made).
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    sigprocmask(SIG_SETMASK, &old_mask, nullptr);
    dup2(fds[1], 2);
    if (quiet) dup2(fds[1], 1);
    close(fds[0]);
    close(fds[1]);
    execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  if (pid > 0) {
    setpgid(pid, pid);
    g_child_group = pid;
  }
  sigprocmask(SIG_SETMASK, &old_mask, nullptr);
  if (pid < 0) {
    const int err = errno;
    close(fds[0]);
    close(fds[1]);
    LOOM_FAIL(kIo, "loom launch: fork: {}", std::strerror(err));
  }
  close(fds[1]);
  fcntl(fds[0], F_SETFL, O_NONBLOCK);
  Outcome out;
  std::string partial;
  bool killed = false, exited = false;
  int status = 0;
  // Reads what is there; false once the pipe is drained or closed.
  auto drain = [&] {
    char buf[4096];
    ssize_t n = read(fds[0], buf, sizeof buf);
    if (n <= 0) return false;
    if (!quiet) {
      fwrite(buf, 1, static_cast<size_t>(n), stderr);
      std::fflush(stderr);
    }
    partial.append(buf, static_cast<size_t>(n));
    for (size_t nl; (nl = partial.find('\n')) != std::string::npos;) {
      keep_line(out, partial.substr(0, nl));
      partial.erase(0, nl + 1);
    }
    return true;
  };
  AgentWatch agents(pid, watch_hosts);
  auto last_poll = Clock::now() - std::chrono::seconds(1);
  while (!exited) {
    // The agents are polled while output streams too: a lost host's agent
    // ends just before mpirun writes its account and exits, so a poll
    // skipped while that account is read would miss it.
    const bool read_some = drain();
    if (!watch_hosts.empty() && Clock::now() - last_poll > std::chrono::milliseconds(20)) {
      agents.poll();
      last_poll = Clock::now();
    }
    if (read_some) continue;
    const pid_t w = waitpid(pid, &status, WNOHANG);
    exited = w == pid || (w < 0 && errno != EINTR);
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    if (!exited && limit_s > 0 && elapsed > limit_s && !killed) {
      kill(-pid, SIGKILL);
      killed = true;
    }
    if (!exited) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // What mpirun left in its group (a daemon it could not reach) goes too;
  // then what was written just before the end is read.
  kill(-pid, SIGKILL);
  g_child_group = 0;
  while (drain()) {
  }
  if (!partial.empty()) keep_line(out, partial);
  close(fds[0]);
  out.first_lost_agent = agents.first_lost();
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  out.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (killed) out.status = 124;
  return out;
}

struct Cause {
  std::string report;  // the first failure report, as printed
  std::string host;    // the host it names, when it names one
};

// The first loom report ("loom: rank N: ..."), else mpirun's own account
// (its most telling line); and the host it names: a lost peer or daemon, a
// rank killed there.
Cause read_cause(const Outcome& out) {
  const std::vector<std::string> head = out.lines();
  static const std::vector<std::regex> mpi_lines = {
      std::regex(R"(peer process has unexpectedly disconnected)"),
      std::regex(R"(lost communication with a remote daemon)"),
      std::regex(R"(noticed that process rank .*)"),
      std::regex(R"(MPI_ABORT was invoked .*)"),
      std::regex(R"(unable to reliably start one or more daemons)"),
  };
  static const std::vector<std::regex> host_lines = {
      std::regex(R"(unreachable hosts?: ([^;,\s]+))"),
      std::regex(R"(Peer host:\s+(\S+))"),
      std::regex(R"(Remote daemon: .* on node (\S+))"),
      std::regex(R"(on node (\S+) (exited|killed))"),
  };
  Cause c;
  std::smatch m;
  c.report = out.loom_report;
  bool daemon_lost = false;
  for (size_t k = 0; k < mpi_lines.size() && c.report.empty(); ++k)
    for (const std::string& l : head)
      if (std::regex_search(l, mpi_lines[k])) {
        // The first sentence of mpirun's paragraph.
        std::string line = l.substr(l.find_first_not_of(' '));
        const size_t stop = line.find(". ");
        c.report = "mpirun: " + (stop == std::string::npos ? line : line.substr(0, stop + 1));
        daemon_lost = k == 1 || k == 4;  // a lost daemon, one that "could not start"
        break;
      }
  for (const auto& re : host_lines)
    for (const std::string& l : head)
      if (c.host.empty() && std::regex_search(l, m, re)) c.host = m.str(1);
  // Only when mpirun says a daemon was lost does the first agent to end
  // name the host (otherwise the agents end in any order as the job is
  // torn down).
  if (c.host.empty() && out.loom_report.empty() && daemon_lost) c.host = out.first_lost_agent;
  return c;
}

std::string shell_command(const std::vector<std::string>& words) {
  std::string s;
  for (const auto& w : words) {
    if (!s.empty()) s += ' ';
    s += sh_quote(w);
  }
  return s;
}

// The value of option `name` in a train command ("--out DIR" or "--out=DIR").
std::string option_value(const std::vector<std::string>& cmd, const std::string& name) {
  for (size_t i = 0; i < cmd.size(); ++i) {
    if (cmd[i] == name && i + 1 < cmd.size()) return cmd[i + 1];
    if (cmd[i].rfind(name + "=", 0) == 0) return cmd[i].substr(name.size() + 1);
  }
  return {};
}

// The command without `name` (and its value, when it takes one).
std::vector<std::string> without(const std::vector<std::string>& cmd, const std::string& name,
                                 bool has_value) {
  std::vector<std::string> out;
  for (size_t i = 0; i < cmd.size(); ++i) {
    if (cmd[i] == name) {
      i += has_value ? 1 : 0;
      continue;
    }
    if (cmd[i].rfind(name + "=", 0) == 0) continue;
    out.push_back(cmd[i]);
  }
  return out;
}

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& o) : o_(o) {}

  int run() {
    validate();
    std::vector<HostSlots> alive = hosts_;
    int world = o_.np > 0 ? o_.np : total_slots(hosts_);
    std::vector<std::string> cmd = o_.command;
    const auto t_start = Clock::now();
    for (int attempt = 0;; ++attempt) {
      if (g_stop_signal != 0) return stopped();
      say(format("{} {} rank{} on {}", attempt == 0 ? "starting" : "restarted:", world,
                 world == 1 ? "" : "s", hosts_arg(alive)));
      std::vector<std::string> names;
      for (const HostSlots& h : alive) names.push_back(h.name);
      Outcome r = run_shell(mpirun(alive, world) + " " + shell_command(cmd), false, 0, names);
      if (g_stop_signal != 0) return stopped();
      if (r.status == 0) {
        say(format("the job trained ({} restart{}, {} s in all)", attempt, attempt == 1 ? "" : "s",
                   seconds(std::chrono::duration<double>(Clock::now() - t_start).count())));
        return 0;
      }
      Cause c = read_cause(r);
      std::string cause = format("exit {} after {} s", r.status, seconds(r.seconds));
      if (!c.report.empty()) cause += ": " + c.report;
      if (!c.host.empty()) cause += format(" (host {})", c.host);
      say("the job failed: " + cause);
      if (attempt >= o_.max_restarts) {
        say(format("no restarts left (--max-restarts {})", o_.max_restarts));
        return r.status;
      }
      try {
        alive = reachable(alive, cause);
        if (g_stop_signal != 0) return stopped();
        LOOM_CHECK_KIND(kComm, static_cast<int>(alive.size()) >= o_.min_hosts,
                        "{} host{} left ({}), fewer than --min-hosts {}", alive.size(),
                        alive.size() == 1 ? "" : "s", hosts_arg(alive), o_.min_hosts);
        const nlohmann::json resolved = resolved_config();
        const BatchLayout batch = batch_layout(resolved);
        const RestartLayout next = restart_layout(batch, alive, world);
        world = next.world;
        last_cause_ = cause;
        cmd = restart_command(attempt + 1, resolved, batch, next);
      } catch (const Error& e) {
        say(format("giving up: {}", e.what()));
        return r.status;
      }
    }
  }

 private:
  // The hosts of `hosts` that a one-rank job still starts on; the lost ones
  // are logged and appended to `cause`.
  int stopped() const {
    say(format("stopped by signal {}; no restart", int(g_stop_signal)));
    return 128 + g_stop_signal;
  }

  std::vector<HostSlots> reachable(const std::vector<HostSlots>& hosts, std::string& cause) const {
    std::vector<HostSlots> next;
    std::string lost;
    for (const HostSlots& h : hosts) {
      std::string why = probe(h.name);
      if (g_stop_signal != 0) return next;  // a probe the stop ended says nothing
      if (why.empty()) {
        next.push_back(h);
      } else {
        lost += (lost.empty() ? "" : ", ") + h.name;
        say(format("host {} is unreachable: {}", h.name, why));
      }
    }
    if (!lost.empty()) cause += format("; unreachable: {}", lost);
    return next;
  }

  void validate() {
    hosts_ = parse_hosts(o_.hosts);
    const int slots = total_slots(hosts_);
    LOOM_CHECK_KIND(kConfig, o_.min_hosts >= 1 && o_.min_hosts <= static_cast<int>(hosts_.size()),
                    "--min-hosts {} is more than the {} host{} of --hosts {}", o_.min_hosts,
                    hosts_.size(), hosts_.size() == 1 ? "" : "s", o_.hosts);
    LOOM_CHECK_KIND(kConfig, o_.np <= slots,
                    "--np {} is more than the {} slots of --hosts {} (one rank per slot)", o_.np,
                    slots, o_.hosts);
    LOOM_CHECK_KIND(kConfig, o_.max_restarts >= 0, "--max-restarts {}: expected >= 0",
                    o_.max_restarts);
    LOOM_CHECK_KIND(kConfig, !o_.command.empty() && o_.command.front() == "train",
                    "loom launch runs training: expected `-- train ARGS...` after the options{}",
                    o_.command.empty() ? "" : format(", got `{}`", o_.command.front()));
    out_ = option_value(o_.command, "--out");
    LOOM_CHECK_KIND(kConfig, !out_.empty() || o_.max_restarts == 0,
                    "loom launch --max-restarts: the train command needs --out DIR (a restart "
                    "resumes from that run's checkpoints)");
    for (const HostSlots& h : hosts_) {
      std::string why = probe(h.name);
      LOOM_CHECK_KIND(kConfig, why.empty(), "--hosts: host {} cannot be reached: {}", h.name, why);
    }
  }

  std::string mpirun(const std::vector<HostSlots>& hosts, int np) const {
    return format("exec {} {} --host {} -np {} {}", sh_quote(o_.mpirun), o_.mpirun_args,
                  sh_quote(hosts_arg(hosts)), np, sh_quote(o_.loom));
  }

  // Empty when a one-rank job starts on the host and ends; else why not.
  std::string probe(const std::string& host) const {
    if (g_stop_signal != 0) return "the launcher was stopped";
    const std::string cmd = format("exec {} {} --host {} -np 1 true", sh_quote(o_.mpirun),
                                   o_.mpirun_args, sh_quote(host + ":1"));
    Outcome r = run_shell(cmd, true, o_.probe_timeout_s);
    if (r.status == 0) return {};
    if (r.status == 124)
      return format("a one-rank job there did not finish within {} s (--probe-timeout)",
                    o_.probe_timeout_s);
    // What the launcher said about the host (not a warning about options).
    std::string first;
    for (const auto& l : r.head)
      if (l.find_first_not_of(" -*") != std::string::npos &&
          l.find("Warning") == std::string::npos) {
        first = l.substr(l.find_first_not_of(' '));
        break;
      }
    return format("a one-rank job there exited {}{}", r.status, first.empty() ? "" : ": " + first);
  }

  nlohmann::json resolved_config() const {
    const fs::path p = fs::path(out_) / "config.resolved.json";
    std::error_code ec;
    LOOM_CHECK_KIND(kComm, fs::exists(p, ec),
                    "cannot restart: {} is missing (the job failed before it wrote its run "
                    "folder)",
                    p.string());
    return read_json_file(p.string());
  }

  // The ranks of the next attempt: all the slots left, fitted to the batch.
  // What the run keeps across restarts, from its config.resolved.json.
  static BatchLayout batch_layout(const nlohmann::json& j) {
    BatchLayout b;
    b.train_batch_size = j.at("train_batch_size").get<int64_t>();
    b.micro_batch = j.at("train_micro_batch_size_per_gpu").get<int64_t>();
    b.tp = j.at("parallel").at("tensor").get<int>();
    b.pp = j.at("parallel").at("pipeline").get<int>();
    b.ep = j.at("parallel").value("expert", 1);
    b.cp = j.at("parallel").value("context", 1);
    b.interleaved = j.at("parallel").value("schedule", std::string()) == "interleaved";
    return b;
  }

  // The next attempt's layout: as many of the slots left as fit the batch
  // (never more ranks than the job had).
  static RestartLayout restart_layout(const BatchLayout& b, const std::vector<HostSlots>& alive,
                                      int world) {
    const int slots = std::min(total_slots(alive), world);
    auto fit = fit_layout(b, slots);
    LOOM_CHECK_KIND(kComm, fit.has_value(),
                    "no layout of at most {} ranks keeps train_batch_size {} with micro-batch {}, "
                    "tensor {} x context {} x pipeline {} (expert {})",
                    slots, b.train_batch_size, b.micro_batch, b.tp, b.cp, b.pp, b.ep);
    return *fit;
  }

  std::vector<std::string> restart_command(int attempt, const nlohmann::json& j,
                                           const BatchLayout& b, const RestartLayout& l) const {
    std::vector<std::string> cmd = o_.command;
    const std::string dir = j.contains("checkpoint") && !j["checkpoint"].value("dir", "").empty()
                                ? j["checkpoint"]["dir"].get<std::string>()
                                : (fs::path(out_) / "checkpoints").string();
    std::error_code ec;
    if (fs::exists(fs::path(dir) / "latest", ec)) {
      // What the run saved supersedes where it started from.
      cmd = without(without(without(cmd, "--resume", true), "--init-from", true), "--overwrite",
                    false);
      cmd.insert(cmd.end(), {"--resume", "latest"});
    } else if (option_value(cmd, "--resume").empty()) {
      say(format("no checkpoint in {} yet: the restart starts again from the beginning", dir));
      if (std::find(cmd.begin(), cmd.end(), "--overwrite") == cmd.end())
        cmd.push_back("--overwrite");
    } else {
      say(format("no checkpoint in {} yet: the restart resumes from {} again", dir,
                 option_value(cmd, "--resume")));
    }
    // The global batch and micro-batch as the run had them; accumulation
    // and the data-parallel size follow from the ranks.
    cmd.insert(cmd.end(), {"--set", format("train_batch_size={}", b.train_batch_size), "--set",
                           format("train_micro_batch_size_per_gpu={}", b.micro_batch), "--set",
                           format("gradient_accumulation_steps={}", l.accumulation), "--set",
                           format("parallel.data={}", l.dp), "--restart", format("{}", attempt),
                           "--restart-cause", last_cause_});
    return cmd;
  }

  const LaunchOptions& o_;
  std::vector<HostSlots> hosts_;
  std::string out_, last_cause_;
};

}  // namespace

int run_launch(const LaunchOptions& options) {
  signal(SIGCHLD, SIG_DFL);  // waitpid must see mpirun end
  struct sigaction sa {};
  sa.sa_handler = forward_signal;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  return Launcher(options).run();
}

}  // namespace loom
