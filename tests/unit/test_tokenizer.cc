// GPT-2 tokenizer against reference encodings produced by an independent
// implementation (tests/fixtures/make_gpt2_fixtures.js), plus the byte-level
// corner cases the reference cannot express (invalid UTF-8).
#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/data/gpt2_tokenizer.h"
#include "loom/data/prepare.h"
#include "loom/io/fs.h"
#include "test_util.h"

namespace loom {
namespace {

const Gpt2Tokenizer& gpt2() {
  static Gpt2Tokenizer tok(gpt2_vocab_dir());
  return tok;
}

TEST(Gpt2Tokenizer, MatchesReferenceEncodings) {
  auto j = nlohmann::json::parse(
      read_file(std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/gpt2_encodings.json"));
  ASSERT_GE(j["cases"].size(), 30u);
  EXPECT_EQ(gpt2().vocab_size(), 50257u);
  for (const auto& c : j["cases"]) {
    std::string text = c["text"].get<std::string>();
    auto want = c["ids"].get<std::vector<uint32_t>>();
    EXPECT_EQ(gpt2().encode(text), want) << "text: " << text;
    EXPECT_EQ(gpt2().decode(want), text) << "text: " << text;
  }
}

TEST(Gpt2Tokenizer, PretokenizationFollowsThePattern) {
  auto pieces = [](std::string_view s) {
    std::vector<std::string> out;
    for (auto p : Gpt2Tokenizer::pretokenize(s)) out.emplace_back(p);
    return out;
  };
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces("a   b"), (V{"a", "  ", " b"}));  // the run leaves one space for " b"
  EXPECT_EQ(pieces("end  "), (V{"end", "  "}));
  EXPECT_EQ(pieces("don't"), (V{"don", "'t"}));
  EXPECT_EQ(pieces("x\n\ny"), (V{"x", "\n", "\n", "y"}));
  EXPECT_EQ(pieces("12ab!?"), (V{"12", "ab", "!?"}));
}

TEST(Gpt2Tokenizer, InvalidUtf8BytesAreOtherSymbolsAndRoundTrip) {
  const Gpt2Tokenizer& t = gpt2();
  std::string bad = "abc\xff def \xc3(x)\xe2\x82";
  auto pieces = Gpt2Tokenizer::pretokenize(bad);
  std::vector<std::string> got(pieces.begin(), pieces.end());
  EXPECT_EQ(got, (std::vector<std::string>{"abc", "\xff", " def", " \xc3(", "x", ")\xe2\x82"}));
  auto ids = t.encode(bad);
  EXPECT_EQ(t.decode(ids), bad);
  // "\xff" alone is GPT-2's token for byte 0xff ("\u00ff").
  auto ff = t.encode("\xff");
  ASSERT_EQ(ff.size(), 1u);
  EXPECT_EQ(t.decode(ff), "\xff");
  std::vector<uint32_t> abc = t.encode("abc"), def = t.encode(" def");
  ASSERT_GE(ids.size(), abc.size() + 1 + def.size());
  EXPECT_TRUE(std::equal(abc.begin(), abc.end(), ids.begin()));
  EXPECT_EQ(ids[abc.size()], ff[0]);
}

TEST(Gpt2Tokenizer, EveryByteRoundTrips) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(gpt2().decode(gpt2().encode(all)), all);
  try {
    gpt2().decode({50257});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 50257 is beyond the gpt2 vocabulary"),
              std::string::npos);
  }
}

TEST(Utf8, FindsTheFirstInvalidOffset) {
  EXPECT_EQ(find_invalid_utf8("plain ascii"), std::string::npos);
  EXPECT_EQ(find_invalid_utf8("caf\xc3\xa9 \xf0\x9f\x98\x80"), std::string::npos);
  EXPECT_EQ(find_invalid_utf8("ab\xc3"), 2u);         // truncated sequence
  EXPECT_EQ(find_invalid_utf8("ab\xc0\xafz"), 2u);    // overlong
  EXPECT_EQ(find_invalid_utf8("x\xed\xa0\x80"), 1u);  // surrogate
  EXPECT_EQ(find_invalid_utf8("\x80"), 0u);           // stray continuation
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// Damaged tokenizer files end in one line naming the file and the token.
TEST(Gpt2Tokenizer, DamagedVocabularyFilesNameTheFileAndToken) {
  test::TempDir tmp;
  auto load = [&](const std::string& encoder) {
    std::ofstream(tmp.path / "encoder.json") << encoder;
    std::ofstream(tmp.path / "vocab.bpe") << "#version: 0.2\n";
    return test::error_of([&] { Gpt2Tokenizer t(tmp.path.string()); });
  };
  EXPECT_HAS(load(R"({"a": "zero"})"),
             "encoder.json: token \"a\" has id \"zero\", not a whole "
             "number below the 1 tokens");
  EXPECT_HAS(load(R"({"a": -1})"), "token \"a\" has id -1");
  EXPECT_HAS(load(R"({"a": 0.5})"), "token \"a\" has id 0.5");
  EXPECT_HAS(load(R"({"a": 7})"), "token \"a\" has id 7, not a whole number below the 1 tokens");
  EXPECT_HAS(load("[1]"), "encoder.json: not a JSON object");
}

}  // namespace
}  // namespace loom
