"""A varied, generated set of instruction prompts; held-out prompts use content the training never sees.

Families: chat answers, how-to questions, explanations, code (functions, classes, SQL,
shell, reading code), lists and JSON, summaries of a passage given in the prompt,
stories and poems, arithmetic, and writing tasks (emails, rewrites, names).

Every content pool (topics, tasks, things to list, characters...) is split once: about
one item in five is held out, chosen by a hash of the item, so held-out prompts combine
templates the training saw with content it never saw. Version 1's pools keep their
split (its training subjects stay training, its held-out ones stay held out), so the
draft trained on version 1 is still evaluated on content it never saw.

The pools themselves are data, in prompt_pools.json beside this module; this module holds the
templates, the split and the sampling.
"""

from __future__ import annotations

import json
import random
import zlib
from importlib import resources

VERSION = 2  # part of the distillation data's cache key


def _load_pools() -> dict:
    """The content pools, from prompt_pools.json beside this module. Their order matters: rng.choice indexes them."""
    return json.loads(resources.files(__package__).joinpath("prompt_pools.json").read_text(encoding="utf-8"))


_POOLS = _load_pools()
# version 1's pools: their train/held-out split is fixed
SUBJECTS, HELD_OUT_SUBJECTS = _POOLS["subjects"], _POOLS["held_out_subjects"]
CODE_TASKS, HELD_OUT_CODE_TASKS = _POOLS["code_tasks"], _POOLS["held_out_code_tasks"]
# version 2's pools, split by hash
TOPICS = _POOLS["topics"]
HOWTOS = _POOLS["howtos"]
QUESTIONS = _POOLS["questions"]  # plain questions, each complete
THINGS = _POOLS["things"]  # things to list
ENTITIES = _POOLS["entities"]  # JSON objects: entity -> keys
FUNCTION_TASKS = _POOLS["function_tasks"]
CLASSES = _POOLS["classes"]
SQL_TASKS = _POOLS["sql_tasks"]
SHELL_TASKS = _POOLS["shell_tasks"]
LANGUAGES = _POOLS["languages"]
CHARACTERS = _POOLS["characters"]
SETTINGS = _POOLS["settings"]
OPENINGS = _POOLS["openings"]
VIRTUES = _POOLS["virtues"]
# (who, what) pairs: tuples, as the split hashes an item's repr
RECIPIENTS = [tuple(pair) for pair in _POOLS["recipients"]]
SENTENCES = _POOLS["sentences"]
PRODUCTS = _POOLS["products"]
BUSINESSES = _POOLS["businesses"]
AUDIENCES = _POOLS["audiences"]
NAMES = _POOLS["names"]
PLACES = _POOLS["places"]
SYSTEMS = _POOLS["systems"]  # None: no system message


def _hash(item) -> int:
    return zlib.crc32(repr(item).encode())


def _split(pool, held_out: bool) -> list:
    """About one item in five is held out (at least one), chosen by hash."""
    held = [x for x in pool if _hash(x) % 5 == 0] or [min(pool, key=_hash)]
    return held if held_out else [x for x in pool if x not in held]


class _Pools:
    """Every pool, restricted to its training or its held-out part."""

    def __init__(self, held_out: bool):
        self.subjects = (HELD_OUT_SUBJECTS if held_out else SUBJECTS) + _split(TOPICS, held_out)
        self.v1_tasks = HELD_OUT_CODE_TASKS if held_out else CODE_TASKS
        self.tasks = self.v1_tasks + _split(FUNCTION_TASKS, held_out)
        for name in (
            "HOWTOS",
            "QUESTIONS",
            "THINGS",
            "CLASSES",
            "SQL_TASKS",
            "SHELL_TASKS",
            "CHARACTERS",
            "SETTINGS",
            "OPENINGS",
            "VIRTUES",
            "RECIPIENTS",
            "SENTENCES",
            "PRODUCTS",
            "BUSINESSES",
        ):
            setattr(self, name.lower(), _split(globals()[name], held_out))
        self.entities = _split(list(ENTITIES.items()), held_out)


def _passage(rng: random.Random, subject: str) -> str:
    name, place, n = rng.choice(NAMES), rng.choice(PLACES), rng.randint(5, 90)
    kind = rng.randrange(4)
    if kind == 0:  # a biography
        sentences = [
            f"{name} grew up in {place} and became curious about {subject} at an early age.",
            f"Every weekend, {name} read books and asked experts questions about {subject}.",
            f"After years of study, {name} started a small club so that others could learn about {subject} too.",
            f"The club met every {rng.choice(['Monday', 'Wednesday', 'Friday', 'Sunday'])} and grew to {n} members.",
            f"Some people in {place} thought it was a strange hobby, but most of them joined at least one meeting.",
            f"Today, {name} says that learning about {subject} taught patience, curiosity and teamwork.",
        ]
    elif kind == 1:  # a news item
        sentences = [
            f"A new exhibition about {subject} opened this week in {place}.",
            f"The organisers expected a few hundred visitors, but {n * 40} people came on the first weekend.",
            f"The exhibition was planned for {rng.randint(2, 6)} years by a team led by {name}.",
            "Visitors can try hands-on experiments and listen to short talks every afternoon.",
            f"Local schools have booked {n} class visits, and tickets are free for children.",
            "The exhibition will stay open until the end of the year.",
        ]
    elif kind == 2:  # a short narrative
        sentences = [
            f"When the storm closed the only road out of {place}, {name} had nothing to do but wait.",
            f"On the shelf of the rented room there was an old book about {subject}.",
            f"{name} read it from cover to cover in {rng.randint(2, 5)} days and filled a notebook with questions.",
            f"When the road opened again, {name} did not leave at once, but visited the author, who lived nearby.",
            f"They talked for hours, and the author gave {name} a second, unfinished book.",
            f"A year later, {name} finished writing it.",
        ]
    else:  # a meeting note
        sentences = [
            f"The team met on {rng.choice(['Monday', 'Tuesday', 'Thursday'])} to plan the project on {subject}.",
            f"{name} reported that the first draft is {n}% complete and that two sections still need data.",
            f"The budget is {n * 100} dollars, and the deadline was moved by one week.",
            "Everyone agreed to share their notes in a common folder before Friday.",
            "The next meeting will review the results and decide on the final format.",
        ]
    return " ".join(sentences[: rng.randint(4, len(sentences))])


def _chat(rng, p: _Pools) -> str:
    s = rng.choice(p.subjects)
    return rng.choice(
        [
            rng.choice(p.questions),
            rng.choice(p.questions),
            f"What is interesting about {s}?",
            f"Can you tell me about {s}?",
            f"Why do people care about {s}?",
            f"Give me a fun fact about {s}.",
            f"I want to learn about {s}. Where should I start?",
            f"What are common myths about {s}?",
            f"What should a beginner know about {s}?",
            f"Is {s} overrated?",
            f"What are the pros and cons of {s}?",
            f"How has {s} changed over the last hundred years?",
            f"What is the difference between {s} and {rng.choice(p.subjects)}?",
        ]
    )


def _howto(rng, p: _Pools) -> str:
    a = rng.choice(p.howtos)
    return rng.choice(
        [
            f"How do I {a}?",
            f"What is the best way to {a}?",
            f"Give me step-by-step instructions to {a}.",
            f"I'm a beginner. How should I {a}?",
            f"What mistakes should I avoid when I {a}?",
            f"Can you help me {a}?",
            f"List {rng.randint(3, 8)} steps to {a}.",
            f"Any tips to {a}?",
        ]
    )


def _explain(rng, p: _Pools) -> str:
    s = rng.choice(p.subjects)
    return rng.choice(
        [
            f"Explain how {s} work, step by step.",
            f"Explain {s} to {rng.choice(AUDIENCES)}.",
            f"What are the main ideas behind {s}? Explain briefly.",
            f"Describe the history of {s} in a few paragraphs.",
            f"Explain {s} in simple terms.",
            f"Explain the difference between {s} and {rng.choice(p.subjects)}.",
            f"Explain why {s} matter.",
            f"{rng.choice(p.questions)} Explain in detail.",
        ]
    )


def _code(rng, p: _Pools) -> str:
    lang = rng.choice(LANGUAGES)
    kind = rng.randrange(10)
    if kind < 5:
        task = rng.choice(p.v1_tasks if kind == 0 else p.tasks)
        return rng.choice(
            [
                f"Write a {lang} function that {task}.",
                f"Write a {lang} function that {task}, with a short explanation.",
                f"Show me {lang} code that {task}, and add comments.",
                f"How do I write a function that {task} in {lang}?",
                f"Write a {lang} function that {task}, and a test for it.",
            ]
        )
    if kind < 7:
        return rng.choice(
            [f"Write a {lang} class for {rng.choice(p.classes)}.", f"Implement {rng.choice(p.classes)} in {lang}."]
        )
    if kind == 7:
        return rng.choice(
            [
                f"Write a SQL query that {rng.choice(p.sql_tasks)}.",
                f"Write a SQL query that {rng.choice(p.sql_tasks)}, and explain it.",
            ]
        )
    if kind == 8:
        return rng.choice(
            [
                f"Write a bash script that {rng.choice(p.shell_tasks)}.",
                f"Give me a shell command that {rng.choice(p.shell_tasks)}.",
            ]
        )
    a, b = rng.choice(["total", "count", "result", "x"]), rng.choice(["items", "numbers", "values", "data"])
    snippet = rng.choice(
        [
            f"def f({b}):\n    {a} = 0\n    for v in {b}:\n        if v % 2 == 0:\n            {a} += v\n    return {a}",
            f"def f({b}):\n    return [v * v for v in {b} if v > 0]",
            "def f(s):\n    return s == s[::-1]",
            f"def f({b}):\n    {a} = {{}}\n    for v in {b}:\n        {a}[v] = {a}.get(v, 0) + 1\n    return {a}",
        ]
    )
    return rng.choice(
        [
            f"Explain what this code does:\n\n```python\n{snippet}\n```",
            f"Can you improve this function and explain the change?\n\n```python\n{snippet}\n```",
            f"Add a docstring and type hints to this function:\n\n```python\n{snippet}\n```",
        ]
    )


def _list(rng, p: _Pools) -> str:
    n, s = rng.randint(3, 8), rng.choice(p.subjects)
    entity, keys = rng.choice(p.entities)
    return rng.choice(
        [
            f"List {n} facts about {s}.",
            f"Give me {n} tips related to {s}, as a numbered list.",
            f"List {n} {rng.choice(p.things)}.",
            f"Give me a numbered list of {n} {rng.choice(p.things)}.",
            f"Make a bulleted list of {n} {rng.choice(p.things)}, one sentence each.",
            f"Make a checklist to {rng.choice(p.howtos)}.",
            f"Make a bulleted list of pros and cons of {s}.",
            f"Return a JSON object with {n} key facts about {s}.",
            f"Return a JSON list of {n} items related to {s}, each with a name and a description.",
            f"Return a JSON object describing {entity} with the keys {keys}.",
            f"Return a JSON array of {rng.randint(2, 5)} examples of {entity}, each with {keys}.",
            f"Make a table of {n} {rng.choice(p.things)} in Markdown.",
        ]
    )


def _summary(rng, p: _Pools) -> str:
    instruction = rng.choice(
        [
            f"Summarize the following passage in {rng.choice(['one', 'two', 'three'])} sentences.",
            "Summarize this text for a child.",
            "What is the main idea of this passage?",
            f"Give {rng.randint(2, 4)} bullet points summarizing this passage.",
            "Write a headline for this passage.",
            "Summarize this passage and say what lesson it teaches.",
            "List the names and numbers mentioned in this text.",
            "Rewrite this passage in fewer words.",
        ]
    )
    return f"{instruction}\n\n{_passage(rng, rng.choice(p.subjects))}"


def _story(rng, p: _Pools) -> str:
    c, s, place = rng.choice(p.characters), rng.choice(p.subjects), rng.choice(p.settings)
    return rng.choice(
        [
            f"Write a short story about {c}.",
            f"Write a short story about {rng.choice(NAMES)} and {s}.",
            f"Tell a bedtime story set in {place} about {c}.",
            f"Write a poem about {s}.",
            f"Write a haiku about {s}.",
            f"Write a funny story about {c} in {place}.",
            f"Write a short adventure story set in {place}.",
            f"Write a short story that starts with: {rng.choice(p.openings)}",
            f"Write a fable about {c} with a moral about {rng.choice(p.virtues)}.",
            f"Write a short dialogue between {c} and {rng.choice(p.characters)}.",
        ]
    )


def _math(rng, p: _Pools) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
    pct, price, name = rng.choice([5, 10, 15, 20, 25, 30, 40, 50]), rng.randint(10, 200), rng.choice(NAMES)
    return rng.choice(
        [
            f"What is {a} + {b}?",
            f"What is {a} times {c}? Show your working.",
            f"Compute {a} * {b} - {c}.",
            f"If I have {a} apples and give away {c}, how many are left?",
            f"A train travels {a * c} km in {c} hours. What is its average speed?",
            f"Solve for x: {c}x + {a} = {a + c * b}.",
            f"What is {pct} percent of {price}?",
            f"What is {a * c} divided by {c}, plus {b}?",
            f"If a jacket costs {price} dollars and is discounted by {pct} percent, what is the new price?",
            f"{name} reads {c} pages a day. How many days does a {c * b}-page book take?",
            f"What is the area of a rectangle that is {a} cm by {c} cm?",
            f"Convert {a * c} minutes to hours and minutes.",
            f"Is {a * 2 + 1} a prime number? Explain.",
            f"What is the average of {a}, {b} and {c}?",
            f"{name} has {a} dollars and spends {c} dollars a day. After how many days is the money gone?",
        ]
    )


def _writing(rng, p: _Pools) -> str:
    who, what = rng.choice(p.recipients)
    return rng.choice(
        [
            f"Write an email to {who} asking {what}.",
            f"Write a short, polite message to {who} asking {what}.",
            f"Rewrite this sentence to sound more formal: {rng.choice(p.sentences)}",
            f"Correct the grammar of this sentence: {rng.choice(p.sentences)}",
            f"Translate this sentence into French: {rng.choice(p.sentences)}",
            f"Write a product description for {rng.choice(p.products)}.",
            f"Give me {rng.randint(3, 8)} name ideas for {rng.choice(p.businesses)}.",
            f"Write a short speech for {rng.choice(['a wedding', 'a retirement party', 'a graduation', 'a team meeting'])}.",
            f"Write a tweet announcing {rng.choice(p.businesses)}.",
        ]
    )


FAMILIES = {
    "chat": (_chat, 14),
    "howto": (_howto, 10),
    "explain": (_explain, 12),
    "code": (_code, 16),
    "list": (_list, 12),
    "summary": (_summary, 10),
    "story": (_story, 10),
    "math": (_math, 8),
    "writing": (_writing, 8),
}


def make_prompts(n: int, seed: int, held_out: bool = False) -> list[list[dict]]:
    """n chat conversations (lists of messages), reproducible from seed."""
    rng = random.Random(seed)
    pools = _Pools(held_out)
    makers, weights = zip(*FAMILIES.values())
    out = []
    for _ in range(n):
        messages = []
        if (system := rng.choice(SYSTEMS)) is not None:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": rng.choices(makers, weights)[0](rng, pools)})
        out.append(messages)
    return out
