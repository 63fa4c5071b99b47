"""Prompts for distillation (training) and for evaluation (held out).

Training prompts are composed from short hand-written task templates and
subjects, plus Python functions and module docstrings from the standard
library shipped with the interpreter (PSF licence, no download). The target
answers them; its sampled answers and next-token distributions are the
training data. The evaluation prompts below are written separately, in other
words and formats, and never come out of :func:`training_prompts` (a test
checks it).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from functools import lru_cache
from pathlib import Path

# ---------------------------------------------------------------------------
# Held-out evaluation prompts (never used for training).
# ---------------------------------------------------------------------------

EVAL_PROMPTS: tuple[str, ...] = (
    "What would happen to the tides if the Moon were twice as far away?",
    "Give me three tips for keeping houseplants alive in a dark apartment.",
    "Write a limerick about a cat who refuses to take a bath.",
    "My bicycle chain keeps slipping. What should I check first?",
    "Translate 'Where is the train station?' into Spanish and French.",
    "Describe the taste of a lemon to someone who has never eaten one.",
    "How do vaccines teach the immune system to recognise a virus?",
    "Draft a polite email asking my landlord to repair a leaking tap.",
    "What are the pros and cons of working from home?",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Why is the sky blue during the day but red at sunset?",
    "Plan a vegetarian dinner menu for four people on a small budget.",
    "Summarise the plot of Romeo and Juliet in four sentences.",
    "What is the difference between a list and a tuple in Python?",
    "Invent a name and a short backstory for a friendly dragon.",
    "How can I improve my sleep if I often wake up at 3 a.m.?",
    "Explain compound interest with a simple numeric example.",
    "Write the opening paragraph of a mystery novel set on a ferry.",
    "What should a beginner know before running their first marathon?",
    "List five common logical fallacies with one-line examples.",
    "How does a refrigerator keep food cold?",
    "Suggest a weekend itinerary for a first visit to Rome.",
    "Write a SQL query that counts orders per customer, highest first.",
    "Why do onions make people cry, and how can I avoid it?",
    "Compose a short motivational message for a student before exams.",
    "What causes earthquakes, and why are some regions safer than others?",
    "Explain recursion to a ten-year-old.",
    "Write a haiku about the first snow of winter.",
    "How do I politely decline an invitation to a wedding?",
    "Compare electric cars and petrol cars in terms of running costs.",
    "What is photosynthesis and why does it matter for animals?",
    "Give a step-by-step recipe for fluffy pancakes.",
    "Write a short dialogue between a detective and a nervous witness.",
    "What is the purpose of a constitution?",
    "How can a small bakery attract more customers online?",
    "Explain what a hash table is and when to use one.",
    "Tell me an interesting fact about octopuses and explain it.",
    "What are good habits for keeping a personal budget?",
    "Describe a sunrise over the mountains in vivid language.",
    "How does the heart pump blood through the body?",
    "Write a thank-you note to a colleague who helped with a project.",
    "What were the main causes of the French Revolution?",
    "Give me a packing list for a three-day camping trip.",
    "Explain the rules of chess for the knight and the bishop.",
    "Why do we have leap years?",
    "Write a bash command that finds all .log files larger than 10 MB.",
    "How can I learn to draw faces as an adult beginner?",
    "What is inflation, and how does it affect savings?",
)

# Three fixed prompts for the regression test (a subset of the held-out set).
TEST_PROMPTS: tuple[str, ...] = EVAL_PROMPTS[:3]

# ---------------------------------------------------------------------------
# Training prompts: templates x subjects, and standard-library code.
# ---------------------------------------------------------------------------

_TEMPLATES: tuple[str, ...] = (
    "Explain {s} in simple terms.",
    "Write a short essay about {s}.",
    "What are the most important facts about {s}?",
    "Tell me a story that involves {s}.",
    "Give me five questions a student might ask about {s}, with answers.",
    "Write a poem about {s}.",
    "What are common misconceptions about {s}?",
    "Describe the history of {s}.",
    "How would you teach {s} to a beginner?",
    "Write a blog post introduction about {s}.",
    "What are the advantages and disadvantages of {s}?",
    "Summarize what an encyclopedia would say about {s}.",
    "Create a lesson plan about {s} for a high-school class.",
    "Write a conversation between two friends discussing {s}.",
    "List some practical tips related to {s}.",
    "Why is {s} important?",
    "Write a news article about a recent discovery related to {s}.",
    "Explain {s} as if you were a pirate.",
    "Give an analogy that helps understand {s}.",
    "What would the world look like without {s}?",
    "Write a product description inspired by {s}.",
    "Describe {s} to a child.",
    "What careers are connected to {s}?",
    "Write a quiz with four multiple-choice questions about {s}.",
    "Compare {s} with something similar and explain the differences.",
    "What are the ethical questions raised by {s}?",
    "Write a short speech about {s}.",
    "Give a step-by-step guide related to {s}.",
    "What are three surprising things about {s}?",
    "Write a diary entry from someone who just learned about {s}.",
    "How has {s} changed in the last hundred years?",
    "Write a tweet thread about {s}.",
    "Explain the science behind {s}.",
    "Write a fairy tale in which {s} plays a key role.",
    "What questions remain unanswered about {s}?",
    "Give me a one-paragraph summary of {s}.",
    "{S}: explain it in a few paragraphs.",
    "I am confused about {s}. Can you help me understand it?",
    "Write a short advertisement that mentions {s}.",
    "How do experts measure or study {s}?",
)

_SUBJECTS: tuple[str, ...] = (
    "black holes", "the water cycle", "the Roman Empire", "machine learning", "volcanoes",
    "the human brain", "climate change", "the printing press", "honey bees", "the stock market",
    "electricity", "democracy", "the Great Wall of China", "DNA", "the internet", "coral reefs",
    "renewable energy", "the Renaissance", "gravity", "ancient Egypt", "coffee", "jazz music",
    "the immune system", "rainforests", "cryptography", "the Moon landing", "chess", "bread baking",
    "earthquakes", "the periodic table", "friendship", "mountain climbing", "recycling",
    "the Industrial Revolution", "photosynthesis", "dinosaurs", "the Olympic Games", "sleep",
    "artificial satellites", "the French language", "meditation", "public libraries",
    "ocean currents", "robots", "vaccines", "the solar system", "origami", "taxes",
    "the Silk Road", "bicycles", "Shakespeare", "quantum physics", "deserts", "money",
    "the camera", "wolves", "sourdough", "video games", "the Amazon river", "glaciers",
    "urban gardening", "the Cold War", "penguins", "prime numbers", "social media",
    "the theory of evolution", "submarines", "tea ceremonies", "solar panels", "bridges",
    "the piano", "antibiotics", "migration of birds", "the Middle Ages", "time zones",
    "composting", "elections", "the telescope", "sharks", "spices", "the Arctic",
    "open-source software", "marathons", "the violin", "forests", "airplanes", "magnets",
    "the Aztecs", "nutrition", "volunteering", "lighthouses", "languages", "probability",
    "mushrooms", "the Vikings", "television", "tornadoes", "architecture", "the alphabet",
    "train travel", "elephants", "cheese making", "the blood cycle", "kites", "mathematics",
    "the Pyramids", "wind turbines", "poetry", "microbes", "the metric system", "snow",
    "teamwork", "fire", "the Greek gods", "rivers", "sign language", "plastic pollution",
    "the Sahara", "typewriters", "butterflies", "space stations", "the Beatles",
    "public speaking", "algorithms", "bees and flowers", "cartography", "the speed of light",
    "knitting", "ancient Greece", "batteries", "the economy", "first aid", "clocks",
    "volcanic islands", "neural networks", "gardening", "the ocean floor", "castles",
    "paper", "earth's atmosphere", "board games", "photography", "salt", "hurricanes",
    "the Internet of Things", "astronauts", "museums", "fermentation", "skyscrapers",
    "philosophy", "caves", "the compass", "whales", "self-driving cars", "the Titanic",
    "glass making", "comets", "the brain's memory", "cooking rice", "wildfires", "trade",
    "the Nile", "cybersecurity", "frogs", "statistics", "the United Nations", "owls",
    "3D printing", "calendars", "minimalism", "the Eiffel Tower", "bacteria", "weather forecasts",
    "rainbows", "the Andes", "honey", "tides", "the Byzantine Empire", "chemistry labs", "yoga", "maps",
    "podcasts", "the Mongol Empire", "fossils", "zero", "irrigation", "the human skeleton", "bees' dances",
    "electric guitars", "paper money", "cloud computing", "ancient Rome's roads", "octopuses", "deserts at night",
    "lightning", "the stock exchange", "baking bread at home", "the Great Barrier Reef", "the Inca", "recycling glass",
    "spreadsheets", "the Milky Way", "sailing", "chocolate", "the water supply of cities", "insects",
    "the Hubble telescope", "child development", "farming", "movie making", "bread yeast", "public transport",
    "the Northern Lights", "vitamins", "the Internet's history", "mountain glaciers", "ants", "volcanic ash",
    "email etiquette", "database indexes", "version control", "sorting algorithms", "web browsers", "passwords",
    "the Fibonacci sequence", "climate models", "jellyfish", "ice cream", "the Renaissance painters", "pianos",
)

# Everyday requests: a task with one or two slots, filled from small lists.
_REQUESTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Write a short email to {x}.", (
        "my neighbour about a noisy party", "a teacher asking for an extension", "a hotel about a lost umbrella",
        "my team announcing a new meeting time", "a customer apologising for a late delivery",
        "a friend I have not seen in years", "my manager asking for a day off", "a plumber asking for a quote",
        "a club inviting new members", "a shop asking about a refund")),
    ("Give me advice on {x}.", (
        "starting a vegetable garden", "saving money on groceries", "learning a new language",
        "preparing for a job interview", "keeping a cat entertained", "organising a small kitchen",
        "staying focused while studying", "travelling with a toddler", "making new friends in a new city",
        "writing a good CV", "getting back into running", "reducing screen time", "cooking for one person")),
    ("Write a recipe for {x}.", (
        "tomato soup", "banana bread", "a simple curry", "lemonade", "vegetable stir-fry", "oatmeal cookies",
        "guacamole", "a green salad", "mashed potatoes", "apple crumble", "hummus", "fried rice")),
    ("Write a {x}.", (
        "haiku about autumn leaves", "limerick about a forgetful wizard", "short poem about the ocean",
        "birthday message for my grandmother", "toast for a friend's wedding", "short bedtime story about a fox",
        "product review of a pair of running shoes", "motivational quote with an explanation",
        "two-sentence horror story", "riddle and its answer", "short speech for a school graduation",
        "job advertisement for a café barista", "letter from a knight to a dragon")),
    ("What is the difference between {x}?", (
        "weather and climate", "a virus and a bacterium", "speed and velocity", "a lake and a pond",
        "baking soda and baking powder", "RAM and storage", "a simile and a metaphor", "affect and effect",
        "a comet and an asteroid", "an alligator and a crocodile", "stocks and bonds", "a list and a set in Python")),
    ("Solve this step by step: {x}", (
        "a train travels 180 km in 2 hours; what is its average speed?",
        "what is 15 % of 240?", "if 3 pencils cost 1.20 dollars, how much do 10 pencils cost?",
        "a rectangle is 7 m long and 4 m wide; what is its area and perimeter?",
        "what is the sum of the first 20 positive integers?", "simplify (2x + 3) + (5x - 7)",
        "solve 4x - 6 = 18", "how many minutes are there in a week?",
        "a shirt costs 40 dollars after a 20 % discount; what was the original price?")),
    ("Write a Python function that {x}.", (
        "reverses a string", "checks whether a number is prime", "counts the words in a sentence",
        "returns the largest element of a list", "merges two sorted lists", "removes duplicates from a list",
        "converts Celsius to Fahrenheit", "checks whether a word is a palindrome", "computes a factorial recursively",
        "flattens a nested list", "reads a CSV file and prints each row", "returns the n-th prime number")),
    ("Explain how {x} works.", (
        "a microwave oven", "a bicycle gear", "a search engine", "a credit card payment", "a thermostat",
        "an electric motor", "a vaccine", "GPS navigation", "a touchscreen", "a dishwasher", "a hot-air balloon",
        "compound interest", "a binary search", "public-key encryption", "a solar panel")),
)

_CODE_TEMPLATES: tuple[str, ...] = (
    "Explain what this Python code does:\n\n```python\n{c}\n```",
    "Review this Python function and suggest improvements:\n\n```python\n{c}\n```",
    "Write unit tests for this function:\n\n```python\n{c}\n```",
    "Rewrite this code with clearer variable names and comments:\n\n```python\n{c}\n```",
    "Is there a bug in this code?\n\n```python\n{c}\n```",
)

_DOC_TEMPLATES: tuple[str, ...] = (
    "Summarize this documentation:\n\n{d}",
    "Explain this to a new programmer:\n\n{d}",
    "Give an example of how to use the module described here:\n\n{d}",
)

_STDLIB_SKIP = {"test", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages", "ensurepip"}
_MAX_CODE_LINES = 24
_MAX_DOC_CHARS = 700


@lru_cache(maxsize=1)
def stdlib_snippets() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(function sources, module docstrings) from the interpreter's standard library."""
    root = Path(sysconfig.get_paths()["stdlib"])
    funcs: list[str] = []
    docs: list[str] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if rel[0] in _STDLIB_SKIP or rel[0].startswith("_"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        doc = ast.get_docstring(tree)
        if doc and len(doc) > 120:
            docs.append(doc[:_MAX_DOC_CHARS])
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                n = node.end_lineno - node.lineno + 1
                if 4 <= n <= _MAX_CODE_LINES:
                    body = lines[node.lineno - 1 : node.end_lineno]
                    indent = len(body[0]) - len(body[0].lstrip())
                    funcs.append("\n".join(line[indent:] for line in body))
    return tuple(funcs), tuple(docs)


def training_prompts(num: int, seed: int) -> list[str]:
    """``num`` training prompts, deterministic for (``num``, ``seed``) and the Python version.

    Roughly 60 % template x subject, 10 % everyday requests, 20 % stdlib code,
    10 % stdlib docs. Each list is shuffled once and then cycled, so a prompt
    repeats only after its whole list was used (the answers still differ: every
    request has its own sampling seed). The first ``n`` prompts do not depend
    on ``num`` (``training_prompts(n, s)`` is a prefix of ``training_prompts(m, s)``
    for ``m >= n``).
    """
    rng = random.Random(seed)
    grid = [(t, s) for t in _TEMPLATES for s in _SUBJECTS]
    requests = [(t, x) for t, xs in _REQUESTS for x in xs]
    funcs, docs = (list(x) for x in stdlib_snippets())
    for items in (grid, requests, funcs, docs):
        rng.shuffle(items)
    out: list[str] = []
    counters = {"grid": 0, "request": 0, "code": 0, "doc": 0}

    def take(kind: str, items: list):
        item = items[counters[kind] % len(items)]
        counters[kind] += 1
        return item

    for _ in range(num):
        u = rng.random()
        if u < 0.6 or not funcs or not docs:
            t, s = take("grid", grid)
            out.append(t.format(s=s, S=s[0].upper() + s[1:]))
        elif u < 0.7:
            t, x = take("request", requests)
            out.append(t.format(x=x))
        elif u < 0.9:
            out.append(rng.choice(_CODE_TEMPLATES).format(c=take("code", funcs)))
        else:
            out.append(rng.choice(_DOC_TEMPLATES).format(d=take("doc", docs)))
    return out
