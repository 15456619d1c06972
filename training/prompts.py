"""A varied, generated set of instruction prompts; held-out prompts use content the training never sees.

Families: chat answers, how-to questions, explanations, code (functions, classes, SQL,
shell, reading code), lists and JSON, summaries of a passage given in the prompt,
stories and poems, arithmetic, and writing tasks (emails, rewrites, names).

Every content pool (topics, tasks, things to list, characters...) is split once: about
one item in five is held out, chosen by a hash of the item, so held-out prompts combine
templates the training saw with content it never saw. Version 1's pools keep their
split (its training subjects stay training, its held-out ones stay held out), so the
draft trained on version 1 is still evaluated on content it never saw.
"""

from __future__ import annotations

import random
import zlib

VERSION = 2  # part of the distillation data's cache key

# version 1's pools: their train/held-out split is fixed
SUBJECTS = [
    "volcanoes",
    "honey bees",
    "the printing press",
    "black holes",
    "photosynthesis",
    "the Roman Empire",
    "electric cars",
    "coffee",
    "the human heart",
    "chess",
    "rainforests",
    "the internet",
    "glaciers",
    "vaccines",
    "the moon landing",
    "jazz music",
    "recycling",
    "earthquakes",
    "solar panels",
    "dinosaurs",
    "the stock market",
    "sleep",
    "octopuses",
    "bread baking",
    "the Olympic games",
    "bicycles",
    "tea",
    "the water cycle",
    "compound interest",
    "origami",
    "submarines",
    "wind turbines",
    "the Great Wall of China",
    "penguins",
    "climate change",
    "the piano",
    "gardening",
    "bridges",
    "friendship",
    "airplanes",
    "volunteering",
    "mushrooms",
    "the ocean tides",
    "libraries",
    "marathon running",
    "cheese",
    "the Renaissance",
    "robots",
    "lighthouses",
    "deserts",
    "wolves",
    "public speaking",
    "time management",
    "the immune system",
    "kites",
]
HELD_OUT_SUBJECTS = [
    "hot air balloons",
    "coral reefs",
    "the violin",
    "ancient Egypt",
    "snowflakes",
    "trains",
    "the brain",
    "pizza",
    "owls",
    "comets",
    "museums",
    "yoga",
    "rivers",
    "camping",
    "spiders",
    "the telescope",
]
CODE_TASKS = [
    "reverses a string",
    "checks whether a number is prime",
    "counts the words in a sentence",
    "returns the largest element of a list",
    "merges two sorted lists",
    "computes the factorial of n",
    "removes duplicates from a list",
    "converts Celsius to Fahrenheit",
    "checks if a string is a palindrome",
    "computes the nth Fibonacci number",
    "flattens a nested list",
    "counts vowels in a string",
    "sorts a list of dictionaries by a key",
    "finds the second smallest number in a list",
    "validates an email address with a simple rule",
    "computes the average of a list of numbers",
]
HELD_OUT_CODE_TASKS = [
    "capitalizes every word in a sentence",
    "finds the greatest common divisor of two numbers",
    "rotates a list by k positions",
    "checks whether two strings are anagrams",
]

# version 2's pools, split by hash
TOPICS = [
    "rainbows",
    "lightning",
    "gravity",
    "magnets",
    "sound waves",
    "the seasons",
    "static electricity",
    "evaporation",
    "DNA",
    "atoms",
    "the speed of light",
    "erosion",
    "fossils",
    "the northern lights",
    "clouds",
    "tsunamis",
    "the solar system",
    "batteries",
    "GPS",
    "3D printing",
    "cloud computing",
    "passwords",
    "Wi-Fi",
    "search engines",
    "spreadsheets",
    "email",
    "smartphones",
    "databases",
    "encryption",
    "machine learning",
    "open source software",
    "version control",
    "microwave ovens",
    "refrigerators",
    "the Silk Road",
    "the Industrial Revolution",
    "ancient Greece",
    "the Vikings",
    "the telephone",
    "the Aztecs",
    "castles",
    "the French Revolution",
    "democracy",
    "elephants",
    "dolphins",
    "ants",
    "sharks",
    "frogs",
    "butterflies",
    "cats",
    "dogs",
    "horses",
    "bats",
    "whales",
    "chocolate",
    "sushi",
    "pasta",
    "rice",
    "spices",
    "olive oil",
    "fermentation",
    "vitamins",
    "stretching",
    "hydration",
    "stress",
    "meditation",
    "nutrition labels",
    "budgeting",
    "credit scores",
    "inflation",
    "taxes",
    "teamwork",
    "remote work",
    "negotiation",
    "leadership",
    "supply and demand",
    "renewable energy",
    "nuclear power",
    "plastic pollution",
    "bird migration",
    "soil",
    "forests",
    "mountains",
    "islands",
    "the Amazon river",
    "the Sahara",
    "Antarctica",
    "football",
    "tennis",
    "swimming",
    "board games",
    "video games",
    "photography",
    "painting",
    "poetry",
    "theater",
    "podcasts",
    "movies",
    "architecture",
    "skyscrapers",
    "tunnels",
    "roads",
    "ships",
    "rockets",
    "satellites",
    "the Internet of Things",
]
HOWTOS = [
    "cook rice on the stove",
    "save money on groceries",
    "start running as a beginner",
    "learn to swim as an adult",
    "write a resume",
    "fall asleep faster",
    "keep houseplants alive",
    "prepare for a job interview",
    "study for an exam",
    "organize a messy closet",
    "train a puppy to sit",
    "make friends in a new city",
    "reduce screen time",
    "plan a birthday party",
    "change a car tire",
    "start a vegetable garden",
    "learn to play the guitar",
    "write a cover letter",
    "make pancakes",
    "brew tea properly",
    "clean a laptop keyboard",
    "back up my photos",
    "choose a good password",
    "start journaling",
    "become a morning person",
    "learn to code",
    "improve my handwriting",
    "pack a suitcase efficiently",
    "give a good presentation",
    "stay focused while studying",
    "make a budget",
    "paint a room",
    "fix a squeaky door",
    "care for a cat",
    "bake cookies",
    "write a short poem",
    "set up a home office",
    "deal with procrastination",
    "learn a new language",
    "cook a simple curry",
    "repot a plant",
    "read more books",
    "keep a conversation going",
    "prepare for a marathon",
    "meal prep for a week",
]
QUESTIONS = [  # plain questions, each complete
    "Why is the sky blue?",
    "Why does ice float on water?",
    "Why do we have leap years?",
    "How do birds know where to migrate?",
    "Why do onions make people cry?",
    "How do airplanes stay in the air?",
    "Why does bread rise?",
    "How does a refrigerator keep food cold?",
    "Why do we dream?",
    "How do noise-cancelling headphones work?",
    "Why is sea water salty but rain is not?",
    "How do plants know which way is up?",
    "Why do metals feel cold?",
    "How do chameleons change color?",
    "Why do we get goosebumps?",
    "How does a compass work?",
    "What causes hiccups?",
    "Why do stars twinkle?",
    "How are rainbows formed?",
    "Why do leaves fall in autumn?",
    "What happens when we sleep?",
    "How do vaccines get tested?",
    "Why is the moon sometimes visible during the day?",
    "How do touch screens know where I touch?",
    "What makes a good friend?",
    "How long does it take light to reach Earth from the Sun?",
    "What is the tallest mountain in the world?",
    "Why do some people like spicy food?",
    "How do bees make honey?",
    "What is the difference between a virus and a bacterium?",
    "What is the difference between a lake and a pond?",
    "What is the difference between a crocodile and an alligator?",
    "What is the difference between speed and velocity?",
    "What is the difference between a list and a tuple in Python?",
    "What is the difference between HTTP and HTTPS?",
    "Is it better to rent or to buy a home?",
    "What are the main causes of traffic jams?",
    "How does recycling actually work?",
]
THINGS = [  # things to list
    "countries and their capitals",
    "healthy snacks",
    "famous scientists",
    "board games for families",
    "uses for baking soda",
    "programming languages",
    "ways to save energy at home",
    "indoor hobbies",
    "vegetables that grow quickly",
    "famous paintings",
    "classic novels",
    "dog breeds",
    "musical instruments",
    "ways to reduce stress",
    "kitchen tools every cook needs",
    "things to do on a rainy day",
    "gift ideas for a teacher",
    "questions to ask in a job interview",
    "tips for a long flight",
    "habits of productive people",
    "ocean animals",
    "inventions that changed the world",
    "fruits rich in fiber",
    "ways to be more environmentally friendly",
    "team building activities",
    "card games",
    "study techniques",
    "camping essentials",
    "breakfast ideas",
    "famous bridges",
    "constellations",
    "desserts from around the world",
    "first aid supplies",
    "mammals that live in the desert",
]
ENTITIES = {  # JSON objects: entity -> keys
    "a movie": "title, director, year and genres",
    "a recipe": "name, servings, ingredients and steps",
    "a city": "name, country, population and famous landmarks",
    "a student": "name, age, grade and subjects",
    "a car": "make, model, year and features",
    "a planet": "name, diameter, moons and distance from the sun",
    "a song": "title, artist, album and duration",
    "a restaurant": "name, cuisine, rating and opening hours",
    "an employee": "name, role, department and skills",
    "a product": "name, price, category and tags",
    "a hotel booking": "guest, check-in date, nights and room type",
    "a pet": "name, species, age and favourite toys",
    "a football team": "name, city, coach and players",
    "a weather report": "city, temperature, humidity and forecast",
    "a library book": "title, author, isbn and available copies",
    "a flight": "number, origin, destination and departure time",
}
FUNCTION_TASKS = [
    "returns the sum of the digits of a number",
    "counts how often each character appears in a string",
    "checks whether a year is a leap year",
    "converts a number to binary",
    "returns the n smallest numbers of a list",
    "finds the longest word in a sentence",
    "checks whether a list is sorted",
    "splits a list into chunks of size n",
    "computes the median of a list",
    "returns the intersection of two lists",
    "removes all whitespace from a string",
    "converts a string to title case",
    "computes the power of a number without using the built-in operator",
    "returns the index of an item in a sorted list using binary search",
    "sorts a list with bubble sort",
    "counts the lines in a text file",
    "reads a CSV file and prints each row",
    "returns the most common element of a list",
    "checks whether a string contains only digits",
    "generates a random password",
    "computes simple interest",
    "converts minutes to hours and minutes",
    "reverses the words in a sentence",
    "zips two lists into a dictionary",
    "returns all even numbers from a list",
    "computes the distance between two points",
    "checks whether a number is a perfect square",
    "finds all prime numbers below n",
    "truncates a string to a maximum length",
    "computes the running total of a list",
]
CLASSES = [
    "a bank account with deposit and withdraw methods",
    "a stack with push, pop and peek",
    "a queue with enqueue and dequeue",
    "a simple to-do list",
    "a rectangle with area and perimeter methods",
    "a counter that can be incremented and reset",
    "a linked list with append and print methods",
    "a temperature converter",
    "a shopping cart with a total price method",
    "a simple timer",
    "a student with a list of grades and an average method",
    "a library that lends and returns books",
]
SQL_TASKS = [
    "returns all users older than 30",
    "counts the orders of each customer",
    "finds the five most expensive products",
    "returns the average salary per department",
    "lists the customers who never placed an order",
    "returns the total sales per month",
    "deletes rows with a missing email address",
    "finds duplicate email addresses",
]
SHELL_TASKS = [
    "renames every .txt file in a folder to .md",
    "finds the ten largest files in a folder",
    "counts the files in a folder",
    "prints the lines of a file that contain an error",
    "creates a backup copy of a folder with today's date",
    "shows which process uses the most memory",
    "downloads a list of URLs from a file",
    "replaces a word in every file of a folder",
]
LANGUAGES = [
    "Python",
    "Python",
    "Python",
    "JavaScript",
    "JavaScript",
    "TypeScript",
    "Java",
    "C",
    "C++",
    "Go",
    "Rust",
    "C#",
]
CHARACTERS = [
    "a dragon who is afraid of heights",
    "a shy robot",
    "a talking tree",
    "a young inventor",
    "a lost puppy",
    "a grumpy wizard",
    "a brave little mouse",
    "an old fisherman",
    "a girl who can speak to birds",
    "a clumsy knight",
    "a lonely astronaut",
    "a detective cat",
    "a baker who bakes magical bread",
    "a curious penguin",
    "twin sisters",
    "a retired pirate",
    "a teacher on her first day",
    "a fox who wants to fly",
    "a boy who finds a map",
    "a friendly ghost",
]
SETTINGS = [
    "a small village",
    "a busy city",
    "an island",
    "a mountain town",
    "a space station",
    "a farm",
    "an old castle",
    "a desert oasis",
    "a school",
    "a forest cabin",
    "an underwater city",
    "a train at night",
    "a haunted library",
    "a market full of spices",
    "a snowy valley",
    "a lighthouse",
    "a circus",
    "a hidden garden",
]
OPENINGS = [
    "The letter arrived on a Tuesday, three years too late.",
    "Nobody in town had ever seen the river run backwards.",
    "The last light in the building went out at midnight.",
    "It was the first day of summer, and the robot was bored.",
    "The map was drawn on the back of an old recipe.",
    "When the clock struck thirteen, the cat started talking.",
    "Everyone said the bridge could not be crossed.",
    "The new neighbour had a very unusual garden.",
]
VIRTUES = ["honesty", "patience", "kindness", "courage", "sharing", "hard work", "gratitude", "listening", "humility"]
RECIPIENTS = [
    ("my manager", "for a day off next Friday"),
    ("a landlord", "to fix a leaking tap"),
    ("a teacher", "for an extension on an assignment"),
    ("a colleague", "to review my report"),
    ("customer support", "for a refund of a broken kettle"),
    ("a neighbour", "to keep the noise down at night"),
    ("a client", "to reschedule a meeting"),
    ("a friend", "to join a weekend hike"),
    ("the school", "for information about enrollment"),
    ("a hotel", "about an early check-in"),
]
SENTENCES = [
    "me and him goes to the store yesterday",
    "the meeting have been moved to monday",
    "i cant find my keys anywhere",
    "Our sales went up a lot this year.",
    "The food was ok but the service was slow.",
    "We need the report by tomorrow.",
    "She don't like coffee in the morning.",
    "The project is late because of many problems.",
    "Thank you for the gift, I like it very much.",
    "Please send me the files when you can.",
]
PRODUCTS = [
    "a reusable water bottle",
    "noise-cancelling headphones",
    "a standing desk",
    "an electric kettle",
    "a hiking backpack",
    "a smart watch",
    "a handmade candle",
    "a children's picture book",
    "a yoga mat",
    "a coffee grinder",
]
BUSINESSES = [
    "a bakery",
    "a bike repair shop",
    "a tech startup",
    "a dog grooming salon",
    "a bookstore cafe",
    "a cleaning company",
    "a podcast about history",
    "a plant nursery",
    "a coding school",
]
AUDIENCES = [
    "a ten year old",
    "a beginner",
    "a grandparent",
    "a high school student",
    "someone who has never heard of it",
]
NAMES = [
    "Mia",
    "Leo",
    "Ava",
    "Omar",
    "Zoe",
    "Ivan",
    "Lena",
    "Sam",
    "Nora",
    "Kai",
    "Rosa",
    "Tom",
    "Priya",
    "Diego",
    "Yuki",
]
PLACES = [
    "a small village",
    "a busy city",
    "an island",
    "a mountain town",
    "a space station",
    "a farm",
    "an old castle",
    "a desert oasis",
    "a school",
    "a forest cabin",
]
SYSTEMS = [
    None,
    None,
    None,
    "You are a helpful assistant.",
    "You are a concise assistant. Keep answers short.",
    "You are a friendly teacher who explains things simply.",
]


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
