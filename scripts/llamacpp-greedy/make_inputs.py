#!/usr/bin/env python3
"""Writes the input files for the llama.cpp reference data (JSON lines):

  crates/handoff-model/tests/data/llamacpp_prompts.jsonl         (greedy prompts)
  crates/handoff-model/tests/data/llamacpp_tokenize_inputs.jsonl (tokenizer strings)

The .jsonl files are committed; re-running this script must reproduce them
byte for byte. Chat prompts are rendered with the GGUF's tokenizer.chat_template
(SmolLM2 ChatML; the default system message is inserted when the first message
is not a system message)."""
import json
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "crates", "handoff-model", "tests", "data")

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def chatml(messages, add_generation_prompt=True):
    """Python port of the GGUF chat template:
    {% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}
    {{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}
    {% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}
    {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""
    s = ""
    for i, m in enumerate(messages):
        if i == 0 and messages[0]["role"] != "system":
            s += "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n"
        s += "<|im_start|>" + m["role"] + "\n" + m["content"] + "<|im_end|>" + "\n"
    if add_generation_prompt:
        s += "<|im_start|>assistant\n"
    return s


LONG = (
    "The history of the lighthouse is closely tied to the history of seafaring itself. "
    "Long before electric lamps and rotating lenses, coastal communities lit fires on hilltops "
    "to warn sailors of dangerous rocks and to guide them safely into harbor. The most famous "
    "ancient example, the Pharos of Alexandria, was built in the third century BC and stood for "
    "more than a thousand years, becoming one of the Seven Wonders of the Ancient World.\n\n"
    "During the Middle Ages, lighthouses were rare, and many were maintained by monks or local "
    "lords who collected fees from passing ships. The situation changed dramatically in the "
    "eighteenth and nineteenth centuries, when growing trade and larger fleets created a demand "
    "for reliable navigation aids. Engineers such as John Smeaton and Robert Stevenson developed "
    "new construction techniques that allowed towers to withstand violent storms on exposed reefs.\n\n"
    "Perhaps the most important innovation was the Fresnel lens, invented by the French physicist "
    "Augustin-Jean Fresnel in 1822. By arranging concentric rings of glass prisms, the lens could "
    "capture and focus nearly all of the light from a single lamp into a powerful horizontal beam "
    "that was visible for more than twenty miles. Different lighthouses were given distinctive "
    "patterns of flashes, so that a navigator could identify each one at night.\n\n"
    "In the twentieth century, automation gradually replaced the lighthouse keepers who had once "
    "lived in isolated stations, trimming wicks and winding clockwork mechanisms. Today, satellite "
    "navigation has made many lighthouses less essential, yet they remain powerful symbols of "
    "safety, guidance, and human perseverance. In summary, the main reasons lighthouses were built are"
)

RAW = [
    ("prose", "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea,"),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"),
    ("list", "Shopping list:\n1. Apples\n2. Bread\n3."),
    ("numbers", "The first ten prime numbers are 2, 3, 5, 7, 11, 13, 17, 19, 23, and 29. Their sum is 129, and 3.14159 * 2 ="),
    ("punctuation", "Wait... what?! \"No way,\" she said -- (really?) [yes]; {ok}: 100% & more... #tags @user:"),
    ("unicode", "Café naïve résumé — Zoë's piñata 🎉🚀 costs 5€. 日本語のテキスト。 Translation:"),
    ("leading_ws", "\n\n   Indented text after blank lines:\n\t- first item\n\t-"),
    ("trailing_space", "The capital of Germany is "),
    ("single_token", "Hello"),
    ("long_prose", LONG),
]

CHAT = [
    ("chat_capital", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat_code", [{"role": "user", "content": "Write a Python function that reverses a string."}]),
    ("chat_multiturn", [
        {"role": "user", "content": "Hi! My name is Ana and I live in Lisbon."},
        {"role": "assistant", "content": "Hello Ana! Nice to meet you. How can I help you today?"},
        {"role": "user", "content": "What's my name, and which city do I live in?"},
    ]),
    ("chat_custom_system", [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ]),
]

TOKENIZE = [
    ("empty", ""),
    ("space", " "),
    ("two_spaces", "  "),
    ("many_spaces", "a     b"),
    ("leading_space", " hello"),
    ("leading_spaces", "   hello world"),
    ("trailing_space", "hello "),
    ("tab", "\t"),
    ("tabs_mixed", "a\tb\t\tc \t d"),
    ("newline", "\n"),
    ("newlines", "line1\nline2\n\nline4\n\n\n"),
    ("crlf", "windows\r\nline\r\n"),
    ("hello_world", "Hello world"),
    ("hello_world_punct", "Hello, world!"),
    ("digits", "12345"),
    ("long_digits", "1234567890123"),
    ("pi", "3.14"),
    ("numbers_mixed", "In 2024, 1,000,000 people paid $3.99 (about 4%)."),
    ("contractions", "don't I'll we're they've she'd it's"),
    ("contractions_caps", "DON'T I'LL WE'RE"),
    ("accents", "café naïve résumé Zoë piñata"),
    ("emoji", "🎉🚀👍🏽"),
    ("emoji_zwj", "👨‍👩‍👧‍👦 family"),
    ("cjk", "日本語のテキスト"),
    ("chinese", "你好，世界！"),
    ("korean", "안녕하세요"),
    ("cyrillic", "Привет, мир"),
    ("arabic", "مرحبا بالعالم"),
    ("code", "fn main() {\n    println!(\"hi\");\n}"),
    ("python_indent", "def f(x):\n        return x ** 2"),
    ("url", "https://example.com/path?q=1&r=two#frag"),
    ("punct_run", "!!!??...---***"),
    ("mixed_case", "camelCaseIdentifier snake_case_name SCREAMING_CASE"),
    ("special_im_start", "<|im_start|>user"),
    ("special_in_text", "Hello <|im_start|>user\nHi<|im_end|>\n bye"),
    ("special_endoftext", "text<|endoftext|>more"),
    ("special_adjacent", "<|im_end|><|im_start|>"),
    ("special_spaced", " <|im_start|> user "),
    ("special_like_not_special", "<|im_middle|> <im_start> <|im_start"),
    ("chat_rendered", chatml([{"role": "user", "content": "Hi there!"}])),
    ("null_byte_free_control", "bell\x07 and escape\x1b[0m"),
    ("long_word", "Pneumonoultramicroscopicsilicovolcanoconiosis"),
]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(path)


def main():
    os.makedirs(OUT, exist_ok=True)
    prompts = [{"name": n, "kind": "raw", "prompt": p} for n, p in RAW]
    prompts += [{"name": n, "kind": "chat", "messages": m, "prompt": chatml(m)} for n, m in CHAT]
    write_jsonl(os.path.join(OUT, "llamacpp_prompts.jsonl"), prompts)
    write_jsonl(os.path.join(OUT, "llamacpp_tokenize_inputs.jsonl"),
                [{"name": n, "text": t} for n, t in TOKENIZE])


if __name__ == "__main__":
    main()
