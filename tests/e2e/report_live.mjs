// Opens a run's report.html while the run is going and follows it: the
// page must reload itself, each reload showing a later step with no error
// (the page is rewritten atomically, so no reload may find half a page),
// until the run ends and its final page (live: false) stops reloading.
// Usage: node report_live.mjs RUN_DIR/report.html TOTAL_STEPS
//        node report_live.mjs PAGE.html stale   (a live page nobody rewrote for
//        long: it says so and does not reload)
import { createRequire } from "module";
import path from "path";
import url from "url";

const require = createRequire(process.env.LOOM_NPM_DIR + "/node_modules/");
const { chromium } = require("playwright-core");
const [report, totalArg] = process.argv.slice(2);
const total = Number(totalArg);

const browser = await chromium.launch({
  executablePath: "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const page = await browser.newPage({ viewport: { width: 1200, height: 800 } });
const pageUrl = url.pathToFileURL(path.resolve(report)).href;
const requests = [], errors = [];
page.on("request", (r) => { if (r.url() !== pageUrl) requests.push(r.url()); });
page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
page.on("pageerror", (e) => errors.push(String(e)));
let loads = 0;
page.on("load", () => loads++);

// One state per page load, read once the page has drawn.
async function state() {
  await page.waitForFunction(() => window.loomReport && window.loomReport.done, null,
                             { timeout: 20000 });
  return page.evaluate(() => ({
    live: window.loomReport.live, last_step: window.loomReport.last_step,
    reload_s: window.loomReport.reload_s, errors: window.loomReport.errors,
    banner: document.getElementById("live") ? document.getElementById("live").textContent : null,
  }));
}

const fails = [];
const expect = (cond, what) => { if (!cond) fails.push(what); };
await page.goto(pageUrl, { waitUntil: "load" });
if (totalArg === "stale") {
  const st = await state();
  const stale = await page.evaluate(() => window.loomReport.stale);
  await page.waitForTimeout(3000);
  expect(stale && !st.live && st.banner && st.banner.startsWith("stale: this page was written"),
         "stale page: " + JSON.stringify(st));
  expect(loads === 1, "a stale page reloaded");
  await browser.close();
  if (fails.length) { console.error("FAIL: " + fails.join("\n")); process.exit(1); }
  console.log("ok: a stale live page says so and does not reload");
  process.exit(0);
}
const seen = [await state()];
expect(seen[0].live, "the first page opened is not live: " + JSON.stringify(seen[0]));
expect(seen[0].banner && seen[0].banner.includes("of " + total), "live banner: " + seen[0].banner);
const deadline = Date.now() + 120000;
while (seen[seen.length - 1].live && Date.now() < deadline) {
  const before = loads;
  // The page reloads itself: wait for the next load, then read it.
  await page.waitForEvent("load", { timeout: 1000 * (seen[seen.length - 1].reload_s + 20) });
  expect(loads === before + 1, "load events: " + (loads - before));
  seen.push(await state());
}
const last = seen[seen.length - 1];
expect(!last.live && last.last_step === total, "the run's final page: " + JSON.stringify(last));
const shown = seen.map((s) => s.last_step);
for (let i = 1; i < shown.length; i++)
  expect(shown[i] >= shown[i - 1], "steps went back: " + shown.join(" "));
expect(new Set(shown.filter((_, i) => seen[i].live)).size >= 2,
       "fewer than two distinct live pages: " + shown.join(" "));
// The final page does not reload.
const loadsAtEnd = loads;
await page.waitForTimeout(1000 * (seen[Math.max(0, seen.length - 2)].reload_s + 1));
expect(loads === loadsAtEnd, "the final page reloaded");
await browser.close();

expect(requests.length === 0, "network requests: " + requests.join(", "));
const pageErrors = errors.concat(...seen.map((s) => s.errors));
expect(pageErrors.length === 0, "errors: " + pageErrors.join("; "));
console.log(JSON.stringify({ loads: seen.length, steps_shown: shown }));
if (fails.length) { console.error("FAIL: " + fails.join("\n")); process.exit(1); }
console.log("ok: the live page reloaded itself through the run and stopped at its final page");
