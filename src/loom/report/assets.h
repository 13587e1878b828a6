// The page's scripts and styles, embedded at build time
// (cmake/embed_assets.cmake): uPlot's, as scripts/setup.sh installs it from
// the npm registry, and the report's own (report.js, report.css).
#pragma once

namespace loom::report_assets {

extern const char* const kUplotJs;
extern const char* const kUplotCss;
extern const char* const kReportJs;
extern const char* const kReportCss;

}  // namespace loom::report_assets
