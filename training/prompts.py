"""A varied, generated set of instruction prompts; held-out prompts use subjects the training never sees.

Families: chat answers, explanations, code, lists and JSON, stories, arithmetic,
and summaries of a passage given in the prompt.
"""

from __future__ import annotations

import random

SUBJECTS = [
    "volcanoes", "honey bees", "the printing press", "black holes", "photosynthesis", "the Roman Empire",
    "electric cars", "coffee", "the human heart", "chess", "rainforests", "the internet", "glaciers",
    "vaccines", "the moon landing", "jazz music", "recycling", "earthquakes", "solar panels", "dinosaurs",
    "the stock market", "sleep", "octopuses", "bread baking", "the Olympic games", "bicycles", "tea",
    "the water cycle", "compound interest", "origami", "submarines", "wind turbines", "the Great Wall of China",
    "penguins", "climate change", "the piano", "gardening", "bridges", "friendship", "airplanes", "volunteering",
    "mushrooms", "the ocean tides", "libraries", "marathon running", "cheese", "the Renaissance", "robots",
    "lighthouses", "deserts", "wolves", "public speaking", "time management", "the immune system", "kites",
]
HELD_OUT_SUBJECTS = [
    "hot air balloons", "coral reefs", "the violin", "ancient Egypt", "snowflakes", "trains", "the brain",
    "pizza", "owls", "comets", "museums", "yoga", "rivers", "camping", "spiders", "the telescope",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the words in a sentence",
    "returns the largest element of a list", "merges two sorted lists", "computes the factorial of n",
    "removes duplicates from a list", "converts Celsius to Fahrenheit", "checks if a string is a palindrome",
    "computes the nth Fibonacci number", "flattens a nested list", "counts vowels in a string",
    "sorts a list of dictionaries by a key", "finds the second smallest number in a list",
    "validates an email address with a simple rule", "computes the average of a list of numbers",
]
HELD_OUT_CODE_TASKS = [
    "capitalizes every word in a sentence", "finds the greatest common divisor of two numbers",
    "rotates a list by k positions", "checks whether two strings are anagrams",
]
LANGUAGES = ["Python", "JavaScript", "Python", "C", "Python", "Go"]
NAMES = ["Mia", "Leo", "Ava", "Omar", "Zoe", "Ivan", "Lena", "Sam", "Nora", "Kai", "Rosa", "Tom"]
PLACES = ["a small village", "a busy city", "an island", "a mountain town", "a space station", "a farm",
          "an old castle", "a desert oasis", "a school", "a forest cabin"]
SYSTEMS = [None, None, None, "You are a helpful assistant.", "You are a concise assistant. Keep answers short.",
           "You are a friendly teacher who explains things simply."]


def _passage(rng: random.Random, subject: str) -> str:
    name, place = rng.choice(NAMES), rng.choice(PLACES)
    sentences = [
        f"{name} grew up in {place} and became curious about {subject} at an early age.",
        f"Every weekend, {name} read books and asked experts questions about {subject}.",
        f"After years of study, {name} started a small club so that others could learn about {subject} too.",
        f"The club met every {rng.choice(['Monday', 'Wednesday', 'Friday', 'Sunday'])} and grew to "
        f"{rng.randint(5, 90)} members.",
        f"Some people in {place} thought it was a strange hobby, but most of them joined at least one meeting.",
        f"Today, {name} says that learning about {subject} taught patience, curiosity and teamwork.",
    ]
    return " ".join(sentences[: rng.randint(4, 6)])


def _user_text(rng: random.Random, family: str, subject: str, task: str) -> str:
    if family == "chat":
        return rng.choice([f"What is interesting about {subject}?", f"Can you tell me about {subject}?",
                           f"Why do people care about {subject}?", f"Give me a fun fact about {subject}.",
                           f"I want to learn about {subject}. Where should I start?"])
    if family == "explain":
        return rng.choice([f"Explain how {subject} work, step by step.", f"Explain {subject} to a ten year old.",
                           f"What are the main ideas behind {subject}? Explain briefly.",
                           f"Describe the history of {subject} in a few paragraphs."])
    if family == "code":
        lang = rng.choice(LANGUAGES)
        return rng.choice([f"Write a {lang} function that {task}.",
                           f"Write a {lang} function that {task}, with a short explanation.",
                           f"Show me {lang} code that {task}, and add comments."])
    if family == "list":
        n = rng.randint(3, 8)
        return rng.choice([f"List {n} facts about {subject}.", f"Give me {n} tips related to {subject}, as a numbered list.",
                           f"Return a JSON object with {n} key facts about {subject}.",
                           f"Return a JSON list of {n} items related to {subject}, each with a name and a description.",
                           f"Make a bulleted list of pros and cons of {subject}."])
    if family == "story":
        return rng.choice([f"Write a short story about {rng.choice(NAMES)} and {subject}.",
                           f"Tell a bedtime story set in {rng.choice(PLACES)} that involves {subject}.",
                           f"Write a poem about {subject}.", f"Write a funny story about a robot who loves {subject}."])
    if family == "math":
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
        return rng.choice([f"What is {a} + {b}?", f"What is {a} times {c}? Show your working.",
                           f"Compute {a} * {b} - {c}.", f"If I have {a} apples and give away {c}, how many are left?",
                           f"A train travels {a} km in {c} hours. What is its average speed?",
                           f"Solve for x: {c}x + {a} = {a + c * b}."])
    return f"Summarize the following passage in {rng.choice(['one', 'two', 'three'])} sentences.\n\n{_passage(rng, subject)}"


FAMILIES = ["chat", "explain", "code", "list", "story", "math", "summary"]


def make_prompts(n: int, seed: int, held_out: bool = False) -> list[list[dict]]:
    """n chat conversations (lists of messages), reproducible from seed."""
    rng = random.Random(seed)
    subjects = HELD_OUT_SUBJECTS if held_out else SUBJECTS
    tasks = HELD_OUT_CODE_TASKS if held_out else CODE_TASKS
    out = []
    for i in range(n):
        family = FAMILIES[i % len(FAMILIES)]
        messages = []
        if (system := rng.choice(SYSTEMS)) is not None:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": _user_text(rng, family, rng.choice(subjects), rng.choice(tasks))})
        out.append(messages)
    return out
