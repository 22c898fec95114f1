"""Chat prompts: a conversation rendered with the model's own chat template, then tokenized.

An instruct model was trained on conversations written in one exact layout, with its own special
tokens around each turn (ChatML's ``<|im_start|>user ... <|im_end|>``, Llama 3's
``<|start_header_id|>``, Gemma's ``<start_of_turn>`` ...). A GGUF file carries that layout as a
Jinja template, the metadata key ``tokenizer.chat_template``, copied from Hugging Face's
``tokenizer_config.json``. ``ChatTemplate`` renders it as llama-cpp-python does (and Hugging Face's
``apply_chat_template`` before it):

* a *sandboxed* Jinja environment (a template is data from a downloaded file: it may not reach
  Python attributes or mutate the messages), with ``trim_blocks`` and ``lstrip_blocks``, the
  ``loopcontrols`` extension (``{% break %}``), ``{% generation %}`` blocks rendered as their body,
  and a ``tojson`` filter that keeps non-ASCII text as it is;
* the variables ``messages`` (a list of ``{"role": ..., "content": ...}``),
  ``add_generation_prompt`` (end with the header of an assistant turn, so the model answers),
  ``bos_token`` and ``eos_token`` (the texts of those tokens), ``tools`` (None), and the functions
  ``raise_exception(message)`` and ``strftime_now(format)``.

An undefined variable renders as an empty string, as in those libraries (an attribute of one, or a
call, is an error). Every error of a template (its syntax, ``raise_exception``, a bad operation) is a
``ChatTemplateError`` that names where the template came from.

``tokenize_chat`` turns the text into token ids with the special tokens parsed, and with llama.cpp's
rule for BOS: the vocabulary's BOS is added unless the template already wrote it, so a prompt never
starts with two.
"""
from __future__ import annotations

import json
import os
from datetime import datetime

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ChatTemplateError

__all__ = ["ChatTemplateError", "ChatTemplate", "chat_template", "tokenize_chat", "TEMPLATE_KEY"]

TEMPLATE_KEY = "tokenizer.chat_template"


class _RaisedByTemplate(Exception):
    """What ``raise_exception`` in a template raises, told apart from our own errors."""


def _raise_exception(message):
    raise _RaisedByTemplate(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's text for training; here it
    is just its body."""
    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)   # the tag's name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment():
    env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    return env


class ChatTemplate:
    """A compiled chat template. ``source`` is the Jinja text; ``bos_token``/``eos_token`` the texts the
    template may write; ``where`` names its origin in errors (e.g. ``"model.gguf: tokenizer.chat_template"``)."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", where: str = TEMPLATE_KEY):
        self.source, self.bos_token, self.eos_token, self.where = source, bos_token, eos_token, where
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{where}: line {e.lineno}: {e.message}") from None

    def render(self, messages, add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text of ``messages`` (``[{"role": ..., "content": ...}, ...]``); ``extra``
        variables (``tools=...``, ``date_string=...``) are passed to the template as they are."""
        # no tools: None, not undefined (``tools is not none`` must be false), as both libraries pass them
        extra = {"tools": None, "tool_choice": None, "functions": None, "function_call": None, **extra}
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token,
                                         raise_exception=_raise_exception, strftime_now=_strftime_now, **extra)
        except _RaisedByTemplate as e:
            raise ChatTemplateError(f"{self.where}: the template refused the conversation: {e}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"{self.where}: rendering failed: {type(e).__name__}: {e}") from None


def chat_template(metadata: dict, tokenizer, path="<model>", override: str | None = None) -> ChatTemplate:
    """The chat template of a model: ``override`` (a file's path, or else the template text itself,
    which has ``{{`` or ``{%``, as ``--chat-template`` gives it) or the file's ``tokenizer.chat_template``; ``tokenizer`` (a
    ``Tokenizer`` of the same file) gives the BOS/EOS texts. No template at all is a
    ``ChatTemplateError`` that says how to give one."""
    if override is not None:
        if os.path.isfile(override):
            with open(override, encoding="utf-8") as f:
                source, where = f.read(), f"--chat-template {override}"
        elif "{{" in override or "{%" in override:
            source, where = override, "--chat-template"
        else:   # neither a file nor a template: most likely a misspelt file name
            raise ChatTemplateError(f"--chat-template {override}: no such file, and not a Jinja template")
    else:
        source, where = metadata.get(TEMPLATE_KEY), f"{path}: {TEMPLATE_KEY}"
        if source is None:
            raise ChatTemplateError(f"{path}: the file has no chat template ({TEMPLATE_KEY}); give one with "
                                    f"--chat-template FILE_OR_STRING")
        if not isinstance(source, str):
            raise ChatTemplateError(f"{where}: expected a string, got {type(source).__name__}")

    def text(tid):   # llama-cpp-python's bos_token/eos_token: the token's text, "" when there is none
        return tokenizer.tokens[tid] if tid is not None else ""
    return ChatTemplate(source, bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id), where=where)


def tokenize_chat(tokenizer, text: str) -> list:
    """Token ids of a rendered chat prompt: special tokens parsed, and BOS/EOS added as the vocabulary
    asks unless the text already begins/ends with them (llama.cpp strips the template's own BOS/EOS
    text before tokenizing with ``add_special``, so they are never doubled)."""
    bos = tokenizer.tokens[tokenizer.bos_id] if tokenizer.add_bos and tokenizer.bos_id is not None else None
    eos = tokenizer.tokens[tokenizer.eos_id] if tokenizer.add_eos and tokenizer.eos_id is not None else None
    if bos and text.startswith(bos):
        text = text[len(bos):]
    if eos and text.endswith(eos):
        text = text[:-len(eos)]
    return tokenizer.tokenize(text, add_special=True, parse_special=True)
