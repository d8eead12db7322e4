"""Chat messages -> one prompt string, and the assistant's output split into reasoning and content.

DeepSeek-V4's chat format, written from its public description: the `encoding/README.md` of the
deepseek-ai/DeepSeek-V4 model repositories ("DeepSeek-V4 Encoding": special tokens, basic chat,
thinking mode, `drop_thinking`, reasoning effort) and DeepSeek's API guide
(api-docs.deepseek.com/guides/thinking_mode: the effort names and how they map). In this
module's words:

- The conversation starts with the BOS token (`<｜begin▁of▁sentence｜>` in DeepSeek's
  tokenizer); a system message follows it as plain text, with no token of its own, and only
  as the first message (V4 has no mid-conversation system token).
- A user message is `<｜User｜>` + its text. After a user message that an assistant message
  follows, and after the last message (the prompt asks for the next assistant turn), comes
  `<｜Assistant｜>` and then the thinking marker: `<think>` opens a reasoning block the model
  writes and closes with `</think>` before its answer (thinking mode); `</think>` right away
  closes it empty, so the model answers directly (chat mode).
- An assistant message is its text + the EOS token (`<｜end▁of▁sentence｜>`). Its reasoning is
  dropped: the format keeps reasoning only in the turns after the last user message, and the
  prompt here always ends with a user message, so every earlier assistant turn is written as
  in chat mode (`<｜Assistant｜></think>` + answer + EOS), whatever the request's mode.
- Reasoning effort: thinking mode with effort `max` puts a fixed instruction (REASONING_EFFORT_MAX,
  the format's text) before the first message, right after BOS; `high` (the default) adds
  nothing. The API's names map as DeepSeek's API does: minimal / low / medium / high / xhigh
  -> high, max -> max, none -> chat mode.
- Tool calls (the format's DSML blocks) and the quick-instruction tokens are not rendered:
  a `tool` message is refused by name.

A checkpoint that ships its own Jinja `chat_template` (tokenizer_config.json, or
chat_template.jinja beside it; the build writes it into the engine's tokenizer_config.json)
is rendered with that template instead, in Jinja's immutable
sandbox (the template is engine data: no attribute or method reaches outside the values it is
given), with the variables Hugging Face's `apply_chat_template` passes (messages,
add_generation_prompt, bos_token, eos_token) plus `thinking` and `reasoning_effort`.

The output split (`ReasoningSplit`): in thinking mode the completion begins inside the
reasoning block, so its text up to the first `</think>` is `reasoning_content` and the rest is
`content`; `</think>` may arrive split over several deltas (tokens or steps), so a tail that
could be its start is held until the next delta decides. In chat mode everything is content.
The split reads text: a tokenizer must decode `</think>` (DeepSeek's does: it is an added token,
not a special one that decoding skips).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# the format's text for effort `max` (a constant the model was trained on, so spelt exactly)
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n")
# the API's reasoning_effort names -> the format's (DeepSeek's API maps them so); None: chat
EFFORTS = {"none": None, "minimal": "high", "low": "high", "medium": "high", "high": "high",
           "xhigh": "high", "max": "max"}
ROLES = ("system", "user", "assistant")
TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
MAX_TEMPLATE_CHARS = 1 << 20       # a template larger than 1 MiB is not a chat template
TEMPLATE_OUTPUT_SLACK = 1 << 20    # characters a template may add to its messages' text


class ChatError(ValueError):
    """A conversation the format cannot render: `param` names the field (messages[i].role)."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message


def check_messages(messages: list[dict]) -> None:
    """The conversations the format renders: roles system / user / assistant, a system
    message only first, an assistant message only right after a user message, and a user
    message last (the prompt asks for the assistant's next turn)."""
    if not messages:
        raise ChatError("messages", "at least one message is needed")
    for i, m in enumerate(messages):
        role = m["role"]
        if role not in ROLES:
            raise ChatError(f"messages[{i}].role", f"{role!r} is not supported (system, user "
                                                  "and assistant are; no tool calling)")
        if role == "system" and i != 0:
            raise ChatError(f"messages[{i}].role", "a system message may only be the first "
                                                  "(DeepSeek-V4's format has no later one)")
        if role == "assistant" and (i == 0 or messages[i - 1]["role"] != "user"):
            raise ChatError(f"messages[{i}].role", "an assistant message must follow a user "
                                                  "message")
    if messages[-1]["role"] != "user":
        raise ChatError(f"messages[{len(messages) - 1}].role",
                        "the last message must be the user's (the reply is the assistant's "
                        "next turn)")


def render_deepseek_v4(messages: list[dict], thinking: bool, effort: str | None = "high",
                       bos: str = BOS, eos: str = EOS) -> str:
    """The prompt of `messages` ({role, content}; content a string) in DeepSeek-V4's format.
    `effort`: the format's name (high or max; EFFORTS maps the API's)."""
    return "".join(text for text, _ in deepseek_v4_parts(messages, thinking, effort, bos, eos))


def deepseek_v4_parts(messages: list[dict], thinking: bool, effort: str | None = "high",
                      bos: str = BOS, eos: str = EOS) -> list[tuple[str, bool]]:
    """The prompt as (text, is_marker) pieces: the format's own tokens apart from the text of
    the messages, so a message that spells a special token is encoded as its characters."""
    check_messages(messages)
    last = len(messages) - 1
    out = [(bos, True)]
    if thinking and effort == "max":
        out.append((REASONING_EFFORT_MAX, False))
    for i, m in enumerate(messages):
        role, text = m["role"], m["content"]
        if role == "system":
            out.append((text, False))
        elif role == "user":
            out += [(USER, True), (text, False)]
            if i == last:
                out += [(ASSISTANT, True), (THINK_OPEN if thinking else THINK_CLOSE, True)]
            elif messages[i + 1]["role"] == "assistant":
                out += [(ASSISTANT, True), (THINK_CLOSE, True)]   # reasoning dropped
        else:
            out += [(text, False), (eos, True)]
    return out


class ReasoningSplit:
    """A completion's text deltas -> (reasoning delta, content delta)."""

    def __init__(self, thinking: bool):
        self.reasoning = thinking       # inside the reasoning block
        self.held = ""

    def add(self, text: str) -> tuple[str, str]:
        if not self.reasoning:
            return "", text
        pending = self.held + text
        at = pending.find(THINK_CLOSE)
        if at >= 0:
            self.reasoning, self.held = False, ""
            return pending[:at], pending[at + len(THINK_CLOSE):]
        keep = next((n for n in range(min(len(pending), len(THINK_CLOSE) - 1), 0, -1)
                     if THINK_CLOSE.startswith(pending[-n:])), 0)
        self.held = pending[len(pending) - keep:]
        return pending[:len(pending) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What is held at the end: reasoning that merely ended like `</think>`'s start."""
        held, self.held = self.held, ""
        return held, ""


def split_reasoning(text: str, thinking: bool) -> tuple[str | None, str]:
    """A whole completion -> (reasoning_content or None in chat mode, content)."""
    s = ReasoningSplit(thinking)
    r, c = s.add(text)
    r2, c2 = s.finish()
    return (r + r2 if thinking else None), c + c2


# The same format as a Jinja chat template, for the engine's tokenizer_config.json (Hugging
# Face's apply_chat_template, vLLM's --tokenizer ENGINE): variables bos_token, eos_token,
# messages, add_generation_prompt, thinking (or enable_thinking; default off) and
# reasoning_effort. The server recognises this text and renders with the function above.
DEEPSEEK_V4_TEMPLATE = (
    "{%- set think = thinking if thinking is defined else (enable_thinking if enable_thinking "
    "is defined else false) -%}"
    "{{- bos_token -}}"
    "{%- if think and reasoning_effort is defined and reasoning_effort == 'max' -%}"
    "{{- " + json.dumps(REASONING_EFFORT_MAX) + " -}}{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{{- m['content'] -}}"
    "{%- elif m['role'] == 'user' -%}{{- '" + USER + "' + m['content'] -}}"
    "{%- if loop.last and add_generation_prompt -%}"
    "{{- '" + ASSISTANT + "' + ('" + THINK_OPEN + "' if think else '" + THINK_CLOSE + "') -}}"
    "{%- elif not loop.last and messages[loop.index0 + 1]['role'] == 'assistant' -%}"
    "{{- '" + ASSISTANT + THINK_CLOSE + "' -}}{%- endif -%}"
    "{%- elif m['role'] == 'assistant' -%}{{- m['content'] + eos_token -}}"
    "{%- else -%}{{- raise_exception('unsupported role: ' + m['role']) -}}"
    "{%- endif -%}{%- endfor -%}")


def tokenizer_config(checkpoint_dir, tokenizer=None, bos_id: int | None = None,
                     eos_id: int | None = None, max_len: int | None = None) -> str:
    """The engine's tokenizer_config.json (written at build beside tokenizer.json, so the
    engine directory is a Hugging Face tokenizer directory): the checkpoint's own when it has
    one (its chat template kept), else one naming the tokenizer class, the BOS / EOS tokens
    (the tokenizer's tokens at the config's ids) and DEEPSEEK_V4_TEMPLATE."""
    d = Path(checkpoint_dir)
    cfg = _read_config(d / TOKENIZER_CONFIG)
    jinja = d / TEMPLATE_FILE         # newer checkpoints keep the template in its own file
    if cfg:
        if "chat_template" not in cfg and jinja.is_file():
            cfg["chat_template"] = jinja.read_text(encoding="utf-8")
        return json.dumps(cfg, indent=1, ensure_ascii=False) + "\n"
    out = {"tokenizer_class": "PreTrainedTokenizerFast",
           "bos_token": _id_text(tokenizer, bos_id) or BOS,
           "eos_token": _id_text(tokenizer, eos_id) or EOS,
           "clean_up_tokenization_spaces": False,
           "chat_template": (jinja.read_text(encoding="utf-8") if jinja.is_file()
                             else DEEPSEEK_V4_TEMPLATE)}
    if max_len is not None:
        out["model_max_length"] = max_len       # the engine's positions per request
    return json.dumps(out, indent=1, ensure_ascii=False) + "\n"


# ---- the engine's format ---------------------------------------------------------------------

@dataclass(frozen=True)
class ChatFormat:
    """How this engine's conversations become prompts: the checkpoint's Jinja template when
    it ships one, else DeepSeek-V4's format with this tokenizer's BOS / EOS strings."""
    bos: str
    eos: str
    template_source: str | None = None      # the template's text (None: DeepSeek-V4's format)
    origin: str = "DeepSeek-V4 chat format"

    def render(self, messages: list[dict], thinking: bool, effort: str | None) -> str:
        if self.template_source is None:
            return render_deepseek_v4(messages, thinking, effort, self.bos, self.eos)
        check_messages(messages)
        return render_template(self._template(), messages, self.bos, self.eos, thinking,
                               effort)

    def parts(self, messages: list[dict], thinking: bool,
              effort: str | None) -> list[tuple[str, bool]] | None:
        """The prompt as (text, is_marker) pieces; None for a Jinja template, whose output
        is one text (its special tokens and the messages' cannot be told apart)."""
        if self.template_source is not None:
            return None
        return deepseek_v4_parts(messages, thinking, effort, self.bos, self.eos)

    def _template(self):
        return compile_template(self.template_source, self.origin)

    @classmethod
    def of_engine(cls, engine_dir, tokenizer=None, bos_id: int | None = None,
                  eos_id: int | None = None) -> "ChatFormat":
        """Read at server start; a template that does not compile is refused here, naming
        the file, rather than at every request."""
        d = Path(engine_dir)
        cfg = _read_config(d / TOKENIZER_CONFIG)
        bos = _token_text(cfg.get("bos_token")) or _id_text(tokenizer, bos_id) or BOS
        eos = _token_text(cfg.get("eos_token")) or _id_text(tokenizer, eos_id) or EOS
        source, origin = _template_text(d, cfg)
        fmt = cls(bos, eos, source, origin)
        if source is not None:
            fmt._template()
        return fmt


def _read_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: not a JSON file ({str(e)[:200]})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _token_text(v) -> str | None:
    """tokenizer_config.json spells a special token as its string or {"content": string}."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


def _id_text(tokenizer, i: int | None) -> str | None:
    """The string of token `i`: `tokenizer` is a text.Tokenizer, or a tokenizer.json's parsed
    content (the build reads it so, without loading the library)."""
    if i is None or tokenizer is None:
        return None
    if isinstance(tokenizer, dict):
        for a in tokenizer.get("added_tokens") or ():
            if isinstance(a, dict) and a.get("id") == i and isinstance(a.get("content"), str):
                return a["content"]
        vocab = (tokenizer.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            return next((t for t, j in vocab.items() if j == i), None)
        return None
    tok = getattr(tokenizer, "tok", None)
    return None if tok is None else tok.id_to_token(i)


def _template_text(d: Path, cfg: dict) -> tuple[str | None, str]:
    """The engine's chat template: tokenizer_config.json's `chat_template` (a string, or a list
    of {name, template} whose `default` is taken; the build folds a checkpoint's
    chat_template.jinja into it, so the server reads only the checksummed file)."""
    t = cfg.get("chat_template")
    origin = f"{d / TOKENIZER_CONFIG}: chat_template"
    if t is None:
        return None, "DeepSeek-V4 chat format"
    if isinstance(t, list):
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default")
        origin += "[default]"
    if not isinstance(t, str):
        raise ValueError(f"{origin}: expected a string (or a list of {{name, template}} "
                         "with a 'default')")
    text = t
    if text == DEEPSEEK_V4_TEMPLATE:     # this module's own: rendered by the function
        return None, "DeepSeek-V4 chat format"
    if len(text) > MAX_TEMPLATE_CHARS:
        raise ValueError(f"{origin}: {len(text)} characters, more than a chat template's "
                         f"{MAX_TEMPLATE_CHARS}")
    return text, origin


_COMPILED: dict = {}


def compile_template(source: str, origin: str):
    key = (source, origin)
    if key not in _COMPILED:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, ensure_ascii=False,
                                                                   indent=indent)
        try:
            _COMPILED[key] = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"{origin}: the chat template does not compile "
                             f"({type(e).__name__}: {str(e)[:200]})") from None
    return _COMPILED[key]


class TemplateRaised(ValueError):
    """The template's own raise_exception (it refuses the conversation)."""


def _raise_exception(message):
    raise TemplateRaised(str(message))


def render_template(template, messages: list[dict], bos: str, eos: str, thinking: bool,
                    effort: str | None) -> str:
    import jinja2
    # the output is bounded (a template's loops could write gigabytes): the messages' text,
    # twice over, plus what a template's own text and tokens take
    limit = 2 * sum(len(m["content"]) for m in messages) + TEMPLATE_OUTPUT_SLACK
    try:
        out, n = [], 0
        for piece in template.generate(messages=messages, add_generation_prompt=True,
                                       bos_token=bos, eos_token=eos, thinking=thinking,
                                       enable_thinking=thinking, reasoning_effort=effort):
            n += len(piece)
            if n > limit:
                raise ChatError("messages", f"the engine's chat template wrote more than "
                                            f"{limit} characters for them")
            out.append(piece)
        return "".join(out)
    except TemplateRaised as e:
        raise ChatError("messages", f"the engine's chat template refused them: {e}") from None
    except jinja2.exceptions.SecurityError as e:
        raise ChatError("messages", f"the engine's chat template tried an unsafe operation "
                                    f"({str(e)[:200]})") from None
    except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
        raise ChatError("messages", f"the engine's chat template failed on them "
                                    f"({type(e).__name__}: {str(e)[:200]})") from None
