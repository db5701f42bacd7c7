"""Byte-level tokenizer and the demo's prompts built from public-domain texts.

Token ids are the UTF-8 bytes of the text (vocab 256), so every prompt maps to the
same ids in every process without a vocabulary file. The texts live in
``connector/demo_engine/texts/`` (see ``SOURCES.md`` there).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TEXT_DIR = Path(__file__).resolve().parent / "texts"

# The shared "system prompt": instructions followed by the documents, in this order.
DOCUMENTS = ("gettysburg_address", "declaration_of_independence", "pride_and_prejudice_ch1", "moby_dick_ch1")
QUICK_DOCUMENTS = ("gettysburg_address",)

SYSTEM_HEADER = ("You are a careful reading assistant. Answer the question at the end using only "
                 "the documents below, and quote the passage you rely on.\n\n")

QUESTIONS = (
    "What proposition was the new nation dedicated to?",
    "Which rights does the Declaration call unalienable?",
    "Who has taken Netherfield Park, and how large is his fortune?",
    "What does Ishmael do whenever it is a damp, drizzly November in his soul?",
    "Name one sentence that appears in two of the documents in spirit, and explain why.",
    "How many years is four score and seven?",
)


def encode(text: str) -> list[int]:
    """UTF-8 bytes of ``text`` as token ids (ints in [0, 256))."""
    return list(text.encode("utf-8"))


def decode(ids: list[int]) -> str:
    """Inverse of :func:`encode`; undecodable byte runs become U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def load_text(name: str) -> str:
    """The text of ``texts/<name>.txt``."""
    path = TEXT_DIR / f"{name}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in TEXT_DIR.glob("*.txt"))
        raise FileNotFoundError(f"no demo text {name!r}; shipped texts: {', '.join(known)}")
    return path.read_text(encoding="utf-8")


def system_prompt(documents: tuple[str, ...] = DOCUMENTS) -> str:
    """Instructions plus the named documents, each under a ``Document i`` header."""
    parts = [SYSTEM_HEADER]
    for i, name in enumerate(documents, 1):
        parts.append(f"Document {i}:\n{load_text(name).strip()}\n\n")
    return "".join(parts)


def user_turn(question: str) -> str:
    return f"Question: {question}\nAnswer:"


@dataclass(frozen=True)
class Request:
    """One demo request: a stable id, its prompt text and a short label for reports."""

    request_id: str
    prompt: str
    label: str = ""

    @property
    def token_ids(self) -> list[int]:
        return encode(self.prompt)


def demo_requests(quick: bool = False) -> tuple[list[Request], list[Request]]:
    """(engine A's requests, engine B's requests).

    A answers the first questions over the shared system prompt. B asks those same
    prompts again (hits up to the last full block), new questions over the same
    documents (hits the shared prefix only), and one prompt over a different document
    order (a miss: its first block differs, so no block hash matches).
    """
    docs = QUICK_DOCUMENTS if quick else DOCUMENTS
    sp = system_prompt(docs)
    n_seen = 2 if quick else 3
    a = [Request(f"a{i}", sp + user_turn(q), q) for i, q in enumerate(QUESTIONS[:n_seen])]
    b = [Request(f"b{i}", r.prompt, r.label) for i, r in enumerate(a)]
    new_qs = QUESTIONS[n_seen:n_seen + (1 if quick else 3)]
    b += [Request(f"b{len(b) + i}", sp + user_turn(q), q) for i, q in enumerate(new_qs)]
    doc = "moby_dick_ch1" if quick else "declaration_of_independence"
    other = "Document 1:\n" + load_text(doc).strip()
    b.append(Request(f"b{len(b)}", other + "\n\n" + user_turn(QUESTIONS[0]),
                     f"{QUESTIONS[0]} [no system prompt; document {doc} only]"))
    return a, b
