"""Chat requests built from training text, for self-distillation: the verifier answers them
(`forerun distill`) and the heads train on its own answers, the text they draft in serving.

A head trained on library source drafts library source; served, it meets an instruct
model's chat answers (explanations, summaries, code with prose around it, arithmetic) and
its acceptance falls by 3-4x. No chat corpus ships on PyPI, so the requests are built from
the same allowed sources `forerun train` reads (installed packages' code and docs, the
user's own files): a seeded mix of tasks over their functions and paragraphs, plus
arithmetic word problems made from templates. The benchmark sets and the standard library
stay refused (data.check_allowed).

Worked example (seeded, so the same sources and seed give the same requests):
    a function `def clamp(x, lo, hi):` with docstring "Limit x to [lo, hi]." may become
    "Write a Python function `clamp(x, lo, hi)` that limits x to [lo, hi]." and a
    README paragraph "Summarize the following text in two or three sentences:\n\n...".
"""
from __future__ import annotations

import ast
import random
import re
from dataclasses import dataclass
from pathlib import Path

from forerun.train import data

CODE_TASKS = (
    "Write a Python function `{sig}` that {doc}.",
    "Implement `{sig}` in Python. It should {doc}. Include a short example of calling it.",
    "Explain what this Python function does, step by step:\n\n```python\n{src}\n```",
    "Review this Python code and suggest improvements:\n\n```python\n{src}\n```",
    "Write unit tests with pytest for this function:\n\n```python\n{src}\n```",
)
PROSE_TASKS = (
    "Summarize the following text in two or three sentences:\n\n{para}",
    "Read the text below and answer: what problem does it describe, and how is it solved?\n\n{para}",
    "Translate the following text into German:\n\n{para}",
    "Translate the following text into French:\n\n{para}",
    "Explain the following to a beginner, with an example:\n\n{para}",
    "Write three questions a reader might ask about this text, and answer each:\n\n{para}",
    "What is \"{topic}\"? Explain briefly.",
    "Give me a short list of tips about {topic}.",
)
GENERAL_TASKS = (
    "Write a short story about {t}.",
    "What are the pros and cons of {t}?",
    "Write a polite email to a colleague about {t}.",
    "Give me five practical tips about {t}.",
    "Explain {t} to a ten-year-old.",
    "Write a short blog post about {t}.",
    "Compare {t} and {t2}: how are they alike, and how do they differ?",
    "Write a poem about {t}.",
    "I have to give a two-minute talk on {t}. Write an outline.",
    "What are common misconceptions about {t}?",
)
TOPICS = (
    "remote work", "learning a new language", "climate change", "electric cars", "a trip to Japan",
    "a healthy breakfast", "time management", "the printing press", "photosynthesis", "saving money",
    "public libraries", "running a marathon", "volcanoes", "the stock market", "balcony gardening",
    "chess", "coffee", "recycling", "job interviews", "solar panels", "the Roman Empire", "sleep",
    "social media", "bees", "space exploration", "cooking pasta", "moving to a new city", "video games",
    "the ocean", "public speaking", "vaccines", "jazz", "board games", "rainforests", "bicycles",
    "the internet", "friendship", "museums", "tea", "earthquakes",
)
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jia")
ITEMS = ("apples", "books", "pencils", "stickers", "marbles", "cookies", "stamps", "cards")
MATH_TASKS = (
    "{n1} has {a} {item}. {n2} gives {n1} {b} more, and then {n1} gives away {c}. How many {item} does {n1} have now?",
    "A box holds {a} {item}. How many {item} are in {b} boxes, if {c} of them are taken out?",
    "{n1} reads {a} pages a day for {b} days, then {c} pages on the last day. How many pages in all?",
    "{n1} buys {b} {item} at {a} dollars each and pays with a {big}-dollar bill. How much change is left?",
    "{b} children each get {a} {item}, and {c} {item} are left over. How many {item} were there at the start?",
    "A train travels {a} km per hour for {b} hours and then {c} km more. How far does it travel?",
)


API_HEADINGS = re.compile(r"(Args|Arguments|Returns?|Raises|Parameters|Yields|Examples?|Notes?|See Also|Attributes)\b")


@dataclass(frozen=True)
class Snippet:
    kind: str  # "code" | "prose"
    fields: dict  # the template's fields: sig/doc/src for code, para/topic for prose


def code_snippets(text: str) -> list[Snippet]:
    """Public functions with a docstring (signature, first docstring line, source), and the
    prose paragraphs of every docstring."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return []
    lines, out = text.splitlines(), []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
            continue
        doc = ast.get_docstring(node) or ""
        out += [s for s in prose_snippets(doc) if s.fields["topic"] is None]
        if isinstance(node, (ast.ClassDef, ast.Module)) or node.name.startswith("_"):
            continue
        first = doc.strip().split("\n\n")[0].replace("\n", " ").strip().rstrip(".")
        src = "\n".join(lines[node.lineno - 1 : node.end_lineno])
        if not (12 <= len(first) <= 200) or not (80 <= len(src) <= 1500) or src[:1].isspace():
            continue
        sig = f"{node.name}({ast.unparse(node.args)})"
        if len(sig) <= 100:
            out.append(Snippet("code", {"sig": sig, "doc": first[0].lower() + first[1:], "src": src}))
    return out


def prose_snippets(text: str) -> list[Snippet]:
    """Paragraphs of documentation (markup lines dropped) and the headings above them."""
    out, topic = [], None
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.strip().splitlines()]
        if not lines:
            continue
        if len(lines) == 2 and set(lines[1]) <= set("=-~^*#") or lines[0].startswith("#"):
            topic = lines[0].lstrip("# ").strip() or topic
            continue
        if any(ln.startswith(("..", ">>>", "|", ":", "```", "    ")) for ln in lines) or API_HEADINGS.match(lines[0]):
            continue
        para = " ".join(lines)
        if 200 <= len(para) <= 1200 and para.count(" ") > 25 and sum(c.isalpha() for c in para) > 0.7 * len(para):
            out.append(Snippet("prose", {"para": para, "topic": topic if topic and 3 <= len(topic) <= 60 else None}))
    return out


def math_request(rng: random.Random) -> str:
    n1, n2 = rng.sample(NAMES, 2)
    a, b, c = rng.randint(2, 60), rng.randint(2, 12), rng.randint(1, 20)
    return rng.choice(MATH_TASKS).format(n1=n1, n2=n2, a=a, b=b, c=c, item=rng.choice(ITEMS), big=(a * b // 10 + 1) * 10)


def snippets(specs: list[str], want: int, seed: int) -> list[Snippet]:
    """Code and prose snippets of the sources' files, read in a seeded order until there are
    `want` of each kind (or the files run out). Refused sources raise, as in training."""
    files = [p for spec in specs for p in data.source_files(spec)]
    for p in files:
        data.check_allowed(p)
    random.Random(seed).shuffle(files)
    out, n_code, n_prose = [], 0, 0
    for path in files:
        for text in data.read_texts(path):
            got = code_snippets(text) if path.suffix in (".py", ".pyi") else prose_snippets(text)
            out += got
            n_code += sum(s.kind == "code" for s in got)
            n_prose += sum(s.kind == "prose" for s in got)
        if n_code >= want and n_prose >= want:
            break
    return out


def general_request(rng: random.Random) -> str:
    t, t2 = rng.sample(TOPICS, 2)
    return rng.choice(GENERAL_TASKS).format(t=t, t2=t2)


def requests(specs: list[str], count: int, seed: int, math_share: float = 0.15, general_share: float = 0.25) -> list[str]:
    """count user requests: math_share arithmetic word problems, general_share everyday
    requests over a fixed topic list, the rest tasks over the sources' snippets (code and
    prose in turn where both exist), in a seeded order."""
    rng = random.Random(seed)
    pool = snippets(specs, count, seed)
    code, prose = _shuffled_kinds(pool, rng)
    out = []
    for i in range(count):
        r = rng.random()
        if r < math_share:
            out.append(math_request(rng))
            continue
        if r < math_share + general_share or not (code or prose):
            out.append(general_request(rng))
            continue
        use_code = bool(code) and (not prose or i % 2 == 0)
        s = (code if use_code else prose).pop()
        tasks = CODE_TASKS if use_code else [t for t in PROSE_TASKS if "{topic}" not in t or s.fields["topic"]]
        out.append(rng.choice(tasks).format(**s.fields))
        if not code and not prose:  # every snippet used once: reuse them with other tasks
            code, prose = _shuffled_kinds(pool, rng)
    return out


def _shuffled_kinds(pool: list[Snippet], rng: random.Random) -> tuple[list[Snippet], list[Snippet]]:
    """(code snippets, prose snippets) of the pool, each in a seeded shuffle."""
    code = [s for s in pool if s.kind == "code"]
    prose = [s for s in pool if s.kind == "prose"]
    rng.shuffle(code)
    rng.shuffle(prose)
    return code, prose
