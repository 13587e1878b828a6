#include "loom/data/gpt2_tokenizer.h"

#include <unicode/uchar.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/io/fs.h"

namespace loom {

namespace {

// GPT-2's table: printable bytes map to themselves, the rest to 256 + n.
std::vector<uint32_t> byte_to_unicode() {
  std::vector<uint32_t> table(256);
  uint32_t n = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    table[b] = printable ? b : 256 + n++;
  }
  return table;
}

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Decodes one code point at s[i]; an invalid sequence is one byte, cp = -1.
int decode_utf8(std::string_view s, size_t i, int32_t& cp) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return cp = c, 1;
  int len = (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
  if (len == 0 || i + static_cast<size_t>(len) > s.size()) return cp = -1, 1;
  int32_t v = c & (0x7F >> len);
  for (int k = 1; k < len; ++k) {
    unsigned char cc = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
    if ((cc >> 6) != 0x2) return cp = -1, 1;
    v = (v << 6) | (cc & 0x3F);
  }
  static const int32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < kMin[len] || (v >= 0xD800 && v <= 0xDFFF) || v > 0x10FFFF) return cp = -1, 1;
  cp = v;
  return len;
}

enum class Cls : uint8_t { kLetter, kNumber, kSpace, kOther };

bool js_space(int32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000 || cp == 0xFEFF;
}

Cls classify(int32_t cp) {
  if (cp < 0) return Cls::kOther;
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return Cls::kLetter;
    if (cp >= '0' && cp <= '9') return Cls::kNumber;
    return js_space(cp) ? Cls::kSpace : Cls::kOther;
  }
  if (js_space(cp)) return Cls::kSpace;
  switch (u_charType(cp)) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER:
      return Cls::kLetter;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER:
      return Cls::kNumber;
    default:
      return Cls::kOther;
  }
}

}  // namespace

std::string gpt2_vocab_dir() {
  if (const char* env = std::getenv("LOOM_GPT2_DIR"); env != nullptr && *env != '\0') return env;
  return std::string(LOOM_SOURCE_DIR) + "/.cache/gpt2";
}

Gpt2Tokenizer::Gpt2Tokenizer(const std::string& dir) {
  namespace fs = std::filesystem;
  const std::string enc_path = (fs::path(dir) / "encoder.json").string();
  const std::string bpe_path = (fs::path(dir) / "vocab.bpe").string();
  std::error_code ec;
  LOOM_CHECK_KIND(kIo, fs::exists(enc_path, ec) && fs::exists(bpe_path, ec),
                  "gpt2 tokenizer: {} needs encoder.json and vocab.bpe (scripts/setup.sh fetches "
                  "them; or set LOOM_GPT2_DIR)",
                  dir);
  nlohmann::json enc = nlohmann::json::parse(read_file(enc_path), nullptr, false);
  LOOM_CHECK_KIND(kData, enc.is_object() && !enc.empty(), "{}: not a JSON object", enc_path);
  std::unordered_map<std::string, uint32_t> encoder;
  decoder_.resize(enc.size());
  std::vector<bool> seen(enc.size(), false);
  for (const auto& [token, id] : enc.items()) {
    // Ids are whole numbers below the vocabulary's size (anything else
    // would escape as a JSON type error or wrap).
    LOOM_CHECK_KIND(
        kData, id.is_number_unsigned() && id.get<uint64_t>() < decoder_.size(),
        "{}: token {} has id {}, not a whole number below the {} tokens", enc_path,
        nlohmann::json(token).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
        id.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), decoder_.size());
    const uint32_t i = id.get<uint32_t>();
    // Each id once (with every id below the size, a permutation): a shared
    // id would decode one token as another.
    LOOM_CHECK_KIND(
        kData, !seen[i], "{}: tokens {} and {} share id {}", enc_path,
        nlohmann::json(decoder_[i]).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
        nlohmann::json(token).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), i);
    seen[i] = true;
    decoder_[i] = token;
    encoder[token] = i;
  }
  std::vector<uint32_t> table = byte_to_unicode();
  unicode_to_byte_.assign(512, -1);
  for (uint32_t b = 0; b < 256; ++b) {
    std::string s;
    append_utf8(s, table[b]);
    auto it = encoder.find(s);
    LOOM_CHECK_KIND(kData, it != encoder.end(), "{}: no token for byte {}", enc_path, b);
    byte_id_[b] = it->second;
    unicode_to_byte_[table[b]] = static_cast<int>(b);
  }
  std::istringstream lines(read_file(bpe_path));
  std::string line;
  uint32_t rank = 0;
  while (std::getline(lines, line)) {
    if (line.empty() || line.starts_with("#version")) continue;
    size_t sp = line.find(' ');
    LOOM_CHECK_KIND(kData, sp != std::string::npos, "{}: bad merge line '{}'", bpe_path, line);
    std::string a = line.substr(0, sp), b = line.substr(sp + 1);
    auto ia = encoder.find(a), ib = encoder.find(b), iab = encoder.find(a + b);
    LOOM_CHECK_KIND(kData, ia != encoder.end() && ib != encoder.end() && iab != encoder.end(),
                    "{}: merge '{}' names tokens missing from encoder.json", bpe_path, line);
    uint64_t key = (static_cast<uint64_t>(ia->second) << 32) | ib->second;
    merges_.emplace(key, std::make_pair(rank++, iab->second));
  }
}

std::vector<std::string_view> Gpt2Tokenizer::pretokenize(std::string_view s) {
  std::vector<std::string_view> out;
  const size_t n = s.size();
  size_t i = 0;
  int32_t cp = 0;
  while (i < n) {
    // 's 't 're 've 'm 'll 'd
    if (s[i] == '\'' && i + 1 < n) {
      char a = s[i + 1], b = i + 2 < n ? s[i + 2] : '\0';
      size_t len = 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd')
        len = 2;
      else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
        len = 3;
      if (len > 0) {
        out.push_back(s.substr(i, len));
        i += len;
        continue;
      }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional space, then a run of one class.
    size_t start = i;
    if (s[i] == ' ' && i + 1 < n) {
      decode_utf8(s, i + 1, cp);
      if (classify(cp) != Cls::kSpace) start = i + 1;
    }
    int len = decode_utf8(s, start, cp);
    Cls cls = classify(cp);
    if (cls != Cls::kSpace) {
      size_t j = start + static_cast<size_t>(len);
      while (j < n) {
        int l = decode_utf8(s, j, cp);
        if (classify(cp) != cls) break;
        j += static_cast<size_t>(l);
      }
      out.push_back(s.substr(i, j - i));
      i = j;
      continue;
    }
    // `\s+(?!\S)|\s+`: a whitespace run; before a non-space it leaves its last
    // character to start the next token (as " word").
    size_t j = i, last = i;
    while (j < n) {
      int l = decode_utf8(s, j, cp);
      if (classify(cp) != Cls::kSpace) break;
      last = j;
      j += static_cast<size_t>(l);
    }
    size_t end = (j < n && last > i) ? last : j;
    out.push_back(s.substr(i, end - i));
    i = end;
  }
  return out;
}

void Gpt2Tokenizer::bpe(std::string_view piece, std::vector<uint32_t>& out) const {
  if (auto it = cache_.find(piece); it != cache_.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  std::vector<uint32_t> word;
  for (char c : piece) word.push_back(byte_id_[static_cast<unsigned char>(c)]);
  // Repeatedly merge every occurrence of the lowest-ranked adjacent pair.
  while (word.size() > 1) {
    uint32_t best = std::numeric_limits<uint32_t>::max(), merged = 0;
    uint64_t best_key = 0;
    for (size_t k = 0; k + 1 < word.size(); ++k) {
      uint64_t key = (static_cast<uint64_t>(word[k]) << 32) | word[k + 1];
      auto it = merges_.find(key);
      if (it != merges_.end() && it->second.first < best) {
        best = it->second.first;
        merged = it->second.second;
        best_key = key;
      }
    }
    if (best == std::numeric_limits<uint32_t>::max()) break;
    std::vector<uint32_t> next;
    next.reserve(word.size());
    for (size_t k = 0; k < word.size(); ++k) {
      if (k + 1 < word.size() &&
          ((static_cast<uint64_t>(word[k]) << 32) | word[k + 1]) == best_key) {
        next.push_back(merged);
        ++k;
      } else {
        next.push_back(word[k]);
      }
    }
    word.swap(next);
  }
  if (cache_.size() > (1u << 18)) cache_.clear();
  cache_.emplace(std::string(piece), word);
  out.insert(out.end(), word.begin(), word.end());
}

std::vector<uint32_t> Gpt2Tokenizer::encode(std::string_view text) const {
  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 3);
  for (std::string_view piece : pretokenize(text)) bpe(piece, ids);
  return ids;
}

std::string Gpt2Tokenizer::decode(const std::vector<uint32_t>& ids) const {
  std::string out;
  for (uint32_t id : ids) {
    LOOM_CHECK_KIND(kData, id < decoder_.size(), "token id {} is beyond the gpt2 vocabulary ({})",
                    id, decoder_.size());
    const std::string& t = decoder_[id];
    int32_t cp = 0;
    for (size_t i = 0; i < t.size();) {
      i += static_cast<size_t>(decode_utf8(t, i, cp));
      LOOM_CHECK(cp >= 0 && cp < static_cast<int32_t>(unicode_to_byte_.size()) &&
                     unicode_to_byte_[cp] >= 0,
                 "token {} holds a character outside the byte table", id);
      out.push_back(static_cast<char>(unicode_to_byte_[cp]));
    }
  }
  return out;
}

}  // namespace loom
