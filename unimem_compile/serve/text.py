"""Text in and out of the server: tokenizers, chat templates, incremental detokenisation, stop strings.

Two tokenizers stand behind one interface (:class:`TextCodec`):

* :class:`HFCodec` wraps a checkpoint folder's tokenizer (``AutoTokenizer.from_pretrained``) and renders
  chat messages with the folder's own chat template (``apply_chat_template``).
* :class:`ByteCodec` serves the built-in presets (random weights, no tokenizer files): one token per UTF-8
  byte, ``id = byte + 3`` (0 pad, 1 bos, 2 eos), the encoding ``unimem-compile demo`` uses; chat messages
  are rendered by :data:`PRESET_CHAT_TEMPLATE` through transformers' Jinja renderer.

Text comes out token by token through :class:`IncrementalDetokenizer` (so a character split over several
byte tokens is emitted once it is whole) and :class:`StopMatcher` (OpenAI's ``stop``: the text ends just
before the first occurrence of any stop string, which is not returned).
"""

from __future__ import annotations

from typing import Protocol, Sequence

__all__ = [
    "TextCodec",
    "ByteCodec",
    "HFCodec",
    "ChatTemplateMissing",
    "ChatTemplateRefused",
    "PRESET_CHAT_TEMPLATE",
    "IncrementalDetokenizer",
    "StopMatcher",
]

#: The presets' chat template: one ``<|role|>`` line per message, then the assistant's header when a reply
#: is wanted. Plain text on purpose: the byte tokenizer has no special tokens for roles.
PRESET_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ChatTemplateMissing(ValueError):
    """The tokenizer has no chat template, so ``/v1/chat/completions`` cannot render messages."""


class ChatTemplateRefused(ValueError):
    """The chat template refused the messages (its ``raise_exception(...)``: a system role it does not take,
    roles that do not alternate, ...); the message is the template's."""


def _render(render, messages):
    """``render(messages)``, with a template's own refusal raised as :class:`ChatTemplateRefused` (a
    template that does not parse is the server's fault and propagates)."""
    from jinja2.exceptions import TemplateError, TemplateSyntaxError

    try:
        return render(messages)
    except TemplateSyntaxError:
        raise
    except TemplateError as e:
        raise ChatTemplateRefused(str(e)) from None


class TextCodec(Protocol):
    """What the server needs from a tokenizer.

    Attributes:
        vocab_size: ids are in ``[0, vocab_size)``.
        eos_token_ids: ids that end a reply; they are never detokenised.
    """

    vocab_size: int
    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]:
        """Token ids of a completion prompt (the tokenizer's special tokens, e.g. bos, included)."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens skipped; invalid UTF-8 shows as U+FFFD."""

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of ``messages`` (``[{"role", "content": str}]``) rendered with the chat template and
        the assistant's generation prompt; :class:`ChatTemplateMissing` when there is no template,
        :class:`ChatTemplateRefused` when the template raises for these messages."""


class ByteCodec:
    """The built-in presets' byte-level tokenizer: ``id = byte + 3``, 0 pad, 1 bos, 2 eos.

    A preset's vocabulary is larger than 259 (1024 for the tiny models, 32000 for the real geometry) and its
    random weights emit any id; ids past 258 decode as the byte ``(id - 3) % 256``, so every generated token
    is text and a reply's length in bytes equals its length in tokens (minus specials).
    """

    offset = 3
    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2

    def __init__(self, vocab_size: int, chat_template: str = PRESET_CHAT_TEMPLATE):
        if vocab_size < 259:
            raise ValueError(f"a byte-level tokenizer needs a vocabulary of at least 259 ids, got {vocab_size}")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset({self.eos_token_id})
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        """``[bos] + [byte + 3 for each UTF-8 byte of text]``."""
        return [self.bos_token_id] + [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes ``(id - 3) % 256`` of the non-special ids, decoded as UTF-8 with U+FFFD for invalid
        sequences (Python's ``errors="replace"``: one U+FFFD per maximal invalid subpart)."""
        data = bytes((int(i) - self.offset) % 256 for i in ids if int(i) >= self.offset)
        return data.decode("utf-8", errors="replace")

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """``[bos]`` + the bytes of the rendered template (no second bos: the template carries none)."""
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = _render(lambda m: render_jinja_template(conversations=[m], chat_template=self.chat_template,
                                                              add_generation_prompt=True), messages)
        return self.encode(rendered[0])


class HFCodec:
    """A transformers tokenizer (a checkpoint folder's), with its chat template.

    Args:
        tokenizer: a ``PreTrainedTokenizerBase``.
        eos_token_ids: the ids that end a reply (the model's generation config's ``eos_token_id``, which may
            differ from ``tokenizer.eos_token_id``).
    """

    def __init__(self, tokenizer, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)

    @classmethod
    def from_pretrained(cls, folder: str, eos_token_ids: Sequence[int]) -> "HFCodec":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(folder), eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_ids(self, messages: list[dict]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateMissing("this model's tokenizer has no chat template; use /v1/completions")
        out = _render(lambda m: self.tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                                                   return_dict=True), messages)
        return list(out["input_ids"])


class IncrementalDetokenizer:
    """Text deltas of a growing token list, emitted only once they are final.

    The algorithm of text-generation-inference's ``decode_token`` (also vLLM's): decode a window
    ``ids[prefix:]`` and ``ids[prefix:read]``; the text past the shorter decode is new once it does not end
    in U+FFFD (a character still split over tokens) and then the window slides. Decoding a window instead
    of single tokens keeps tokenizers whose decode depends on neighbours (SentencePiece's leading spaces)
    right, and keeps each step's cost bounded by the window, not the reply.

    Args:
        decode: ``ids -> str`` (a :class:`TextCodec`'s ``decode``).
        prompt_tail: the last few prompt ids, decoded as context so the first reply token is spelled as it
            is inside the sequence (may be empty).
    """

    def __init__(self, decode, prompt_tail: Sequence[int] = ()):
        self._decode = decode
        self._ids: list[int] = list(prompt_tail)
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, ids: Sequence[int]) -> str:
        """Append ``ids``; return the text that became final (possibly "")."""
        self._ids.extend(int(i) for i in ids)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text):]


class StopMatcher:
    """OpenAI's ``stop`` strings on text that arrives in pieces.

    The reply ends at the first character that completes a stop string, just before that stop string (of
    the strings completed by that character, the one that starts first), and the stop string is not
    returned (OpenAI's trimming). Deciding character by character makes the result independent of how the
    text is cut into tokens and events. To never emit text that a later piece turns into the start of a match,
    the longest tail of the text that begins some stop string (at most ``max(len(s)) - 1`` characters) is
    held back until more text (or :meth:`flush`) decides it.

    Args:
        stops: the stop strings (empty strings are ignored; none: every piece passes through at once).
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def push(self, text: str, armed: bool = True) -> str:
        """Feed ``text``; return what may be emitted now. After a match, :attr:`stopped` is True and every
        later call returns "".

        ``armed=False`` (text of tokens before ``min_tokens``, vLLM's rule that stop strings do not end a
        reply shorter than that): no match may end in this ``text``; a stop string that begins in it and is
        completed by later, armed text still matches."""
        if self.stopped:
            return ""
        # a match may end at any character this text adds (none, unarmed)
        first_end = len(self._pending) + 1 if armed else len(self._pending) + len(text) + 1
        self._pending += text
        for end in range(first_end, len(self._pending) + 1):
            hits = [end - len(s) for s in self.stops if self._pending.endswith(s, 0, end)]
            if hits:
                self.stopped = True
                out, self._pending = self._pending[:min(hits)], ""
                return out
        keep = next((k for k in range(min(self._hold, len(self._pending)), 0, -1)
                     if any(s.startswith(self._pending[-k:]) for s in self.stops)), 0)
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """The held-back text at the end of the reply (no stop string matched it)."""
        out, self._pending = ("" if self.stopped else self._pending), ""
        return out
