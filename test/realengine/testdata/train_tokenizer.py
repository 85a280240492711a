"""Test-only (test/realengine BenchmarkTokenizeRealEngine, and the tiny model of vLLM's CPU engine
image, hack/vllm-image.sh): writes a byte-level BPE tokenizer of 8000 tokens, trained on random
words, into the model directory given (tokenizer.json and tokenizer_config.json, with a plain chat
template), so that vLLM serves text prompts, chat and /tokenize for the tiny model without a
download. Its speed per token is a real tokenizer's (Hugging Face tokenizers, as vLLM loads any);
its vocabulary is not a language's. The directory's config.json, if any, gets the tokenizer's
vocabulary size, so that every token the random weights pick decodes to text."""

import json, os, random, sys
from tokenizers import Tokenizer, models, trainers, pre_tokenizers, decoders
from transformers import PreTrainedTokenizerFast
random.seed(1)
words = ["".join(random.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(random.randint(2, 9))) for _ in range(3000)]
text = [" ".join(random.choice(words) for _ in range(50)) for _ in range(4000)]
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "<s>", "</s>"]))
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
# vLLM's chat endpoint needs the model's template (transformers has no default any more).
fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<s>assistant: {% endif %}")
fast.save_pretrained(sys.argv[1])
config = os.path.join(sys.argv[1], "config.json")
if os.path.exists(config):
    with open(config) as f:
        c = json.load(f)
    c["vocab_size"] = len(fast)
    with open(config, "w") as f:
        json.dump(c, f, indent=2)
print(len(fast), fast("hello world abc").input_ids)
