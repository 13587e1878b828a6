#include "loom/data/prepare.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/data/token_file.h"
#include "loom/data/tokenizer.h"
#include "loom/io/fs.h"
#include "loom/io/sha256.h"

namespace loom {

namespace fs = std::filesystem;

size_t find_invalid_utf8(const std::string& s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80           ? 1
                 : (c >> 5) == 0x6  ? 2
                 : (c >> 4) == 0xe  ? 3
                 : (c >> 3) == 0x1e ? 4
                                    : 0;
    if (len == 0 || i + len > n) return i;
    uint32_t cp = len == 1 ? c : c & (0x7f >> len);
    for (size_t k = 1; k < len; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 0x2) return i;
      cp = (cp << 6) | (cc & 0x3f);
    }
    // Overlong forms, surrogates and values beyond U+10FFFF are invalid.
    static const uint32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) return i;
    i += len;
  }
  return std::string::npos;
}

namespace {

std::vector<fs::path> expand_inputs(const std::vector<std::string>& inputs) {
  LOOM_CHECK_KIND(kData, !inputs.empty(), "prepare-data: no --input given");
  std::vector<fs::path> files;
  for (const std::string& in : inputs) {
    std::error_code ec;
    fs::file_status st = fs::status(in, ec);
    LOOM_CHECK_KIND(kData, !ec && fs::exists(st), "{}: no such file or folder", in);
    if (fs::is_directory(st)) {
      std::vector<fs::path> found;
      for (auto it = fs::recursive_directory_iterator(in, ec); !ec && it != fs::end(it);
           it.increment(ec)) {
        if (it->is_symlink() || !it->is_regular_file()) continue;
        if (it->path().filename().string().starts_with(".")) continue;
        found.push_back(it->path());
      }
      LOOM_CHECK_KIND(kData, !ec, "{}: cannot read folder: {}", in, ec.message());
      LOOM_CHECK_KIND(kData, !found.empty(), "{}: folder has no files", in);
      std::sort(found.begin(), found.end());
      files.insert(files.end(), found.begin(), found.end());
    } else {
      files.emplace_back(in);
    }
  }
  return files;
}

}  // namespace

PrepareSummary prepare_data(const PrepareOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  LOOM_CHECK_KIND(kConfig, o.val_fraction >= 0 && o.val_fraction < 1,
                  "--val-fraction {} must be in [0, 1)", o.val_fraction);
  LOOM_CHECK_KIND(kConfig, !o.out_dir.empty(), "prepare-data: --out is required");
  auto tokenizer = make_tokenizer(o.tokenizer);
  const fs::path out(o.out_dir);
  for (const char* name : {"train.bin", "val.bin", "meta.json"}) {
    std::error_code ec;
    LOOM_CHECK_KIND(kIo, o.overwrite || !fs::exists(out / name, ec),
                    "{}: already exists (pass --overwrite to replace it)", (out / name).string());
  }
  // Read and check every input before writing anything.
  std::vector<uint32_t> train, val;
  nlohmann::json sources = nlohmann::json::array();
  PrepareSummary sum;
  for (const fs::path& path : expand_inputs(o.inputs)) {
    std::string text = read_file(path.string());
    LOOM_CHECK_KIND(kData, !text.empty(), "{}: file is empty", path.string());
    size_t bad = find_invalid_utf8(text);
    LOOM_CHECK_KIND(kData, bad == std::string::npos, "{}: not valid UTF-8 at byte offset {}",
                    path.string(), bad);
    std::vector<uint32_t> ids = tokenizer->encode(text);
    size_t n_val = static_cast<size_t>(std::floor(o.val_fraction * double(ids.size())));
    train.insert(train.end(), ids.begin(), ids.end() - static_cast<std::ptrdiff_t>(n_val));
    val.insert(val.end(), ids.end() - static_cast<std::ptrdiff_t>(n_val), ids.end());
    sources.push_back({{"path", path.string()},
                       {"bytes", text.size()},
                       {"tokens", ids.size()},
                       {"sha256", sha256_hex(text)}});
    sum.files++;
    sum.bytes += text.size();
  }
  fs::create_directories(out);
  write_token_file((out / "train.bin").string(), train, tokenizer->vocab_size());
  write_token_file((out / "val.bin").string(), val, tokenizer->vocab_size());
  nlohmann::json meta = {{"format", "loom token file v1"},
                         {"tokenizer", tokenizer->name()},
                         {"vocab_size", tokenizer->vocab_size()},
                         {"train_tokens", train.size()},
                         {"val_tokens", val.size()},
                         {"val_fraction", o.val_fraction},
                         {"sources", sources}};
  write_file_atomic((out / "meta.json").string(), meta.dump(2) + "\n");
  sum.train_tokens = train.size();
  sum.val_tokens = val.size();
  sum.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sum;
}

}  // namespace loom
