"""Training text for the project's own tokenizer, generated offline from a seed.

``generate_corpus(n_docs, seed)`` returns a list of short documents mixing the kinds of text the
demo and example environments put in front of the model: arithmetic word problems, calculator
tool calls and results, guessing-game and search/read tool dialogue, tool JSON schemas, the
chat template's tool instructions, short English sentences, numbers, and python-ish code.

Guarantees: pure and deterministic — the same ``(n_docs, seed)`` gives the same list on every
machine (only ``random.Random`` and the standard library are used). The documents never contain
chat-control strings such as ``<|im_start|>``; those are special tokens, not trained text.

Not a language corpus: the text is templated, so a model trained on it learns formats, not
English. Its only job is to give byte-level BPE merges that fit the project's text.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from policies.wire.toolcalls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    TOOLS_INSTRUCTIONS,
    TOOLS_PREAMBLE,
)


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


_NAMES = _words(
    """
Sam Alex Maria Li Omar Priya Ken Ana Tom Zoe Ivan Mei Noah Lea Ravi Emma
"""
)
_THINGS = _words(
    """
apples books coins pens cards marbles eggs stamps shells boxes cups stones
"""
)
_VERBS = _words(
    """
accept add agree allow answer arrive ask bake believe borrow break bring build buy call carry
catch change check choose clean climb close collect compare compute cook copy count cover cross
cut dance decide deliver describe design draw dream drink drive drop earn eat enjoy enter
explain fall feel fill find finish fix fly follow forget give grow guess hang hear help hide
hold hope hunt improve include invite join jump keep kick know laugh learn leave lend lift like
listen live look lose love make mark measure meet mix move need notice offer open order paint
pass pay pick plan plant play point pour practice prefer prepare print promise pull push read
reach reply report rest return ride ring rise run save say search see sell send serve share
shout show sing sit sleep slide solve sort speak spend stand start stay step stop study swim
take talk teach tell test think throw touch train travel try turn use visit wait walk want wash
watch win wish wonder work write
"""
)
_NOUNS = _words(
    """
animal answer apple area arm baby bag ball bank bed bird boat body bone book bottle box boy
bread bridge brother bus cake camera car card cat chair child city class clock cloud coat code
coin computer country cup day desk dinner doctor dog door dream dress driver egg engine evening
eye face family farm father field file fire fish floor flower food foot forest friend fruit game
garden girl glass goal group hand hat head heart hill horse hospital hour house idea island job
key kitchen lake lamp language letter library light line list map market meal minute money month
morning mother mountain mouth music name night number ocean office page paper park party pen
person phone picture piece plan plant player pocket problem program question rain river road
robot room rule school sea season seat ship shirt shoe shop side sister sky song sound space
square star station step stone story street student sun table teacher team test thing ticket
time tool town train tree truck value village voice wall watch water wave week window winter
word world year
"""
)
_ADJ = _words(
    """
able angry big black blue bold brave bright broad busy calm careful cheap clean clear clever
cold cool dark deep dry early easy empty fair fast few fine flat fresh full funny gentle good
great green happy hard heavy high hot huge kind large late light little long loud low lucky
modern narrow near new nice old open plain polite poor proud quick quiet rare ready red rich
right rough round sad safe sharp short simple slow small smart soft solid strange strong sweet
tall thick thin tiny warm weak wet white whole wide wild wise young
"""
)
_PREPOSITIONS = _words(
    """
about above after against along among around before behind below beside between beyond during
from into near over past through toward under until with without
"""
)
_SYLLABLES = _words(
    """
ka lo mi ren ta vo si ne bar tu del fi gor an el ix um os qua zen pri dro
"""
)
_TOPICS = (
    "prime numbers",
    "the water cycle",
    "python lists",
    "binary search",
    "the solar system",
    "photosynthesis",
    "sorting algorithms",
    "the french revolution",
    "neural networks",
    "volcanoes",
    "rational numbers",
)
_OPS = ("+", "-", "*", "/")
_SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful math tutor. Use the calculator when it helps.",
    "Play the guessing game. Use the guess tool until you find the number.",
    "Answer questions by searching the documents and reading the best result.",
)

_TOOL_SCHEMAS: dict[str, tuple[str, dict[str, str]]] = {
    "calculator": ("Evaluate an arithmetic expression.", {"expression": "string"}),
    "guess": ("Guess the secret number.", {"number": "integer"}),
    "search": ("Search the documents for a query.", {"query": "string"}),
    "read": ("Read a document by its id.", {"doc_id": "string"}),
    "python": ("Run python code and return its output.", {"code": "string"}),
}


def _schema(name: str) -> str:
    description, params = _TOOL_SCHEMAS[name]
    properties = {p: {"type": t, "description": f"The {p}."} for p, t in params.items()}
    tool = {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(params)},
        },
    }
    return json.dumps(tool, ensure_ascii=False)


def _call(name: str, arguments: dict[str, object]) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def _response(text: str) -> str:
    return f"{TOOL_RESPONSE_OPEN}\n{text}\n{TOOL_RESPONSE_CLOSE}"


def _evaluate(a: int, op: str, b: int) -> str:
    if op == "+":
        return str(a + b)
    if op == "-":
        return str(a - b)
    if op == "*":
        return str(a * b)
    return f"{a / b:.4g}"


def _arithmetic(rng: random.Random) -> str:
    a, b, op = rng.randint(0, 999), rng.randint(1, 99), rng.choice(_OPS)
    who, things = rng.choice(_NAMES), rng.choice(_THINGS)
    style = rng.randrange(4)
    if style == 0:
        return f"What is {a} {op} {b}?\n{a} {op} {b} = {_evaluate(a, op, b)}"
    if style == 1:
        return (
            f"{who} has {a} {things} and buys {b} more. How many {things} does {who} have now?\n"
            f"{a} + {b} = {a + b}. The answer is {a + b}."
        )
    if style == 2:
        return (
            f"{who} packs {a} {things} into boxes of {b}. How many full boxes are there?\n"
            f"{a} // {b} = {a // b}. The answer is {a // b}."
        )
    c, op = b % 10, rng.choice(_OPS[:3])
    inner = int(_evaluate(a, op, b))
    return (
        f"Compute ({a} {op} {b}) * {c}.\n{a} {op} {b} = {inner}, and {inner} * {c} = {inner * c}."
    )


def _calculator_dialogue(rng: random.Random) -> str:
    a, b, op = rng.randint(2, 999), rng.randint(2, 99), rng.choice(_OPS)
    expression = f"{a} {op} {b}"
    value = _evaluate(a, op, b)
    return "\n".join(
        (
            "user",
            f"What is {expression}?",
            "assistant",
            _call("calculator", {"expression": expression}),
            "user",
            _response(json.dumps({"result": value})),
            "assistant",
            f"{expression} = {value}. The answer is {value}.",
        )
    )


def _guessing_dialogue(rng: random.Random) -> str:
    low, high = 1, rng.choice((10, 50, 100, 1000))
    secret = rng.randint(low, high)
    lines = ["user", f"I am thinking of a number between {low} and {high}. Guess it."]
    while True:
        guess = (low + high) // 2
        lines += ["assistant", _call("guess", {"number": guess}), "user"]
        if guess == secret:
            lines += [_response("correct"), "assistant", f"The number is {guess}."]
            return "\n".join(lines)
        if guess < secret:
            lines.append(_response("higher"))
            low = guess + 1
        else:
            lines.append(_response("lower"))
            high = guess - 1


def _search_dialogue(rng: random.Random) -> str:
    topic = rng.choice(_TOPICS)
    ids = [f"doc-{rng.randint(0, 99)}" for _ in range(3)]
    results = [{"id": i, "title": f"Notes on {topic} ({n + 1})"} for n, i in enumerate(ids)]
    return "\n".join(
        (
            "user",
            f"Find out about {topic}.",
            "assistant",
            _call("search", {"query": topic}),
            "user",
            _response(json.dumps(results)),
            "assistant",
            _call("read", {"doc_id": ids[0]}),
            "user",
            _response(f"{topic.capitalize()} is a topic. {_sentence(rng)}"),
            "assistant",
            f"According to {ids[0]}, {topic} is a topic worth reading about.",
        )
    )


def _tools_block(rng: random.Random) -> str:
    names = rng.sample(sorted(_TOOL_SCHEMAS), k=rng.randint(1, 3))
    schemas = "\n".join(_schema(n) for n in names)
    return (
        f"system\n{rng.choice(_SYSTEM_PROMPTS)}\n\n{TOOLS_PREAMBLE}<tools>\n{schemas}\n</tools>\n\n"
        f"{TOOLS_INSTRUCTIONS}"
    )


def _plural(word: str) -> str:
    """Third-person / plural ``-s`` by the regular spelling rules (irregulars are not covered)."""
    if word.endswith(("s", "sh", "ch", "x", "o")):
        return word + "es"
    if word.endswith("y") and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    return word + "s"


def _gerund(word: str) -> str:
    if word.endswith("e") and not word.endswith("ee"):
        return word[:-1] + "ing"
    short = len(word) <= 4 and word[-1] not in "aeiouwxy"
    if short and word[-2] in "aeiou" and word[-3] not in "aeiou":
        return word + word[-1] + "ing"
    return word + "ing"


def _pseudo_word(rng: random.Random) -> str:
    """A pronounceable made-up word: names, places and identifiers beyond the word lists."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3)))


def _noun_phrase(rng: random.Random, *, allow_plural: bool = True) -> str:
    noun = rng.choice(_NOUNS)
    if allow_plural and rng.random() < 0.4:
        determiner, noun = rng.choice(("the", "some", "many", "two", "these")), _plural(noun)
    else:
        determiner = rng.choice(("the", "a", "this", "my", "our", "every"))
    return f"{determiner} {rng.choice(_ADJ)} {noun}"


def _sentence(rng: random.Random) -> str:
    verb = rng.choice(_VERBS)
    style = rng.randrange(4)
    if style == 0:
        subject, predicate = _noun_phrase(rng, allow_plural=False), _plural(verb)
    elif style == 1:
        subject, predicate = rng.choice(_NAMES), f"is {_gerund(verb)}"
    elif style == 2:
        subject, predicate = _pseudo_word(rng).capitalize(), f"will {verb}"
    else:
        subject, predicate = rng.choice(("we", "they", "you", "I")), f"{verb}"
    text = (
        f"{subject} {predicate} {_noun_phrase(rng)} {rng.choice(_PREPOSITIONS)} {_noun_phrase(rng)}"
    )
    end = rng.choice((".", ".", "!", "?"))
    return text[0].upper() + text[1:] + end


def _prose(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))


def _numbers(rng: random.Random) -> str:
    style = rng.randrange(3)
    if style == 0:
        return " ".join(str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(8))
    if style == 1:
        return ", ".join(f"{rng.uniform(-100, 100):.2f}" for _ in range(6))
    return f"The number is {rng.randint(0, 100000)}."


def _code(rng: random.Random) -> str:
    name = f"{rng.choice(_VERBS)}_{rng.choice((_pseudo_word(rng), rng.choice(_NOUNS)))}"
    a, b = rng.choice(_NOUNS), rng.choice(("x", "y", "n", "i", "value", _pseudo_word(rng)))
    style = rng.randrange(3)
    if style == 0:
        op = rng.choice(_OPS)
        return f"def {name}({a}, {b}):\n    return {a} {op} {b}\n\n\nprint({name}(3, 4))"
    if style == 1:
        return (
            f"def {name}({a}):\n    result = 0\n    for {b} in range({a}):\n"
            f"        if {b} % 2 == 0:\n            result += {b}\n    return result"
        )
    k = rng.randint(1, 9)
    return f"{a} = [{', '.join(str(rng.randint(0, 99)) for _ in range(k))}]\n{b} = sorted({a})"


_KINDS: tuple[tuple[Callable[[random.Random], str], int], ...] = (
    (_arithmetic, 4),
    (_calculator_dialogue, 3),
    (_guessing_dialogue, 2),
    (_search_dialogue, 2),
    (_tools_block, 1),
    (_prose, 3),
    (_numbers, 2),
    (_code, 2),
)


def generate_corpus(n_docs: int, seed: int) -> list[str]:
    """``n_docs`` generated documents, a pure function of ``(n_docs, seed)``."""
    rng = random.Random(seed)
    makers = [maker for maker, _ in _KINDS]
    weights = [weight for _, weight in _KINDS]
    return [rng.choices(makers, weights)[0](rng) for _ in range(n_docs)]
