#!/usr/bin/env python3
"""Writes the input file for the Gemma 3 llama.cpp reference data (JSON lines):

  crates/handoff-model/tests/data/gemma3_prompts.jsonl

The .jsonl file is committed; re-running this script must reproduce it byte
for byte. Used by scripts/gen-gemma3-refs.sh.

Chat prompts: the GGUF (models/gemma-3-270m-q4_k_m.gguf) carries no
tokenizer.chat_template, so they are rendered with Gemma 3's published
template (google/gemma-3-*-it tokenizer_config.json, quoted in `gemma3_chat`
below), which starts with the literal text `<bos>`. The GGUF has
tokenizer.ggml.add_bos_token=true, so llama_tokenize(add_special=true) would
prepend a second BOS; chat lines therefore carry "add_special": false (the
`<bos>` text is parsed as the special token, id 2). Raw lines leave
add_special at its default (true): llama.cpp prepends the one BOS.

Long prompts (> 600 tokens) exercise Gemma 3's sliding-window layers
(gemma3.attention.sliding_window = 512)."""
import json
import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
OUT = os.path.join(ROOT, "crates", "handoff-model", "tests", "data")

BOS = "<bos>"

# Gemma 3's chat template (HF google/gemma-3-270m-it etc.), verbatim:
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""


def gemma3_chat(messages, add_generation_prompt=True):
    """Python port of GEMMA3_TEMPLATE for string contents: `<bos>`, a leading
    system message is prepended (untrimmed, plus a blank line) to the first
    user turn, `assistant` is renamed `model`, contents are trimmed (Jinja's
    `trim` = Python's str.strip())."""
    s = BOS
    if messages[0]["role"] == "system":
        prefix = messages[0]["content"] + "\n\n"
        loop = messages[1:]
    else:
        prefix = ""
        loop = messages
    for i, m in enumerate(loop):
        if (m["role"] == "user") != (i % 2 == 0):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        role = "model" if m["role"] == "assistant" else m["role"]
        s += "<start_of_turn>" + role + "\n" + (prefix if i == 0 else "")
        s += m["content"].strip()
        s += "<end_of_turn>\n"
    if add_generation_prompt:
        s += "<start_of_turn>model\n"
    return s


CLOCKS = (
    "For most of human history, time was read from the sky. Farmers watched the length of shadows, "
    "sailors watched the stars, and priests kept calendars by noting where the sun rose on the "
    "horizon at each solstice. The earliest instruments for measuring time were shadow clocks and "
    "sundials, which appeared in Egypt and Babylon more than three thousand years ago. A sundial "
    "is simple and reliable on a clear day, but it is useless at night and under clouds, and the "
    "hours it shows change length with the seasons.\n\n"
    "Water clocks solved part of the problem. In a clepsydra, water drips from one vessel into "
    "another at a steady rate, and marks on the inside of the vessel show how much time has "
    "passed. Greek and Chinese engineers built elaborate versions with floats, gears, and moving "
    "figures. In the eleventh century, the Chinese official Su Song designed an astronomical clock "
    "tower more than ten meters tall, driven by a water wheel and an escapement that released the "
    "wheel one bucket at a time.\n\n"
    "Mechanical clocks driven by falling weights appeared in European monasteries and town squares "
    "at the end of the thirteenth century. Their verge-and-foliot escapements were crude, and a "
    "good tower clock might gain or lose a quarter of an hour in a day, so they were regularly "
    "corrected against a sundial. Still, they changed daily life: the striking of the hours "
    "organized work, trade, and prayer, and cities competed to build ever more impressive "
    "mechanisms.\n\n"
    "The great leap in accuracy came with the pendulum. Galileo noticed that a swinging pendulum "
    "keeps nearly the same period whatever the size of its swing, and in 1656 the Dutch scientist "
    "Christiaan Huygens built the first pendulum clock. Its error fell from minutes to seconds per "
    "day. Soon afterwards the balance spring made accurate pocket watches possible, and clocks "
    "moved from the church tower into the home.\n\n"
    "Accurate time also turned out to be the key to finding longitude at sea. A navigator who knows "
    "the time at his home port and the local time, measured from the sun, can compute how far east "
    "or west he has traveled. In the eighteenth century the British Parliament offered a large "
    "prize for a practical method, and the carpenter and clockmaker John Harrison spent decades "
    "building a series of marine chronometers. His fourth design, a large watch tested on a voyage "
    "to Jamaica in 1761, lost only about five seconds in more than two months.\n\n"
    "The railways brought another change. As long as every town kept its own local solar time, "
    "timetables were a nightmare, and in the nineteenth century railway companies adopted standard "
    "times distributed by telegraph. In 1884 an international conference in Washington chose the "
    "meridian through Greenwich as the prime meridian, and the world was gradually divided into "
    "time zones.\n\n"
    "In the twentieth century, quartz crystals, which vibrate at a precise frequency when an "
    "electric field is applied, replaced pendulums and springs in most clocks and watches. Atomic "
    "clocks went further still: since 1967 the second has been defined by the frequency of a "
    "transition in the cesium atom, and the best modern optical clocks would neither gain nor lose "
    "a second over the age of the universe. Today these clocks keep the satellites of navigation "
    "systems synchronized, and a phone in a pocket quietly corrects its time many times a day. "
    "Looking back over this long history, the single invention that mattered most was"
)

REPORT = (
    "Project report: the Marlow Creek footbridge\n\n"
    "Summary. The town council of Eastwick approved the replacement of the old timber footbridge "
    "over Marlow Creek in March. The contract was awarded to Hollis & Grant Engineering, and the "
    "project manager is Priya Natarajan. The approved budget is 412,000 euros, of which 60,000 "
    "euros is held as a contingency reserve. The new bridge is a single steel span of 34 meters "
    "with a deck of recycled composite planks, designed for pedestrians and bicycles.\n\n"
    "Site and ground conditions. Marlow Creek is about nine meters wide at normal water level, but "
    "it floods several times each winter, and in the flood of two years ago the water rose almost "
    "two meters above the old deck. The survey found soft clay to a depth of six meters on the "
    "north bank and firm gravel on the south bank. For this reason, the north abutment rests on "
    "eight steel piles driven to the gravel layer, while the south abutment uses a shallow concrete "
    "footing. The new deck is placed 1.5 meters higher than the old one so that it stays above the "
    "highest recorded flood.\n\n"
    "Schedule. Demolition of the old bridge began on the 4th of June and took eleven days. Piling "
    "on the north bank was delayed by a week because the piling rig broke down, and a replacement "
    "had to be brought from another site. The steel span was fabricated off site in three "
    "segments, delivered by road at night, and lifted into place by a mobile crane on a single "
    "Sunday in August, when the riverside path could be closed without disturbing commuters. "
    "Deck installation, railings, and lighting followed in September. The bridge opened to the "
    "public on the 2nd of October, nine days later than the original plan.\n\n"
    "Costs. The final cost was 398,500 euros, below the approved budget. About 21,000 euros of the "
    "contingency reserve was used: most of it paid for the replacement piling rig and for "
    "additional night work during the steel delivery. The lighting contractor's quote was lower "
    "than expected because the council chose solar-powered bollards instead of lamps connected "
    "to the grid, which also avoided digging a cable trench across the park.\n\n"
    "Environment. Marlow Creek is home to a small colony of water voles, a protected species. An "
    "ecologist surveyed both banks before work started and marked an exclusion zone along the "
    "south bank, where no machinery was allowed. Work in the water was limited to the period from "
    "July to September, outside the breeding season of the local trout. Old timber from the "
    "demolished bridge was sent to a recycling yard, and two benches near the new bridge were "
    "made from the best of the old planks.\n\n"
    "Lessons learned. The team recommends keeping a second piling rig on call for future projects "
    "with soft ground, booking the crane earlier in the year, and involving residents sooner: a "
    "public meeting in May produced the idea of the benches and the request for better lighting, "
    "both of which were easy to include at that stage but would have been expensive later.\n\n"
    "Maintenance. The steel span needs a visual inspection every year and a detailed inspection "
    "every six years. The composite planks are expected to last at least twenty-five years. The "
    "solar bollards have batteries that should be replaced after about eight years."
)

LONG_CODE = '''"""Inventory management for a small warehouse.

The warehouse stores items on shelves. Each shelf has a fixed capacity, and
each item has a SKU, a name, a unit weight in kilograms, and a quantity.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Dict, Iterable, List, Optional


class InventoryError(Exception):
    """Raised when an operation would leave the inventory inconsistent."""


@dataclasses.dataclass
class Item:
    sku: str
    name: str
    unit_weight: float
    quantity: int = 0

    def total_weight(self) -> float:
        return self.unit_weight * self.quantity


@dataclasses.dataclass
class Shelf:
    label: str
    max_weight: float
    items: Dict[str, Item] = dataclasses.field(default_factory=dict)

    def load(self) -> float:
        """Total weight currently on the shelf."""
        return sum(item.total_weight() for item in self.items.values())

    def free_capacity(self) -> float:
        return self.max_weight - self.load()

    def add(self, item: Item, quantity: int) -> None:
        if quantity <= 0:
            raise InventoryError(f"quantity must be positive, got {quantity}")
        extra = item.unit_weight * quantity
        if extra > self.free_capacity():
            raise InventoryError(
                f"shelf {self.label} cannot take {extra:.1f} kg more "
                f"(free: {self.free_capacity():.1f} kg)"
            )
        stored = self.items.get(item.sku)
        if stored is None:
            stored = Item(item.sku, item.name, item.unit_weight, 0)
            self.items[item.sku] = stored
        stored.quantity += quantity

    def remove(self, sku: str, quantity: int) -> None:
        stored = self.items.get(sku)
        if stored is None:
            raise InventoryError(f"shelf {self.label} has no item {sku}")
        if quantity > stored.quantity:
            raise InventoryError(
                f"shelf {self.label} has only {stored.quantity} of {sku}, "
                f"cannot remove {quantity}"
            )
        stored.quantity -= quantity
        if stored.quantity == 0:
            del self.items[sku]


class Warehouse:
    def __init__(self, shelves: Iterable[Shelf]):
        self.shelves: List[Shelf] = list(shelves)
        self.history: List[dict] = []

    def find(self, sku: str) -> List[Shelf]:
        """All shelves that hold at least one unit of `sku`."""
        return [shelf for shelf in self.shelves if sku in shelf.items]

    def quantity(self, sku: str) -> int:
        return sum(shelf.items[sku].quantity for shelf in self.find(sku))

    def store(self, item: Item, quantity: int) -> List[str]:
        """Store `quantity` units, filling the emptiest shelves first.

        Returns the labels of the shelves used."""
        used = []
        remaining = quantity
        for shelf in sorted(self.shelves, key=lambda s: s.free_capacity(), reverse=True):
            if remaining == 0:
                break
            fits = int(shelf.free_capacity() // item.unit_weight)
            take = min(fits, remaining)
            if take > 0:
                shelf.add(item, take)
                used.append(shelf.label)
                remaining -= take
        if remaining:
            raise InventoryError(f"no room for {remaining} units of {item.sku}")
        self.history.append({"op": "store", "sku": item.sku, "quantity": quantity})
        return used

    def pick(self, sku: str, quantity: int) -> List[str]:
        """Remove `quantity` units, emptying the fullest shelves first."""
        if self.quantity(sku) < quantity:
            raise InventoryError(f"only {self.quantity(sku)} units of {sku} in stock")
        used = []
        remaining = quantity
        for shelf in sorted(self.find(sku), key=lambda s: s.items[sku].quantity, reverse=True):
            take = min(shelf.items[sku].quantity, remaining)
            shelf.remove(sku, take)
            used.append(shelf.label)
            remaining -= take
            if remaining == 0:
                break
        self.history.append({"op": "pick", "sku": sku, "quantity": quantity})
        return used

    def report(self) -> str:
        lines = []
        for shelf in self.shelves:
            lines.append(f"{shelf.label}: {shelf.load():.1f}/{shelf.max_weight:.1f} kg")
            for item in sorted(shelf.items.values(), key=lambda i: i.sku):
                lines.append(f"  {item.sku} {item.name} x{item.quantity}")
        return "\\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(
            {
                "shelves": [
                    {
                        "label": shelf.label,
                        "max_weight": shelf.max_weight,
                        "items": [dataclasses.asdict(i) for i in shelf.items.values()],
                    }
                    for shelf in self.shelves
                ],
                "history": self.history,
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> "Warehouse":
'''

RAW = [
    ("short_fact", "The capital of France is Paris, and the capital of Germany is"),
    ("prose", "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea, there lived"),
    ("code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"),
    ("list", "Shopping list:\n1. Apples\n2. Bread\n3. Milk\n4."),
    ("numbers", "The first ten prime numbers are 2, 3, 5, 7, 11, 13, 17, 19, 23, and 29. Their sum is 129, and 3.14159 * 2 ="),
    ("unicode", "Café naïve résumé — Zoë's piñata 🎉🚀 costs 5€. 日本語のテキスト。 Translation:"),
    ("long_prose", CLOCKS),
    ("long_code", LONG_CODE),
]

CHAT = [
    ("chat_capital", [{"role": "user", "content": "What is the capital of France?"}]),
    ("chat_code", [{"role": "user", "content": "Write a Python function that reverses a string."}]),
    ("chat_multiturn", [
        {"role": "user", "content": "Hi! My name is Ana and I live in Lisbon."},
        {"role": "assistant", "content": "Hello Ana! Nice to meet you. How can I help you today?"},
        {"role": "user", "content": "What's my name, and which city do I live in?"},
    ]),
    ("chat_system", [
        {"role": "system", "content": "You are a concise assistant. Answer in one sentence."},
        {"role": "user", "content": "  Why is the sky blue?\n"},
    ]),
    ("chat_long_document", [
        {"role": "user", "content": REPORT + "\n\nAccording to the report above, who is the project "
         "manager, what was the approved budget, and what was the final cost?"},
    ]),
]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(path)


def main():
    os.makedirs(OUT, exist_ok=True)
    prompts = [{"name": n, "kind": "raw", "prompt": p} for n, p in RAW]
    prompts += [{"name": n, "kind": "chat", "messages": m, "prompt": gemma3_chat(m), "add_special": False}
                for n, m in CHAT]
    write_jsonl(os.path.join(OUT, "gemma3_prompts.jsonl"), prompts)


if __name__ == "__main__":
    main()
