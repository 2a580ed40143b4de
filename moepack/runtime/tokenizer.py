"""The model's tokenizer and chat template, without transformers: ``tokenizer.json`` through the `tokenizers`
library, the chat template rendered with jinja2 the way transformers renders it.

    tok = load_tokenizer("packed/")
    ids = tok.encode_chat([{"role": "user", "content": "Hello"}])      # what apply_chat_template(...) gives
    detok = tok.detokenizer()
    for t in generated: sys.stdout.write(detok.add(t))
    sys.stdout.write(detok.finalize())

Chat template rendering follows transformers (``utils/chat_template_utils.py``): a jinja2
``ImmutableSandboxedEnvironment`` with ``trim_blocks``/``lstrip_blocks`` and the ``loopcontrols`` extension,
``raise_exception``, a ``tojson`` that does not HTML-escape, ``strftime_now``; the special-token strings
(``bos_token``, ``eos_token``, ...) from tokenizer_config.json are passed as variables; the rendered text is
encoded without adding special tokens. The template comes from ``chat_template.jinja`` (what transformers
saves and prefers), else tokenizer_config.json's ``chat_template`` (a string, or a list of named templates:
"default" is used), else ``chat_template.json``.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path

from ..errors import MoepackError

TOKENIZER_FILE = "tokenizer.json"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerError(MoepackError):
    """The model folder's tokenizer or chat template is missing or cannot be used."""

    default_hint = "pass token ids with --prompt-ids 1,2,3 instead of --prompt"


def _token_str(v) -> str | None:
    """tokenizer_config stores special tokens as strings or as AddedToken dicts {"content": ...}."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path.name} cannot be read: {e}") from None
    return d if isinstance(d, dict) else {}


def _find_template(folder: Path, config: dict) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    t = config.get("chat_template")
    if t is None:
        t = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    return t if isinstance(t, str) else None


def _compile_template(source: str):
    """transformers' jinja environment for chat templates (sandboxed, trim/lstrip blocks, its globals)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"the chat template does not parse: {e.message} (line {e.lineno})",
                             hint="fix chat_template.jinja, or pass --raw to use the prompt as plain text") from None


class Tokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat template) of one model folder."""

    def __init__(self, folder: str | os.PathLike):
        from tokenizers import Tokenizer as _HFTokenizer

        self.folder = Path(folder)
        path = self.folder / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(f"{self.folder} has no {TOKENIZER_FILE}, so a text prompt cannot be tokenized")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception subclasses
            raise TokenizerError(f"{TOKENIZER_FILE} cannot be loaded: {e}") from None
        self.config = _read_json(self.folder / "tokenizer_config.json")
        specials = _read_json(self.folder / "special_tokens_map.json")
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            s = _token_str(self.config.get(key)) or _token_str(specials.get(key))
            if s is not None:
                self.special_tokens[key] = s
        self.chat_template: str | None = _find_template(self.folder, self.config)
        self._compiled = None

    # ------------------------------------------------------------------------------------------ vocabulary
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.special_tokens.get("eos_token")
        i = self._tok.token_to_id(eos) if eos else None
        return [] if i is None else [i]

    # ------------------------------------------------------------------------------------------ encode/decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def detokenizer(self) -> "StreamingDetokenizer":
        return StreamingDetokenizer(self)

    # ------------------------------------------------------------------------------------------ chat template
    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **template_kwargs) -> str:
        """The rendered conversation text, as transformers' ``apply_chat_template(..., tokenize=False)``."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.folder} has no chat template (tokenizer_config.json or chat_template.jinja)",
                                 hint="pass --raw to use the prompt as plain text")
        if self._compiled is None:
            self._compiled = _compile_template(self.chat_template)
        import jinja2

        variables = {**self.special_tokens, **template_kwargs}  # explicit keywords win, as in transformers
        try:
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template refused the conversation: {e}",
                                 hint="pass --raw to use the prompt as plain text") from None

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """Token ids of the rendered conversation (special tokens come from the template, none are added)."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.encode(text, add_special_tokens=False)


def load_tokenizer(folder: str | os.PathLike, *, required: bool = True) -> Tokenizer | None:
    """The tokenizer of a model folder; None (or TokenizerError when `required`) if it has none."""
    if not required and not Path(folder, TOKENIZER_FILE).is_file():
        return None
    return Tokenizer(folder)


def encode_prompt(tokenizer: Tokenizer, prompt: str, *, raw: bool = False, **template_kwargs) -> list[int]:
    """A user prompt as ids: through the chat template (one user message, generation prompt added) unless
    `raw` or the tokenizer has no template; `raw` encodes the text as is (special tokens added as the
    tokenizer's post-processor says)."""
    if raw or tokenizer.chat_template is None:
        return tokenizer.encode(prompt, add_special_tokens=True)
    return tokenizer.encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True, **template_kwargs)


class StreamingDetokenizer:
    """Text of a growing token sequence, handed out in pieces as soon as they are complete.

    Byte-level tokenizers split multi-byte UTF-8 characters across tokens; decoding such a partial sequence
    ends in U+FFFD, so that piece is held back until a later token completes the character. Each new piece
    is the difference between decoding a short window with and without the newest tokens (the window keeps
    one token of left context, so tokenizers that drop a leading space at the start of a decode stay right).
    The pieces concatenate to ``decode(all tokens)`` for byte-level and SentencePiece-style tokenizers.
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.tokens: list[int] = []
        self.text = ""  # everything handed out so far
        self._prefix = 0  # window start (left context)
        self._read = 0  # tokens before this index have been turned into text

    def add(self, token: int) -> str:
        """Append one token; returns the text it completes ('' while a character is still incomplete)."""
        self.tokens.append(int(token))
        prefix_text = self._tok.decode(self.tokens[self._prefix:self._read])
        new_text = self._tok.decode(self.tokens[self._prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            piece = new_text[len(prefix_text):]
            self._prefix, self._read = self._read, len(self.tokens)
            self.text += piece
            return piece
        return ""

    def finalize(self) -> str:
        """Whatever is held back (an incomplete character comes out as U+FFFD, as decode() gives it)."""
        if self._read == len(self.tokens):
            return ""
        prefix_text = self._tok.decode(self.tokens[self._prefix:self._read])
        new_text = self._tok.decode(self.tokens[self._prefix:])
        piece = new_text[len(prefix_text):]
        self._prefix = self._read = len(self.tokens)
        self.text += piece
        return piece
