"""The OpenAI request bodies the server accepts, and the one error shape every failure takes.

Models are strict (no "5" for 5) because a client that sends the wrong type should hear so, not
get a silently coerced answer. Every number is range-checked here, so nothing out of range reaches
the engine (a seed beyond int64 used to end in an engine error). Unknown fields are ignored, as
OpenAI's and vLLM's servers do, but known OpenAI and vLLM features the engine does not have (n > 1,
penalties, echo, tools, response_format, guided decoding, ...) are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from quantship.engine.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered as {"error": {...}} with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # vLLM's bounds for seed and priority; torch's generator takes them
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]

# Known fields of features this server does not have, and the values that ask for nothing (None and
# empty containers always do). Anything else is refused by name rather than answered as if honoured.
NEUTRAL: dict[str, tuple] = {
    "response_format": ({"type": "text"},), "tool_choice": ("none", "auto"), "functions": (),
    "function_call": ("none", "auto"), "repetition_penalty": (1,), "min_p": (0,), "min_tokens": (0,),
    "use_beam_search": (False,), "length_penalty": (1,), "prompt_logprobs": (), "truncate_prompt_tokens": (),
    "include_stop_str_in_output": (False,), "guided_json": (), "guided_regex": (), "guided_choice": (),
    "guided_grammar": (), "structured_outputs": (), "prediction": (), "audio": (), "web_search_options": (),
    "bad_words": (), "allowed_token_ids": (),
}


def _is_neutral(value: Any, neutral: tuple) -> bool:
    if value is None or value == [] or value == {}:
        return True
    if isinstance(value, bool):  # bool is an int in Python: JSON true must not pass as the number 1
        return any(v is value for v in neutral)
    return any(not isinstance(v, bool) and v == value for v in neutral)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share. None means "the default", as OpenAI's SDKs may send null."""

    model_config = ConfigDict(strict=True, extra="allow")  # extras are kept only to refuse NEUTRAL's by name
    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)  # vLLM extension; -1 and 0 both mean off
    n: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None  # vLLM extension
    seed: Int64 | None = None
    ignore_eos: bool = False  # vLLM extension
    priority: Int64 = 0  # vLLM extension: lower values are served first
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    def refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise APIError(400, "n must be 1: this server returns one choice per request", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (only 0)", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        for name, value in (self.model_extra or {}).items():
            if name in NEUTRAL and not _is_neutral(value, NEUTRAL[name]):
                raise APIError(400, f"{name} is not supported by this server (got {str(value)[:80]})", param=name)

    def sampling_params(self, max_tokens: int, logprobs: bool) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k or 0, 0), seed=self.seed,
            stop=[s for s in stop if s], stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)  # None: 16, as OpenAI
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: Int64 | None = None
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.logprobs is not None and self.logprobs > 1:
            raise APIError(400, "logprobs must be 0 or 1: only the chosen token's log-probability is computed",
                           param="logprobs")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of the request; batches of prompts are refused (one choice per request)."""
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise APIError(400, "send one prompt per request (got a list of prompts)", param="prompt")
            p = p[0]
        if not p:
            raise APIError(400, "the prompt is empty", param="prompt")
        return p


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"content parts of type {part.type!r} are not supported (text only)",
                               param="messages")
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)  # deprecated by OpenAI: max_completion_tokens
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs:
            raise APIError(400, "top_logprobs must be 0: only the chosen token's log-probability is computed",
                           param="top_logprobs")
        if self.tools:
            raise APIError(400, "tools are not supported", param="tools")
