"""The OpenAI request bodies the server accepts (pydantic models) and its OpenAI-style error bodies.

Validation is pydantic's, in strict mode, so a JSON string is not an integer and 1 is not ``true``, as
with OpenAI's API. Unknown fields are refused by name (``extra="forbid"``: OpenAI answers "Unrecognized
request argument"), and fields OpenAI has but this server does not implement are accepted only at their
neutral value (``logprobs: null``, ``presence_penalty: 0``, ...) and refused by name otherwise, so a
client never gets silently different behaviour. docs/serve.md lists both sets.
"""

from __future__ import annotations

from typing import ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

__all__ = [
    "APIError",
    "CompletionRequest",
    "ChatCompletionRequest",
    "ChatMessage",
    "StreamOptions",
    "MAX_N",
    "MAX_STOP",
    "error_body",
    "validation_error",
]

#: most choices (``n``) one request may ask for
MAX_N = 16
#: most stop strings one request may give (OpenAI's limit)
MAX_STOP = 4


class APIError(Exception):
    """An error answered with an OpenAI-style body (:func:`error_body`).

    Args:
        status: HTTP status (400, 401, 404, 429, 503, 500).
        message: says what was wrong, with the numbers.
        type: OpenAI's error type (``invalid_request_error``, ``authentication_error``, ...).
        param: the request field at fault (``messages.0.content``) or None.
        code: a short machine-readable code or None.
        headers: extra response headers (``Retry-After`` for 429).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: Optional[str] = None, code: Optional[str] = None) -> dict:
    """``{"error": {"message", "type", "param", "code"}}``: OpenAI's error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# pydantic's tags for the member of a union that failed; they are not field names
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "literal"}


# the JSON type of a parsed value, for a body that is not an object
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


def _param(loc: tuple) -> str:
    parts = []
    for p in loc:
        if isinstance(p, int):
            parts.append(str(p))
        elif p.isidentifier() and p.lower() not in _TYPE_TAGS and not p[:1].isupper():
            parts.append(p)
        else:
            break  # a union member's tag: the path to the field is complete
    return ".".join(parts) or None


def validation_error(err: ValidationError) -> APIError:
    """The 400 for a body that failed validation: the first failing field, every reason pydantic gives for
    it (a union reports one per member), and the value that was sent (truncated to 80 characters)."""
    errors = err.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first['msg']}", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:  # valid JSON, but not an object
        got = _JSON_TYPES.get(type(first.get("input")), type(first.get("input")).__name__)
        return APIError(400, f"the request body must be a JSON object, got {got}", code="invalid_value")
    param = _param(first["loc"])
    reasons = []
    for e in errors:
        if _param(e["loc"]) == param and e["msg"] not in reasons:
            reasons.append(e["msg"])
    sent = repr(first.get("input"))
    sent = sent if len(sent) <= 80 else sent[:77] + "..."
    if first["type"] == "extra_forbidden":
        message = f"unrecognized request argument supplied: {param}"
    elif first["type"] == "missing":
        message = f"{param}: field required"
    else:
        message = f"{param}: {'; or '.join(reasons)} (got {sent})"
    return APIError(400, message, param=param, code="invalid_value" if first["type"] != "missing" else "missing")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    #: an extension (vLLM's name): the reply runs at least this many tokens, EOS ignored until then
    min_tokens: Optional[int] = Field(None, ge=0)

    #: fields OpenAI has and this server does not implement -> the test a value passes to be accepted
    NEUTRAL: ClassVar[dict] = {
        "presence_penalty": lambda v: not v,
        "frequency_penalty": lambda v: not v,
        "logit_bias": lambda v: not v or not any(v.values()),  # a bias of 0 changes no logit
    }
    #: what the refusal of a non-neutral value says is accepted, where that is more than the default
    NEUTRAL_ACCEPTED: ClassVar[dict] = {"logit_bias": "an empty map or a bias of 0 for every token"}

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_common(self) -> None:
        """Refusals pydantic's field constraints cannot say (raised as :class:`APIError`)."""
        if len(self.stop_list) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(self.stop_list)}", param="stop",
                           code="invalid_value")
        empty = next((i for i, s in enumerate(self.stop_list) if not s), None)
        if empty is not None:  # "" would match before the first character: OpenAI refuses it too
            where = "" if isinstance(self.stop, str) else f" (stop.{empty})"
            raise APIError(400, f"stop: an empty stop string{where}; give at least one character",
                           param="stop", code="invalid_value")
        if self.min_tokens and self.limit is not None and self.min_tokens > self.limit:
            raise APIError(400, f"min_tokens: {self.min_tokens} is more than max_tokens ({self.limit})",
                           param="min_tokens", code="invalid_value")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options",
                           code="invalid_value")
        # OpenAI's logit_bias maps token ids, as decimal strings, to biases
        token = next((k for k in self.logit_bias or {} if not (k.isascii() and k.isdigit())), None)
        if token is not None:
            raise APIError(400, f"logit_bias: the key {token!r} is not a token id (a decimal integer such as "
                           "\"50256\")", param="logit_bias", code="invalid_value")
        for name, ok in self.NEUTRAL.items():
            value = getattr(self, name)
            if not ok(value):
                accepted = self.NEUTRAL_ACCEPTED.get(name, "its default")
                raise APIError(400, f"{name}: not supported by this server (got {value!r}; only {accepted} is "
                               "accepted)", param=name, code="unsupported_parameter")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of either (one choice
    set per prompt). ``max_tokens`` defaults to 16, as in OpenAI's API."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=1)
    echo: bool = False
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    NEUTRAL: ClassVar[dict] = {
        **_Sampling.NEUTRAL,
        "echo": lambda v: v is False,
        "logprobs": lambda v: v is None,
        "best_of": lambda v: v is None or v == 1,
        "suffix": lambda v: not v,
    }

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_kind_of_prompt(cls, value):
        """A list that mixes strings, token ids and token-id lists is refused in one sentence (pydantic's own
        message lists a reason per member of the union, none of which says what is wrong)."""
        if isinstance(value, list):
            first: dict[str, int] = {}  # kind -> index of its first item
            for i, item in enumerate(value):
                kind = _PROMPT_KINDS.get(type(item))
                if kind is not None:
                    first.setdefault(kind, i)
            if len(first) > 1:
                (a, i), (b, j) = sorted(first.items(), key=lambda kv: kv[1])[:2]
                raise PydanticCustomError(
                    "prompt_kinds_mixed", "a prompt is a string, a list of strings, a list of token ids or a list "
                    "of token-id lists, not a mix: item {i} is {a} and item {j} {b}", {"i": i, "a": a, "j": j, "b": b})
        return value

    @property
    def limit(self) -> Optional[int]:
        return self.max_tokens

    @property
    def limit_param(self) -> str:
        """The request field :attr:`limit` came from (what a 400 about it names)."""
        return "max_tokens"


# what one item of a completion's prompt list is, by its JSON type (bool is no token id)
_PROMPT_KINDS = {str: "a string", int: "a token id", list: "a token-id list"}


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: Optional[str] = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Strict):
    type: Literal["text"]


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. Without ``max_tokens`` / ``max_completion_tokens`` a reply may run
    to the server's ``max_seq_len``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[str] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None

    NEUTRAL: ClassVar[dict] = {
        **_Sampling.NEUTRAL,
        "logprobs": lambda v: not v,
        "top_logprobs": lambda v: v is None,
        "tools": lambda v: not v,
        "tool_choice": lambda v: v in (None, "none"),
    }

    def check_common(self) -> None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise APIError(400, f"max_completion_tokens: max_tokens ({self.max_tokens}) and max_completion_tokens "
                           f"({self.max_completion_tokens}) disagree; give one", param="max_completion_tokens",
                           code="invalid_value")
        super().check_common()

    @property
    def limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
