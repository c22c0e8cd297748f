"""Text from the environment is data, never markup: its control strings are escaped before it enters a context.

A backbone's tokenizer turns the text of its added and special tokens (``<|im_end|>``, ``<|im_start|>``,
``<tool_call>``, ``<|eot_id|>``, ``<|start_header_id|>``, ``<|python_tag|>``, ...) into their control token ids
wherever that text appears in a rendered chat template. A policy can make the environment echo such text back
(a file's contents, a file name, a path, an unknown tool's name in an error), and the context it is trained on would
then hold turns it forged for itself: a "user" turn, a closed tool reply, a tool call nobody made.

So every text the environment (or a user simulator) returns is escaped before it is put into a context: a backslash
goes in after the first character of each control string (``<|im_end|>`` -> ``<\\|im_end|>``), which leaves only
ordinary tokens. Why this escape and not an invisible separator or a token-level split:

- it is plain text, so the same function serves the agent loop (training and ``seal.eval``'s checkpoint path) and the
  endpoint path, where a server applies the template and tokenizes what it is sent; the trained and the evaluated
  context are the same text. vLLM's chat endpoint and the official BFCL harness escape nothing (both would make the
  control token), so no escape could match them; ours is applied on both sides of our own paths instead;
- it is ASCII and visible: no tokenizer normaliser removes it (some drop zero-width characters, which would bring the
  control string back), and a person reading a record or the model reading its context sees that the text was
  altered, rather than text that looks like a real turn boundary;
- no BFCL reply holds a control string, so the faithful recipe's contexts are unchanged (a test replays tasks).

The control strings come from the tokenizer itself: every added and special token, except whitespace-only ones, which
some tokenizers add as ordinary text pieces.

One exception is the service's own framing (:data:`FRAMING`): in the released reply format the service wraps each tool
result in ``<tool_response>`` tags, which the backbone's template knows as markup (Qwen renders tool results so). The
service escapes these tags in everything else it puts into a reply (``render_tool_result`` escapes each result before
framing it, ``Episode._reply`` every other reply), so each of them left in a reply is the service's framing, and a
reader escapes every control string but these. This module imports nothing outside the standard library (the service,
the agent loop and ``seal.eval``'s endpoint path share it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: Inserted after the first character of a control string; never part of one (checked when the set is built).
ESCAPE = "\\"
#: The service's own markup in a reply: the tags around each tool result (``bfcl_tool_response`` mode).
FRAMING = ("<tool_response>", "</tool_response>")


class ControlText:
    """Escapes one tokenizer's control strings in text that is data (``escape``)."""

    def __init__(self, strings: Iterable[str]):
        self.strings = tuple(sorted({s for s in strings if s and not s.isspace()}, key=lambda s: (-len(s), s)))
        holding = [s for s in self.strings if ESCAPE in s]
        if holding:  # an escape that is part of a control string could complete one
            raise ValueError(f"control strings hold the escape character {ESCAPE!r}: {holding[:3]}")
        # longest first: of two control strings at one place, the longer is the one the tokenizer would take
        self._pattern = re.compile("|".join(re.escape(s) for s in self.strings)) if self.strings else None

    @classmethod
    def from_tokenizer(cls, tokenizer, keep: Iterable[str] = FRAMING) -> ControlText:
        """The control strings of a Hugging Face tokenizer (its added tokens and its special tokens) for reading the
        service's replies: all but ``keep``, the service's framing."""
        added = [str(token) for token in getattr(tokenizer, "added_tokens_decoder", {}).values()]
        kept = set(keep)
        return cls(s for s in [*added, *getattr(tokenizer, "all_special_tokens", [])] if s not in kept)

    def escape(self, text: str) -> str:
        """``text`` with no control string left in it; text without one comes back unchanged."""
        if self._pattern is None:
            return text
        # Escaping one match can leave an overlapping one (control strings "ab" and "bc" in "abc"): repeat until none
        # is left. Each pass breaks at least one match and the escape is in no control string, so this ends.
        while self._pattern.search(text):
            text = self._pattern.sub(_escaped, text)
        return text

    def find(self, text: str) -> list[str]:
        """The control strings in ``text``, in order (for checks and messages)."""
        return self._pattern.findall(text) if self._pattern is not None else []


def _escaped(match: re.Match) -> str:
    found = match.group(0)
    if len(found) == 1:  # nothing to insert into: a one-character control string is written as its code point
        return f"\\u{ord(found):04x}"
    return found[0] + ESCAPE + found[1:]


#: What the service escapes in the text it puts into a reply, so that its framing is the only markup of its own there.
SERVICE_MARKUP = ControlText(FRAMING)
