"""`# nandoctor: ignore[<id>, ...]` comments: silence a finding on the lines it spans, or
on any line of its statement (of a compound statement, its header).

    loss = torch.log(probs)  # nandoctor: ignore[log-of-softmax]   (that id only)
    y = x / x.sum()          # nandoctor: ignore                   (every id)

Only real comments count (read with `tokenize`), not the same text inside a string.
"""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Mapping
from dataclasses import dataclass

PATTERN = re.compile(r"#\s*nandoctor:\s*ignore\b(?:\[([^\]]*)\])?", re.IGNORECASE)


@dataclass(frozen=True)
class Suppressions:
    by_line: Mapping[int, frozenset[str] | None]  # None: every id

    def covers(self, cause_id: str, first_line: int, last_line: int) -> bool:
        for line in range(first_line, last_line + 1):
            ids = self.by_line.get(line, frozenset())
            if ids is None or cause_id in ids:
                return True
        return False


def parse_suppressions(text: str) -> Suppressions:
    by_line: dict[int, frozenset[str] | None] = {}
    if "nandoctor" not in text.lower():
        return Suppressions(by_line)  # NB: spares tokenizing nearly every file
    for line, comment in _comments(text):
        match = PATTERN.search(comment)
        if match is None:
            continue
        if match.group(1) is None:
            by_line[line] = None
        elif by_line.get(line, frozenset()) is not None:
            ids = frozenset(i for i in re.split(r"[,\s]+", match.group(1)) if i)
            by_line[line] = (by_line.get(line) or frozenset()) | ids
    return Suppressions(by_line)


def _comments(text: str) -> list[tuple[int, str]]:
    try:
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        return [(t.start[0], t.string) for t in tokens if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        # NB: the file parsed, so this is rare; fall back to a plain search per line
        return [(i, line) for i, line in enumerate(text.splitlines(), 1) if "#" in line]
