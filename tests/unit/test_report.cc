// loom report's data: downsampling that keeps spikes, run folders read with
// their damage noted, and a page whose data cannot end its script early.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "loom/core/error.h"
#include "loom/report/report.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

TEST(Report, DownsampleKeepsEveryPointWhenFew) {
  std::vector<double> x = {1, 2, 3, 4}, y = {4, 3, 2, 1};
  const Series s = downsample_minmax(x, y, 2);
  EXPECT_EQ(s.x, x);
  EXPECT_EQ(s.y, y);
}

TEST(Report, DownsampleKeepsSpikesAndBounds) {
  const size_t n = 100000;
  std::vector<double> x(n), y(n);
  for (size_t i = 0; i < n; ++i) x[i] = double(i + 1), y[i] = 2.0 + 0.001 * std::sin(double(i));
  y[31337] = 50.0;  // a loss spike
  y[77777] = -3.0;  // a dip
  y[90001] = NAN;   // a non-finite step
  y[50010] = 40.0;  // a spike beside a NaN in its bucket
  y[50011] = NAN;
  const Series s = downsample_minmax(x, y, 1000);
  EXPECT_LE(s.x.size(), 3001u);
  EXPECT_GE(s.x.size(), 1000u);
  for (size_t i = 1; i < s.x.size(); ++i) ASSERT_LT(s.x[i - 1], s.x[i]);
  EXPECT_EQ(s.x.back(), double(n));
  auto has = [&](double step) { return std::find(s.x.begin(), s.x.end(), step) != s.x.end(); };
  EXPECT_TRUE(has(31338));
  EXPECT_TRUE(has(77778));
  EXPECT_TRUE(has(90002));
  EXPECT_NE(std::find(s.y.begin(), s.y.end(), 50.0), s.y.end());
  EXPECT_NE(std::find(s.y.begin(), s.y.end(), -3.0), s.y.end());
  EXPECT_TRUE(has(50011) && has(50012));
  // Against a brute-force pass: every bucket's finite least and greatest
  // value, and its first non-finite step, are kept.
  for (size_t b = 0; b < 1000; ++b) {
    const size_t begin = b * n / 1000, end = (b + 1) * n / 1000;
    double lo = HUGE_VAL, hi = -HUGE_VAL;
    size_t bad = n;
    for (size_t i = begin; i < end; ++i)
      if (std::isfinite(y[i]))
        lo = std::min(lo, y[i]), hi = std::max(hi, y[i]);
      else if (bad == n)
        bad = i;
    std::vector<double> kept;
    for (size_t k = 0; k < s.x.size(); ++k)
      if (s.x[k] >= x[begin] && s.x[k] <= x[end - 1]) kept.push_back(s.y[k]);
    ASSERT_NE(std::find(kept.begin(), kept.end(), lo), kept.end()) << "bucket " << b;
    ASSERT_NE(std::find(kept.begin(), kept.end(), hi), kept.end()) << "bucket " << b;
    if (bad != n) {
      ASSERT_TRUE(has(x[bad])) << "bucket " << b;
    }
  }
}

fs::path make_run(const std::string& name, const std::string& metrics) {
  const fs::path dir = fs::temp_directory_path() / ("loom_report_test_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "config.resolved.json")
      << R"({"model": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 256, "seq_len": 8},
            "train_batch_size": 4, "train": {"steps": 3}})";
  std::ofstream(dir / "metrics.jsonl") << metrics;
  return dir;
}

TEST(Report, ReadRunNotesDamageAndKeepsWholeSteps) {
  const fs::path dir = make_run("damage",
                                "{\"step\":1,\"loss\":5}\nnot json\n{\"step\":2,\"loss\":4}\n"
                                "{\"step\":3,\"lo");
  const RunRecord r = read_run(dir.string());
  ASSERT_EQ(r.steps.size(), 2u);
  ASSERT_EQ(r.damage.size(), 2u);
  EXPECT_EQ(r.damage[0], "metrics.jsonl line 2 is not a step record: skipped");
  EXPECT_EQ(r.damage[1],
            "metrics.jsonl line 4 is incomplete (being written, or the run stopped while writing "
            "it): skipped");
  fs::remove_all(dir);
}

TEST(Report, BadFoldersAreNamed) {
  try {
    read_run("/nonexistent/run");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "/nonexistent/run does not exist");
  }
  const fs::path dir = make_run("empty", "");
  try {
    read_run(dir.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), dir.string() + " has no steps yet: metrics.jsonl is empty");
  }
  fs::remove(dir / "metrics.jsonl");
  try {
    read_run(dir.string());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not a run folder: it has no metrics.jsonl"),
              std::string::npos);
  }
  fs::remove_all(dir);
}

TEST(Report, DataCannotCloseItsScript) {
  const fs::path dir = make_run("</script><b>", "{\"step\":1,\"loss\":5}\n");
  ReportOptions o;
  const nlohmann::json data = report_data({read_run(dir.string())}, o);
  const std::string html = report_html(data);
  const size_t begin = html.find("<script id=\"loom-data\"");
  const size_t end = html.find("</script>", begin);
  ASSERT_NE(begin, std::string::npos);
  const std::string payload = html.substr(begin, end - begin);
  EXPECT_EQ(payload.find("</script"), std::string::npos);
  EXPECT_NE(payload.find("\\u003c/script>\\u003cb>"), std::string::npos);
  EXPECT_NE(html.find("uPlot"), std::string::npos);  // the library is inlined
  fs::remove_all(dir);
}

}  // namespace
}  // namespace loom
