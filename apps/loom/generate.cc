// loom generate --checkpoint DIR --prompt TEXT [--max-tokens N --temperature T --top-k K --seed S]
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/core/error.h"
#include "loom/core/threads.h"
#include "loom/data/tokenizer.h"
#include "loom/infer/generate.h"

namespace loom::app {

namespace {
struct GenerateArgs {
  std::string checkpoint;
  std::string prompt;
  SampleOptions sample;
};

}  // namespace

void add_generate_command(CLI::App& app) {
  auto a = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Sample text from a checkpoint");
  cmd->add_option("--checkpoint", a->checkpoint, "Checkpoint folder (step-NNNNNNNN)")->required();
  cmd->add_option("--prompt", a->prompt, "Text to continue")->required();
  cmd->add_option("--max-tokens", a->sample.max_tokens, "Tokens to generate")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--temperature", a->sample.temperature, "0 is greedy")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-k", a->sample.top_k, "Keep the k most likely tokens (0: all)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--seed", a->sample.seed, "Sampling seed");
  cmd->callback([a] {
    configure_threads();
    verify_checkpoint(a->checkpoint);
    TrainerState state = read_trainer_state(a->checkpoint);
    LOOM_CHECK_KIND(kUnsupported, !state.tokenizer.empty(),
                    "{}: the run had no tokenizer (synthetic data), so there is no text to decode",
                    a->checkpoint);
    auto tokenizer = make_tokenizer(state.tokenizer);
    GptStage<float> model(read_checkpoint_model(a->checkpoint));
    load_checkpoint(a->checkpoint, model);
    auto ids = generate(model, tokenizer->encode(a->prompt), a->sample);
    std::printf("%s%s\n", a->prompt.c_str(), tokenizer->decode(ids).c_str());
  });
}

}  // namespace loom::app
