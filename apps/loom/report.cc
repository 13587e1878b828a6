// loom report: one self-contained HTML page from one or more run folders.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "commands.h"
#include "loom/report/report.h"

namespace loom::app {

void add_report_command(CLI::App& app) {
  auto o = std::make_shared<ReportOptions>();
  o->out = "report.html";
  CLI::App* cmd = app.add_subcommand(
      "report",
      "One HTML page of one or more runs (curves, layout, step time, memory, MoE load, the "
      "schedule's timeline) that opens offline");
  cmd->add_option("runs", o->runs, "Run folders (loom train --out), overlaid in this order")
      ->required();
  cmd->add_option("--out", o->out, "The page to write (default report.html)");
  cmd->add_option("--buckets", o->buckets,
                  "Points per series: longer runs keep each bucket's least and greatest value "
                  "(default 1000)")
      ->check(CLI::Range(size_t{1}, size_t{1000000}));
  cmd->callback([o] {
    const ReportSummary s = write_report(*o);
    for (const std::string& n : s.notes) std::printf("loom: report: %s\n", n.c_str());
    std::printf("loom: report %s: %zu run%s, %zu steps, %.1f kB\n", o->out.c_str(), s.runs,
                s.runs == 1 ? "" : "s", s.steps, s.bytes / 1e3);
  });
}

}  // namespace loom::app
