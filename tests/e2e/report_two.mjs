// Opens a page of two runs overlaid (different models, allowed) and checks
// that each chart carries both runs' series, labelled by run, and that the
// page notes the difference and logged no error.
// Usage: node report_two.mjs REPORT.html
import { createRequire } from "module";
import path from "path";
import url from "url";

const require = createRequire(process.env.LOOM_NPM_DIR + "/node_modules/");
const { chromium } = require("playwright-core");
const browser = await chromium.launch({
  executablePath: "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"],
});
const page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
const errors = [];
page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
page.on("pageerror", (e) => errors.push(String(e)));
await page.goto(url.pathToFileURL(path.resolve(process.argv[2])).href, { waitUntil: "load" });
await page.waitForFunction(() => window.loomReport && window.loomReport.done, null, { timeout: 10000 });
const r = await page.evaluate(() => window.loomReport);
const notes = await page.evaluate(() => document.querySelector("#notes")?.textContent || "");
await browser.close();
const fails = [];
const loss = r.panels.loss;
if (!loss || loss.series !== 4 || !loss.labels.some((l) => l.startsWith("run ")) ||
    !loss.labels.some((l) => l.startsWith("small ")))
  fails.push("loss: " + JSON.stringify(loss));
for (const id of ["lr", "tokens_per_s"])
  if (!r.panels[id] || r.panels[id].series !== 2) fails.push(id + ": " + JSON.stringify(r.panels[id]));
if (!notes.includes("the runs train different models")) fails.push("notes: " + notes);
if (errors.length || r.errors.length) fails.push("errors: " + errors.concat(r.errors).join("; "));
if (fails.length) { console.error("FAIL: " + fails.join("\n")); process.exit(1); }
console.log("ok: two runs overlaid, labelled by run");
