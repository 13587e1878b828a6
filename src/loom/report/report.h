// `loom report`: one self-contained HTML page (every script and style
// inlined, no network access) built from run folders: metrics.jsonl,
// config.resolved.json, run.json and trace.json. The page's charts are
// uPlot's, drawn by report.js from the data this file gathers; long runs are
// downsampled here, keeping each bucket's least and greatest value so that
// no spike is lost.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace loom {

// A series of (x, y) points, x ascending.
struct Series {
  std::vector<double> x, y;
};

// Cuts the points into `buckets` runs of equal count and keeps, of each, the
// point with the least finite y, the one with the greatest, and the first
// whose y is not finite (a NaN loss is a spike too; the page marks it), in
// x order and each once, plus the last point. At most 3 x buckets + 1
// points; every point when there are no more than 2 x buckets.
Series downsample_minmax(const std::vector<double>& x, const std::vector<double>& y,
                         size_t buckets);

// What one run folder holds, read and checked.
struct RunRecord {
  std::string dir, name;              // the folder and the label it is shown by
  nlohmann::json config;              // config.resolved.json
  nlohmann::json info;                // run.json (empty object when absent)
  std::vector<nlohmann::json> steps;  // metrics.jsonl, one object per step
  std::vector<std::string> damage;    // lines of metrics.jsonl that could not be read
  nlohmann::json trace;               // trace.json (null when absent)
  nlohmann::json profile;             // profile.json, log.profile (null when absent)
};

// Reads a run folder. Error(kData) when the folder does not exist, is not a
// run (no metrics.jsonl or no config.resolved.json) or has no steps yet; a
// truncated or malformed line of metrics.jsonl is skipped and noted in
// `damage`, as is an unreadable trace.json or profile.json.
// metrics_bytes > 0 reads only that much of metrics.jsonl (a live page
// reads what the trainer had flushed when it asked for the page). A
// trace.json or profile.json older than the folder's run.json is an earlier
// run's: left out, and noted.
RunRecord read_run(const std::string& dir, uint64_t metrics_bytes = 0);

struct ReportOptions {
  std::vector<std::string> runs;  // run folders, overlaid in this order
  std::string out;                // the page to write (atomically)
  size_t buckets = 1000;          // points kept per series: at most 3 x buckets + 1
  bool live = false;              // the run is going: the page reloads itself
  double refresh_s = 5;           // live: seconds between reloads
  // Set when the run stopped with an error: the final page says so.
  std::string stopped;
  uint64_t metrics_bytes = 0;  // read_run's, for every run
};

struct ReportSummary {
  size_t runs = 0, steps = 0, bytes = 0;
  std::vector<std::string> notes;  // damage and differences, as the page shows them
};

// The data the page draws, as report.js reads it.
nlohmann::json report_data(const std::vector<RunRecord>& runs, const ReportOptions& options);
// The whole page.
std::string report_html(const nlohmann::json& data);
// Reads every run, writes the page; Error(kData) naming the run on bad input.
ReportSummary write_report(const ReportOptions& options);

}  // namespace loom
