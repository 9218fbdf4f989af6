"""Benchmark prompt sets, written for this project, with fixed seeds and checkable answers.

Four workloads, each a deterministic function of (n, seed):
- ``math``: GSM8K-style word problems; every problem's integer answer is computed when it is generated, and
  the check reads the LAST number of the reply.
- ``code``: MBPP-style "write a function" tasks with input/output tests; the check parses the reply
  (``ast.parse``) and runs the tests on the function in a sandboxed subprocess (see ``check_code``).
- ``chat``: ShareGPT-style open chat (some multi-turn); no right answer, only completion (EOS before the
  token budget) and non-empty output are recorded.
- ``grounded``: rewrite / summarise / edit a passage of real text that ships with Python (standard-library
  docstrings, read with ``inspect.getdoc`` at run time, so the Python version is part of the workload's
  identity and its passages are hashed into the result). Edit tasks have an exact expected text.

A workload is a list of ``Request`` (chat messages + what the check needs); tokenising them with the
target's chat template gives the prompt ids, and ``length_summary`` records the input-length distribution.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

WORKLOADS = ("math", "code", "chat", "grounded")  # the default suite's
# Code editing: the answer copies most of its prompt (the workload where prompt lookup pays). ``make run``'s.
EDIT_WORKLOAD = "edit"


@dataclasses.dataclass(frozen=True)
class Request:
    """One benchmark request. ``messages`` is the chat (OpenAI-style role/content dicts, ending with a user
    turn); ``check`` holds what ``score`` needs (answer, tests, expected text); ``kind`` names the check."""

    id: str
    workload: str
    messages: tuple[dict[str, str], ...]
    kind: str
    check: dict[str, Any] = dataclasses.field(default_factory=dict)

    def prompt_text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


# --------------------------------------------------------------------------------------------------------
# math (GSM8K-style)

_NAMES = ("Ava", "Ben", "Chloe", "Diego", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonah", "Kira", "Liam")
_ITEMS = ("apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells")


def _math_templates() -> list[Callable[[np.random.Generator], tuple[str, int]]]:
    """Each template draws its numbers and returns (problem text, integer answer)."""

    def shopping(r):
        n, item = r.choice(_NAMES), r.choice(_ITEMS)
        a, b, c = int(r.integers(12, 60)), int(r.integers(5, 30)), int(r.integers(3, 12))
        return (f"{n} has {a} {item}. {n} buys {b} more and then gives {c} to a friend. "
                f"How many {item} does {n} have now?", a + b - c)  # fmt: skip

    def price(r):
        n = r.choice(_NAMES)
        k, p, paid = int(r.integers(3, 9)), int(r.integers(2, 9)), 100
        return (f"{n} buys {k} notebooks that cost ${p} each and pays with a $100 bill. "
                f"How many dollars of change does {n} get?", paid - k * p)  # fmt: skip

    def rate(r):
        n = r.choice(_NAMES)
        per_hour, hours, days = int(r.integers(8, 25)), int(r.integers(2, 7)), int(r.integers(3, 8))
        return (f"{n} earns ${per_hour} per hour and works {hours} hours a day for {days} days. "
                f"How many dollars does {n} earn in total?", per_hour * hours * days)  # fmt: skip

    def share(r):
        n, item = r.choice(_NAMES), r.choice(_ITEMS)
        friends = int(r.integers(2, 7))
        each = int(r.integers(3, 12))
        left = int(r.integers(0, friends))
        total = friends * each + left
        return (f"{n} has {total} {item} and shares them equally among {friends} friends, giving each friend "
                f"as many as possible. How many {item} does each friend get?", each)  # fmt: skip

    def ages(r):
        a, b = r.choice(_NAMES, 2, replace=False)
        age, diff, years = int(r.integers(6, 30)), int(r.integers(2, 12)), int(r.integers(2, 15))
        return (f"{a} is {age} years old. {b} is {diff} years older than {a}. "
                f"How old will {b} be in {years} years?", age + diff + years)  # fmt: skip

    def garden(r):
        rows, per_row, eaten = int(r.integers(3, 12)), int(r.integers(4, 15)), int(r.integers(2, 10))
        return (f"A garden has {rows} rows of tomato plants with {per_row} plants in each row. "
                f"Rabbits eat {eaten} plants. How many plants are left?", rows * per_row - eaten)  # fmt: skip

    def speed(r):
        n = r.choice(_NAMES)
        kmh, h1, h2 = int(r.integers(30, 90)), int(r.integers(1, 4)), int(r.integers(1, 4))
        return (f"{n} drives at {kmh} km per hour for {h1} hours, stops for lunch, then drives {h2} more hours "
                f"at the same speed. How many kilometres does {n} drive?", kmh * (h1 + h2))  # fmt: skip

    def percent(r):
        n = r.choice(_NAMES)
        price = int(r.integers(2, 20)) * 10
        off = int(r.choice([10, 20, 25, 50]))
        if off == 25 and price % 20:  # 75% of an odd multiple of 10 is not whole ($150 -> $112.50): one lower
            price -= 10  # (same draws, so every other request of the seed is unchanged)
        pay = price * (100 - off)
        assert pay % 100 == 0, (price, off)
        return (f"A jacket costs ${price}. {n} gets a {off}% discount. How many dollars does {n} pay?",
                pay // 100)  # fmt: skip

    def pages(r):
        n = r.choice(_NAMES)
        total, per_day, days = int(r.integers(150, 400)), int(r.integers(10, 30)), int(r.integers(2, 6))
        return (f"A book has {total} pages. {n} reads {per_day} pages a day for {days} days. "
                f"How many pages are left to read?", total - per_day * days)  # fmt: skip

    def bakery(r):
        trays, per_tray, sold, boxes = (int(r.integers(3, 8)), int(r.integers(6, 13)), int(r.integers(5, 15)), 4)
        baked = trays * per_tray
        return (f"A bakery bakes {trays} trays of {per_tray} muffins. It sells {sold} muffins and packs the rest "
                f"into boxes of {boxes}, keeping any leftovers. How many full boxes does it pack?",
                (baked - sold) // boxes)  # fmt: skip

    return [shopping, price, rate, share, ages, garden, speed, percent, pages, bakery]


_MATH_SYSTEM = "Solve the problem step by step, then give the final answer as a number on the last line."


def math_requests(n: int, seed: int = 0) -> list[Request]:
    rng = np.random.default_rng([seed, 1])
    templates = _math_templates()
    out = []
    for i in range(n):
        text, answer = templates[i % len(templates)](rng)
        msgs = ({"role": "system", "content": _MATH_SYSTEM}, {"role": "user", "content": text})
        out.append(Request(f"math-{seed}-{i}", "math", msgs, "math", {"answer": int(answer)}))
    return out


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def extract_last_number(text: str) -> float | None:
    """The last number in a reply ("1,200" -> 1200.0), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return float(found[-1].replace(",", ""))
    except ValueError:
        return None


# --------------------------------------------------------------------------------------------------------
# code (MBPP-style)

# (function name, signature, description, tests as (args, expected)); every expected value was computed
# from a reference written next to the task, so the tests are right by construction.
_CODE_TASKS: tuple[tuple[str, str, str, tuple[tuple[tuple, Any], ...]], ...] = (
    ("is_palindrome", "is_palindrome(s)", "returns True if the string s reads the same forwards and backwards",
     ((("racecar",), True), (("hello",), False), (("",), True), (("abba",), True))),
    ("sum_of_squares", "sum_of_squares(n)", "returns the sum of the squares of the integers from 1 to n",
     (((1,), 1), ((3,), 14), ((10,), 385), ((0,), 0))),
    ("count_vowels", "count_vowels(s)", "returns how many vowels (a, e, i, o, u, either case) the string s has",
     ((("hello",), 2), (("AEIOU",), 5), (("xyz",), 0), (("Programming",), 3))),
    ("reverse_words", "reverse_words(s)", "returns the words of the sentence s in reverse order, joined by spaces",
     ((("hello world",), "world hello"), (("a b c",), "c b a"), (("one",), "one"))),
    ("factorial", "factorial(n)", "returns n factorial (factorial(0) is 1)",
     (((0,), 1), ((1,), 1), ((5,), 120), ((7,), 5040))),
    ("fib", "fib(n)", "returns the n-th Fibonacci number, with fib(0) = 0 and fib(1) = 1",
     (((0,), 0), ((1,), 1), ((2,), 1), ((10,), 55))),
    ("remove_duplicates", "remove_duplicates(xs)",
     "returns the list xs without repeated elements, keeping the first occurrence of each, in order",
     ((([1, 2, 1, 3, 2],), [1, 2, 3]), (([],), []), ((["a", "a"],), ["a"]))),
    ("second_largest", "second_largest(xs)", "returns the second largest distinct number in the list xs",
     ((([1, 5, 3],), 3), (([10, 10, 9],), 9), (([-1, -2, -3],), -2))),
    ("is_prime", "is_prime(n)", "returns True if the integer n is a prime number",
     (((2,), True), ((1,), False), ((17,), True), ((21,), False))),
    ("celsius_to_fahrenheit", "celsius_to_fahrenheit(c)", "converts a temperature from Celsius to Fahrenheit",
     (((0,), 32), ((100,), 212), ((-40,), -40))),
    ("flatten", "flatten(xss)", "flattens a list of lists into one list, in order",
     ((([[1, 2], [3], []],), [1, 2, 3]), (([],), []), (([["a"], ["b", "c"]],), ["a", "b", "c"]))),
    ("gcd", "gcd(a, b)", "returns the greatest common divisor of two positive integers",
     (((12, 18), 6), ((7, 5), 1), ((100, 75), 25))),
    ("capitalize_words", "capitalize_words(s)", "returns s with the first letter of every word in upper case",
     ((("hello world",), "Hello World"), (("a",), "A"))),
    ("max_of_three", "max_of_three(a, b, c)", "returns the largest of three numbers",
     (((1, 2, 3), 3), ((5, -1, 2), 5), ((0, 0, 0), 0))),
    ("count_char", "count_char(s, c)", "returns how many times the character c occurs in the string s",
     ((("banana", "a"), 3), (("", "x"), 0), (("mississippi", "s"), 4))),
    ("running_sum", "running_sum(xs)", "returns the list of running totals of the numbers in xs",
     ((([1, 2, 3],), [1, 3, 6]), (([],), []), (([5, -5],), [5, 0]))),
)  # fmt: skip


def code_requests(n: int, seed: int = 0) -> list[Request]:
    order = np.random.default_rng([seed, 2]).permutation(len(_CODE_TASKS))
    out = []
    for i in range(n):
        name, sig, desc, tests = _CODE_TASKS[int(order[i % len(order)])]
        text = f"Write a Python function `{sig}` that {desc}. Reply with the code only, in one ```python block."
        msgs = ({"role": "user", "content": text},)
        check = {"function": name, "tests": [[list(a), e] for a, e in tests]}
        out.append(Request(f"code-{seed}-{i}", "code", msgs, "code", check))
    return out


def extract_code(text: str) -> str:
    """The first fenced code block of a reply (```python or ```), else the whole reply."""
    m = re.search(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", text, re.S)
    return m.group(1) if m else text


# Only the harmless standard modules a small pure function may want; everything else is refused before the
# code runs. Names that reach the interpreter's internals are refused as well.
_ALLOWED_IMPORTS = frozenset({"math", "string", "itertools", "functools", "collections", "re", "operator"})
_FORBIDDEN_NAMES = frozenset(
    {"open", "exec", "eval", "compile", "__import__", "globals", "locals", "vars", "getattr", "setattr",
     "delattr", "input", "breakpoint", "help", "memoryview", "exit", "quit", "os", "sys", "subprocess"}
)  # fmt: skip


def _dunder(name: str) -> bool:
    # ``if __name__ == "__main__":`` is how small models end a script; the sandbox names the module
    # "candidate", so such a block does not run.
    return name.startswith("__") and name != "__name__"


def static_code_problems(tree: ast.AST) -> list[str]:
    """Why the parsed code may not run in the property check (empty list: it may)."""
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            bad += [f"import {m}" for m in mods if m.split(".")[0] not in _ALLOWED_IMPORTS]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("__"):
            bad.append(f"attribute {node.attr}")
        elif isinstance(node, ast.Name) and (node.id in _FORBIDDEN_NAMES or _dunder(node.id)):
            bad.append(f"name {node.id}")
    return bad


# Runs in a fresh, isolated interpreter (-I: no site, no user paths, no PYTHON* env) with CPU-time, memory and
# file-size limits, from an empty temporary directory, with a short builtins whitelist; the parent also
# enforces a wall-clock timeout. Input and output go through stdin/stdout as JSON.
_SANDBOX = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_CPU, (2, 2))
resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
job = json.loads(sys.stdin.read())
import builtins, importlib
ALLOWED = set(job["allowed_imports"])
def guarded_import(name, *a, **k):
    if name.split(".")[0] not in ALLOWED:
        raise ImportError(name)
    return importlib.import_module(name)
SAFE = ["abs", "all", "any", "bool", "chr", "dict", "divmod", "enumerate", "filter", "float", "frozenset", "int",
        "isinstance", "len", "list", "map", "max", "min", "ord", "pow", "range", "reversed", "round", "set",
        "sorted", "str", "sum", "tuple", "zip", "ValueError", "TypeError", "IndexError", "KeyError",
        "Exception", "ZeroDivisionError", "StopIteration", "True", "False", "None", "iter", "next",
        "hash", "slice", "type", "object", "__build_class__"]
env = {"__builtins__": {k: getattr(builtins, k) for k in SAFE if hasattr(builtins, k)}}
env["__builtins__"]["__import__"] = guarded_import
def to_stderr(*args, **kw):  # a reply's own prints: stdout carries only the result line
    kw.pop("file", None)
    kw.pop("flush", None)
    builtins.print(*args, file=sys.stderr, **kw)
env["__builtins__"]["print"] = to_stderr
env["__name__"] = "candidate"
results = []
try:
    exec(compile(job["code"], "<candidate>", "exec"), env)
    fn = env[job["function"]]
    for args, expected in job["tests"]:
        try:
            got = fn(*args)
            results.append(got == expected or (isinstance(expected, (int, float)) and isinstance(got, (int, float))
                                              and abs(got - expected) < 1e-6))
        except Exception:
            results.append(False)
    print(json.dumps({"ok": True, "passed": results}))
except Exception as e:
    print(json.dumps({"ok": False, "error": type(e).__name__ + ": " + str(e)[:200]}))
"""


def run_code_tests(code: str, function: str, tests: Sequence, timeout_s: float = 5.0) -> dict[str, Any]:
    """Run ``tests`` ([(args, expected)]) on ``function`` defined by ``code`` in the sandbox subprocess.
    Returns {"passed": k, "total": n, "error": str | None}."""
    job = json.dumps({"code": code, "function": function, "tests": [list(t) for t in tests],
                      "allowed_imports": sorted(_ALLOWED_IMPORTS)})  # fmt: skip
    total = len(tests)
    with tempfile.TemporaryDirectory() as cwd:
        try:
            proc = subprocess.run(
                [sys.executable, "-I", "-c", _SANDBOX],
                input=job,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                cwd=cwd,
                env={"PATH": os.environ.get("PATH", "")},
            )
        except subprocess.TimeoutExpired:
            return {"passed": 0, "total": total, "error": f"timeout after {timeout_s} s"}
    try:
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"passed": 0, "total": total, "error": f"sandbox exited {proc.returncode}: {proc.stderr[-200:]}"}
    if not res.get("ok"):
        return {"passed": 0, "total": total, "error": res.get("error")}
    return {"passed": int(sum(res["passed"])), "total": total, "error": None}


def check_code(text: str, function: str, tests: Sequence, timeout_s: float = 5.0) -> dict[str, Any]:
    """Format validity (``ast.parse`` of the extracted code) and the property check (all tests pass)."""
    code = extract_code(text)
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return {"parses": False, "defines_function": False, "passed": 0, "total": len(tests), "correct": False,
                "error": "syntax"}  # fmt: skip
    defines = any(isinstance(n, ast.FunctionDef) and n.name == function for n in ast.walk(tree))
    problems = static_code_problems(tree)
    if not defines or problems:
        err = "no function " + function if not defines else "refused: " + ", ".join(sorted(set(problems)))
        return {"parses": True, "defines_function": defines, "passed": 0, "total": len(tests), "correct": False,
                "error": err}  # fmt: skip
    res = run_code_tests(code, function, tests, timeout_s)
    return {"parses": True, "defines_function": True, **res, "correct": res["passed"] == res["total"]}


# --------------------------------------------------------------------------------------------------------
# chat (ShareGPT-style)

_CHAT: tuple[tuple[str, ...], ...] = (
    ("What are three tips for staying focused while studying?",),
    ("Explain what a black hole is to a ten-year-old.",),
    ("Write a short poem about the sea in the morning.",),
    ("I have eggs, spinach and cheese. What can I cook for dinner?",),
    ("What is the difference between weather and climate?",),
    ("Give me a packing list for a weekend hiking trip.",),
    ("How do I politely decline an invitation to a party?",),
    ("Tell me a short story about a robot who learns to paint.",),
    ("What are the pros and cons of working from home?",),
    ("Suggest five names for a friendly neighbourhood bakery.",),
    ("Why is the sky blue?",),
    ("How can I start learning to play the guitar?",),
    ("Write a thank-you note to a teacher.",),
    ("What should I consider when adopting a dog?",),
    ("Describe a perfect Sunday afternoon.",),
    ("How does a bicycle stay upright when it moves?",),
    ("I'm planning a trip to Japan.", "That sounds exciting! When are you going and what do you enjoy?",
     "In spring. I like food and old temples. What should I see?"),
    ("Can you help me write an email?", "Of course. Who is it for and what is it about?",
     "It's to my landlord, asking to fix a leaking kitchen tap."),
    ("What's a good way to save money each month?", "Start by tracking what you spend for a month.",
     "I did that. Most of it goes on eating out. Any ideas?"),
    ("Let's play a word game: give me a word that starts with S.", "Sunflower!",
     "Now a word that starts with the last letter of yours."),
)  # fmt: skip


def chat_requests(n: int, seed: int = 0) -> list[Request]:
    order = np.random.default_rng([seed, 3]).permutation(len(_CHAT))
    out = []
    for i in range(n):
        turns = _CHAT[int(order[i % len(order)])]
        roles = ["user" if j % 2 == 0 else "assistant" for j in range(len(turns))]
        msgs = tuple({"role": r, "content": t} for r, t in zip(roles, turns))
        out.append(Request(f"chat-{seed}-{i}", "chat", msgs, "chat"))
    return out


# --------------------------------------------------------------------------------------------------------
# grounded (rewrite / summarise / edit real text that ships with Python)

# "module:qualified name" of standard-library objects whose docstrings are the passages.
_PASSAGE_SOURCES = (
    "textwrap:dedent", "textwrap:wrap", "json:dumps", "collections:namedtuple", "functools:lru_cache",
    "heapq:merge", "bisect:bisect_left", "dataclasses:dataclass", "statistics:median", "fractions:Fraction",
    "functools:reduce", "collections:Counter", "shutil:copytree", "difflib:SequenceMatcher",
)  # fmt: skip

# (word in the passage, replacement) pairs for the edit tasks: the expected output is exact.
_EDITS = (("the", "THE"), ("is", "IS"), ("a", "one"), ("and", "&"), ("of", "OF"))


def _load_passage(source: str, max_chars: int) -> str:
    import importlib

    mod_name, qual = source.split(":")
    obj: Any = importlib.import_module(mod_name)
    for part in qual.split("."):
        obj = getattr(obj, part)
    doc = inspect.getdoc(obj) or ""
    # Whole paragraphs up to max_chars (at least the first), so a passage never ends mid-sentence.
    paras, out = doc.split("\n\n"), []
    for p in paras:
        if out and len("\n\n".join([*out, p])) > max_chars:
            break
        out.append(p)
    text = "\n\n".join(out)
    if len(text) > max_chars * 2:  # one very long first paragraph: cut after its last sentence that fits
        cut = text.rfind(". ", 0, max_chars * 2)
        if cut < 0:
            raise ValueError(f"{source}: the first paragraph has no sentence end within {max_chars * 2} characters")
        text = text[: cut + 1]
    return text


def grounded_requests(n: int, seed: int = 0, max_chars: int = 600) -> list[Request]:
    rng = np.random.default_rng([seed, 4])
    order = rng.permutation(len(_PASSAGE_SOURCES))
    tasks = ("edit", "summarise", "copy", "rewrite")  # verbatim and free-form tasks alternate
    out = []
    for i in range(n):
        src = _PASSAGE_SOURCES[int(order[i % len(order)])]
        passage = _load_passage(src, max_chars)
        task = tasks[i % len(tasks)]
        check: dict[str, Any] = {"source": src, "task": task, "passage_sha256": _sha(passage)}
        if task == "rewrite":
            text = f"Rewrite the following documentation in plain English, keeping every fact:\n\n{passage}"
        elif task == "summarise":
            text = f"Summarise the following text in two or three sentences:\n\n{passage}"
        elif task == "edit":
            old, new = _EDITS[int(rng.integers(len(_EDITS)))]
            text = (f"Copy the text below exactly, but replace every whole word '{old}' with '{new}'. "
                    f"Output only the edited text.\n\n{passage}")  # fmt: skip
            check["expected"] = re.sub(rf"\b{re.escape(old)}\b", new, passage)
        else:
            text = f"Repeat the following text exactly, without any comment:\n\n{passage}"
            check["expected"] = passage
        out.append(Request(f"grounded-{seed}-{i}", "grounded", ({"role": "user", "content": text},), "grounded", check))
    return out


# --------------------------------------------------------------------------------------------------------
# edit (annotate a function that ships with Python: the answer repeats the prompt's code)

# "module:qualified name" of pure-Python standard-library functions of 35-80 lines.
_EDIT_SOURCES = (
    "textwrap:dedent", "difflib:get_close_matches", "heapq:nsmallest", "statistics:variance",
    "difflib:unified_diff", "ipaddress:collapse_addresses", "difflib:ndiff", "urllib.parse:urljoin",
)  # fmt: skip

EDIT_INSTRUCTION = "Add type hints to this Python function. Reply with the whole annotated function in one code block."


def function_source(source: str) -> str:
    """The source code of the standard-library function "module:qualified name"."""
    import importlib

    mod_name, sep, qual = source.partition(":")
    if not sep or not mod_name or not qual:
        raise ValueError(f"{source!r}: name a function as module:qualified_name, e.g. textwrap:dedent")
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return inspect.getsource(obj)
    except (ImportError, AttributeError, TypeError, OSError) as e:  # no such module or name, or no Python source
        raise ValueError(f"{source!r}: no Python source to read ({type(e).__name__}: {e})") from None


def edit_prompt(source: str) -> str:
    """The user turn asking to annotate the function ``source`` ("module:qualified name")."""
    return f"{EDIT_INSTRUCTION}\n\n```python\n{function_source(source)}```"


def edit_requests(n: int, seed: int = 0) -> list[Request]:
    order = np.random.default_rng([seed, 5]).permutation(len(_EDIT_SOURCES))
    out = []
    for i in range(n):
        src = _EDIT_SOURCES[int(order[i % len(order)])]
        text = edit_prompt(src)
        check = {"source": src, "function": src.split(":")[1].split(".")[-1], "code_sha256": _sha(function_source(src))}
        out.append(Request(f"edit-{seed}-{i}", EDIT_WORKLOAD, ({"role": "user", "content": text},), "edit", check))
    return out


def _sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------
# All together, checks, lengths


_BUILDERS: dict[str, Callable[[int, int], list[Request]]] = {
    "math": math_requests,
    "code": code_requests,
    "chat": chat_requests,
    "grounded": grounded_requests,
    EDIT_WORKLOAD: edit_requests,
}


def build(workloads: Sequence[str], n_per_workload: int, seed: int = 0, interleave: bool = True) -> list[Request]:
    """Requests of the named workloads, ``n_per_workload`` each. Interleaved (math, code, chat, grounded,
    math, ...) by default, so a run cut short or a batch of rows still mixes the workloads."""
    if not isinstance(n_per_workload, int) or n_per_workload < 1:
        raise ValueError(f"n_per_workload (requests per workload) must be an integer >= 1, got {n_per_workload!r}")
    unknown = [w for w in workloads if w not in _BUILDERS]
    if unknown:
        raise ValueError(f"unknown workload(s) {unknown}; choose from {', '.join(_BUILDERS)}")
    per = [_BUILDERS[w](n_per_workload, seed) for w in workloads]
    if not interleave:
        return [r for group in per for r in group]
    return [group[i] for i in range(n_per_workload) for group in per]


def score(req: Request, text: str, *, code_timeout_s: float = 5.0) -> dict[str, Any]:
    """Task quality of one reply (decoded text, special tokens removed)."""
    if req.kind == "math":
        got = extract_last_number(text)
        return {"answer": req.check["answer"], "extracted": got, "correct": got == req.check["answer"]}
    if req.kind == "code":
        return check_code(text, req.check["function"], req.check["tests"], code_timeout_s)
    if req.kind == "grounded":
        out: dict[str, Any] = {"task": req.check["task"]}
        if "expected" in req.check:
            exp = req.check["expected"]
            out["similarity"] = difflib.SequenceMatcher(None, text.strip(), exp.strip(), autojunk=False).ratio()
            out["correct"] = text.strip() == exp.strip()
        # Grounding: share of the reply's words found in the passage (copying scores 1, invention lowers it).
        words = re.findall(r"\w+", text.lower())
        src = set(re.findall(r"\w+", req.prompt_text().lower()))
        out["grounding"] = sum(w in src for w in words) / len(words) if words else 0.0
        return out
    if req.kind == "edit":  # the reply's code against the original: kept (similar) and still the same function
        code = extract_code(text)
        original = function_source(req.check["source"])
        sim = difflib.SequenceMatcher(None, code.strip(), original.strip(), autojunk=False).ratio()
        return {"similarity": sim, "defines_function": f"def {req.check['function']}(" in code}
    return {"nonempty": bool(text.strip())}


def length_summary(lengths: Sequence[int]) -> dict[str, float]:
    """min / median / p95 / max / mean of a list of token counts (the input or output length distribution)."""
    a = np.asarray(lengths, np.float64)
    if a.size == 0:
        return {"n": 0}
    return {
        "n": int(a.size),
        "min": float(a.min()),
        "median": float(np.median(a)),
        "p95": float(np.percentile(a, 95)),
        "max": float(a.max()),
        "mean": float(a.mean()),
    }


def workload_fingerprint(requests: Sequence[Request]) -> str:
    """sha256 over every request's messages and check data: equal fingerprints = identical prompt sets."""
    h = hashlib.sha256()
    for r in requests:
        h.update(json.dumps([r.id, r.messages, r.check], sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]
