"""OpenAI's shapes: the requests of /v1/chat/completions and /v1/completions, their answers and stream chunks, and
the error object.

Requests are validated strictly (a string where a number belongs is an error, as with OpenAI). Fields this server
does not know are ignored, as OpenAI ignores them; the ones it knows but cannot honour are refused unless they hold
their default value, since any other value would silently change the answer.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _default(*values) -> Callable[[Any], bool]:
    """A test for "left out, or one of these values" (of the same type: True is not 1)."""
    return lambda value: value is None or any(value == v and type(value) is type(v) for v in values)


# fields we know but cannot honour, and the values that ask nothing of us (OpenAI's defaults)
UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    "n": _default(1),
    "best_of": _default(1),
    "echo": _default(False),
    "logprobs": _default(False),
    "top_logprobs": _default(0),
    "suffix": _default(""),
    "logit_bias": _default({}),
    "presence_penalty": _default(0, 0.0),
    "frequency_penalty": _default(0, 0.0),
    "tools": _default([]),
    "tool_choice": _default("none"),
    "functions": _default([]),
    "function_call": _default("none"),
    "response_format": _default({"type": "text"}),
}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Request(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # unknown fields are kept aside, then ignored

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)  # what torch.Generator takes
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    def check_supported(self) -> None:
        """Every field asked for that this server cannot honour, in one error (`param`: the first)."""
        extra = self.model_extra or {}
        refused = [name for name, is_default in UNSUPPORTED.items() if not is_default(extra.get(name))]
        if refused:
            asked = ", ".join(f"{name}={extra[name]!r}" for name in refused)
            one = len(refused) == 1
            raise APIError(400, f"{asked} {'is' if one else 'are'} not supported by treeflash serve; leave "
                           f"{'it' if one else 'them'} out (one choice of plain text per request)", param=refused[0],
                           code="unsupported_parameter")

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def limit(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_calls, ...: ignored

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, str]:
        """The plain {"role", "content"} a chat template reads (a developer message is a system message)."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Request):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]  # one prompt per request

    @property
    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Reply:
    """What every body of one answer shares: kind (chat or plain completion), id, time, model."""

    chat: bool
    model: str
    include_usage: bool = False  # stream chunks carry "usage": null, and a last chunk the usage
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    def _envelope(self, chunk: bool, choices: list[dict]) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": ("chatcmpl-" if self.chat else "cmpl-") + self.id, "object": kind, "created": self.created,
                "model": self.model, "choices": choices}

    def body(self, text: str, finish_reason: str, usage: dict, extension: dict) -> dict:
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        choice = {"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope(False, [choice]), "usage": usage, "treeflash": extension}

    def chunk(self, text: str = "", finish_reason: str | None = None, first: bool = False,
              extension: dict | None = None) -> dict:
        """A stream chunk: `first` opens a chat answer (its role), `finish_reason` closes the choice."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else {"content": text} if text else {}
            content = {"delta": delta}
        else:
            content = {"text": text}
        body = self._envelope(True, [{"index": 0, **content, "logprobs": None, "finish_reason": finish_reason}])
        if self.include_usage:
            body["usage"] = None
        if extension:
            body["treeflash"] = extension
        return body

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._envelope(True, []), "usage": usage}
