"""Every prompt the trainers and their evaluations read, in one place.

The order of every list below is part of the trainers' caches: the data is generated per batch from these lists
in order (batch i answers prompts [i * B, (i + 1) * B)), so a list is only ever extended at its end, and a
prompt set that would change a cached batch gets a new name instead.

Training (the target answers these; the drafter learns from its answers):
- ``TOPICS`` x ``TEMPLATES``: chat requests, the EAGLE trainer's first ~1000 training prompts.
  ``EXTRA_TOPICS`` and then ``STYLES`` (other kinds of request over every topic) come after them, for larger
  data budgets (``eagle_training_prompts``).
- ``DRAFT_TOPICS`` x ``DRAFT_TEMPLATES``: the draft trainer's chat requests (``draft_chat_prompts``).
- ``EARLY_EXIT_TRAIN_CHATS``: the early-exit trainer's chat requests.
- Requests about real text that ships with Python (no download): stdlib docstrings (``eagle_docstring_prompts``,
  ``draft_docstring_prompts``, ``stdlib_paragraphs``) and the reference manual's topics (``topic_answers``).
  The draft trainer's leave out the benchmark's grounded passages (``bench_passages``).

Held out (never trained on: acceptance is measured on them):
- ``EAGLE_EVAL_PROMPTS``: the EAGLE trainer's evaluation; with ``BENCH_EAGLE_PROMPTS`` (the prompts of
  ``examples/bench_eagle.py``) they are ``held_out_prompts``, which self-written training requests must not
  restate (``too_close``).
- ``DRAFT_EVAL_PROMPTS``: the draft trainer's evaluation.
- ``EARLY_EXIT_EVAL_CHATS``: the early-exit trainer's evaluation.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys

import numpy as np

# ---- chat requests: topics x templates ---------------------------------------------------------------------

TOPICS = [
    "bread baking", "the solar system", "learning a new language", "saving money", "running a marathon",
    "growing tomatoes", "the French Revolution", "climate change", "writing a resume", "meditation",
    "electric cars", "the human heart", "chess openings", "photography", "volcanoes", "time management",
    "coffee", "the Roman Empire", "machine learning", "recycling", "dogs as pets", "public speaking",
    "the water cycle", "healthy sleep", "the internet", "friendship", "camping", "jazz music",
    "renewable energy", "the stock market", "ancient Egypt", "video games", "yoga", "bees", "the moon",
    "cooking pasta", "job interviews", "rainforests", "smartphones", "the immune system", "painting",
    "earthquakes", "kindness", "the Olympic Games", "budget travel", "vitamins", "cybersecurity",
]  # fmt: skip
# More topics for a larger EAGLE data budget (``--gen-batches`` past the first 14): their prompts come after every
# prompt of TOPICS, so a larger budget keeps the batches a smaller one generated (the data cache is per batch).
EXTRA_TOPICS = [
    "origami", "the printing press", "sharks", "hiking safety", "first aid", "the history of tea", "knitting",
    "black holes", "composting", "the Great Wall of China", "solar panels", "birdwatching", "board games",
    "the Renaissance", "gardening in small spaces", "learning to swim", "volunteering", "the ocean tides",
    "baking cookies", "fossils", "the human brain", "cats as pets", "starting a small business", "podcasts",
    "the Industrial Revolution", "rain gardens", "healthy breakfasts", "mountain climbing", "the piano",
    "recycling electronics", "tornadoes", "honey", "the Silk Road", "minimalism", "public libraries",
    "electric bikes", "the Amazon river", "map reading", "cloud computing", "dinosaurs", "staying hydrated",
    "the Vikings", "home insulation", "penguins", "robots", "wildfires", "learning to draw",
    "the metric system", "friendly debate", "the history of money", "glaciers", "wind turbines", "coral reefs",
    "team sports", "cooking rice", "the Moon landing", "insomnia", "3D printing", "the Eiffel Tower",
    "calligraphy", "whales", "saving water at home", "the periodic table", "street food", "trains",
    "negotiation", "sundials", "the northern lights", "mushrooms", "typing faster",
]  # fmt: skip
# The draft trainer's topics: TOPICS and thirteen more.
DRAFT_TOPICS = TOPICS + [
    "gardening in small spaces", "the history of writing", "bicycles", "ocean tides", "studying for exams",
    "starting a small business", "black holes", "tea", "mountains", "team work", "first aid", "birds",
    "the printing press",
]  # fmt: skip
TEMPLATES = [
    "Can you explain {t} to a beginner?",
    "What are the most important things to know about {t}?",
    "Give me some practical tips about {t}.",
    "Write a short story that involves {t}.",
    "What are common misconceptions about {t}?",
    "Write a short blog post about {t}.",
    "What are the pros and cons of {t}?",
    "How would you teach a child about {t}?",
]
# The draft trainer's templates: TEMPLATES and two more, in the order its cached data has them.
DRAFT_TEMPLATES = [
    *TEMPLATES[:5],
    "Why is {t} interesting? Answer in a few paragraphs.",
    *TEMPLATES[5:],
    "Summarize the history of {t}.",
]
# Other kinds of request over every topic, after all of the above (so the batches that a smaller budget
# generated stay the same): the held-out and benchmark prompts are open chat in many forms, and a head trained
# on eight request templates learns their answers' shapes more than the target's.
STYLES = [
    "What are some fun facts about {t}?",
    "Write a friendly email to a friend about {t}.",
    "Summarize what everyone should know about {t} in five bullet points.",
    "Why do people care about {t}?",
    "Write a short poem about {t}.",
    "Explain {t} using a simple analogy.",
    "What questions should I ask an expert on {t}?",
    "Give me a step-by-step plan to get started with {t}.",
    "Describe a typical day for someone who works with {t}.",
    "What is the history of {t} in a few sentences?",
    "Write a dialogue between two friends discussing {t}.",
    "What mistakes do beginners make with {t}, and how can they avoid them?",
    "Compare {t} today with how it was fifty years ago.",
    "Write a short speech to encourage students to learn about {t}.",
    "I am bored. Suggest three activities related to {t}.",
    "What would the world be like without {t}?",
    "Write a product description for a book about {t}.",
    "Explain {t} to a ten-year-old.",
    "What are five interesting questions about {t}, with short answers?",
    "Tell me a funny story about {t}.",
]
# The early-exit trainer's chat requests (its text is prompt + answer of each, half greedy, half sampled).
EARLY_EXIT_TRAIN_CHATS = [
    "What are three good habits for staying focused while studying?",
    "Explain how a rainbow forms, in simple terms.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give me a recipe for a quick vegetable soup.",
    "What is the difference between weather and climate?",
    "How do I politely decline an invitation to a party?",
    "Write a haiku about autumn leaves.",
    "Explain what a black hole is to a ten-year-old.",
    "What are some tips for a first job interview?",
    "Describe the water cycle step by step.",
    "Why do cats purr?",
    "Write a limerick about a forgetful robot.",
    "How can I save money on groceries?",
    "What is photosynthesis and why is it important?",
    "Suggest a plan for a relaxing weekend at home.",
    "Explain the rules of chess briefly.",
    "Write a friendly email inviting colleagues to a team lunch.",
    "What causes the seasons on Earth?",
    "How do vaccines work?",
    "Give me five ideas for a birthday gift for my mother.",
    "What is the history of the bicycle?",
    "Explain recursion with an everyday example.",
    "Write a motivational message for someone starting to learn the piano.",
    "What should I pack for a three-day hiking trip?",
    "How does a refrigerator keep food cold?",
    "Tell me about the life of honeybees.",
    "What is a good morning routine?",
    "Explain what inflation means for everyday people.",
    "Write a short poem about a city in the rain.",
    "How do I start a small vegetable garden on a balcony?",
    "What are the benefits of reading every day?",
    "Describe a typical day in the life of a medieval farmer.",
    "What is the difference between a virus and a bacterium?",
    "Write a thank-you note to a teacher.",
    "Why is the sky blue?",
    "How can I improve my sleep?",
]

# ---- held out: evaluation and benchmark prompts ------------------------------------------------------------

# Open chat prompts, like the benchmark's: the EAGLE trainer's evaluation.
EAGLE_EVAL_PROMPTS = [
    "What should I pack for a weekend trip to the mountains?",
    "How can I become a better listener?",
    "Explain the difference between weather and climate.",
    "Write a friendly email inviting my neighbours to a picnic.",
    "Give me ideas for a vegetarian dinner.",
    "Why do leaves change colour in autumn?",
]
# The draft trainer's evaluation: EAGLE_EVAL_PROMPTS and two more, in the order its reports record.
DRAFT_EVAL_PROMPTS = [
    *EAGLE_EVAL_PROMPTS[:4],
    "What are some good habits for staying healthy while working at a desk?",
    "Describe how a rainbow forms.",
    *EAGLE_EVAL_PROMPTS[4:],
]
# The early-exit trainer's evaluation.
EARLY_EXIT_EVAL_CHATS = [
    "Write a short poem about the sea at night.",
    "What are the main causes of traffic jams in big cities?",
    "Explain how a compass works.",
    "Give me some advice for learning a new language as an adult.",
]
# examples/bench_eagle.py's prompts (``--prompts N`` takes the first N); held out from EAGLE training too.
BENCH_EAGLE_PROMPTS = [
    "What are some fun things to do on a rainy afternoon?",
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about a city waking up in the morning.",
    "What advice would you give to someone starting their first job?",
    "Why is the sky blue? Explain it simply.",
    "Tell me a short story about a fox who wants to fly.",
]


def held_out_prompts() -> list[str]:
    """Every prompt an EAGLE evaluation reads: EAGLE_EVAL_PROMPTS and the benchmark's (BENCH_EAGLE_PROMPTS)."""
    return list(EAGLE_EVAL_PROMPTS) + list(BENCH_EAGLE_PROMPTS)


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9']+", text.lower()))


def too_close(text: str, held_out: list[str], threshold: float = 0.5) -> bool:
    """Word-set Jaccard similarity >= ``threshold`` with any held-out prompt: such a request is dropped, so
    self-written training prompts cannot restate an evaluation or benchmark prompt."""
    w = _words(text)
    return any(len(w & h) / max(len(w | h), 1) >= threshold for h in map(_words, held_out))


def request_key(text: str) -> str:
    """A self-written request's words, sorted: two requests with the same key are one (a repeat)."""
    return " ".join(sorted(_words(text)))


# ---- text shipped with Python: docstrings and the reference manual -----------------------------------------

# The EAGLE trainer's docstring modules; the draft trainer's are these and more.
DOC_MODULES = (
    "json os collections itertools functools textwrap string random math statistics datetime pathlib re".split()
)
DRAFT_DOC_MODULES = (
    DOC_MODULES
    + (
        "shutil heapq bisect dataclasses argparse logging csv calendar difflib fractions decimal queue threading "
        "subprocess contextlib enum typing tempfile glob fnmatch zipfile tarfile gzip base64 hashlib secrets uuid "
        "pprint copy operator inspect ast traceback warnings weakref socket sched urllib.parse html.parser "
        "sqlite3 configparser locale unittest timeit asyncio io codecs struct zlib pickle mimetypes ipaddress shlex"
    ).split()
)
EARLY_EXIT_DOC_MODULES = (
    "json collections itertools functools pathlib re os subprocess threading asyncio logging argparse datetime "
    "random statistics textwrap string heapq bisect csv sqlite3 unittest typing dataclasses enum contextlib "
    "shutil tempfile zipfile decimal fractions math copy pickle hashlib base64 inspect difflib calendar queue"
).split()
DRAFT_DOC_TEMPLATES = [
    "Explain in simple words what this Python {kind} does:\n\n{name}: {doc}",
    "Here is the documentation of the Python {kind} `{name}`. Give an example of when to use it.\n\n{doc}",
]
EARLY_EXIT_DOC_TASKS = (
    "Summarize the following documentation in two or three sentences:",
    "Explain the following text to a beginner programmer:",
    "Rewrite the following text as a short list of bullet points:",
)
# Docstrings sharing a run of this many words with a benchmark passage are not trained on (``bench_passages``).
OVERLAP_WORDS = 8


def eagle_docstring_prompts(max_chars: int = 600) -> list[str]:
    """Requests about stdlib docstrings (DOC_MODULES' functions and classes): real English text shipped with
    Python, no download."""
    out = []
    for mod_name in DOC_MODULES:
        mod = importlib.import_module(mod_name)
        for name, obj in inspect.getmembers(mod):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and 150 <= len(doc) <= max_chars:
                out.append(f"Explain in simple words what the Python function {mod_name}.{name} does:\n\n{doc}")
    return out


def doc_answers(max_chars: int = 3000) -> list[tuple[str, str]]:
    """(request, docstring) pairs from the standard library: real English prose, shipped with Python (the EAGLE
    trainer's off-policy text, laid out as the assistant's answers)."""
    out, seen = [], set()
    for mod_name in sorted(sys.stdlib_module_names):
        if mod_name.startswith("_") or mod_name in ("antigravity", "this", "idlelib", "tkinter", "turtle"):
            continue
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # a stdlib module this build lacks or cannot import here
            continue
        for name, obj in [(mod_name, mod)] + inspect.getmembers(mod):
            if name.startswith("_") or not (inspect.ismodule(obj) or inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and 200 <= len(doc) <= max_chars and doc not in seen:
                seen.add(doc)
                full = name if inspect.ismodule(obj) else f"{mod_name}.{name}"
                out.append((f"What does the Python {full} do?", doc))
    return out


def topic_answers(max_chars: int = 1200) -> list[tuple[str, str]]:
    """(request, passage) pairs from the Python reference manual's topics that ship with Python
    (``pydoc_data.topics``, what ``help('assert')`` prints), split at blank lines into passages of at most
    ``max_chars`` (a longer paragraph is a passage of its own)."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        passage = ""
        for para in topics[name].split("\n\n"):
            if passage and len(passage) + len(para) > max_chars:
                out.append((f"Explain this part of the Python reference manual on '{name}'.", passage.strip()))
                passage = ""
            passage += para + "\n\n"
        if len(passage.strip()) >= 200:
            out.append((f"Explain this part of the Python reference manual on '{name}'.", passage.strip()))
    return out


def bench_passages() -> dict[str, tuple[object, str]]:
    """The standard-library objects whose docstrings are the benchmark's grounded passages (``jspec.bench.
    workloads``' passage sources, "module:name" -> (object, whole docstring)). The grounded workload asks the target
    to copy, edit, summarise and rewrite them: a draft trained on answers about the same text would be measured on
    its training data."""
    from jspec.bench import workloads

    out = {}
    for source in workloads._PASSAGE_SOURCES:
        mod_name, qual = source.split(":")
        obj: object = importlib.import_module(mod_name)
        for part in qual.split("."):
            obj = getattr(obj, part)
        out[source] = (obj, inspect.getdoc(obj) or "")
    return out


def _word_runs(text: str, n: int = OVERLAP_WORDS) -> set[tuple[str, ...]]:
    words = text.split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def draft_docstring_prompts(max_chars: int = 700) -> list[str]:
    """Requests about stdlib docstrings (DRAFT_DOC_MODULES'), in DRAFT_DOC_TEMPLATES' two forms. The benchmark's
    grounded passages are left out (``bench_passages``): the object itself under any name (``statistics.Fraction``
    is ``fractions.Fraction``) and any docstring sharing ``OVERLAP_WORDS`` consecutive words with one
    (``textwrap.fill``'s with ``textwrap.wrap``'s, ``statistics.median_low``'s with ``statistics.median``'s)."""
    bench = bench_passages()
    bench_objs = [obj for obj, _ in bench.values()]
    bench_runs = set().union(*(_word_runs(doc) for _, doc in bench.values()))
    out = []
    for mod_name in DRAFT_DOC_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # an optional stdlib module missing on this build
            continue
        for name, obj in inspect.getmembers(mod):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and 150 <= len(doc) <= max_chars:
                if any(obj is b for b in bench_objs) or _word_runs(doc) & bench_runs:  # a benchmark passage
                    continue
                kind = "class" if inspect.isclass(obj) else "function"
                tpl = DRAFT_DOC_TEMPLATES[len(out) % len(DRAFT_DOC_TEMPLATES)]
                out.append(tpl.format(kind=kind, name=f"{mod_name}.{name}", doc=doc))
    return out


def stdlib_paragraphs() -> list[str]:
    """Docstring paragraphs of 200-500 characters from EARLY_EXIT_DOC_MODULES and their public members."""
    out = []
    for name in EARLY_EXIT_DOC_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
        for obj in objs:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            for para in (doc or "").split("\n\n"):
                para = " ".join(para.split())
                if 200 <= len(para) <= 500 and para not in out:
                    out.append(para)
    return out


# ---- each trainer's training prompts, in the order its data is generated ----------------------------------


def eagle_training_prompts(seed: int, doc_every: int = 4) -> list[str]:
    """The EAGLE trainer's: the TOPICS x TEMPLATES requests with a docstring request every ``doc_every``-th entry,
    then EXTRA_TOPICS x TEMPLATES, then every topic x STYLES, each part shuffled deterministically."""
    rng = np.random.default_rng(seed)
    chat = [tpl.format(t=t) for t in TOPICS for tpl in TEMPLATES]
    docs = eagle_docstring_prompts()
    rng.shuffle(chat)
    rng.shuffle(docs)
    out, d = [], 0
    for i, c in enumerate(chat):
        if i % doc_every == doc_every - 1 and d < len(docs):
            out.append(docs[d])
            d += 1
        out.append(c)
    extra = [tpl.format(t=t) for t in EXTRA_TOPICS for tpl in TEMPLATES]
    rng.shuffle(extra)
    styled = [tpl.format(t=t) for t in TOPICS + EXTRA_TOPICS for tpl in STYLES]
    rng.shuffle(styled)
    return out + extra + styled


def draft_chat_prompts() -> list[str]:
    return [tpl.format(t=t) for t in DRAFT_TOPICS for tpl in DRAFT_TEMPLATES]


def draft_training_prompts(seed: int, doc_fraction: float) -> list[str]:
    """The draft trainer's: its chat prompts and ``doc_fraction`` of docstring requests, interleaved. A fraction
    outside [0, 1), or one that needs more docstring requests than this Python's standard library gives, is refused
    (SystemExit): the mix would silently be another one."""
    if not 0 <= doc_fraction < 1:
        raise SystemExit(f"--doc-fraction {doc_fraction:g}: expected a share in [0, 1)")
    rng = np.random.default_rng(seed)
    chat = draft_chat_prompts()
    docs = draft_docstring_prompts()
    rng.shuffle(chat)
    rng.shuffle(docs)
    # Interleave so any prefix of the list (the number of batches is a budget) keeps the mix.
    n_doc = int(round(len(chat) * doc_fraction / (1 - doc_fraction)))
    if n_doc > len(docs):
        most = int(1000 * len(docs) / (len(chat) + len(docs))) / 1000  # rounded down: it fits
        raise SystemExit(
            f"--doc-fraction {doc_fraction:g} asks for {n_doc} docstring requests next to the {len(chat)} chat "
            f"prompts, and this Python's standard library gives {len(docs)}: use {most:.3f} at most"
        )
    docs = docs[:n_doc]
    out, i, j = [], 0, 0
    while i < len(chat) or j < len(docs):
        if j < len(docs) and (i >= len(chat) or j / max(len(docs), 1) < i / max(len(chat), 1)):
            out.append(docs[j])
            j += 1
        else:
            out.append(chat[i])
            i += 1
    return out


def early_exit_prompt_texts(n_doc: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """The early-exit trainer's: (the training prompts' texts, in the order of the generated sequences: its chats,
    then ``n_doc`` stdlib paragraphs picked at random, each under one of EARLY_EXIT_DOC_TASKS; every stdlib
    paragraph)."""
    rng = np.random.default_rng(seed)
    paras = stdlib_paragraphs()
    picked = [paras[i] for i in rng.choice(len(paras), size=min(n_doc, len(paras)), replace=False)]
    tasks = EARLY_EXIT_DOC_TASKS
    texts = list(EARLY_EXIT_TRAIN_CHATS) + [f"{tasks[i % len(tasks)]}\n\n{p}" for i, p in enumerate(picked)]
    return texts, paras
