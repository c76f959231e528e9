"""What a prompt text may cost the lane before it is refused: tokenized a piece at a time.

A fast (Rust) tokenizer holds about 400 bytes per token until ``encode`` returns (the encoding's
token strings, offsets and masks, the normalizer's alignments, the pre-tokenizer's splits): 900 KB
of text is 677k tokens of the tiny model and 290 MB at the peak. Encoded whole, four such prompts
at once (the lane tokenizes up to four) took a server from 0.47 to 1.6 GB, and most of it stayed
held once they had been answered 400, for a prompt that could never fit the model's context.

:func:`tokens_over` counts a long text's tokens :data:`PIECE_CHARS` characters at a time and
stops as soon as the count passes the limit, so a prompt that cannot fit is refused having
encoded one piece at a time (about 15 MB at the peak), and a prompt that fits is encoded whole
as before, at the cost of its own tokens.

Guarantees:

- texts of at most :data:`PIECE_CHARS` characters in all are not tokenized here (encoding them
  whole costs no more than one piece);
- a longer text is cut into pieces of at most :data:`PIECE_CHARS` characters, each cut made at
  the start of a run of whitespace that follows other text (where the pre-tokenizers of
  byte-level BPE and SentencePiece tokenizers split anyway) when one lies in the piece's second
  half, else at :data:`PIECE_CHARS`; a count is returned only once it exceeds ``limit`` by more
  than :data:`SLACK` tokens a piece, which covers what a cut can add (a word cut in two, a
  normalizer's prefix on each piece), so a text is never refused for the cuts alone.

Not covered: the exact count. A text within the slack of the limit is encoded whole, and the
route checks that count (``prompt has N tokens; the model's context is C``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from transformers import PreTrainedTokenizerBase

PIECE_CHARS = 1 << 15
"""Characters tokenized at once while counting (about 15 MB of tokenizer memory at most)."""
SLACK = 16
"""Tokens a piece may add to the count over the whole text's (covers the cuts)."""


def tokens_over(
    tokenizer: PreTrainedTokenizerBase, parts: Sequence[tuple[str, bool]], limit: int
) -> int | None:
    """The tokens of ``parts`` counted so far, once they certainly exceed ``limit``; None when
    they may fit. Each part is a text and whether its special tokens' texts are plain text
    (``split_special_tokens``)."""
    if sum(len(text) for text, _ in parts) <= PIECE_CHARS:
        return None
    count = pieces = 0
    for text, plain in parts:
        for piece in _pieces(text):
            pieces += 1
            count += len(
                tokenizer.encode(piece, add_special_tokens=False, split_special_tokens=plain)
            )
            if count > limit + SLACK * pieces:
                return count - SLACK * pieces
    return None


def _pieces(text: str) -> Iterator[str]:
    start = 0
    while start < len(text):
        end = start + PIECE_CHARS
        cut = len(text) if end >= len(text) else _cut(text, start + PIECE_CHARS // 2, end)
        yield text[start:cut]
        start = cut


def _cut(text: str, lo: int, hi: int) -> int:
    """Where to end a piece in ``text[lo:hi]``: the start of its last run of whitespace that
    follows other text, else ``hi``."""
    j = max(text.rfind(" ", lo, hi), text.rfind("\n", lo, hi))
    while j > lo and text[j - 1].isspace():
        j -= 1
    return j if j > lo else hi


def shown(text: str, chars: int = 40) -> str:
    """``text`` as an error message quotes it: its ``repr``, cut to its first ``chars``
    characters (a hostile request's text is never echoed whole)."""
    return repr(text) if len(text) <= chars else f"{text[:chars]!r}… ({len(text)} characters)"
