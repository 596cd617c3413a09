"""Chat prompts: a checkpoint's chat template rendered the way Hugging Face's
`apply_chat_template` renders it, and its tokenizer files.

The template comes from `chat_template.jinja` in the checkpoint directory, else from the
`chat_template` field of `tokenizer_config.json` (a string, or a list of named templates of
which "default" is used). It is rendered by jinja2's immutable sandbox with `trim_blocks`
and `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` block that renders
its body, `tojson` as `json.dumps` (no HTML escaping, non-ASCII kept), and the globals
`raise_exception(msg)` and `strftime_now(fmt)`; the variables are `messages`, `tools`,
`documents`, `add_generation_prompt`, the special tokens of tokenizer_config.json
(`bos_token`, `eos_token`, ...) and any extra keyword arguments. The text is then tokenized
*without* the tokenizer's own special tokens: a template that writes `{{ bos_token }}` gets
exactly one BOS.

    ids = apply_chat_template("path/to/model", [{"role": "user", "content": "Hi"}])
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path

from ..errors import FormatError, InvalidArgument, Unsupported

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                      "cls_token", "mask_token", "additional_special_tokens")


def checkpoint_dir(model_or_path) -> Path:
    """The directory of a checkpoint given as a path or a `ModelSource`."""
    if isinstance(model_or_path, (str, os.PathLike)):
        p = Path(model_or_path)
        return p.parent if p.is_file() else p
    path = getattr(model_or_path, "path", None)
    if path is None:
        raise InvalidArgument(f"expected a checkpoint directory or a ModelSource read from "
                              f"one, got {type(model_or_path).__name__} (a preset has no "
                              "tokenizer files)")
    p = Path(path)
    return p.parent if p.is_file() else p


def tokenizer_config(directory) -> dict:
    """tokenizer_config.json of a checkpoint directory, or {} when it has none."""
    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise FormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise FormatError(f"{path}: expected a JSON object")
    return cfg


def special_tokens(cfg: dict) -> dict:
    """The special-token strings a template sees (`bos_token`, ...), from
    tokenizer_config.json values that are strings or serialized AddedTokens; unset ones
    are left out, as in transformers' `special_tokens_map`."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        elif isinstance(v, list):
            v = [x.get("content") if isinstance(x, dict) else x for x in v]
        if v is not None:
            out[key] = v
    return out


def chat_template_source(directory) -> tuple[str, str]:
    """(template text, where it came from) of a checkpoint directory."""
    d = Path(directory)
    jinja_file = d / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
    where = str(d / "tokenizer_config.json")
    t = tokenizer_config(d).get("chat_template")
    if isinstance(t, list):   # named templates: [{"name": ..., "template": ...}]
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        if "default" not in named:
            raise Unsupported(f"{where}: chat_template holds named templates "
                              f"{sorted(map(str, named))} but no 'default'")
        t = named["default"]
    processor = d / "chat_template.json"   # a multimodal processor's (LLaVA checkpoints)
    if (not isinstance(t, str) or not t) and processor.is_file():
        try:
            t, where = json.loads(processor.read_text(encoding="utf-8")).get(
                "chat_template"), str(processor)
        except (OSError, ValueError, AttributeError) as e:
            raise FormatError(f"{processor}: not a JSON object with a chat_template ({e})") \
                from None
    if not isinstance(t, str) or not t:
        raise InvalidArgument(f"{d} has no chat template (no chat_template.jinja, no "
                              "chat_template in tokenizer_config.json and no "
                              "chat_template.json); give a plain prompt instead")
    return t, where


@lru_cache(maxsize=16)
def _compile(template: str):
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise Unsupported("chat templates need the jinja2 package: pip install jinja2") \
            from None

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        for rendering it is its body."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
                .set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def check_messages(messages) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidArgument("messages must be a non-empty list of {'role': ..., "
                              "'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise InvalidArgument(f"messages[{i}] must be a dict with a 'role' (and usually "
                                  f"'content'), got {m!r}")
    return [dict(m) for m in messages]


def render_chat_template(template: str, messages, *, add_generation_prompt: bool = True,
                         tools=None, documents=None, where: str = "chat template",
                         **variables) -> str:
    """The text of `messages` under a jinja2 chat `template` (HF's rendering rules)."""
    import jinja2
    messages = check_messages(messages)
    try:
        compiled = _compile(template)
        return compiled.render(messages=messages, tools=tools, documents=documents,
                               add_generation_prompt=bool(add_generation_prompt),
                               **variables)
    except jinja2.exceptions.TemplateError as e:
        raise InvalidArgument(f"{where}: {type(e).__name__}: {e}") from None


def _gguf_source(model_or_path):
    """The GGUF source of a path to a .gguf file (template and tokenizer are in its
    metadata, not in its folder), else None."""
    if isinstance(model_or_path, (str, os.PathLike)):
        p = Path(model_or_path)
        if p.suffix == ".gguf" and p.is_file():
            from ..formats import open_source
            return open_source(p)
    return None


def load_tokenizer(directory):
    """tokenizer.json of a checkpoint directory as a `tokenizers.Tokenizer`, or None; for
    a .gguf file, the tokenizer of its metadata (tokenizer.ggml.*)."""
    gguf = _gguf_source(directory)
    if gguf is not None:
        return gguf.tokenizer()
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise Unsupported(f"{path}: reading it needs the tokenizers package; pip install "
                          "tokenizers") from None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:   # the Rust parser's error, one line
        raise FormatError(f"{path}: cannot be read as a tokenizer.json ({e})") from None


def apply_chat_template(model_or_path, messages, add_generation_prompt: bool = True,
                        tokenize: bool = True, tokenizer=None, **variables):
    """Render `messages` with a checkpoint's chat template, as transformers'
    `tokenizer.apply_chat_template`.

    model_or_path: a checkpoint directory, a `ModelSource` read from one, or a .gguf file
    or its source (formats/gguf/: template and tokenizer from its metadata). Returns the
    prompt token ids (list of int) or, with `tokenize=False`, the text. `tokenizer`: a
    `tokenizers.Tokenizer` to use instead of the directory's tokenizer.json. Extra keyword
    arguments become template variables (e.g. `enable_thinking=False`).
    """
    model_or_path = _gguf_source(model_or_path) or model_or_path
    own = getattr(model_or_path, "chat_template", None)
    if callable(own):   # a GGUF source: template, special tokens and tokenizer in the file
        template = own()
        where = f"{model_or_path.description} (tokenizer.chat_template)"
        if template is None:
            raise InvalidArgument(f"{model_or_path.description} has no chat template (no "
                                  "tokenizer.chat_template); give a plain prompt instead")
        specials, read_tokenizer = model_or_path.special_tokens(), model_or_path.tokenizer
        lacking = f"{model_or_path.description} has no tokenizer (no tokenizer.ggml.tokens)"
    else:
        d = checkpoint_dir(model_or_path)
        template, where = chat_template_source(d)
        specials = special_tokens(tokenizer_config(d))
        read_tokenizer = lambda: load_tokenizer(d)   # noqa: E731
        lacking = f"{d} has no tokenizer.json"
    text = render_chat_template(template, messages,
                                add_generation_prompt=add_generation_prompt, where=where,
                                **{**specials, **variables})
    if not tokenize:
        return text
    tok = tokenizer if tokenizer is not None else read_tokenizer()
    if tok is None:
        raise InvalidArgument(f"{lacking} to tokenize the chat prompt (tokenize=False returns "
                              "the text)")
    # the template wrote every special token itself (BOS included): add none
    return list(tok.encode(text, add_special_tokens=False).ids)
