// loom tokenize --tokenizer byte|gpt2 [--decode]: standard input to token ids
// on one line (or, with --decode, ids back to text), to see what the model sees.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>

#include "commands.h"
#include "loom/core/error.h"
#include "loom/data/tokenizer.h"

namespace loom::app {

namespace {
struct TokenizeArgs {
  std::string tokenizer = "byte";
  bool decode = false;
};

void run(const TokenizeArgs& a) {
  auto tok = make_tokenizer(a.tokenizer);
  std::string input((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  if (a.decode) {
    std::vector<uint32_t> ids;
    std::istringstream in(input);
    for (std::string word; in >> word;) {
      size_t used = 0;
      unsigned long v = 0;
      try {
        v = std::stoul(word, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      LOOM_CHECK_KIND(kData, used == word.size() && word[0] != '-',
                      "'{}' is not a token id (expected non-negative integers)", word);
      LOOM_CHECK_KIND(kData, v < tok->vocab_size(), "token id {} is beyond the {} vocabulary ({})",
                      v, tok->name(), tok->vocab_size());
      ids.push_back(static_cast<uint32_t>(v));
    }
    std::string text = tok->decode(ids);
    std::fwrite(text.data(), 1, text.size(), stdout);
    return;
  }
  std::string line;
  for (uint32_t id : tok->encode(input)) line += (line.empty() ? "" : " ") + std::to_string(id);
  std::printf("%s\n", line.c_str());
}
}  // namespace

void add_tokenize_command(CLI::App& app) {
  auto a = std::make_shared<TokenizeArgs>();
  CLI::App* cmd = app.add_subcommand("tokenize", "Standard input to token ids, or back");
  cmd->add_option("--tokenizer", a->tokenizer, "byte or gpt2");
  cmd->add_flag("--decode", a->decode, "Read token ids, print the text");
  cmd->callback([a] { run(*a); });
}

}  // namespace loom::app
